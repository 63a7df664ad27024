"""`shardgrid bench`: load generator and benchmark (see runbook/benchmarking.md).

    shardgrid bench --cluster local --concurrency 16 --duration 10 --mix put=100
    shardgrid bench --cluster local --target etcd --concurrency 16 --duration 10 --mix put=100
    shardgrid bench --gateway http://10.0.0.5:8080 --rate 5000 --procs 2 --json out.json
    shardgrid bench --cluster local --topology examples/layers.yaml --mix infer=100 --concurrency 16
    shardgrid bench --target inproc --topology examples/layers.yaml --mix infer=100 --concurrency 16
    shardgrid bench --cluster local --target both --client wrk --concurrency 64 --batch 100

The parent process starts the cluster under test when asked (`--cluster
local`: a LocalCluster, or a 3-member etcd, in a temporary data directory,
always stopped afterwards, also on Ctrl-C, SIGTERM or errors), spawns
`--procs` generator processes (load.py), starts them together, merges
their once-a-second ticks (stats.py) into the progress lines and the
totals, samples the CPU time of the cluster's processes before and after
(cpu.py), then prints the report and writes it as JSON (`--json`).

`--target both` and `--client wrk` run in rounds instead (compare.py:
shardgrid and etcd side by side, medians of interleaved rounds; wrk.py: the
native load generator and its Lua scripts).

Figures: achieved ops/s (and records/s with --batch) over the measured part
of the run, errors by code, latency percentiles of successful operations
from an HdrHistogram, cluster CPU seconds and CPU µs per acknowledged write,
and the generator's own CPU (to tell whether it was the bottleneck).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from shardgrid.bench.cpu import CpuAccount, pids_from_dir, pids_from_list, pids_from_pattern
from shardgrid.bench.load import (ETCD_TARGETS, KINDS, MAX_BATCH, MAX_INFER_ROWS, TARGETS, WRITE_KINDS, LoadConfig,
                                  MixError, check_mix_for_target, child_main, parse_mix)
from shardgrid.bench.rounds import WorkerCounters, format_rounds, rounds_report
from shardgrid.bench.stats import KindTotals, latency_summary, merge_into, new_histogram, overall

if TYPE_CHECKING:
    from topology.model import Topology

RESULT_VERSION = 1
DEFAULT_URLS = {"shardgrid": "http://127.0.0.1:8080", "etcd": "http://127.0.0.1:2379",
                "etcd-grpc": "http://127.0.0.1:2379"}
FSYNC_MODES = ("batch", "always", "none")
READY_TIMEOUT_S = 60.0
WORKERS_UP_TIMEOUT_S = 120.0


class BenchError(Exception):
    """A failure to report in one line (exit 1); usage errors are BenchUsageError (exit 2)."""


class BenchUsageError(BenchError):
    pass


# -- options -----------------------------------------------------------------------------------


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    kinds = ", ".join(f"{k} ({v})" for k, v in KINDS.items())
    p.add_argument("--target", choices=(*TARGETS, "both"), default="shardgrid",
                   help="what to drive: shardgrid gateways, or etcd for comparison through its JSON gateway "
                        "(etcd) or its native gRPC API (etcd-grpc), or inproc: --topology's model computed in "
                        "the generator's own process, no cluster (with --mix infer=100 only), or both: shardgrid "
                        "and etcd (JSON gateway) with --cluster local, in interleaved --rounds, side by side "
                        "(default shardgrid)")
    p.add_argument("--cluster", choices=("local", "none"), default="none",
                   help="local: start a cluster for the run in a temp dir and stop it afterwards; "
                        "none (default): drive the running one at --gateway")
    p.add_argument("--gateway", action="append", default=None, metavar="URL",
                   help="gateway (or, with --target etcd, etcd client) URL; repeat for round-robin "
                        f"(default {DEFAULT_URLS['shardgrid']}, etcd {DEFAULT_URLS['etcd']})")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, metavar="N",
                      help="closed loop: N requests in flight, each sent when the previous is answered (default 16)")
    mode.add_argument("--rate", type=float, default=None, metavar="R",
                      help="open loop: R requests/s on a fixed schedule; latency counts from the intended send time")
    p.add_argument("--duration", type=float, default=10.0, metavar="S", help="measured seconds (default 10)")
    p.add_argument("--warmup", type=int, default=0, metavar="S",
                   help="whole seconds of load before the measured part, left out of every figure (default 0)")
    p.add_argument("--mix", default="put=100", help=f"operation weights, e.g. put=70,incr=20,get=10,search=0; "
                                                    f"operations: {kinds} (default put=100)")
    p.add_argument("--ack", choices=("leader", "quorum", "all"), default=None,
                   help="x-ack of every write (default: the cluster's settings.ack)")
    p.add_argument("--deadline-ms", type=int, default=None, help="x-deadline-ms of every request (default: cluster's)")
    p.add_argument("--value-bytes", type=int, default=100, metavar="B",
                   help="size of the value each put writes: the doc is {\"v\": \"<B characters>\"} (default 100)")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="send writes as POST /batch of N writes (etcd: a txn of N puts); reports records/s")
    p.add_argument("--keys", type=int, default=100_000, help="size of the key space ops pick from (default 100000)")
    p.add_argument("--procs", type=int, default=1, metavar="P",
                   help="generator processes (one client tops out near 15k req/s); histograms are merged")
    p.add_argument("--max-inflight", type=int, default=10_000,
                   help="open loop: most requests outstanding at once, all processes (default 10000)")
    p.add_argument("--client", choices=("raw", "aiohttp", "wrk"), default="raw",
                   help="HTTP client of the generator: raw (lean keep-alive HTTP/1.1, shardgrid/bench/http_client.py; "
                        "about a fifth of aiohttp's CPU per request) or aiohttp, both Python generator processes; "
                        "or wrk: the native load generator wrk (2 threads, a Lua script per workload; closed "
                        "loop, --mix put=100 with or without --batch, only) (default raw)")
    p.add_argument("--rounds", type=int, default=None, metavar="N",
                   help="--target both / --client wrk: rounds per target, interleaved between the targets; "
                        "the report gives each target's median (default 3 with --target both, else 1)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="client timeout per request (default 10)")
    p.add_argument("--embedding-dim", type=int, default=None,
                   help="vector length for embed/search (default: the local topology's, else 64)")
    p.add_argument("--search-k", type=int, default=10, help="k of search requests (default 10)")
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="--cluster local: start the cluster from FILE (its addresses moved onto free loopback "
                        "ports; its models, groups and settings kept) instead of a generated one; also where "
                        "--mix infer and --target inproc find the model")
    p.add_argument("--model", default="tiny", help="the model infer requests name (default tiny)")
    p.add_argument("--infer-rows", type=int, default=1, metavar="R",
                   help="rows of each infer request (default 1); the report adds rows/s when R > 1")
    p.add_argument("--infer-max-rows", type=int, default=None, metavar="N",
                   help="--cluster local: every worker's --infer-max-rows (1: no batching; worker default 64); "
                        "--target inproc: the most rows one forward pass concatenates (default 64)")
    p.add_argument("--infer-max-wait-ms", type=float, default=None, metavar="F",
                   help="--cluster local: every worker's --infer-max-wait-ms (worker default 2.0)")
    p.add_argument("--seed", type=int, default=None, help="seed of keys and values (default random)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the whole result as JSON to FILE")
    p.add_argument("--quiet", action="store_true", help="no per-second progress lines")
    loc = p.add_argument_group("--cluster local")
    loc.add_argument("--workers", type=int, default=None, help="workers (default 3)")
    loc.add_argument("--shards", type=int, default=None, help="shard groups S (default 3)")
    loc.add_argument("--rf", type=int, default=None, help="replication factor (default 3, or fewer workers)")
    loc.add_argument("--gateways", type=int, default=1, help="gateways, run with --no-access-log (default 1)")
    loc.add_argument("--fsync", choices=FSYNC_MODES, default=None, help="settings.fsync (default batch)")
    loc.add_argument("--snapshot-every", type=int, default=None, metavar="N",
                     help="settings.snapshot_every: client writes between a group's snapshots (default the "
                          "topology default, 100000; runs longer than N writes per group include snapshots)")
    loc.add_argument("--data-dir", default=None, metavar="DIR", help="make the temp data dir under DIR")
    loc.add_argument("--keep-data", action="store_true", help="keep the data dir (logs) after the run")
    cpu = p.add_argument_group("CPU accounting of a running cluster (--cluster none)")
    cpu.add_argument("--cluster-pids-from", default=None, metavar="DIR", help="DIR/*.pid files name the processes")
    cpu.add_argument("--cluster-pids", default=None, metavar="PID,PID", help="the processes' PIDs")
    cpu.add_argument("--cluster-pgrep", default=None, metavar="REGEX",
                     help="every process whose command line matches REGEX (like pgrep -f), not this one")


@dataclass
class BenchOptions:
    load: LoadConfig
    procs: int
    cluster: str = "none"
    workers: int = 3
    shards: int = 3
    rf: int = 3
    gateways: int = 1
    fsync: str = "batch"
    snapshot_every: int | None = None
    data_dir: str | None = None
    keep_data: bool = False
    pids_from: str | None = None
    pids: str | None = None
    pgrep: str | None = None
    json_path: str | None = None
    quiet: bool = False
    command: str = ""
    mix_spec: str = ""
    # --topology: the file as given (its addresses are rewritten at start) and where it came from
    topology_path: str | None = None
    topology_text: str | None = None
    # extra arguments of every worker of --cluster local (--infer-max-rows, --infer-max-wait-ms)
    worker_args: list[str] = field(default_factory=list)
    # --target both / --client wrk: rounds per target (compare.py)
    rounds: int = 1

    @property
    def compare(self) -> bool:
        return self.load.target == "both" or self.load.client == "wrk"


def options_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> BenchOptions:
    def bad(msg: str) -> BenchUsageError:
        return BenchUsageError(msg)

    target = args.target
    try:
        mix = parse_mix(args.mix)
        check_mix_for_target(mix, "etcd" if target == "both" else target)
    except MixError as exc:
        raise bad(str(exc)) from None
    if args.duration <= 0:
        raise bad("--duration must be > 0")
    if args.warmup < 0:
        raise bad("--warmup must be >= 0")
    if args.procs < 1:
        raise bad("--procs must be >= 1")
    concurrency = args.concurrency if args.concurrency is not None else 16
    if args.rate is not None:
        if not args.rate > 0:
            raise bad("--rate must be > 0 requests/s")
    elif concurrency < args.procs:
        raise bad(f"--concurrency {concurrency} is less than --procs {args.procs}: every process needs a worker")
    if args.batch < 0 or args.batch > MAX_BATCH:
        raise bad(f"--batch must be between 0 (off) and {MAX_BATCH}")
    if args.batch and not any(k in WRITE_KINDS for k in mix):
        raise bad("--batch batches writes, and --mix has none")
    if args.value_bytes < 0:
        raise bad("--value-bytes must be >= 0")
    if args.keys < 1:
        raise bad("--keys must be >= 1")
    if args.batch > args.keys:
        raise bad("--batch cannot exceed --keys (the keys of one batch are distinct)")
    if args.max_inflight < args.procs:
        raise bad("--max-inflight must be at least --procs")
    if args.timeout <= 0:
        raise bad("--timeout must be > 0")
    if args.search_k < 1:
        raise bad("--search-k must be >= 1")
    rounds = check_rounds_and_wrk(args, mix)
    infer = read_infer_options(args, mix)
    if target in (*ETCD_TARGETS, "both"):
        if args.ack not in (None, "quorum"):
            raise bad(f"--ack {args.ack} has no etcd equivalent: etcd acknowledges a put once a quorum has it")
        if args.deadline_ms is not None:
            raise bad("--deadline-ms is a shardgrid header; etcd has no equivalent")
    if args.deadline_ms is not None and not 1 <= args.deadline_ms <= 300_000:
        raise bad("--deadline-ms must be between 1 and 300000")
    workers = args.workers if args.workers is not None else 3
    shards = args.shards if args.shards is not None else 3
    fsync = args.fsync or "batch"
    urls = args.gateway
    if target == "inproc":
        # Checked apart: none of a cluster's or a gateway's options mean anything here.
        if args.cluster == "local":
            raise bad("--target inproc runs the model in the generator's process: it starts no cluster "
                      "(drop --cluster local)")
        if urls:
            raise bad("--target inproc sends no requests: it takes no --gateway")
        if args.procs != 1:
            raise bad("--target inproc is the one-process baseline: --procs must be 1")
        for flag, value in (("--deadline-ms", args.deadline_ms), ("--ack", args.ack),
                            ("--infer-max-wait-ms", args.infer_max_wait_ms),
                            ("--cluster-pids-from", args.cluster_pids_from), ("--cluster-pids", args.cluster_pids),
                            ("--cluster-pgrep", args.cluster_pgrep), ("--snapshot-every", args.snapshot_every)):
            if value is not None:
                raise bad(f"{flag} has no meaning for --target inproc (no gateway, no workers)")
    elif args.cluster == "local":
        if urls:
            raise bad("--gateway names a running cluster; --cluster local starts its own (see --gateways)")
        if any(x is not None for x in (args.cluster_pids_from, args.cluster_pids, args.cluster_pgrep)):
            raise bad("--cluster-pids-from/--cluster-pids/--cluster-pgrep are for a running cluster; "
                      "--cluster local accounts for the processes it starts")
        if target in ("shardgrid", "both"):
            if infer.topo is not None:
                given = [f for f, v in (("--workers", args.workers), ("--shards", args.shards), ("--rf", args.rf),
                                        ("--fsync", args.fsync), ("--snapshot-every", args.snapshot_every))
                         if v is not None]
                if given:
                    raise bad(f"{', '.join(given)} shape a generated topology; with --topology the file's "
                              "workers, groups and settings apply")
                if len(infer.topo.meta) > 99 or len(infer.topo.workers) > 99:
                    raise bad("--topology: at most 99 meta nodes and 99 workers")
            if workers < 1 or shards < 1 or args.gateways < 1:
                raise bad("--workers, --shards and --gateways must be >= 1")
            if workers > 99 or args.gateways > 99:
                raise bad("--workers and --gateways are at most 99")
            rf = args.rf if args.rf is not None else min(3, workers)
            if not 1 <= rf <= workers:
                raise bad(f"--rf {rf} needs 1..--workers ({workers})")
            if args.snapshot_every is not None and args.snapshot_every < 1:
                raise bad("--snapshot-every must be >= 1")
        if target != "shardgrid" and target != "both" and args.snapshot_every is not None:
            raise bad("--snapshot-every is a shardgrid setting")
        if target != "shardgrid" and args.fsync == "none":
            raise bad("--fsync none: this etcd (3.4) cannot turn fsync off")
    else:
        if target == "both":
            raise bad("--target both starts a shardgrid cluster and an etcd for the run: add --cluster local")
        if args.snapshot_every is not None:
            raise bad("--snapshot-every sets up the cluster of --cluster local")
        if infer.worker_args:
            raise bad("--infer-max-rows/--infer-max-wait-ms are worker flags: --cluster local passes them to the "
                      "workers it starts (a running cluster's workers have theirs)")
        urls = urls or [DEFAULT_URLS[target]]
        for u in urls:
            if not re.fullmatch(r"https?://[^/\s]+/?", u):
                raise bad(f"--gateway {u!r}: expected http://HOST:PORT")
            if u.startswith("https://") and args.client == "raw" and target != "etcd-grpc":
                # The raw client writes plain HTTP on the socket: every request would be a connection error.
                raise bad(f"--gateway {u!r}: the raw client speaks plain HTTP only; use --client aiohttp "
                          "(a private CA: SSL_CERT_FILE=ca.pem)")
    rf = args.rf if args.rf is not None else min(3, workers)
    load = LoadConfig(target=target, urls=tuple(urls or ()), mix=tuple(mix.items()), concurrency=concurrency,
                      rate=args.rate, duration_s=float(args.duration), warmup_s=int(args.warmup), ack=args.ack,
                      deadline_ms=args.deadline_ms, value_bytes=args.value_bytes, batch=args.batch, keys=args.keys,
                      embedding_dim=args.embedding_dim or 64, search_k=args.search_k, timeout_s=args.timeout,
                      max_inflight=args.max_inflight, client=args.client,
                      seed=args.seed if args.seed is not None else random.randrange(1 << 30),
                      run_id=f"b{secrets.token_hex(3)}", model=args.model, infer_rows=args.infer_rows,
                      model_dim=infer.model_dim, model_spec=infer.model_spec if target == "inproc" else None,
                      infer_max_rows=args.infer_max_rows or 64)
    return BenchOptions(load=load, procs=args.procs, cluster=args.cluster, workers=workers, shards=shards,
                        rf=rf, gateways=args.gateways, fsync=fsync, snapshot_every=args.snapshot_every,
                        data_dir=args.data_dir,
                        keep_data=args.keep_data, pids_from=args.cluster_pids_from, pids=args.cluster_pids,
                        pgrep=args.cluster_pgrep, json_path=args.json, quiet=args.quiet,
                        command=" ".join(["shardgrid", "bench", *map(shlex.quote, argv or [])]), mix_spec=args.mix,
                        topology_path=args.topology, topology_text=infer.text, worker_args=infer.worker_args,
                        rounds=rounds)


def check_rounds_and_wrk(args: argparse.Namespace, mix: dict[str, float]) -> int:
    """The rounds of --target both / --client wrk, and what wrk cannot do (BenchUsageError)."""
    bad = BenchUsageError
    compare = args.target == "both" or args.client == "wrk"
    if args.rounds is not None:
        if not compare:
            raise bad("--rounds repeats the runs of --target both or --client wrk")
        if not 1 <= args.rounds <= 100:
            raise bad("--rounds must be between 1 and 100")
    rounds = args.rounds if args.rounds is not None else 3 if args.target == "both" else 1
    if args.client != "wrk":
        return rounds
    python = "use the Python client (--client raw)"
    if args.rate is not None:
        raise bad(f"--client wrk runs a closed loop only (wrk has no open loop at a fixed rate): drop --rate, or "
                  f"{python} for an open loop")
    if args.target not in ("shardgrid", "etcd", "both"):
        raise bad(f"--client wrk drives shardgrid's gateway or etcd's JSON gateway (--target shardgrid, etcd or "
                  f"both), not --target {args.target}")
    if list(mix) != ["put"]:
        raise bad(f"--client wrk sends one workload: single puts (--mix put=100) or, with --batch N, batches of "
                  f"puts; --mix {args.mix} is not that: {python}")
    if args.procs != 1:
        raise bad("--client wrk runs its own 2 threads in one process: drop --procs")
    if args.duration != int(args.duration):
        raise bad("--client wrk: --duration is in whole seconds (wrk's -d)")
    conc = args.concurrency if args.concurrency is not None else 16
    if conc > 1 and conc % 2:
        raise bad("--client wrk shares the connections between 2 threads: --concurrency must be even (or 1)")
    return rounds


@dataclass
class InferOptions:
    """What --topology, --model, --infer-* resolve to."""

    text: str | None = None
    topo: Topology | None = None
    model_dim: int = 64
    model_spec: str | None = None  # the model's ModelSpec.to_dict() as JSON
    worker_args: list[str] = field(default_factory=list)


def read_infer_options(args: argparse.Namespace, mix: dict[str, float]) -> InferOptions:
    """Check --topology, --model and the --infer-* options against the mix and the target; BenchUsageError."""
    bad = BenchUsageError
    target = args.target
    infer = "infer" in mix
    if not 1 <= args.infer_rows <= MAX_INFER_ROWS:
        raise bad(f"--infer-rows must be between 1 and {MAX_INFER_ROWS}")
    if args.infer_rows != 1 and not infer:
        raise bad("--infer-rows sizes infer requests, and --mix has none")
    if args.infer_max_rows is not None and args.infer_max_rows < 1:
        raise bad("--infer-max-rows must be >= 1 (1: no batching)")
    if args.infer_max_wait_ms is not None and not 0 <= args.infer_max_wait_ms <= 1000:
        raise bad("--infer-max-wait-ms must be between 0 and 1000")
    out = InferOptions()
    if args.infer_max_rows is not None:
        out.worker_args += ["--infer-max-rows", str(args.infer_max_rows)]
    if args.infer_max_wait_ms is not None:
        out.worker_args += ["--infer-max-wait-ms", f"{args.infer_max_wait_ms:g}"]
    if out.worker_args and target in ETCD_TARGETS:
        raise bad("--infer-max-rows/--infer-max-wait-ms are shardgrid worker flags")
    if args.topology is None:
        if infer:
            raise bad(f"--mix infer needs --topology FILE declaring model {args.model!r} "
                      "(e.g. examples/layers.yaml)")
        return out
    if target in ETCD_TARGETS:
        raise bad("--topology is a shardgrid topology; --target etcd has none")
    if target == "shardgrid" and args.cluster != "local" and not infer:
        raise bad("--topology starts --cluster local from FILE, or names the model of --mix infer; "
                  "this run has neither")
    from topology.errors import TopologyError
    from topology.loader import load_topology

    try:
        out.text = Path(args.topology).read_text(encoding="utf-8")
        out.topo = load_topology(out.text)
    except (OSError, UnicodeDecodeError) as exc:
        raise bad(f"--topology {args.topology}: {exc}") from None
    except TopologyError as exc:
        raise bad(f"--topology {args.topology}: {exc}") from None
    if infer:
        spec = out.topo.model(args.model)
        if spec is None:
            known = ", ".join(m.name for m in out.topo.models) or "none"
            raise bad(f"--mix infer: no model {args.model!r} in {args.topology} (models: {known})")
        out.model_dim = spec.d_model
        import orjson

        out.model_spec = orjson.dumps(spec.to_dict()).decode()
    return out


# -- ports -------------------------------------------------------------------------------------


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_port_base(offsets: list[int], low: int = 20000, high: int = 30000, tries: int = 200,
                   rng: random.Random | None = None) -> int:
    """A base B with every B + offset free on 127.0.0.1 (below the ephemeral range)."""
    rng = rng or random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - max(offsets))
        if all(port_free(base + o) for o in offsets):
            return base
    raise BenchError(f"found no free loopback ports in {low}..{high}")


# -- the cluster under test --------------------------------------------------------------------


@dataclass
class ClusterEnv:
    urls: list[str]
    pids: dict[int, str] | None
    info: dict[str, Any]
    stop: Callable[[], None] = lambda: None
    # The workers' /metrics (a local shardgrid cluster): the round counters.
    metrics_urls: list[str] = field(default_factory=list)


def local_settings(opts: BenchOptions) -> str:
    """The `settings:` of the local cluster's topology (YAML flow mapping)."""
    snap = f", snapshot_every: {opts.snapshot_every}" if opts.snapshot_every is not None else ""
    return f"{{ack: quorum, fsync: {opts.fsync}{snap}}}"


