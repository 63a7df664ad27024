"""`shardgrid bench --client wrk` and `--target both` without a cluster: the Lua scripts wrk runs,
the parser of their done() line, wrk's command line (a fake wrk), the median of rounds, the
side-by-side report, and what wrk cannot do (refused with a clear message)."""
from __future__ import annotations

import base64
import json
import os
import random
import stat
from pathlib import Path
from typing import Any

import pytest

from shardgrid.bench import compare, wrk
from shardgrid.bench.compare import (format_compare, median, ratios, round_targets, row_from_figures, schedule,
                                     summarize_rounds)
from shardgrid.bench.load import make_value
from shardgrid.bench.run import BenchUsageError, ClusterEnv, main_from_args, options_from_args
from shardgrid.bench.wrk import (MARKER, Workload, WrkError, lua_script, lua_str, padded_prefix, parse_done_line,
                                 run_wrk, summarize, wrk_argv, wrk_key)
from shardgrid.cli import build_parser

DOC = make_value(100, random.Random(7))


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["bench", *argv])


# -- the Lua scripts ---------------------------------------------------------------------------


def test_lua_str_escapes_quotes_backslashes_and_control_bytes() -> None:
    assert lua_str('{"v":"ab"}') == r'"{\"v\":\"ab\"}"'
    assert lua_str("a\\b\n\x00é") == r'"a\\b\010\000\195\169"'


def test_shardgrid_put_script_sends_the_python_put() -> None:
    s = lua_script(Workload("shardgrid", DOC, "wkp", ack="quorum", deadline_ms=2500))
    # The doc of --value-bytes, the route and headers of load.py's put, a fresh key per request.
    assert f"DOC = {lua_str(DOC)}" in s and len(DOC) == len('{"v":""}') + 100
    assert 'wrk.format("PUT", "/items/" .. key, headers(key), DOC)' in s
    assert '["content-type"] = "application/json"' in s and '["x-ack"] = "quorum"' in s
    assert '["x-deadline-ms"] = "2500"' in s and 'h["x-request-id"] = rid' in s
    assert 'PREFIX = "wkp"' in s and "RECORDS = 1" in s and "BATCH_BODY_ERRORS = false" in s
    assert "DOC64" not in s and "/batch" not in s
    # No x-ack / x-deadline-ms unless asked (the cluster's defaults apply).
    plain = lua_script(Workload("shardgrid", DOC, "wkp"))
    assert "x-ack" not in plain and "x-deadline-ms" not in plain


def test_shardgrid_batch_script_sends_put_items_of_distinct_keys() -> None:
    s = lua_script(Workload("shardgrid", DOC, "wkb", batch=100))
    assert "for i = 1, 100 do" in s and "local key = next_key()" in s
    assert """'{"op":"put_item","id":"' .. key .. '","doc":' .. DOC .. '}'""" in s
    assert """wrk.format("POST", "/batch", headers(rid), '{"writes":[' .. table.concat(items, ",") .. ']}')""" in s
    # 100 records per acknowledged request; a 200 whose body carries an "error" is not all acknowledged.
    assert "RECORDS = 100" in s and "BATCH_BODY_ERRORS = true" in s


def test_etcd_scripts_send_base64_put_and_txn() -> None:
    s = lua_script(Workload("etcd", DOC, "wke"))
    assert f"DOC64 = {lua_str(base64.b64encode(DOC))}" in s
    assert """wrk.format("POST", "/v3/kv/put", HEADERS, '{"key":"' .. key64 .. '","value":"' .. DOC64 .. '"}')""" in s
    assert "x-request-id" not in s and "x-ack" not in s and "RECORDS = 1" in s
    t = lua_script(Workload("etcd", DOC, "wke", batch=50))
    assert "for i = 1, 50 do" in t and "RECORDS = 50" in t and "BATCH_BODY_ERRORS = false" in t
    assert """'{"request_put":{"key":"' .. key64 .. '","value":"' .. DOC64 .. '"}}'""" in t
    assert """wrk.format("POST", "/v3/kv/txn", HEADERS, '{"success":[' .. table.concat(items, ",") .. ']}')""" in t


