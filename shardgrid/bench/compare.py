"""Rounds of `shardgrid bench`: `--target both` (shardgrid and etcd side by side) and `--client wrk`.

`--target both` starts a local shardgrid cluster and a local 3-member etcd,
then runs the same workload against each in interleaved rounds (shardgrid,
etcd, shardgrid, etcd, ...; `--rounds`, default 3), each round measuring the
target's throughput, errors, latency and the CPU of the target's processes
(cpu.py) over the round. Per target the report gives the median of its
rounds, and the ratio shardgrid/etcd. Every figure names the client that
produced it: `wrk` (wrk.py) or `python-raw` / `python-aiohttp` (load.py's
generator processes). Both clusters stay up for the whole run: while one is
measured the other idles.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO

from shardgrid.bench.cpu import CpuAccount

if TYPE_CHECKING:
    from shardgrid.bench.run import BenchOptions, ClusterEnv

COMPARE_VERSION = 1
MEDIAN_FIELDS = ("ops_per_s", "records_per_s", "p50_ms", "p99_ms", "us_per_acked_write", "client_cpu_s")
RATIO_FIELDS = ("ops_per_s", "records_per_s", "p50_ms", "p99_ms", "us_per_acked_write")


def client_label(client: str) -> str:
    """How a report names the client: wrk, or the Python generator with its HTTP client."""
    return "wrk" if client == "wrk" else f"python-{client}"


def round_targets(target: str) -> list[str]:
    return ["shardgrid", "etcd"] if target == "both" else [target]


def schedule(target: str, rounds: int) -> list[tuple[int, str]]:
    """(round, target) in the order they run: interleaved, round by round."""
    return [(r, t) for r in range(1, rounds + 1) for t in round_targets(target)]


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def row_from_figures(round_no: int, target: str, client: str, figures: dict[str, Any], acked_writes: int,
                     cluster_cpu: dict[str, Any] | None, client_cpu_s: float | None) -> dict[str, Any]:
    """One round's row. `figures`: elapsed_s, ops, ops_per_s, records, records_per_s, errors, latency_ms."""
    cpu_s = cluster_cpu["cpu_s"] if cluster_cpu else None
    lat = figures["latency_ms"]
    return {"round": round_no, "target": target, "client": client_label(client),
            "elapsed_s": figures["elapsed_s"], "ops": figures["ops"], "ops_per_s": figures["ops_per_s"],
            "records": figures["records"], "records_per_s": figures["records_per_s"], "acked_writes": acked_writes,
            "errors": figures["errors"],
            "latency_ms": {k: lat.get(k) for k in ("p50", "p90", "p99", "p999", "max")},
            "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"),
            "cluster_cpu_s": cpu_s,
            "cluster_cpu_by_role": cluster_cpu["by_role"] if cluster_cpu else None,
            "us_per_acked_write": round(cpu_s * 1e6 / acked_writes, 1) if cpu_s is not None and acked_writes
            else None,
            "client_cpu_s": client_cpu_s}


def summarize_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A target's medians over its rounds; errors and acknowledged writes summed over all of them."""
    out: dict[str, Any] = {"rounds": len(rows), "client": rows[0]["client"] if rows else None}
    for f in MEDIAN_FIELDS:
        out[f] = median([r[f] for r in rows])
    out["errors"] = sum(r["errors"]["total"] for r in rows)
    out["acked_writes"] = sum(r["acked_writes"] for r in rows)
    return out


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """a / b per figure (None when either is missing or b is 0)."""
    return {f: round(a[f] / b[f], 3) if a.get(f) is not None and b.get(f) else None for f in RATIO_FIELDS}


