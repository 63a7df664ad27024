"""`shardgrid bench` without a real cluster: mix parsing, the open-loop schedule,
histogram merging, CPU accounting over a fake /proc, the result's shape, and
short end-to-end runs against a fake gateway (an aiohttp test server)."""
from __future__ import annotations

import asyncio
import io
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from shardgrid.bench.run import (BenchOptions, BenchUsageError, ClusterEnv, Collector, RunOutput, build_result,
                             format_report, local_settings, options_from_args, run_bench)
from shardgrid.bench.cpu import (CpuAccount, ProcReader, parse_stat, pids_from_dir, pids_from_list,
                                 pids_from_pattern, role_of)
from shardgrid.bench.load import (MISS1, OK1, Engine, EtcdTarget, LoadConfig, MixError, ShardgridTarget,
                                  check_mix_for_target, classify_batch, intended_offset_ns, mix_table, parse_mix,
                                  proc_request_index, scheduled_count)
from shardgrid.bench.rounds import WorkerCounters, format_rounds, parse_counters, rounds_report
from shardgrid.bench.stats import KindStats, latency_summary, merge_ticks, new_histogram, overall
from shardgrid.cli import build_parser

# -- the mix ---------------------------------------------------------------------------------


def test_parse_mix_weights_are_relative_and_zeros_dropped() -> None:
    assert parse_mix("put=70,incr=20,get=10,search=0") == {"put": 70.0, "incr": 20.0, "get": 10.0}
    assert parse_mix(" put = 1.5 , get=.5") == {"put": 1.5, "get": 0.5}
    assert parse_mix("put=100") == {"put": 100.0}


@pytest.mark.parametrize("spec, message", [
    ("", "--mix is empty"),
    ("   ", "--mix is empty"),
    ("putt=3", "unknown operation 'putt'; known: put, get"),
    ("put", "'put' has no weight; write put=WEIGHT"),
    ("put=x", "the weight of put must be a non-negative number, got 'x'"),
    ("put=-1", "the weight of put must be a non-negative number, got '-1'"),
    ("put=", "the weight of put must be a non-negative number, got ''"),
    ("put=1,put=2", "put is given twice"),
    ("put=0,get=0", "every weight is zero"),
    ("put=1,,get=1", "empty entry (a stray comma?)"),
    ("=5", "unknown operation ''"),
    ("put=nan", "non-negative number"),
])
def test_parse_mix_rejects_bad_specs_clearly(spec: str, message: str) -> None:
    with pytest.raises(MixError) as exc:
        parse_mix(spec)
    assert message in str(exc.value)


def test_etcd_supports_put_get_delete_only() -> None:
    check_mix_for_target({"put": 1, "get": 1, "delete": 1}, "etcd")
    with pytest.raises(MixError, match="--target etcd supports only put, get, delete.*got incr, search"):
        check_mix_for_target({"put": 1, "incr": 1, "search": 1}, "etcd")


def test_mix_table_has_the_exact_proportions() -> None:
    table = mix_table({"put": 70, "incr": 20, "get": 10}, size=1000, seed=3)
    assert len(table) == 1000
    assert [table.count(i) for i in range(3)] == [700, 200, 100]
    odd = mix_table({"put": 1, "get": 1, "incr": 1}, size=1000)
    assert sorted(odd.count(i) for i in range(3)) == [333, 333, 334]


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["bench", *argv])