def test_scripts_count_non_2xx_and_print_one_json_line() -> None:
    s = lua_script(Workload("shardgrid", DOC, "x"))
    assert "function response(status, headers, body)" in s and "function done(summary, latency, requests)" in s
    assert 'local k = "http_" .. status' in s
    assert 'for _, k in ipairs({"connect", "read", "write", "timeout"}) do' in s
    assert 'PERCENTILES = {{"p50", 50}, {"p90", 90}, {"p99", 99}, {"p999", 99.9}}' in s
    assert f'MARKER = "{MARKER}"' in s and "latency:percentile(p[2])" in s
    # Several endpoints: wrk's threads are spread over them.
    multi = lua_script(Workload("etcd", DOC, "x"), [("127.0.0.1", 2379), ("127.0.0.1", 2380)])
    assert 'local addrs = {wrk.lookup("127.0.0.1", "2379")[1], wrk.lookup("127.0.0.1", "2380")[1]}' in multi
    assert "local addrs = {}" in s
    with pytest.raises(ValueError, match="not 'etcd-grpc'"):
        lua_script(Workload("etcd-grpc", DOC, "x"))


@pytest.mark.parametrize("prefix", ["w", "wb1r2", "wb12345r3"])
def test_keys_and_their_base64_as_the_script_builds_them(prefix: str) -> None:
    """The script encodes a key as b64(prefix+thread) followed by the b64 of four 3-digit groups:
    right only because every piece is a multiple of 3 bytes (the padding does that)."""
    p = padded_prefix(prefix)
    assert len(p) % 3 == 0 and p.startswith(prefix) and set(p[len(prefix):]) <= {"-"}
    for tid, counter in ((1, 1), (2, 987654321012), (12, 40)):
        key = wrk_key(prefix, tid, counter)
        thread_prefix = p + f"{tid:03d}"
        digits = f"{counter:012d}"
        pieced = base64.b64encode(thread_prefix.encode()) + b"".join(
            base64.b64encode(digits[i:i + 3].encode()) for i in range(0, 12, 3))
        assert key == thread_prefix + digits and pieced == base64.b64encode(key.encode())
    assert len({wrk_key(prefix, t, c) for t in (1, 2) for c in range(1, 500)}) == 998


# -- the done() line and wrk's command line -----------------------------------------------------

DONE = {"requests": 1010, "ok": 1000, "records": 1000, "duration_us": 2_000_000, "bytes": 1,
        "errors": {"http_503": 7, "timeout": 3}, "latency_us": {"p50": 1500.0, "p90": 3000.0, "p99": 9000.0,
                                                               "p999": 12000.0, "mean": 2000.0, "max": 15000.0}}


def test_parse_done_line_among_wrks_text() -> None:
    text = "Running 2s test @ http://x/\n  2 threads and 8 connections\n" + MARKER + json.dumps(DONE) + "\nbye\n"
    assert parse_done_line(text) == DONE
    s = summarize(parse_done_line(text))
    assert s["ops"] == 1000 and s["ops_per_s"] == 500.0 and s["records_per_s"] == 500.0
    assert s["errors"] == {"total": 10, "by_code": {"http_503": 7, "timeout": 3}}
    assert s["latency_ms"]["p50"] == 1.5 and s["latency_ms"]["p99"] == 9.0 and s["latency_ms"]["p999"] == 12.0
    with pytest.raises(WrkError, match="printed no SGWRK line"):
        parse_done_line("Requests/sec: 1000\n")
    with pytest.raises(WrkError, match="not JSON"):
        parse_done_line(MARKER + "{nope\n")
    with pytest.raises(WrkError, match="lacks 'latency_us'"):
        parse_done_line(MARKER + json.dumps({k: v for k, v in DONE.items() if k != "latency_us"}))


