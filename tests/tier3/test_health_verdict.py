"""`topoctl status`'s verdict over real processes: green, non-green while a worker
is down, and `--wait-for green` after it restarts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.cluster import Cluster, wait_until

pytestmark = pytest.mark.tier3

EXIT_BY_VERDICT = {"green": 0, "yellow": 5, "red": 6}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster.create(tmp_path / "cluster", n_workers=3)
    try:
        c.boot(c.topology_yaml(shards=3, rf=3))
        yield c
    finally:
        c.close()


def status_json(c: Cluster) -> tuple[int, dict[str, Any]]:
    res = c.topoctl("status", "-o", "json", timeout=15)
    assert res.returncode in EXIT_BY_VERDICT.values(), res.stderr
    return res.returncode, json.loads(res.stdout)


def test_wait_for_green_after_a_worker_restart(cluster: Cluster) -> None:
    c = cluster
    # Ready leaders come before every follower's first report: wait for the verdict itself.
    first = c.topoctl("status", "--wait-for", "green", "--timeout", "30", timeout=40)
    assert first.returncode == 0, first.stdout + first.stderr
    code, doc = status_json(c)
    assert code == 0 and doc["health"]["verdict"] == "green" and doc["health"]["reasons"] == []
    replicas = doc["health"]["replicas"]
    assert sorted((r["group"], r["worker"]) for r in replicas) == [(g, w) for g in range(3) for w in ("w1", "w2", "w3")]
    assert all(r["state"] == "ok" and isinstance(r["commit"], int) and r["apply_lag"] == 0 for r in replicas)

    c.kill("w3")

    def w3_down() -> tuple[int, dict[str, Any]] | None:
        # Within the lease after the kill meta still counts w3 live (its peers may already
        # report it silent, which is yellow too): wait until meta says why with w3's name.
        code, doc = status_json(c)
        why = [r for r in doc["health"]["reasons"] if r["worker"] == "w3" and r["kind"] in ("replica-down",
                                                                                          "leader-down")]
        return (code, doc) if why else None

    code, doc = wait_until(w3_down, 30, "the verdict to blame w3 once it is down", interval=0.2)
    health = doc["health"]
    assert health["verdict"] in ("yellow", "red") and code == EXIT_BY_VERDICT[health["verdict"]]
    assert {r["state"] for r in health["replicas"] if r["worker"] == "w3"} == {"down"}
    table = c.topoctl("status", timeout=15)
    opening = table.stdout.splitlines()[0].split(":")[0]  # the table opens with the verdict
    assert opening in ("yellow", "red") and table.returncode == EXIT_BY_VERDICT[opening], table.stdout

    # While w3 is down, a short wait gives up with the verdict's code and says why.
    short = c.topoctl("status", "--wait-for", "green", "--timeout", "2", timeout=15)
    assert short.returncode in (5, 6) and "not green after 2 s" in short.stderr and "w3" in short.stderr

    c.start_workers(["w3"])
    res = c.topoctl("status", "--wait-for", "green", "--timeout", "60", timeout=75)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1].split("] ", 1)[1].startswith("green"), res.stdout
    code, doc = status_json(c)
    assert {r["state"] for r in doc["health"]["replicas"] if r["worker"] == "w3"} <= {"ok", "lagging"}