def test_cli_usage_errors() -> None:
    for argv, message in [
        (["--mix", "bogus=1"], "unknown operation 'bogus'"),
        (["--cluster", "local", "--gateway", "http://127.0.0.1:1"], "--cluster local starts its own"),
        (["--target", "etcd", "--ack", "leader"], "no etcd equivalent"),
        (["--target", "etcd", "--mix", "put=1,incr=1"], "supports only put, get, delete"),
        (["--concurrency", "2", "--procs", "3"], "less than --procs"),
        (["--rate", "0"], "--rate must be > 0"),
        (["--batch", "5", "--mix", "get=1"], "--mix has none"),
        (["--batch", "1001"], "--batch must be between 0"),
        (["--gateway", "127.0.0.1:8080"], "expected http://HOST:PORT"),
        (["--gateway", "https://127.0.0.1:8080"], "the raw client speaks plain HTTP only"),
        (["--cluster", "local", "--workers", "2", "--rf", "3"], "--rf 3 needs 1..--workers (2)"),
        (["--cluster", "local", "--snapshot-every", "0"], "--snapshot-every must be >= 1"),
        (["--cluster", "local", "--target", "etcd", "--snapshot-every", "5"], "is a shardgrid setting"),
        (["--snapshot-every", "5"], "sets up the cluster of --cluster local"),
    ]:
        with pytest.raises(BenchUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            options_from_args(_args(*argv))
    with pytest.raises(SystemExit):  # argparse: --rate and --concurrency exclude each other
        _args("--rate", "10", "--concurrency", "4")
    opts = options_from_args(_args("--rate", "500", "--procs", "2", "--mix", "put=3,get=1", "--ack", "all"))
    assert opts.load.rate == 500 and opts.load.mix == (("put", 3.0), ("get", 1.0)) and opts.load.ack == "all"
    assert opts.load.urls == ("http://127.0.0.1:8080",)
    assert options_from_args(_args("--gateway", "https://127.0.0.1:1", "--client", "aiohttp")).load.urls == \
        ("https://127.0.0.1:1",)
    local = options_from_args(_args("--cluster", "local", "--snapshot-every", "2000", "--fsync", "none"))
    assert local_settings(local) == "{ack: quorum, fsync: none, snapshot_every: 2000}"
    assert local_settings(options_from_args(_args("--cluster", "local"))) == "{ack: quorum, fsync: batch}"


# -- the open-loop schedule --------------------------------------------------------------------


def test_schedule_is_fixed_and_interleaved_across_processes() -> None:
    rate = 1000.0
    assert [intended_offset_ns(j, rate) for j in range(4)] == [0, 1_000_000, 2_000_000, 3_000_000]
    assert intended_offset_ns(3, 3.0) == 1_000_000_000
    # Process p of P takes requests p, p+P, p+2P, ... of the one global schedule.
    procs = 3
    per_proc = [[intended_offset_ns(proc_request_index(k, p, procs), rate) for k in range(10)] for p in range(procs)]
    merged = sorted(t for ts in per_proc for t in ts)
    assert merged == [intended_offset_ns(j, rate) for j in range(30)]
    # Due before 10.5 ms: requests 0..10 -> 11 in all, split 4/4/3.
    span = 10_500_000
    assert scheduled_count(span, rate) == 11
    assert [scheduled_count(span, rate, p, procs) for p in range(procs)] == [4, 4, 3]
    # Exactly on a tick: strictly before, so request 10 (due at 10 ms) is not in [0, 10 ms).
    assert scheduled_count(10_000_000, rate) == 10
    assert scheduled_count(0, rate) == 0
    assert sum(scheduled_count(2 * 10**9, 333.3, p, 4) for p in range(4)) == scheduled_count(2 * 10**9, 333.3)


def _slow_server(service_s: float) -> Any:
    """A fake server that answers one request at a time, each in `service_s`."""
    lock = asyncio.Lock()

    async def send(kind: int) -> Any:
        async with lock:
            await asyncio.sleep(service_s)
        return OK1
    return send


async def _engine_run(cfg: LoadConfig, send: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    ticks: list[dict[str, Any]] = []
    summary = await Engine(cfg, send, ticks.append).run(time.monotonic_ns())
    assert ticks[-1]["final"] and all(not t["final"] for t in ticks[:-1])
    return summary, latency_summary(overall(merge_ticks(ticks)).hist)


async def test_open_loop_measures_queueing_that_closed_loop_hides() -> None:
    service = 0.01  # capacity: 100 requests/s
    # Closed loop, one worker: it sends only when the server is free, so every request
    # takes one service time; the waiting that a real client would do is not measured.
    _, closed = await _engine_run(LoadConfig(concurrency=1, duration_s=0.5), _slow_server(service))
    assert closed["count"] >= 10 and closed["p50"] < 40, closed
    # Open loop at twice the capacity: requests are due every 5 ms whatever happens, the
    # backlog grows all run long, and latency from the intended send time shows it.
    summary, open_ = await _engine_run(LoadConfig(rate=200, duration_s=0.5), _slow_server(service))
    assert summary["scheduled"] == 100 and summary["unsent"] == 0 and summary["sent"] == 100, summary
    assert open_["count"] == 100, open_
    assert open_["p50"] > 100 and open_["p99"] > 300 and open_["max"] > 350, open_
    assert open_["p50"] > closed["p99"]
    # The same server below capacity: no queue, latency ~ service time.
    _, easy = await _engine_run(LoadConfig(rate=40, duration_s=0.5), _slow_server(service))
    assert easy["count"] == 20 and easy["p50"] < 60, easy


async def test_open_loop_still_sends_what_fell_due_before_the_end_after_a_stall(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A stall of the generator's loop (a GC pause, a busy machine) that runs past the
    # end must not turn requests that fell due before the end into "unsent": they are
    # sent late, and their latency from the intended time shows the stall. The stall
    # is a 0.2 s jump of the generator's clock (as the loop would see after one).
    import types

    import shardgrid.bench.load as bench_load

    skew = 0

    def monotonic_ns() -> int:
        return time.monotonic_ns() + skew

    monkeypatch.setattr(bench_load, "time", types.SimpleNamespace(monotonic_ns=monotonic_ns,
                                                                  process_time=time.process_time, time=time.time))
    calls = 0

    async def stalls_once(kind: int) -> Any:
        nonlocal calls, skew
        calls += 1
        if calls == 50:  # due at 0.245 s; afterwards the loop sees ~0.45 s, past the end
            skew = 200_000_000
        return OK1

    summary, lat = await _engine_run(LoadConfig(rate=200, duration_s=0.3), stalls_once)
    assert summary["scheduled"] == 60 and summary["unsent"] == 0 and summary["sent"] == 60, summary
    assert lat["count"] == 60 and lat["max"] > 150, lat  # the late ones carry the stall


async def test_open_loop_never_sleeps_less_than_a_timer_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop rounds a sleep down to whole milliseconds: a shorter one returns at once,
    and an open loop whose requests are due 0.2 ms apart would spin through every gap."""
    import shardgrid.bench.load as bench_load

    real_sleep = asyncio.sleep
    asked: list[float] = []

    async def sleep(delay: float) -> None:
        asked.append(delay)
        await real_sleep(delay)

    monkeypatch.setattr(bench_load.asyncio, "sleep", sleep)

    async def instant(kind: int) -> Any:
        return OK1

    summary, lat = await _engine_run(LoadConfig(rate=5000, duration_s=0.2), instant)
    assert summary["sent"] == summary["scheduled"] == 1000 and lat["count"] == 1000, summary
    waits = [d for d in asked if d > 0]
    assert waits and min(waits) >= bench_load.MIN_SLEEP_NS / 1e9, sorted(waits)[:5]
    assert len(waits) < 400  # one wake per millisecond or so, not one per request


async def test_open_loop_counts_what_max_inflight_kept_unsent() -> None:
    summary, lat = await _engine_run(LoadConfig(rate=200, duration_s=0.5, max_inflight=1), _slow_server(0.02))
    assert summary["scheduled"] == 100
    assert 0 < summary["sent"] < 60 and summary["unsent"] == 100 - summary["sent"]
    assert lat["max"] > 200  # still measured from the intended time while waiting for a slot


# -- histograms and ticks ----------------------------------------------------------------------


def _tick(proc: int, index: int, values: list[int], final: bool = False, errors: dict[str, int] | None = None,
          elapsed: float | None = None) -> dict[str, Any]:
    ks = KindStats()
    for v in values:
        ks.hist.record_value(v)
    ks.ok = ks.records = len(values)
    ks.errors = dict(errors or {})
    return {"proc": proc, "index": index, "final": final, "elapsed_s": elapsed if elapsed is not None else index + 1,
            "kinds": {"put": ks.to_wire()}, "lag": None, "inflight": 0}


def test_histograms_merge_exactly_across_processes() -> None:
    a = list(range(100, 10_100, 10))  # 1000 values, 0.1 .. 10 ms
    b = [50_000] * 10  # one slow process: 10 values at 50 ms
    one = new_histogram()
    for v in a + b:
        one.record_value(v)
    merged = merge_ticks([_tick(0, 0, a, errors={"unavailable": 2}), _tick(1, 0, b, errors={"unavailable": 1,
                                                                                           "timeout": 4})])
    put = merged["put"]
    assert put.ok == 1010 and put.errors == {"unavailable": 3, "timeout": 4}
    assert latency_summary(put.hist) == latency_summary(one)
    assert latency_summary(put.hist)["max"] == pytest.approx(50.0, rel=0.001)
    assert latency_summary(put.hist)["p99"] == pytest.approx(latency_summary(one)["p99"])


def test_collector_prints_each_second_once_every_process_reported() -> None:
    out = io.StringIO()
    col = Collector(procs=2, warmup_s=1, batch=0, out=out)
    col.add(_tick(0, 0, [1000] * 5))
    col.add(_tick(0, 1, [2000] * 5))
    assert col.timeline == []  # second 1 waits for process 1
    col.add(_tick(1, 0, [1000] * 5))
    assert [r["second"] for r in col.timeline] == [1]
    col.add(_tick(1, 1, [2000] * 5))
    col.add(_tick(1, 2, [3000], final=True, elapsed=2.25))
    col.add(_tick(0, 2, [3000] * 3, final=True, elapsed=2.5))
    assert [(r["second"], r["ops"], r["warmup"], r["final"]) for r in col.timeline] == [
        (1, 10, True, False), (2, 10, False, False), (3, 4, False, True)]
    assert col.timeline[-1]["span_s"] == 0.5
    # The warm-up second is in the progress output but not in the totals.
    assert overall(col.measured).ok == 14
    assert col.final_elapsed == 2.5
    lines = out.getvalue().splitlines()
    assert "ops/s" in lines[0] and "(warm-up)" in lines[1] and "(drain)" in lines[3]
    assert lines[2].split()[1] == "10"


# -- response classification -------------------------------------------------------------------


def test_batch_answers_count_records_and_per_write_errors() -> None:
    ok = orjson.dumps({"results": [{"shard": 0, "seq": 1, "term": 1, "served_by": "w1", "result": {}}] * 3})
    assert classify_batch(200, ok, 3) == (True, None, 3, None, False)
    mixed = orjson.dumps({"results": [{"seq": 1}, {"error": {"code": "quorum_timeout", "message": "x"}}, {"seq": 2}]})
    assert classify_batch(200, mixed, 3) == (True, None, 2, {"quorum_timeout": 1}, False)
    allbad = orjson.dumps({"results": [{"error": {"code": "unavailable", "message": "x"}}] * 2})
    assert classify_batch(200, allbad, 2) == (False, "unavailable", 0, {"unavailable": 2}, False)
    err = orjson.dumps({"error": {"code": "bad_request", "message": "no"}})
    assert classify_batch(400, err, 2)[:2] == (False, "bad_request")
    assert classify_batch(502, b"<html>", 2)[:2] == (False, "http_502")


def test_single_answers_and_etcd_answers() -> None:
    import random

    sg = ShardgridTarget(LoadConfig(mix=(("get", 1.0), ("put", 1.0))), random.Random(1))
    get, put = sg.classify("get"), sg.classify("put")
    assert get(200, b"{}", 1) == OK1 and get(404, b"", 1) == MISS1
    assert put(404, orjson.dumps({"error": {"code": "not_found", "message": ""}}), 1)[:2] == (False, "not_found")
    assert put(503, orjson.dumps({"error": {"code": "not_leader", "message": ""}}), 1)[:2] == (False, "not_leader")
    method, url, body, headers, n = sg.prepare("put")()
    assert method == "PUT" and str(url).startswith("http://127.0.0.1:8080/items/bench-")
    assert orjson.loads(body) == {"v": orjson.loads(body)["v"]} and len(orjson.loads(body)["v"]) == 100
    assert headers["x-request-id"].startswith("run-0-") and "x-ack" not in headers
    et = EtcdTarget(LoadConfig(target="etcd", mix=(("put", 1.0),), batch=4, keys=10), random.Random(1))
    method, url, body, headers, n = et.prepare("put")()
    assert str(url).endswith("/v3/kv/txn") and n == 4
    keys = [op["request_put"]["key"] for op in orjson.loads(body)["success"]]
    assert len(set(keys)) == 4  # etcd refuses a txn naming a key twice
    assert et.classify("put")(503, orjson.dumps({"error": "x", "code": 14, "message": "x"}), 4)[:2] == (
        False, "etcd_unavailable")


# -- CPU accounting ----------------------------------------------------------------------------


def _fake_proc(root: Path, pid: int, comm: str, ppid: int, utime: int, stime: int, cmdline: str = "") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 39
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")


def test_parse_stat_handles_odd_process_names() -> None:
    st = parse_stat("4242 (we ird) (x) R 17 4242 4242 0 -1 4194560 1 0 0 0 250 75 0 0 20 0 3 0 9 1 1 2 3\n")
    assert (st.pid, st.comm, st.ppid, st.utime, st.stime, st.ticks) == (4242, "we ird) (x", 17, 250, 75, 325)


def test_cpu_accounting_from_a_fake_proc(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    _fake_proc(root, 10, "python3", 1, 100, 50)  # m1
    _fake_proc(root, 20, "python3", 1, 1000, 200)  # w1
    _fake_proc(root, 21, "helper", 20, 5, 5)  # a child of w1
    _fake_proc(root, 30, "python3", 1, 300, 100)  # g1, exits during the run
    acct = CpuAccount({10: "m1", 20: "w1", 30: "g1"}, ProcReader(root, clk_tck=100))
    before = acct.sample()
    assert before[21] == ("w1/helper:21", 10)
    _fake_proc(root, 10, "python3", 1, 150, 60)  # +0.6 s
    _fake_proc(root, 20, "python3", 1, 1400, 300)  # +5.0 s
    _fake_proc(root, 21, "helper", 20, 15, 5)  # +0.1 s
    _fake_proc(root, 22, "late", 20, 20, 0)  # born during the run: +0.2 s
    (root / "30" / "stat").unlink()
    rep = acct.report(before, acct.sample())
    assert rep["cpu_s"] == pytest.approx(5.9)
    assert rep["by_role"] == {"meta": 0.6, "worker": 5.3}
    assert rep["gone"] == [{"pid": 30, "name": "g1"}] and rep["lower_bound"] is True
    assert {p["name"]: p["cpu_s"] for p in rep["processes"]} == {"m1": 0.6, "w1": 5.0, "w1/helper:21": 0.1,
                                                                 "w1/late:22": 0.2}


def test_cluster_pids_from_dir_list_and_pattern(tmp_path: Path) -> None:
    (tmp_path / "w1.pid").write_text("123\n")
    (tmp_path / "g1.pid").write_text("456")
    assert pids_from_dir(tmp_path) == {123: "w1", 456: "g1"}
    (tmp_path / "bad.pid").write_text("x")
    with pytest.raises(ValueError, match="expected one PID"):
        pids_from_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.pid files"):
        pids_from_dir(tmp_path / "empty")
    with pytest.raises(ValueError, match="not a directory"):
        pids_from_dir(tmp_path / "w1.pid")
    assert pids_from_list("1, 2") == {1: "pid1", 2: "pid2"}
    root = tmp_path / "proc"
    _fake_proc(root, 1, "init", 0, 0, 0, "/sbin/init")
    _fake_proc(root, 5, "bash", 1, 0, 0, "bash -c shardgrid bench --cluster-pgrep shardgrid")
    _fake_proc(root, 6, "python3", 5, 0, 0, "python3 shardgrid bench --cluster-pgrep shardgrid")  # me
    _fake_proc(root, 7, "python3", 6, 0, 0, "python3 -c from multiprocessing.spawn shardgrid")  # my generator
    _fake_proc(root, 40, "python3", 1, 0, 0, "python3 -m shardgrid.cli worker --id w1")
    _fake_proc(root, 41, "python3", 40, 0, 0, "python3 -m shardgrid.cli worker-helper")  # a matching child
    _fake_proc(root, 50, "python3", 1, 0, 0, "python3 -m shardgrid.cli gateway")
    _fake_proc(root, 60, "etcd", 1, 0, 0, "etcd --name e1")
    found = pids_from_pattern(r"shardgrid\.cli (worker|gateway)", ProcReader(root), me=6)
    assert found == {40: "python3:40", 50: "python3:50"}
    assert pids_from_pattern("etcd", ProcReader(root), me=6) == {60: "etcd:60"}
    assert role_of("w12") == "worker" and role_of("e1") == "etcd" and role_of("python3:40") == "python3"


# -- the result --------------------------------------------------------------------------------


def _options(**load: Any) -> BenchOptions:
    return BenchOptions(load=LoadConfig(**load), procs=2, command="shardgrid bench --test")


def test_result_json_shape() -> None:
    col = Collector(procs=2, warmup_s=0, batch=0, out=None)
    col.add(_tick(0, 0, [1000] * 50, errors={"unavailable": 1}))
    col.add(_tick(1, 0, [3000] * 50))
    col.add(_tick(0, 1, [2000] * 10, final=True, elapsed=1.5))
    col.add(_tick(1, 1, [], final=True, elapsed=1.6))
    before = {10: ("w1", 100), 11: ("g1", 50)}
    after = {10: ("w1", 300), 11: ("g1", 70)}

    class Fixed(CpuAccount):
        def __init__(self) -> None:
            super().__init__({10: "w1", 11: "g1"}, ProcReader("/nonexistent", clk_tck=100))

    run = RunOutput(col, [{"proc": 0, "cpu_s": 0.4, "sent": 61}, {"proc": 1, "cpu_s": 0.3, "sent": 50}], before, after,
                    counters_before={"passes": 10, "events": 20, "peer_messages": 5, "peer_frames": 5, "fsyncs": 10},
                    counters_after={"passes": 65, "events": 240, "peer_messages": 225, "peer_frames": 115,
                                    "fsyncs": 65})
    env = ClusterEnv(urls=["http://127.0.0.1:1"], pids={10: "w1", 11: "g1"}, info={"mode": "attached"})
    r = build_result(_options(duration_s=1.0), env, run, Fixed(), ((0.5, 0.4, 0.3), (1.0, 0.5, 0.3)))
    r = orjson.loads(orjson.dumps(r))  # JSON-serialisable as it is
    assert set(r) == {"version", "command", "started_at", "interrupted", "config", "cluster", "machine", "elapsed_s",
                      "ops", "ops_per_s", "records", "records_per_s", "acked_writes", "misses", "errors",
                      "latency_ms", "by_kind", "open_loop", "infer", "cluster_cpu", "rounds", "client", "timeline",
                      "histogram"}
    # 110 acknowledged writes: 55 passes carrying 220 events, 220 messages in 110 frames, 55 fsyncs
    assert r["rounds"] == {"passes_per_write": 0.5, "peer_messages_per_write": 2.0, "peer_frames_per_write": 1.0,
                           "fsyncs_per_write": 0.5, "events_per_pass": 4.0,
                           "totals": {"passes": 55, "events": 220, "peer_messages": 220, "peer_frames": 110,
                                      "fsyncs": 55}}
    assert r["ops"] == 110 and r["acked_writes"] == 110 and r["elapsed_s"] == 1.6
    assert r["ops_per_s"] == pytest.approx(110 / 1.6, abs=0.1)
    assert r["errors"] == {"total": 1, "by_code": {"unavailable": 1}, "record_errors": {}}
    assert set(r["latency_ms"]) == {"count", "mean", "p50", "p90", "p99", "p999", "max"}
    assert r["latency_ms"]["count"] == 110 and r["latency_ms"]["p50"] == pytest.approx(2.0, rel=0.01)
    assert r["by_kind"]["put"]["ops"] == 110
    assert r["cluster_cpu"]["cpu_s"] == 2.2 and r["cluster_cpu"]["by_role"] == {"gateway": 0.2, "worker": 2.0}
    assert r["cluster_cpu"]["us_per_acked_write"] == pytest.approx(2.2e6 / 110, abs=0.1)
    assert r["client"]["cpu_s"] == 0.7 and r["open_loop"] is None
    assert r["config"]["mode"] == "closed" and r["config"]["mix"] == {"put": 100.0}
    assert [t["second"] for t in r["timeline"]] == [1, 2]
    assert r["histogram"].startswith("HISTF")
    text = format_report(r)
    assert "110 ok in 1.60 s" in text and "unavailable 1" in text and "µs CPU per acknowledged write" in text
    assert ("rounds       per acknowledged write, all workers: 0.50 group-loop passes (4.0 events each), "
            "2.00 peer messages in 1.00 frames, 0.50 WAL fsyncs") in text


_EXPOSITION = """# HELP shardgrid_worker_passes_total group loop passes, all groups
# TYPE shardgrid_worker_passes_total counter
shardgrid_worker_passes_total 120.0
shardgrid_worker_passes_created 1.7e+09
shardgrid_worker_events_total 300.0
shardgrid_worker_peer_messages_total{peer="a"} 7.0
shardgrid_worker_peer_messages_total{peer="b}x"} 3.0
shardgrid_wal_sync_seconds_bucket{le="0.0005"} 2.0
shardgrid_wal_sync_seconds_count 40.0
shardgrid_wal_sync_seconds_sum 0.5
shardgrid_worker_peer_frames_total NaN-ish
"""


def test_round_counters_are_read_from_the_exposition_and_summed_over_labels() -> None:
    assert parse_counters(_EXPOSITION) == {"passes": 120.0, "events": 300.0, "peer_messages": 10.0, "fsyncs": 40.0}


def test_round_report_needs_both_samples_and_no_restart_between() -> None:
    a = {"passes": 1.0, "events": 2.0, "peer_messages": 3.0, "peer_frames": 3.0, "fsyncs": 1.0}
    b = {"passes": 5.0, "events": 10.0, "peer_messages": 11.0, "peer_frames": 7.0, "fsyncs": 3.0}
    assert rounds_report(None, b, 4) is None and rounds_report(a, None, 4) is None and rounds_report(a, b, 0) is None
    assert rounds_report(b, a, 4) is None  # counters went back: a worker restarted, the differences mean nothing
    r = rounds_report(a, b, 4)
    assert r is not None and r["passes_per_write"] == 1.0 and r["events_per_pass"] == 2.0
    assert r["peer_messages_per_write"] == 2.0 and r["peer_frames_per_write"] == 1.0 and r["fsyncs_per_write"] == 0.5
    idle = rounds_report(a, {**a, "fsyncs": 2.0}, 4)
    assert idle is not None and idle["events_per_pass"] is None and "events each" not in format_rounds(idle)


def test_round_counters_of_a_worker_that_does_not_answer_give_no_report() -> None:
    assert WorkerCounters(["http://127.0.0.1:1/metrics"]).sample() is None


# -- end to end against a fake gateway ---------------------------------------------------------


class FakeGateway:
    def __init__(self) -> None:
        self.items: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.seq = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_put("/items/{id}", self.put)
        app.router.add_get("/items/{id}", self.get)
        app.router.add_post("/signals", self.signal)
        app.router.add_post("/batch", self.batch)
        return app

    def _seen(self, request: web.Request) -> None:
        self.requests.append((request.method, request.path, request.headers.copy()))  # case-insensitive

    async def put(self, request: web.Request) -> web.Response:
        self._seen(request)
        self.items[request.match_info["id"]] = await request.read()
        self.seq += 1
        return web.json_response({"id": request.match_info["id"], "created": True, "seq": self.seq})

    async def get(self, request: web.Request) -> web.Response:
        self._seen(request)
        doc = self.items.get(request.match_info["id"])
        if doc is None:
            return web.json_response({"error": {"code": "not_found", "message": "no"}}, status=404)
        return web.Response(body=doc, content_type="application/json")

    async def signal(self, request: web.Request) -> web.Response:
        self._seen(request)
        body = orjson.loads(await request.read())
        if body["entity"].endswith("7"):
            return web.json_response({"error": {"code": "quorum_timeout", "message": "slow"}}, status=504)
        return web.json_response({"entity": body["entity"], "value": 1, "seq": 1})

    async def batch(self, request: web.Request) -> web.Response:
        self._seen(request)
        writes = orjson.loads(await request.read())["writes"]
        results: list[Any] = [{"seq": i} if i % 5 != 4 else {"error": {"code": "unavailable", "message": "x"}}
                              for i in range(len(writes))]
        return web.json_response({"results": results})


async def _run_cli(argv: list[str]) -> tuple[dict[str, Any], str]:
    out = io.StringIO()
    opts = options_from_args(_args(*argv), argv)
    result = await asyncio.to_thread(run_bench, opts, out)
    return result, out.getvalue()


@pytest.mark.parametrize("client", ["raw", "aiohttp"])
async def test_end_to_end_closed_loop_two_procs(aiohttp_server: Any, client: str) -> None:
    fake = FakeGateway()
    server = await aiohttp_server(fake.app())
    url = f"http://127.0.0.1:{server.port}"
    r, out = await _run_cli(["--gateway", url, "--gateway", url + "/", "--concurrency", "4", "--procs", "2",
                             "--duration", "0.6", "--mix", "put=60,get=20,incr=20", "--ack", "all", "--keys", "50",
                             "--cluster-pids", str(os.getpid()), "--client", client])
    assert r["config"]["client"] == client and f"({client} client)" in format_report(r)
    assert r["ops"] > 10 and r["config"]["procs"] == 2 and not r["client"]["problems"]
    assert set(r["by_kind"]) == {"put", "get", "incr"}
    assert set(r["errors"]["by_code"]) <= {"quorum_timeout"}  # incr of entities ending in 7
    assert r["misses"] == r["by_kind"]["get"]["misses"]  # a 404 on get is a miss, not an error
    assert r["acked_writes"] == r["by_kind"]["put"]["records"] + r["by_kind"]["incr"]["records"]
    assert r["latency_ms"]["count"] == r["ops"] and r["latency_ms"]["p99"] is not None
    assert r["cluster_cpu"]["cpu_s"] > 0 and r["cluster_cpu"]["us_per_acked_write"] > 0
    assert r["client"]["cpu_s"] > 0
    assert "ops/s" in out
    puts = [h for m, p, h in fake.requests if m == "PUT"]
    assert puts and all(h["x-ack"] == "all" for h in puts)
    rids = [h["x-request-id"] for _, _, h in fake.requests]
    assert len(set(rids)) == len(rids)  # unique request ids across both processes
    assert {rid.split("-")[1] for rid in rids} == {"0", "1"}


async def test_end_to_end_open_loop_with_batches(aiohttp_server: Any) -> None:
    fake = FakeGateway()
    server = await aiohttp_server(fake.app())
    r, _ = await _run_cli(["--gateway", f"http://127.0.0.1:{server.port}", "--rate", "200", "--duration", "0.5",
                           "--batch", "10", "--mix", "put=1", "--quiet", "--value-bytes", "32"])
    ol = r["open_loop"]
    assert ol["scheduled"] == 100 and ol["unsent"] == 0 and ol["sent"] == 100
    assert r["ops"] == 100 and r["records"] == 800  # every 5th write of a batch fails
    assert r["errors"]["record_errors"] == {"unavailable": 200} and r["errors"]["total"] == 0
    assert r["records_per_s"] > r["ops_per_s"]
    assert ol["schedule_lag_ms"]["count"] == 100
    assert all(p == "/batch" for _, p, _ in fake.requests)
    assert r["cluster_cpu"] is None  # no cluster PIDs given: no CPU figure