def _num(v: float | None, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


def format_compare(r: dict[str, Any]) -> str:
    """The side-by-side report: every round, then the medians per target and shardgrid/etcd."""
    c = r["config"]
    batch = c["batch"]
    lines = [r["command"]]
    mode = f"open loop at {c['rate']:g} req/s" if c["rate"] else f"closed loop, concurrency {c['concurrency']}"
    what = f"/batch of {batch} (etcd: txn of {batch} puts)" if batch else "single puts"
    many = len(round_targets(c["target"])) > 1
    order = (f"{c['rounds']} round(s) per target interleaved ("
             + ", ".join(t for _, t in schedule(c["target"], 2)) + ", ...)") if many else \
        f"{c['rounds']} round(s) of {c['target']}"
    lines.append(f"  {mode}, {c['duration_s']:g} s per round"
                 + (f" after {c['warmup_s']} s warm-up" if c["warmup_s"] else "")
                 + f", {order}, {what}, "
                 f"{c['value_bytes']}-byte values, client {client_label(c['client'])}")
    lines.append(f"  {'round':<6}{'target':<11}{'client':<15}{'req/s':>9}{'records/s':>11}{'errors':>8}"
                 f"{'p50 ms':>8}{'p99 ms':>8}{'CPU µs/write':>14}")
    for row in r["rounds"]:
        lines.append(f"  {row['round']:<6}{row['target']:<11}{row['client']:<15}{_num(row['ops_per_s']):>9}"
                     f"{_num(row['records_per_s']):>11}{row['errors']['total']:>8,}"
                     f"{_num(row['p50_ms'], '.2f'):>8}{_num(row['p99_ms'], '.2f'):>8}"
                     f"{_num(row['us_per_acked_write']):>14}")
    targets = list(r["targets"])
    heads = [f"{t} (client: {r['targets'][t]['median']['client']})" for t in targets]
    ratio = r.get("ratio")
    width = max(24, *(len(h) + 2 for h in heads))
    lines.append(f"  median of {c['rounds']} round(s)".ljust(26) + "".join(h.rjust(width) for h in heads)
                 + ("shardgrid/etcd".rjust(16) if ratio else ""))
    rows = [("req/s", "ops_per_s", ",.0f"), ("p50 ms", "p50_ms", ".2f"), ("p99 ms", "p99_ms", ".2f"),
            ("CPU µs per ack. write", "us_per_acked_write", ",.0f"), ("client CPU s", "client_cpu_s", ".2f")]
    if batch:
        rows.insert(1, ("records/s", "records_per_s", ",.0f"))
    for label, key, fmt in rows:
        vals = "".join(_num(r["targets"][t]["median"][key], fmt).rjust(width) for t in targets)
        tail = _num(ratio.get(key), ".2f").rjust(16) if ratio and key in ratio else ""
        lines.append(f"  {label:<24}{vals}{tail}")
    errs = "".join(f"{r['targets'][t]['median']['errors']:,}".rjust(width) for t in targets)
    lines.append(f"  {'errors (all rounds)':<24}{errs}")
    for p in r.get("problems", []):
        lines.append(f"  problem      {p}")
    m = r.get("machine")
    if m and m.get("loadavg_before"):
        lines.append(f"  machine      {m['cpus']} CPUs, load average before {m['loadavg_before'][0]:.2f}, "
                     f"after {m['loadavg_after'][0]:.2f}")
    return "\n".join(lines)


# -- running the rounds --------------------------------------------------------------------------


def _say(out: TextIO | None, line: str) -> None:
    if out is not None:
        out.write(line + "\n")
        out.flush()


def run_compare(opts: BenchOptions, out: TextIO | None = sys.stdout) -> dict[str, Any]:
    """Start (or attach to) every target, run the interleaved rounds, stop what was started."""
    from shardgrid.bench.run import attached_env, start_local

    import os

    cfg = opts.load
    load_before = os.getloadavg()
    envs: dict[str, ClusterEnv] = {}
    try:
        for t in round_targets(cfg.target):
            topts = replace(opts, load=replace(cfg, target=t))
            envs[t] = start_local(topts) if opts.cluster == "local" else attached_env(topts)
        rows: list[dict[str, Any]] = []
        for round_no, t in schedule(cfg.target, opts.rounds):
            env = envs[t]
            tcfg = replace(cfg, target=t, urls=tuple(env.urls))
            if cfg.client == "wrk":
                row = _wrk_round(opts, tcfg, env, round_no)
            else:
                row = _python_round(opts, tcfg, env, round_no)
            rows.append(row)
            _say(out, f"round {round_no} {t:<9} ({row['client']}): {_num(row['ops_per_s'])} req/s"
                      + (f", {_num(row['records_per_s'])} records/s" if cfg.batch else "")
                      + f", p99 {_num(row['p99_ms'], '.2f')} ms, {row['errors']['total']} errors, "
                      f"{_num(row['us_per_acked_write'])} µs CPU per write")
    finally:
        for env in envs.values():
            env.stop()
    targets = {t: {"cluster": {**envs[t].info, "pids": {str(k): v for k, v in (envs[t].pids or {}).items()}},
                   "rounds": [r for r in rows if r["target"] == t],
                   "median": summarize_rounds([r for r in rows if r["target"] == t])}
               for t in envs}
    ratio = ratios(targets["shardgrid"]["median"], targets["etcd"]["median"]) if len(targets) == 2 else None
    return {"version": COMPARE_VERSION, "kind": "compare", "command": opts.command,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": {"target": cfg.target, "client": cfg.client, "rounds": opts.rounds,
                       "concurrency": None if cfg.rate else cfg.concurrency, "rate": cfg.rate,
                       "duration_s": cfg.duration_s, "warmup_s": cfg.warmup_s, "batch": cfg.batch,
                       "value_bytes": cfg.value_bytes, "ack": cfg.ack, "deadline_ms": cfg.deadline_ms,
                       "procs": opts.procs, "cluster": opts.cluster},
            "machine": {"cpus": os.cpu_count(), "loadavg_before": list(load_before),
                        "loadavg_after": list(os.getloadavg())},
            "rounds": rows, "targets": targets, "ratio": ratio, "ops": sum(r["ops"] for r in rows),
            "problems": []}