def test_wrk_argv() -> None:
    assert wrk_argv("/usr/bin/wrk", "/tmp/s.lua", "http://h:1/", 8, 2, 10) == [
        "/usr/bin/wrk", "-t", "2", "-c", "8", "-d", "2s", "--latency", "--timeout", "10s", "-s", "/tmp/s.lua",
        "http://h:1/"]
    assert wrk_argv("wrk", "s", "u", 1, 5, 0.5)[1:7] == ["-t", "1", "-c", "1", "-d", "5s"]


def _fake_wrk(tmp_path: Path, line: str, rc: int = 0) -> str:
    """A stand-in for wrk: records its argv and its script, prints `line`."""
    path = tmp_path / "wrk"
    path.write_text(f"""#!/bin/sh
echo "$@" > {tmp_path}/argv
for a in "$@"; do case "$a" in *.lua) cp "$a" {tmp_path}/script.lua;; esac; done
echo "Running a test"
printf '%s\\n' '{line}'
exit {rc}
""")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_run_wrk_writes_the_script_runs_and_parses(tmp_path: Path) -> None:
    binary = _fake_wrk(tmp_path, MARKER + json.dumps(DONE))
    called = []
    w = Workload("etcd", DOC, "wkr", batch=10)
    r = run_wrk(w, ["http://127.0.0.1:2379", "http://127.0.0.1:2380"], 8, 2, 10, before=lambda: called.append(1),
                binary=binary)
    assert r.done == DONE and called == [1] and r.cpu_s >= 0
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:8] == ["-t", "2", "-c", "8", "-d", "2s", "--latency", "--timeout"] and argv[-1] == \
        "http://127.0.0.1:2379/"
    script = (tmp_path / "script.lua").read_text()
    assert script == lua_script(w, [("127.0.0.1", 2379), ("127.0.0.1", 2380)])
    assert not os.path.exists(argv[-2])  # the temp script is removed
    with pytest.raises(WrkError, match="wrk exited with 1"):
        run_wrk(w, ["http://127.0.0.1:2379"], 8, 2, 10, binary=_fake_wrk(tmp_path, "x", rc=1))


# -- rounds, medians, the side-by-side report ---------------------------------------------------


def test_schedule_interleaves_the_targets() -> None:
    assert schedule("both", 3) == [(1, "shardgrid"), (1, "etcd"), (2, "shardgrid"), (2, "etcd"),
                                   (3, "shardgrid"), (3, "etcd")]
    assert schedule("etcd", 2) == [(1, "etcd"), (2, "etcd")]
    assert round_targets("both") == ["shardgrid", "etcd"]


def _row(n: int, target: str, client: str, rps: float, p99: float, cpu_s: float, errors: int = 0) -> dict:
    ops = int(rps * 2)
    figures = {"elapsed_s": 2.0, "ops": ops, "ops_per_s": rps, "records": ops * 10, "records_per_s": rps * 10,
               "errors": {"total": errors, "by_code": {"http_503": errors} if errors else {}},
               "latency_ms": {"p50": p99 / 4, "p90": p99 / 2, "p99": p99, "p999": p99 * 2, "max": p99 * 3}}
    return row_from_figures(n, target, client, figures, ops * 10, {"cpu_s": cpu_s, "by_role": {"x": cpu_s}}, 0.5)


def test_median_of_rounds_and_ratio() -> None:
    assert median([3, None, 1, 2]) == 2 and median([1, 2]) == 1.5 and median([None]) is None
    sg = [_row(1, "shardgrid", "wrk", 1000, 8, 2.0), _row(2, "shardgrid", "wrk", 3000, 4, 6.0, errors=2),
          _row(3, "shardgrid", "wrk", 2000, 6, 2.0)]
    assert sg[0]["client"] == "wrk" and sg[0]["us_per_acked_write"] == 100.0
    m = summarize_rounds(sg)
    assert m["rounds"] == 3 and m["ops_per_s"] == 2000 and m["records_per_s"] == 20000 and m["p99_ms"] == 6
    assert m["p50_ms"] == 1.5 and m["us_per_acked_write"] == 100.0 and m["errors"] == 2
    assert m["acked_writes"] == sum(r["acked_writes"] for r in sg) and m["client"] == "wrk"
    et = summarize_rounds([_row(i, "etcd", "wrk", 4000, 3, 1.6) for i in (1, 2, 3)])
    r = ratios(m, et)
    assert r["ops_per_s"] == 0.5 and r["p99_ms"] == 2.0 and r["us_per_acked_write"] == 5.0
    assert ratios({**m, "ops_per_s": None}, et)["ops_per_s"] is None
    assert compare.client_label("raw") == "python-raw" and compare.client_label("aiohttp") == "python-aiohttp"