def _say_err(line: str) -> None:
    sys.stderr.write(f"[cluster] {line}\n")
    sys.stderr.flush()


def start_local(opts: BenchOptions, say: Callable[[str], None] = _say_err) -> ClusterEnv:
    """Start the cluster of --cluster local; the returned env's stop() stops it and removes its data."""
    parent = opts.data_dir
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix=f"{opts.load.target}-bench-", dir=parent))
    started: list[Any] = []
    keep = opts.keep_data

    def stop() -> None:
        for thing in started:
            codes = thing.stop()
            say("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()))
        if keep:
            say(f"data and logs kept in {data}")
        else:
            shutil.rmtree(data, ignore_errors=True)

    try:
        if opts.load.target in ETCD_TARGETS:
            from shardgrid.bench.etcd import LocalEtcd

            base = find_port_base([0, 1, 2, 100, 101, 102])
            etcd = LocalEtcd(data, client_ports=[base, base + 1, base + 2],
                             peer_ports=[base + 100, base + 101, base + 102], max_txn_ops=opts.load.batch, say=say)
            started.append(etcd)
            etcd.start()
            env = ClusterEnv(urls=etcd.client_urls, pids={c.pid: c.name for c in etcd.children},
                             info={"mode": "local", "target": opts.load.target, "members": 3, "data": str(data),
                                   "client_urls": etcd.client_urls})
        else:
            from shardgrid.devcluster import LocalCluster, generated_topology, relocated_topology, wait_groups_ready

            if opts.topology_text is not None:
                from topology.loader import load_topology

                given = load_topology(opts.topology_text)
                metas, workers = len(given.meta), len(given.workers)
            else:
                metas, workers = 3, opts.workers
            offsets = [*range(metas), *range(100, 100 + metas), *range(200, 200 + workers),
                       *range(300, 300 + opts.gateways)]
            base = find_port_base(offsets)
            if opts.topology_text is not None:
                text = relocated_topology(opts.topology_text, meta_base=base, worker_base=base + 200)
            else:
                text = generated_topology(opts.workers, opts.shards, opts.rf, meta_base=base, worker_base=base + 200,
                                          settings=local_settings(opts))
            gws = [f"127.0.0.1:{base + 300 + i}" for i in range(opts.gateways)]
            cluster = LocalCluster(text, data, gateways=gws, say=say, gateway_args=["--no-access-log"],
                                   worker_args=list(opts.worker_args))
            started.append(cluster)
            cluster.start()
            # start() returns once every group has a quorum; a worker still importing torch (seconds
            # of CPU) would then join, and catch up, during the measurement.
            say("waiting for every worker to be up ...")
            asyncio.run(wait_workers_registered([w.http for w in cluster.topo.workers], WORKERS_UP_TIMEOUT_S))
            say("waiting for every group to be led by its preferred leader ...")
            asyncio.run(wait_groups_ready(cluster.meta_addrs, WORKERS_UP_TIMEOUT_S, balanced=True))
            topo = cluster.topo
            if topo.models:
                # A model group's replicas build their weights after they join: until then the gateway
                # has no route, and the first seconds would measure that.
                say(f"waiting for {', '.join(m.name for m in topo.models)} to answer inference ...")
                asyncio.run(wait_models_answer(f"http://{gws[0]}", [(m.name, m.d_model) for m in topo.models],
                                               WORKERS_UP_TIMEOUT_S))
            say("cluster ready")
            env = ClusterEnv(urls=[f"http://{g}" for g in gws], pids={c.pid: c.name for c in cluster.children},
                             metrics_urls=[f"http://{w.http}/metrics" for w in topo.workers],
                             info={"mode": "local", "target": "shardgrid", "workers": len(topo.workers),
                                   "shards": topo.shards, "rf": topo.replication_factor, "gateways": opts.gateways,
                                   "fsync": topo.settings.fsync, "snapshot_every": topo.settings.snapshot_every,
                                   "embedding_dim": topo.settings.embedding_dim,
                                   "topology": opts.topology_path, "models": [m.name for m in topo.models],
                                   "worker_args": list(opts.worker_args), "data": str(data)})
    except Exception:
        keep = True  # the cluster did not come up: its logs say why
        stop()
        raise
    except BaseException:
        stop()
        raise
    env.stop = stop
    return env


async def wait_workers_registered(addrs: list[str], deadline_s: float) -> None:
    """Until every worker's /healthz answers and says it registered with meta."""
    import aiohttp

    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        for addr in addrs:
            while True:
                try:
                    async with s.get(f"http://{addr}/healthz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200 and (await r.json()).get("registered"):
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {addr} not up after {deadline_s:.0f} s")
                await asyncio.sleep(0.2)


async def wait_models_answer(gateway: str, models: list[tuple[str, int]], deadline_s: float) -> None:
    """Until one inference of one row per model succeeds through `gateway`."""
    import aiohttp

    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        for name, d_model in models:
            last = ""
            while True:
                try:
                    async with s.post(f"{gateway}/v1/models/{name}/infer", json={"input": [[0.0] * d_model]},
                                      headers={"x-deadline-ms": "5000"},
                                      timeout=aiohttp.ClientTimeout(total=6)) as r:
                        if r.status == 200:
                            break
                        last = f"HTTP {r.status}: {(await r.text())[:200]}"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    raise TimeoutError(f"model {name} did not answer within {deadline_s:.0f} s ({last})")
                await asyncio.sleep(0.2)


def inproc_env(opts: BenchOptions) -> ClusterEnv:
    """--target inproc: no cluster; what the generator computes, for the report."""
    import orjson

    from shardgrid.bench.inproc import compute_description

    cfg = opts.load
    spec = orjson.loads(cfg.model_spec or "{}")
    return ClusterEnv(urls=[], pids=None,
                      info={"mode": "inproc", "target": "inproc", "topology": opts.topology_path,
                            "model": cfg.model, "layers": spec.get("layers"), "d_model": spec.get("d_model"),
                            "d_hidden": spec.get("d_hidden"), "infer_max_rows": cfg.infer_max_rows,
                            "compute": compute_description(cfg.infer_max_rows)})


def attached_env(opts: BenchOptions) -> ClusterEnv:
    pids: dict[int, str] | None = None
    try:
        if opts.pids_from:
            pids = pids_from_dir(opts.pids_from)
        if opts.pids:
            pids = {**(pids or {}), **pids_from_list(opts.pids)}
        if opts.pgrep:
            found = pids_from_pattern(opts.pgrep)
            if not found:
                raise BenchUsageError(f"--cluster-pgrep {opts.pgrep!r} matches no process")
            pids = {**(pids or {}), **found}
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None
    return ClusterEnv(urls=list(opts.load.urls), pids=pids,
                      info={"mode": "attached", "target": opts.load.target, "urls": list(opts.load.urls)})


# -- merging ticks -----------------------------------------------------------------------------


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


class Collector:
    """Merges the ticks of every generator process, prints a line per second, keeps the totals."""

    def __init__(self, procs: int, warmup_s: int, batch: int, out: TextIO | None,
                 show_inflight: bool = False) -> None:
        self.procs = procs
        self.show_inflight = show_inflight
        self.warmup_s = warmup_s
        self.batch = batch
        self.out = out
        self.pending: dict[int, list[dict[str, Any]]] = {}
        self.last_index = [-1] * procs
        self.done = [False] * procs
        self.next_line = 0
        self.measured: dict[str, KindTotals] = {}
        self.lag = new_histogram()
        self.timeline: list[dict[str, Any]] = []
        self.final_elapsed = 0.0
        self._header = False

    def add(self, tick: dict[str, Any]) -> None:
        p = tick["proc"]
        self.pending.setdefault(tick["index"], []).append(tick)
        self.last_index[p] = tick["index"]
        if tick["final"]:
            self.done[p] = True
            self.final_elapsed = max(self.final_elapsed, tick["elapsed_s"])
        self.flush()

    def mark_done(self, proc: int) -> None:
        """A process that will send nothing more (it failed)."""
        self.done[proc] = True
        self.flush()

    def flush(self) -> None:
        while True:
            k = self.next_line
            if not all(self.done[p] or self.last_index[p] >= k for p in range(self.procs)):
                return
            ticks = self.pending.pop(k, [])
            if not ticks:
                if all(self.done):
                    return
                self.next_line += 1
                continue
            self._second(k, ticks)
            self.next_line += 1

    def _second(self, k: int, ticks: list[dict[str, Any]]) -> None:
        kinds: dict[str, KindTotals] = {}
        for t in ticks:
            for kind, w in t["kinds"].items():
                kinds.setdefault(kind, KindTotals()).add_wire(w)
        total = overall(kinds)
        warm = k < self.warmup_s
        final = any(t["final"] for t in ticks)
        # A full second, except the last tick: from second k to when the last process finished.
        span = max(0.001, max(t["elapsed_s"] for t in ticks) - k) if final else 1.0
        if not warm:
            for kind, kt in kinds.items():
                self.measured.setdefault(kind, KindTotals()).add(kt)
            for t in ticks:
                if t.get("lag"):
                    merge_into(self.lag, t["lag"])
        lat = latency_summary(total.hist)
        errors = total.error_count
        row = {"second": k + 1, "span_s": round(span, 3), "ops": total.ok, "records": total.records,
               "errors": errors, "p50_ms": lat["p50"], "p99_ms": lat["p99"], "warmup": warm, "final": final,
               "inflight": sum(t.get("inflight", 0) for t in ticks)}
        self.timeline.append(row)
        if self.out is None:
            return
        if not self._header:
            self._header = True
            rec = f" {'rec/s':>10}" if self.batch else ""
            infl = f" {'inflight':>8}" if self.show_inflight else ""
            self.out.write(f"{'time':>7} {'ops/s':>9}{rec} {'errors':>7} {'p50 ms':>8} {'p99 ms':>8}{infl}\n")
        label = f"{k + 1}s" if not final else f"+{span:.2f}s"
        rec = f" {total.records / span:>10,.0f}" if self.batch else ""
        note = "  (warm-up)" if warm else "  (drain)" if final else ""
        infl = f" {row['inflight']:>8}" if self.show_inflight else ""
        self.out.write(f"{label:>7} {total.ok / span:>9,.0f}{rec} {errors:>7} {_fmt_ms(lat['p50']):>8} "
                       f"{_fmt_ms(lat['p99']):>8}{infl}{note}\n")
        self.out.flush()


# -- one run -----------------------------------------------------------------------------------


@dataclass
class RunOutput:
    collector: Collector
    summaries: list[dict[str, Any]]
    cpu_before: dict[int, tuple[str, int]] | None
    cpu_after: dict[int, tuple[str, int]] | None
    interrupted: bool = False
    errors: list[str] = field(default_factory=list)
    counters_before: dict[str, float] | None = None
    counters_after: dict[str, float] | None = None


def run_generators(cfg: LoadConfig, procs: int, cpu: CpuAccount | None, out: TextIO | None,
                   counters: WorkerCounters | None = None) -> RunOutput:
    """Spawn the generator processes, run them together, merge what they report."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    collector = Collector(procs, cfg.warmup_s, cfg.batch, out, show_inflight=cfg.open_loop)
    children = [ctx.Process(target=child_main, args=(cfg.for_proc(i, procs), q, go, stop, start_at),
                            name=f"bench-gen-{i}", daemon=True) for i in range(procs)]
    run = RunOutput(collector, [], None, None)
    for c in children:
        c.start()
    done: set[int] = set()
    try:
        try:
            ready: set[int] = set()
            deadline = time.monotonic() + READY_TIMEOUT_S
            while len(ready) < procs:
                try:
                    kind, proc, payload = q.get(timeout=0.1)
                except queue.Empty:
                    dead = [c.name for c in children if not c.is_alive()]
                    if dead:
                        raise BenchError(f"generator process {dead[0]} exited before it was ready")
                    if time.monotonic() > deadline:
                        raise BenchError(f"generator processes not ready after {READY_TIMEOUT_S:.0f} s")
                    continue
                if kind == "error":
                    raise BenchError(f"generator {proc} failed: {payload}")
                if kind == "ready":
                    ready.add(proc)
            start_at.value = time.time() + 0.3
            measure_at = start_at.value + cfg.warmup_s
            go.set()
            finish_by = start_at.value + cfg.warmup_s + cfg.duration_s + cfg.timeout_s + 30
            while len(done) < procs:
                if cpu is not None and run.cpu_before is None and time.time() >= measure_at:
                    run.cpu_before = cpu.sample()
                    run.counters_before = counters.sample() if counters is not None else None
                try:
                    kind, proc, payload = q.get(timeout=0.02 if run.cpu_before is None and cpu else 0.1)
                except queue.Empty:
                    for i, c in enumerate(children):
                        if i not in done and not c.is_alive():
                            done.add(i)
                            run.errors.append(f"generator {i} exited with {c.exitcode} before it finished")
                            collector.mark_done(i)
                    if time.time() > finish_by:
                        raise BenchError("the generator processes did not finish in time")
                    continue
                if kind == "tick":
                    collector.add(payload)
                elif kind == "done":
                    done.add(proc)
                    run.summaries.append(payload)
                elif kind == "error":
                    done.add(proc)
                    run.errors.append(f"generator {proc}: {payload}")
                    collector.mark_done(proc)
        except KeyboardInterrupt:
            # Stop the load; collect what the processes measured until then (a second Ctrl-C aborts).
            run.interrupted = True
            stop.set()
            sys.stderr.write("\ninterrupted: stopping the load and collecting the results (Ctrl-C again aborts)\n")
            until = time.monotonic() + cfg.timeout_s + 5
            while len(done) < procs and time.monotonic() < until:
                try:
                    kind, proc, payload = q.get(timeout=0.1)
                except queue.Empty:
                    continue
                if kind == "tick":
                    collector.add(payload)
                elif kind in ("done", "error"):
                    done.add(proc)
                    if kind == "done":
                        run.summaries.append(payload)
        if cpu is not None:
            if run.cpu_before is None:
                run.cpu_before = cpu.sample()
                run.counters_before = counters.sample() if counters is not None else None
            run.cpu_after = cpu.sample()
            run.counters_after = counters.sample() if counters is not None else None
        for i in range(procs):
            if i not in done:
                collector.mark_done(i)
    finally:
        stop.set()
        for c in children:
            c.join(timeout=5)
            if c.is_alive():
                c.kill()
                c.join(timeout=5)
        q.close()
    return run


# -- the result --------------------------------------------------------------------------------


def build_result(opts: BenchOptions, env: ClusterEnv, run: RunOutput, cpu: CpuAccount | None,
                 loadavg: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> dict[str, Any]:
    cfg = opts.load
    col = run.collector
    kinds = col.measured
    total = overall(kinds)
    elapsed = max(0.001, (col.final_elapsed or (cfg.warmup_s + cfg.duration_s)) - cfg.warmup_s)
    acked_writes = sum(kt.records for k, kt in kinds.items() if k in WRITE_KINDS)
    by_code: dict[str, int] = {}
    record_errors: dict[str, int] = {}
    for kt in kinds.values():
        for c, n in kt.errors.items():
            by_code[c] = by_code.get(c, 0) + n
        for c, n in kt.record_errors.items():
            record_errors[c] = record_errors.get(c, 0) + n
    client_cpu = sum(s.get("cpu_s", 0.0) for s in run.summaries)
    cluster_cpu = None
    if cpu is not None and run.cpu_before is not None and run.cpu_after is not None:
        rep = cpu.report(run.cpu_before, run.cpu_after)
        rep["cores_busy"] = round(rep["cpu_s"] / elapsed, 3)
        rep["us_per_acked_write"] = round(rep["cpu_s"] * 1e6 / acked_writes, 1) if acked_writes else None
        rep["us_per_op"] = round(rep["cpu_s"] * 1e6 / total.ok, 1) if total.ok else None
        cluster_cpu = rep
    open_loop = None
    if cfg.open_loop:
        scheduled = sum(s.get("scheduled") or 0 for s in run.summaries)
        sent = sum(s.get("sent") or 0 for s in run.summaries)
        open_loop = {"rate": cfg.rate, "scheduled": scheduled, "sent": sent,
                     "unsent": sum(s.get("unsent") or 0 for s in run.summaries),
                     "max_inflight": cfg.max_inflight, "schedule_lag_ms": latency_summary(col.lag)}
    infer = infer_report(cfg, kinds.get("infer"), elapsed, run.summaries) if "infer" in cfg.kinds else None
    return {
        "version": RESULT_VERSION,
        "command": opts.command,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "interrupted": run.interrupted,
        "config": {"target": cfg.target, "mode": "open" if cfg.open_loop else "closed",
                   "concurrency": None if cfg.open_loop else cfg.concurrency, "rate": cfg.rate,
                   "duration_s": cfg.duration_s, "warmup_s": cfg.warmup_s, "mix": dict(cfg.mix),
                   "ack": cfg.ack, "deadline_ms": cfg.deadline_ms, "value_bytes": cfg.value_bytes,
                   "batch": cfg.batch, "keys": cfg.keys, "procs": opts.procs, "urls": env.urls,
                   "timeout_s": cfg.timeout_s, "seed": cfg.seed,
                   "client": "grpcio" if cfg.target == "etcd-grpc" else "none" if cfg.target == "inproc"
                   else cfg.client,
                   "model": cfg.model if infer else None, "infer_rows": cfg.infer_rows if infer else None},
        "cluster": env.info,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": list(loadavg[0]) if loadavg else None,
                    "loadavg_after": list(loadavg[1]) if loadavg else None},
        "elapsed_s": round(elapsed, 3),
        "ops": total.ok,
        "ops_per_s": round(total.ok / elapsed, 1),
        "records": total.records,
        "records_per_s": round(total.records / elapsed, 1),
        "acked_writes": acked_writes,
        "misses": total.misses,
        "errors": {"total": sum(by_code.values()), "by_code": dict(sorted(by_code.items())),
                   "record_errors": dict(sorted(record_errors.items()))},
        "latency_ms": latency_summary(total.hist),
        "by_kind": {k: {"ops": kt.ok, "records": kt.records, "misses": kt.misses, "errors": dict(kt.errors),
                        "latency_ms": latency_summary(kt.hist)} for k, kt in kinds.items()},
        "open_loop": open_loop,
        "infer": infer,
        "cluster_cpu": cluster_cpu,
        "rounds": rounds_report(run.counters_before, run.counters_after, acked_writes),
        "client": {"procs": opts.procs, "cpu_s": round(client_cpu, 3),
                   "cores_busy": round(client_cpu / elapsed, 3) if run.summaries else None,
                   "problems": run.errors},
        "timeline": col.timeline,
        "histogram": total.hist.encode().decode("ascii"),
    }


def infer_report(cfg: LoadConfig, kt: KindTotals | None, elapsed: float,
                 summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The infer figures: inferences (answered requests) and rows per second; with --target inproc
    also the forward passes (over the whole run, warm-up included)."""
    n = kt.ok if kt is not None else 0
    rows = kt.records if kt is not None else 0
    passes = None
    counted = [s["passes"] for s in summaries if s.get("passes")]
    if counted:
        p = {k: sum(c[k] for c in counted) for k in ("passes", "rows", "requests")}
        passes = {**p, "rows_per_pass": round(p["rows"] / p["passes"], 2) if p["passes"] else None}
    return {"model": cfg.model, "rows_per_request": cfg.infer_rows, "inferences": n,
            "inferences_per_s": round(n / elapsed, 1), "rows": rows, "rows_per_s": round(rows / elapsed, 1),
            "passes": passes}


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = []
    mode = f"open loop at {c['rate']:g} req/s" if c["mode"] == "open" else f"closed loop, concurrency {c['concurrency']}"
    mix = ",".join(f"{k}={v:g}" for k, v in c["mix"].items())
    batch = f", batch {c['batch']}" if c["batch"] else ""
    lines.append(f"{r['command']}")
    ack = "quorum (etcd)" if c["target"] in ETCD_TARGETS else c["ack"] or "cluster default"
    warm = f" after {c['warmup_s']} s warm-up" if c["warmup_s"] else ""
    if list(c["mix"]) == ["infer"]:
        # No writes: ack and values mean nothing; the deadline is the inference budget.
        budget = f"deadline {c['deadline_ms']} ms" if c["deadline_ms"] else "cluster default deadline"
        shape = f"model {c['model']}, {c['infer_rows']} row(s) per request, " + \
            (f"{budget}, " if c["target"] != "inproc" else "")
    else:
        shape = f"ack {ack}, {c['value_bytes']}-byte values{batch}, "
    where = "no HTTP" if c["target"] == "inproc" else \
        f"{len(c['urls'])} endpoint(s), {c['procs']} generator proc(s) ({c.get('client', 'aiohttp')} client)"
    lines.append(f"  target {c['target']} ({r['cluster']['mode']}), {mode}, {c['duration_s']:g} s measured"
                 f"{warm}, mix {mix}, {shape}{where}")
    if c["target"] == "inproc":
        cl = r["cluster"]
        lines.append(f"  in process   model {cl['model']} ({cl['layers']} layers, d_model {cl['d_model']}) of "
                     f"{cl['topology']}: {cl['compute']}")
    if r["interrupted"]:
        lines.append("  INTERRUPTED: the figures cover the part that ran")
    rec = f", {r['records_per_s']:,.0f} records/s" if c["batch"] else ""
    misses = f", {r['misses']:,} misses" if r["misses"] else ""
    writes = any(k in WRITE_KINDS for k in c["mix"])
    tail = f" ({r['acked_writes']:,} acknowledged writes{misses})" if writes or misses else ""
    lines.append(f"  throughput   {r['ops']:,} ok in {r['elapsed_s']:.2f} s = {r['ops_per_s']:,.0f} ops/s{rec}{tail}")
    inf = r.get("infer")
    if inf:
        rows = (f", {inf['rows_per_s']:,.0f} rows/s ({inf['rows_per_request']} rows each)"
                if inf["rows_per_request"] > 1 else "")
        passes = inf["passes"]
        per_pass = (f"; {passes['passes']:,} forward passes of {passes['rows_per_pass']} rows on average"
                    if passes and passes["passes"] else "")
        lines.append(f"  inference    {inf['inferences']:,} of model {inf['model']} = "
                     f"{inf['inferences_per_s']:,.0f} inferences/s{rows}{per_pass}")
    err = r["errors"]
    codes = ", ".join(f"{k} {v:,}" for k, v in err["by_code"].items()) or "none"
    lines.append(f"  errors       {err['total']:,} ({codes})"
                 + (f"; inside batches: {', '.join(f'{k} {v:,}' for k, v in err['record_errors'].items())}"
                    if err["record_errors"] else ""))
    lat = r["latency_ms"]
    if lat["count"]:
        lines.append(f"  latency ms   p50 {lat['p50']:.2f}  p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}  "
                     f"p99.9 {lat['p999']:.2f}  max {lat['max']:.2f}  (mean {lat['mean']:.2f})"
                     + ("  from the intended send time" if c["mode"] == "open" else ""))
    if len(r["by_kind"]) > 1:
        for k, v in r["by_kind"].items():
            lk = v["latency_ms"]
            lines.append(f"    {k:<8} {v['ops']:>9,} ok {sum(v['errors'].values()):>6,} err  "
                         f"p50 {_fmt_ms(lk['p50'])}  p99 {_fmt_ms(lk['p99'])} ms")
    ol = r["open_loop"]
    if ol:
        lag = ol["schedule_lag_ms"]
        incl = " (with the warm-up)" if c["warmup_s"] else ""
        lines.append(f"  open loop    scheduled {ol['scheduled']:,}{incl}, sent {ol['sent']:,}, unsent {ol['unsent']:,}; "
                     f"send lag p99 {_fmt_ms(lag['p99'])} ms, max {_fmt_ms(lag['max'])} ms")
        if ol["unsent"]:
            lines.append("               requests left unsent: the cluster (or --max-inflight) could not keep up; "
                         "the latency figures understate what clients would see")
    cc = r["cluster_cpu"]
    if cc:
        roles = ", ".join(f"{k} {v:.2f}" for k, v in cc["by_role"].items())
        per = f"{cc['us_per_acked_write']:,.0f} µs CPU per acknowledged write" if cc["us_per_acked_write"] \
            else f"{cc['us_per_op']:,.0f} µs CPU per {'inference' if r.get('infer') else 'operation'}" \
            if cc["us_per_op"] else "no acknowledged writes"
        lines.append(f"  cluster CPU  {cc['cpu_s']:.2f} s ({roles}) = {cc['cores_busy']:.2f} cores busy; {per}"
                     + (" (lower bound: a process exited)" if cc["lower_bound"] else ""))
    if r.get("rounds"):
        lines.append(format_rounds(r["rounds"]))
    cl = r["client"]
    if cl["cores_busy"] is not None and c["target"] == "inproc":
        lines.append(f"  process CPU  {cl['cpu_s']:.2f} s = {cl['cores_busy']:.2f} cores (the load and the model's "
                     "compute together)")
    elif cl["cores_busy"] is not None:
        lines.append(f"  client CPU   {cl['cpu_s']:.2f} s over {cl['procs']} proc(s) = {cl['cores_busy']:.2f} cores"
                     + ("  <- the generator may be the bottleneck: add --procs" if cl["cores_busy"] > 0.85 * cl["procs"]
                        else ""))
    for p in cl["problems"]:
        lines.append(f"  problem      {p}")
    m = r["machine"]
    if m["loadavg_before"]:
        lines.append(f"  machine      {m['cpus']} CPUs, load average before {m['loadavg_before'][0]:.2f}, "
                     f"after {m['loadavg_after'][0]:.2f}")
    return "\n".join(lines)


def write_json(path: str, result: dict[str, Any]) -> None:
    import orjson

    Path(path).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")


# -- the command -------------------------------------------------------------------------------


def run_bench(opts: BenchOptions, out: TextIO | None = sys.stdout) -> dict[str, Any]:
    """Start (or attach to) the cluster, run the load, stop what was started; the result dict."""
    if opts.load.target == "inproc":
        env = inproc_env(opts)
    else:
        env = start_local(opts) if opts.cluster == "local" else attached_env(opts)
    try:
        cfg = opts.load
        if opts.cluster == "local":
            from dataclasses import replace

            cfg = replace(cfg, urls=tuple(env.urls))
            if env.info.get("embedding_dim") and cfg.kinds and {"embed", "search"} & set(cfg.kinds):
                cfg = replace(cfg, embedding_dim=env.info["embedding_dim"])
            opts.load = cfg
        cpu = CpuAccount(env.pids) if env.pids else None
        if cpu is not None:
            env.info["pids"] = {str(k): v for k, v in env.pids.items()}
        load_before = os.getloadavg()
        counters = WorkerCounters(env.metrics_urls) if env.metrics_urls else None
        run = run_generators(cfg, opts.procs, cpu, None if opts.quiet else out, counters)
        result = build_result(opts, env, run, cpu, (load_before, os.getloadavg()))
    finally:
        env.stop()
    return result


def main_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    try:
        opts = options_from_args(args, argv)
    except BenchUsageError as exc:
        sys.stderr.write(f"shardgrid bench: {exc}\n")
        return 2
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, on_term)
    from meta.client import MetaError, MetaUnreachable

    try:
        if opts.compare:
            from shardgrid.bench.compare import run_compare

            result = run_compare(opts, None if opts.quiet else sys.stdout)
        else:
            result = run_bench(opts)
    except BenchUsageError as exc:
        sys.stderr.write(f"shardgrid bench: {exc}\n")
        return 2
    except (BenchError, MetaUnreachable, MetaError, TimeoutError, RuntimeError, FileNotFoundError, OSError) as exc:
        sys.stderr.write(f"shardgrid bench: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("shardgrid bench: interrupted\n")
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print()
    if opts.compare:
        from shardgrid.bench.compare import format_compare

        print(format_compare(result))
    else:
        print(format_report(result))
    if opts.json_path:
        write_json(opts.json_path, result)
        print(f"  result JSON  {opts.json_path}")
    return 0 if result["ops"] > 0 else 1
