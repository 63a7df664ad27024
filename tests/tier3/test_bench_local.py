"""`shardgrid bench --cluster local`: one command starts a cluster, loads it, reports and stops it.

What the figures of runbook/benchmarking.md rest on: the run reports real
counts and the cluster's CPU, and leaves nothing behind — no process, no
data directory — whether the cluster is shardgrid or etcd.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.bench_run import alive, run_bench

pytestmark = pytest.mark.tier3


def _bench(tmp_path: Path, *extra: str) -> tuple[dict, str, str]:
    return run_bench(tmp_path / "bench.json", "--cluster", "local", "--data-dir", str(tmp_path / "data"),
                     "--duration", "2", "--warmup", "1", *extra)


def _assert_left_nothing(r: dict, stderr: str, tmp_path: Path, clean: set[str]) -> None:
    stopped = [ln for ln in stderr.splitlines() if ln.startswith("[cluster] stopped:")]
    assert len(stopped) == 1, stderr[-3000:]
    # Every process of the cluster exited cleanly on SIGTERM (not killed), and none outlived the run.
    codes = [part.strip() for part in stopped[0][len("[cluster] stopped:"):].split(",")]
    assert codes and all(c.rpartition("=")[2] in clean for c in codes), stopped[0]
    pids = [int(p) for p in r["cluster"]["pids"]]
    assert len(pids) == len(codes) and not [p for p in pids if alive(p)]
    assert list((tmp_path / "data").iterdir()) == []  # the run's data directory is removed


def _assert_counts(r: dict, stdout: str) -> None:
    assert r["errors"]["total"] == 0, r["errors"]
    assert r["ops"] > 50 and r["acked_writes"] == r["ops"] == r["by_kind"]["put"]["ops"]
    assert r["latency_ms"]["count"] == r["ops"] and 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    cpu = r["cluster_cpu"]
    assert cpu["cpu_s"] > 0 and cpu["us_per_acked_write"] == pytest.approx(cpu["cpu_s"] * 1e6 / r["ops"], rel=0.01)
    # One progress line a second: the warm-up second, the two measured ones (and a drain).
    progress = [ln for ln in stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert len(progress) >= 3 and "(warm-up)" in progress[0], stdout[:2000]


def test_local_shardgrid_cluster_is_started_measured_and_stopped(tmp_path: Path) -> None:
    r, stdout, stderr = _bench(tmp_path, "--concurrency", "8", "--procs", "2", "--mix", "put=100")
    assert {k: r["cluster"][k] for k in ("mode", "target", "workers", "shards", "rf", "gateways", "fsync")} == {
        "mode": "local", "target": "shardgrid", "workers": 3, "shards": 3, "rf": 3, "gateways": 1, "fsync": "batch"}
    _assert_counts(r, stdout)
    # The workers were among the measured processes, and their round counters were read.
    assert r["cluster_cpu"]["by_role"].keys() >= {"meta", "worker", "gateway"}
    assert r["rounds"]["totals"]["fsyncs"] > 0
    _assert_left_nothing(r, stderr, tmp_path, clean={"0"})


@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs the etcd binary (apt-get install etcd-server)")
def test_local_etcd_cluster_is_started_measured_and_stopped(tmp_path: Path) -> None:
    r, stdout, stderr = _bench(tmp_path, "--target", "etcd", "--concurrency", "8", "--mix", "put=100")
    assert r["cluster"]["mode"] == "local" and r["cluster"]["members"] == 3
    _assert_counts(r, stdout)
    # etcd ends a graceful shutdown by re-raising SIGTERM: -15 is its clean exit.
    _assert_left_nothing(r, stderr, tmp_path, clean={"0", "-15"})