def _compare_result(batch: int) -> dict:
    rows = [_row(n, t, "wrk", rps, 5, 1.0) for n in (1, 2, 3) for t, rps in (("shardgrid", 3000), ("etcd", 6000))]
    targets = {t: {"rounds": [r for r in rows if r["target"] == t],
                   "median": summarize_rounds([r for r in rows if r["target"] == t])} for t in ("shardgrid", "etcd")}
    return {"command": "shardgrid bench --target both", "rounds": rows, "targets": targets,
            "ratio": ratios(targets["shardgrid"]["median"], targets["etcd"]["median"]),
            "config": {"target": "both", "client": "wrk", "rounds": 3, "concurrency": 16, "rate": None,
                       "duration_s": 10, "warmup_s": 0, "batch": batch, "value_bytes": 100},
            "machine": {"cpus": 2, "loadavg_before": [1.0], "loadavg_after": [2.0]}}


def test_side_by_side_report() -> None:
    text = format_compare(_compare_result(batch=0))
    lines = text.splitlines()
    assert "3 round(s) per target interleaved (shardgrid, etcd, shardgrid, etcd, ...)" in lines[1]
    assert "single puts" in lines[1] and "client wrk" in lines[1]
    assert sum(1 for ln in lines if ln.split()[:2] in (["1", "shardgrid"], ["2", "etcd"])) == 2
    head = next(ln for ln in lines if "median of 3 round(s)" in ln)
    assert "shardgrid (client: wrk)" in head and "etcd (client: wrk)" in head and "shardgrid/etcd" in head
    rps = next(ln for ln in lines if ln.strip().startswith("req/s"))
    assert rps.split() == ["req/s", "3,000", "6,000", "0.50"]
    assert not any(ln.strip().startswith("records/s") for ln in lines)
    assert next(ln for ln in lines if "errors (all rounds)" in ln).split()[-2:] == ["0", "0"]
    batched = format_compare(_compare_result(batch=100))
    assert "/batch of 100 (etcd: txn of 100 puts)" in batched
    assert next(ln for ln in batched.splitlines() if "client CPU s" in ln).split()[-2:] == ["0.50", "0.50"]
    # One target (--client wrk --target etcd): its rounds, no ratio.
    one = _compare_result(batch=0)
    one["config"]["target"], one["ratio"] = "etcd", None
    del one["targets"]["shardgrid"]
    one_text = format_compare(one)
    assert "3 round(s) of etcd" in one_text and "shardgrid/etcd" not in one_text
    assert next(ln for ln in one_text.splitlines() if ln.strip().startswith("req/s")).split() == ["req/s", "6,000"]
    assert next(ln for ln in batched.splitlines() if ln.strip().startswith("records/s")).split() == [
        "records/s", "30,000", "60,000", "0.50"]


