"""`shardgrid bench --cluster local --target both --client wrk`: one command starts a shardgrid
cluster and a 3-member etcd, drives each with wrk in 3 interleaved rounds, reports them side by
side and stops both, leaving no process and no data directory behind."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.bench_run import alive, run_bench

pytestmark = [
    pytest.mark.tier3,
    pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("etcd") is None,
                       reason="machine capability missing: needs the wrk and etcd binaries "
                              "(apt-get install wrk etcd-server; .ci/run installs them)"),
]


def test_both_targets_driven_by_wrk_in_interleaved_rounds(tmp_path: Path) -> None:
    r, stdout, stderr = run_bench(tmp_path / "bench.json", "--cluster", "local", "--target", "both",
                                  "--client", "wrk", "--duration", "2", "--concurrency", "8",
                                  "--data-dir", str(tmp_path / "data"), timeout_s=300)
    assert r["kind"] == "compare" and r["config"]["client"] == "wrk" and r["config"]["rounds"] == 3
    assert [(row["round"], row["target"]) for row in r["rounds"]] == [
        (n, t) for n in (1, 2, 3) for t in ("shardgrid", "etcd")]
    for t in ("shardgrid", "etcd"):
        rounds = r["targets"][t]["rounds"]
        assert len(rounds) == 3
        for row in rounds:
            assert row["client"] == "wrk"
            assert row["ops"] > 0 and row["acked_writes"] == row["ops"], row
            assert row["errors"]["total"] == 0, row["errors"]
            assert 0 < row["latency_ms"]["p50"] <= row["latency_ms"]["p99"]
            assert row["cluster_cpu_s"] > 0 and row["us_per_acked_write"] > 0
        med = r["targets"][t]["median"]
        assert med["client"] == "wrk" and med["rounds"] == 3 and med["errors"] == 0
        assert med["ops_per_s"] > 0 and med["us_per_acked_write"] > 0
        assert r["targets"][t]["cluster"]["target"] == t
    assert r["targets"]["shardgrid"]["rounds"][0]["cluster_cpu_by_role"].keys() >= {"meta", "worker", "gateway"}
    assert r["ratio"]["ops_per_s"] == pytest.approx(
        r["targets"]["shardgrid"]["median"]["ops_per_s"] / r["targets"]["etcd"]["median"]["ops_per_s"], rel=0.01)
    assert "shardgrid (client: wrk)" in stdout and "etcd (client: wrk)" in stdout and "shardgrid/etcd" in stdout
    # Both clusters were stopped cleanly (etcd's clean exit is -15), nothing outlived the run.
    stopped = [ln for ln in stderr.splitlines() if ln.startswith("[cluster] stopped:")]
    assert len(stopped) == 2, stderr[-3000:]
    for line in stopped:
        codes = [part.strip().rpartition("=")[2] for part in line[len("[cluster] stopped:"):].split(",")]
        assert codes and set(codes) <= {"0", "-15"}, line
    pids = [int(p) for t in ("shardgrid", "etcd") for p in r["targets"][t]["cluster"]["pids"]]
    assert len(pids) == 7 + 3 and not [p for p in pids if alive(p)]
    assert list((tmp_path / "data").iterdir()) == []
