"""`shardgrid bench --mix infer`: the example model on a cluster the bench starts from its file,
refusals under an impossible budget, and the in-process baseline; each run short, nothing left behind."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_run import alive, run_bench

pytestmark = pytest.mark.tier3

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "layers.yaml")


def _bench(tmp_path: Path, *argv: str, expect_rc: int = 0) -> tuple[dict, str, str]:
    return run_bench(tmp_path / "bench.json", "--topology", EXAMPLE, "--mix", "infer=100", *argv,
                     expect_rc=expect_rc)


def _assert_cluster_gone(r: dict, stderr: str, tmp_path: Path) -> None:
    stopped = [ln for ln in stderr.splitlines() if ln.startswith("[cluster] stopped:")]
    assert len(stopped) == 1, stderr[-3000:]
    codes = [part.strip() for part in stopped[0][len("[cluster] stopped:"):].split(",")]
    assert codes and all(c.rpartition("=")[2] == "0" for c in codes), stopped[0]
    assert not [p for p in map(int, r["cluster"]["pids"]) if alive(p)]
    assert list((tmp_path / "data").iterdir()) == []


def test_infer_on_a_local_cluster_started_from_the_example_topology(tmp_path: Path) -> None:
    r, stdout, stderr = _bench(tmp_path, "--cluster", "local", "--data-dir", str(tmp_path / "data"),
                               "--concurrency", "4", "--duration", "3")
    assert r["cluster"]["models"] == ["tiny"] and r["cluster"]["topology"] == EXAMPLE
    assert r["cluster"]["workers"] == 3 and r["cluster"]["shards"] == 3
    # The file's addresses were moved onto free ports: not the example's 7xxx/8080.
    assert not r["config"]["urls"][0].endswith(":8080")
    assert r["errors"]["total"] == 0, r["errors"]
    assert r["ops"] > 0 and r["infer"]["inferences"] == r["ops"] == r["by_kind"]["infer"]["ops"]
    assert r["latency_ms"]["count"] == r["ops"] and 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert r["cluster_cpu"]["by_role"]["worker"] > 0
    assert "inferences/s" in stdout
    _assert_cluster_gone(r, stderr, tmp_path)


def test_an_impossible_budget_counts_only_over_budget_refusals(tmp_path: Path) -> None:
    # Nothing succeeds, so the bench exits 1; the JSON still has every count.
    r, stdout, stderr = _bench(tmp_path, "--cluster", "local", "--data-dir", str(tmp_path / "data"),
                               "--concurrency", "4", "--duration", "2", "--deadline-ms", "1",
                               "--infer-max-rows", "1", "--infer-max-wait-ms", "0", expect_rc=1)
    assert r["ops"] == 0
    assert set(r["errors"]["by_code"]) == {"over_budget"} and r["errors"]["total"] > 0, r["errors"]
    assert r["cluster"]["worker_args"] == ["--infer-max-rows", "1", "--infer-max-wait-ms", "0"]
    assert "over_budget" in stdout
    _assert_cluster_gone(r, stderr, tmp_path)


def test_the_in_process_baseline(tmp_path: Path) -> None:
    r, stdout, _ = _bench(tmp_path, "--target", "inproc", "--concurrency", "4", "--duration", "2")
    assert r["cluster"]["mode"] == "inproc" and r["cluster"]["layers"] == 24
    assert r["errors"]["total"] == 0 and r["ops"] > 0 and r["infer"]["inferences"] == r["ops"]
    passes = r["infer"]["passes"]
    assert passes["requests"] >= r["ops"] and passes["rows"] == passes["requests"]
    assert 1 <= passes["rows_per_pass"] <= 4  # never more than the 4 clients' requests in one pass
    assert "one compute thread" in stdout and "inferences/s" in stdout
