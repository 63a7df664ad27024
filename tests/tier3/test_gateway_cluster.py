"""Through two real gateways: concurrent writes and reads, transfer and replica changes under load."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import orjson
import pytest

from tests.support.cluster import Cluster, DevRun, http_json, wait_until
from tests.support.history import check_acknowledged, check_linearizable
from tests.support.load import LoadGenerator, LoadResult, final_state

pytestmark = pytest.mark.tier3

GROUPS = [(0, "w1", ["w1", "w2", "w3"]), (1, "w2", ["w1", "w2", "w3"]), (2, "w3", ["w1", "w2", "w3"])]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster.create(tmp_path / "cluster", n_workers=4, n_gateways=2)
    try:
        c.boot(c.topology_yaml(snapshot_every=100, groups=GROUPS), gateways=True)
        yield c
    finally:
        c.close()


def run_load(c: Cluster, gen: LoadGenerator, out: list[LoadResult]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(asyncio.run(gen.run(max_seconds=120))), daemon=True)
    t.start()
    return t


def verify(c: Cluster, result: LoadResult) -> None:
    items, counters = asyncio.run(final_state(c.gateways[0], result))
    acked = check_acknowledged(result.history, items, counters)
    assert acked.ok, acked.details()
    strong = [op for op in result.history]
    lin = check_linearizable(strong)
    assert lin.ok, lin.details()
    print(f"\n{result.summary()}\n{acked.summary()}\n{lin.summary()}")


def test_concurrent_load_through_two_gateways(cluster: Cluster) -> None:
    gen = LoadGenerator(cluster.gateways, clients=12, ops_per_client=60, seed=7, batch_share=0.15)
    result = asyncio.run(gen.run(max_seconds=90))
    assert sum(result.errors.values()) == 0, result.errors
    assert result.acked_batched_writes > 100
    assert result.acked_writes >= 12 * 60 * 0.5
    verify(cluster, result)


def test_a_batch_of_puts_is_applied_once_and_reads_back(cluster: Cluster) -> None:
    # Each shard's puts go as one put_items write (gateway/batching.py); the
    # client sees one result per write, as if each had gone alone.
    gw0, gw1 = (f"http://{g}" for g in cluster.gateways)
    writes = [{"op": "put_item", "id": f"bulk-{i}", "doc": {"i": i, "s": "é" * (i % 5)}} for i in range(300)]
    writes.append({"op": "signal", "entity": "bulk-sig", "kind": "n", "value": 2})
    headers = {"x-request-id": "bulk-1", "x-deadline-ms": "5000"}
    status, body = http_json("POST", gw0 + "/batch", {"writes": writes}, timeout=10, headers=headers)
    assert status == 200, body
    results = body["results"]
    assert [r["result"] for r in results[:300]] == [{"id": f"bulk-{i}", "created": True} for i in range(300)]
    assert results[300]["result"] == 2
    seqs = {r["shard"]: r["seq"] for r in results[:300]}
    assert len(seqs) == 3 and all(results[i]["seq"] == seqs[results[i]["shard"]] for i in range(300))  # one entry each
    for i in range(0, 300, 7):
        got = http_json("GET", f"{gw1}/items/bulk-{i}", headers={"x-deadline-ms": "5000"})
        assert got == (200, writes[i]["doc"])
    # The same request again, through the other gateway (a client's retry): applied once.
    status, again = http_json("POST", gw1 + "/batch", {"writes": writes}, timeout=10, headers=headers)
    assert status == 200 and [r["seq"] for r in again["results"]] == [r["seq"] for r in results]
    assert http_json("GET", f"{gw0}/signals/bulk-sig")[1]["counters"] == {"n": 2}
    # A new request id is a new write: every put now replaces an existing item.
    status, third = http_json("POST", gw0 + "/batch", {"writes": writes[:300]}, timeout=10,
                              headers={"x-request-id": "bulk-2"})
    assert status == 200 and all(r["result"] == {"id": f"bulk-{i}", "created": False}
                                 for i, r in enumerate(third["results"]))


def test_transfer_and_replica_moves_under_load_are_invisible_to_clients(cluster: Cluster) -> None:
    c = cluster
    gw = f"http://{c.gateways[0]}"
    gen = LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=11)
    out: list[LoadResult] = []
    t = run_load(c, gen, out)
    try:
        wait_until(lambda: len(gen.result.history) > 300, 30, "load to get going")
        # Transfer every group in turn through the gateway's operator verb.
        for gid in range(3):
            before = c.view()["groups"][str(gid)]
            code, body = http_json("POST", f"{gw}/cluster/shards/{gid}/transfer", {}, timeout=20)
            assert code == 200, body
            assert body["old_term"] == before["term"] and body["new_leader"] != before["leader"], body
        # A fourth worker joins group 1 from a snapshot and is promoted; then the old leader leaves.
        code, body = http_json("POST", f"{gw}/cluster/shards/1/replicas", {"add": "w4"}, timeout=10)
        assert code == 202, body
        wait_until(lambda: "w4" in (v := c.view())["groups"]["1"]["voters"] and not v["operators"], 60,
                   "w4 to be promoted in group 1 and the operator to finish", interval=0.3)
        assert "snapshot_downloaded" in (c.root / "logs" / "w4.log").read_text()
        leaving = c.view()["groups"]["1"]["leader"]
        code, body = http_json("POST", f"{gw}/cluster/shards/1/replicas", {"remove": leaving}, timeout=10)
        assert code == 202, body
        wait_until(lambda: leaving not in c.view()["groups"]["1"]["voters"] and not c.view()["operators"], 60,
                   f"{leaving} to leave group 1", interval=0.3)
        n = len(gen.result.history)
        wait_until(lambda: len(gen.result.history) > n + 200, 30, "load to continue after the moves")
    finally:
        gen.stop.set()
        t.join(60)
    result = out[0]
    assert sum(result.errors.values()) == 0, f"client-visible errors: {result.errors}"
    verify(c, result)
    code, shards = http_json("GET", f"{gw}/cluster/shards")
    assert code == 200 and {s["id"] for s in shards["shards"]} == {0, 1, 2}


def test_shardgrid_dev_starts_serves_and_stops(tmp_path: Path) -> None:
    run = DevRun(["--data", str(tmp_path / "dev"), "--fresh"])
    proc, lines = run.proc, run.lines
    try:
        out = run.wait_up(90)
        assert "gateway:  http://127.0.0.1:8080" in out and "curl" in out
        code, body = http_json("PUT", "http://127.0.0.1:8080/items/hello", {"greeting": "hi"}, timeout=5)
        assert code == 200, body
        assert http_json("GET", "http://127.0.0.1:8080/items/hello", timeout=5) == (200, {"greeting": "hi"})
        vec = [0.25] * 64
        assert http_json("PUT", "http://127.0.0.1:8080/embeddings/e1", {"vector": vec}, timeout=5)[0] == 200
        code, found = http_json("POST", "http://127.0.0.1:8080/search", {"vector": vec, "k": 1}, timeout=10)
        assert code == 200 and found["results"][0]["id"] == "e1" and found["degraded"] is False
        # From a second shell: SIGKILL a worker; the cluster goes on, fails over, and takes it back.
        data = str(tmp_path / "dev")

        def dev(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "shardgrid.cli", "dev", *args, "--data", data],
                                  capture_output=True, text=True, timeout=30)
        ps = dev("ps")
        assert ps.returncode == 0 and all(n in ps.stdout for n in ("m1", "w1", "g1")), ps.stdout + ps.stderr
        assert dev("kill", "w1").returncode == 0
        wait_until(lambda: any(ln.startswith("w1 exited: signal 9 (SIGKILL); the cluster goes on") for ln in lines),
                   10, "the dev cluster to say w1 exited and go on")
        wait_until(lambda: http_json("PUT", "http://127.0.0.1:8080/items/after-kill", {"v": 1}, timeout=5)[0] == 200,
                   20, "writes after w1's SIGKILL")
        assert proc.poll() is None
        assert "signal 9 (SIGKILL)" in dev("ps").stdout
        again = dev("start", "w1")
        assert again.returncode == 0 and "started w1" in again.stdout, again.stdout + again.stderr
        wait_until(lambda: "w1" in dev("ps").stdout and "running" in
                   next(ln for ln in dev("ps").stdout.splitlines() if ln.startswith("w1")), 10, "w1 running again")
        added = dev("add-worker", "--available-ram", "8GB")
        assert added.returncode == 0 and "started w4" in added.stdout, added.stdout + added.stderr
        assert "w4 is registered and live (heard by meta leader m" in added.stdout, added.stdout
        wait_until(lambda: (w := http_json("GET", "http://127.0.0.1:7101/v1/cluster", timeout=2)[1]["workers"]
                            .get("w4", {})).get("state") == "available" and w.get("ram_bytes") == 8 * 10**9, 30,
                   "w4 to register as available with 8 GB of RAM")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - started < 20
        wait_until(lambda: any("stopped:" in ln for ln in lines), 5, "the stop summary")
        stopped = next(ln for ln in lines if ln.startswith("stopped:"))
        assert all(part.strip().endswith("=0") for part in stopped[len("stopped:"):].split(",")), stopped
    finally:
        run.kill()


@pytest.mark.parametrize("mode", ["closed", "closed-batch5", "open-2procs"])
def test_the_benchmark_counts_exactly_the_writes_the_cluster_applied(cluster: Cluster, tmp_path: Path,
                                                                      mode: str) -> None:
    # Increments of 20 counters: after the run, the counters' sum is the
    # number of writes that were applied, which must equal what the bench
    # reports as acknowledged (snapshot_every=100: snapshots are taken meanwhile).
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "shardgrid.cli", "bench", "--duration", "2", "--warmup", "0",
            "--mix", "incr=100", "--keys", "20", "--quiet", "--json", str(out)]
    argv += {"closed": ["--concurrency", "8"], "closed-batch5": ["--concurrency", "8", "--batch", "5"],
             "open-2procs": ["--rate", "300", "--procs", "2"]}[mode]
    for addr in cluster.gateways:
        argv += ["--gateway", f"http://{addr}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # its generator processes are in its group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    r = orjson.loads(out.read_bytes())
    assert r["errors"]["total"] == 0 and not r["errors"].get("record_errors"), r["errors"]
    assert r["acked_writes"] > 100
    if mode == "open-2procs":  # the two processes together sent every arrival of the schedule: 300/s for 2 s
        ol = r["open_loop"]
        assert r["client"]["procs"] == 2 and ol["unsent"] == 0 and ol["sent"] == ol["scheduled"], ol
        assert r["ops"] == pytest.approx(600, abs=30), ol
    applied = 0
    for i in range(20):
        status, body = http_json("GET", f"http://{cluster.gateways[0]}/signals/bench-{i}")
        if status == 404:
            continue
        assert status == 200, body
        applied += body["counters"].get("hits", 0)
    assert applied == r["acked_writes"]