def _wrk_round(opts: BenchOptions, cfg: Any, env: ClusterEnv, round_no: int) -> dict[str, Any]:
    import random

    from shardgrid.bench.load import make_value
    from shardgrid.bench.wrk import Workload, run_wrk, summarize

    # Fresh keys per round and target: w<run id><s|e><round><thread><counter>
    w = Workload(target=cfg.target, doc=make_value(cfg.value_bytes, random.Random(cfg.seed)),
                 key_prefix=f"w{cfg.run_id}{cfg.target[0]}{round_no}", batch=cfg.batch, ack=cfg.ack,
                 deadline_ms=cfg.deadline_ms)
    urls = list(env.urls)
    if cfg.warmup_s:
        run_wrk(replace(w, key_prefix=w.key_prefix + "w"), urls, cfg.concurrency, cfg.warmup_s, cfg.timeout_s)
    cpu = CpuAccount(env.pids) if env.pids else None
    samples: dict[str, Any] = {}

    def before() -> None:
        if cpu is not None:
            samples["before"] = cpu.sample()

    wr = run_wrk(w, urls, cfg.concurrency, int(cfg.duration_s), cfg.timeout_s, before=before)
    report = cpu.report(samples["before"], cpu.sample()) if cpu is not None else None
    figures = summarize(wr.done)
    return row_from_figures(round_no, cfg.target, "wrk", figures, figures["records"], report, wr.cpu_s)


def _python_round(opts: BenchOptions, cfg: Any, env: ClusterEnv, round_no: int) -> dict[str, Any]:
    from shardgrid.bench.run import build_result, run_generators

    cpu = CpuAccount(env.pids) if env.pids else None
    run = run_generators(cfg, opts.procs, cpu, None)
    res = build_result(replace(opts, load=cfg), env, run, cpu)
    figures = {k: res[k] for k in ("elapsed_s", "ops", "ops_per_s", "records", "records_per_s", "latency_ms")}
    figures["errors"] = {"total": res["errors"]["total"], "by_code": res["errors"]["by_code"]}
    return row_from_figures(round_no, cfg.target, cfg.client, figures, res["acked_writes"], res["cluster_cpu"],
                            res["client"]["cpu_s"])