def test_run_compare_runs_interleaved_rounds_and_stops_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """--target both --client wrk with the clusters and wrk replaced: 3 rounds each, in order, medians."""
    import shardgrid.bench.run as run_mod

    started, stopped, ran = [], [], []

    def fake_start(opts: Any) -> ClusterEnv:
        t = opts.load.target
        started.append(t)
        return ClusterEnv(urls=[f"http://127.0.0.1:{1 if t == 'shardgrid' else 2}"], pids={os.getpid(): t},
                          info={"mode": "local", "target": t}, stop=lambda: stopped.append(t))

    def fake_run_wrk(w: Workload, urls: list[str], conc: int, dur: int, timeout: float, before: Any = None,
                     binary: Any = None) -> wrk.WrkRun:
        before()
        ran.append((w.target, w.key_prefix, conc, dur))
        ok = 2000 if w.target == "shardgrid" else 4000
        done = {**DONE, "ok": ok, "records": ok, "requests": ok, "errors": {}}
        return wrk.WrkRun(done, 0.1, 2.0, [])

    monkeypatch.setattr(run_mod, "start_local", fake_start)
    monkeypatch.setattr(wrk, "run_wrk", fake_run_wrk)
    opts = options_from_args(_args("--cluster", "local", "--target", "both", "--client", "wrk", "--duration", "2",
                                   "--concurrency", "8"))
    r = compare.run_compare(opts, out=None)
    assert started == ["shardgrid", "etcd"] and sorted(stopped) == ["etcd", "shardgrid"]
    assert [t for t, *_ in ran] == ["shardgrid", "etcd"] * 3
    assert len({p for _, p, _, _ in ran}) == 6 and {(c, d) for _, _, c, d in ran} == {(8, 2)}
    assert [len(r["targets"][t]["rounds"]) for t in ("shardgrid", "etcd")] == [3, 3]
    assert r["targets"]["shardgrid"]["median"]["ops_per_s"] == 1000 and r["ratio"]["ops_per_s"] == 0.5
    assert r["config"]["client"] == "wrk" and {row["client"] for row in r["rounds"]} == {"wrk"}
    assert all(row["cluster_cpu_s"] is not None for row in r["rounds"])
    json.dumps(r)  # what --json writes


# -- what is refused -----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--client", "wrk", "--rate", "100"], "--client wrk runs a closed loop only"),
    (["--client", "wrk", "--mix", "put=70,get=30"], "use the Python client"),
    (["--client", "wrk", "--mix", "get=100"], "use the Python client"),
    (["--client", "wrk", "--target", "etcd-grpc"], "not --target etcd-grpc"),
    (["--client", "wrk", "--procs", "2"], "drop --procs"),
    (["--client", "wrk", "--duration", "2.5"], "whole seconds"),
    (["--client", "wrk", "--concurrency", "7"], "must be even"),
    (["--target", "both"], "add --cluster local"),
    (["--target", "both", "--cluster", "local", "--mix", "put=1,incr=1"], "supports only put, get, delete"),
    (["--target", "both", "--cluster", "local", "--ack", "leader"], "no etcd equivalent"),
    (["--target", "both", "--cluster", "local", "--fsync", "none"], "cannot turn fsync off"),
    (["--rounds", "3"], "--rounds repeats the runs of --target both or --client wrk"),
    (["--client", "wrk", "--rounds", "0"], "between 1 and 100"),
])
def test_refusals(argv: list[str], message: str) -> None:
    with pytest.raises(BenchUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        options_from_args(_args(*argv))


def test_refusal_is_an_exit_2_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_from_args(_args("--client", "wrk", "--rate", "100")) == 2
    err = capsys.readouterr().err
    assert "wrk has no open loop" in err and "--client raw" in err
    assert main_from_args(_args("--client", "wrk", "--mix", "put=50,get=50")) == 2
    assert "--client wrk sends one workload" in capsys.readouterr().err


def test_accepted_options() -> None:
    both = options_from_args(_args("--cluster", "local", "--target", "both", "--client", "wrk"))
    assert both.compare and both.rounds == 3 and both.load.client == "wrk" and both.load.target == "both"
    assert options_from_args(_args("--client", "wrk", "--target", "etcd", "--batch", "100")).rounds == 1
    py = options_from_args(_args("--cluster", "local", "--target", "both", "--rounds", "5"))
    assert py.compare and py.rounds == 5 and py.load.client == "raw"
    assert not options_from_args(_args()).compare
