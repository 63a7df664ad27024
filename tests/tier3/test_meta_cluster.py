"""Three real meta processes: apply, leader SIGKILL, catch-up, full-cluster SIGKILL."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.cluster import Cluster, MemberHttp, http_json, wait_until

pytestmark = pytest.mark.tier3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster.create(tmp_path / "cluster")
    try:
        c.start_meta()
        c.wait_leader()
        yield c
    finally:
        c.close()


def cluster_view(c: Cluster, mid: str) -> dict:
    code, body = http_json("GET", f"http://{c.meta_spec(mid).http}/v1/cluster", timeout=2.0)
    assert code == 200, body
    return body


def heartbeat(c: Cluster, mid: str, wid: str, groups: dict) -> int:
    """A heartbeat as worker `wid` sends it: signed as that worker (meta takes no other)."""
    code, _ = MemberHttp(c.secret_path, f"worker:{wid}").json(
        "POST", f"http://{c.meta_spec(mid).http}/v1/workers/{wid}/heartbeat", {"groups": groups}, timeout=1.0)
    return code


def test_apply_survives_leader_kill_and_full_cluster_restart(cluster: Cluster) -> None:
    c = cluster
    topo = c.write_topology(c.topology_yaml())
    first = c.topoctl("apply", str(topo))
    assert first.returncode == 0, first.stderr
    assert "create group 0" in first.stdout and "applied: topology revision 1" in first.stdout
    again = c.topoctl("apply", str(topo))
    assert again.returncode == 0 and "unchanged" in again.stdout

    # SIGKILL the Raft leader: status and a second apply go through the survivors within 5 s.
    old = c.wait_leader()
    c.kill(old)
    survivors = [m.id for m in c.meta if m.id != old]
    killed_at = time.monotonic()
    # An answer is a verdict's exit code (0 green, 5 yellow, 6 red: here no worker runs), never 3 (unreachable).
    status = wait_until(lambda: (r := c.topoctl("status", timeout=5)).returncode in (0, 5, 6) and r, 5.0,
                        "topoctl status through the survivors")
    assert "tier3" in status.stdout and "DOWN" in status.stdout
    changed = c.write_topology(c.topology_yaml(lease_ms=1400), "topology2.yaml")
    second = wait_until(lambda: (r := c.topoctl("apply", str(changed), timeout=5)).returncode == 0 and r, 5.0,
                        "a second apply through the survivors")
    assert "applied: topology revision 2" in second.stdout, second.stdout
    assert time.monotonic() - killed_at < 5.0 + 5.0  # both steps each bounded by 5 s above

    # Restart the killed node: it catches up to revision 2 from its journal plus the leader.
    c.start_meta([old])
    wait_until(lambda: cluster_view(c, old)["topology_revision"] == 2, 15.0, f"{old} to catch up")
    assert cluster_view(c, old)["topology"]["settings"]["lease_ms"] == 1400

    # Drive a real failover through the controller: w2 and w3 heartbeat, w1 stays silent.
    leader = c.wait_leader()

    def beat_and_check() -> bool:
        for wid in ("w2", "w3"):
            heartbeat(c, leader, wid, {"0": {"term": 1, "last_term": 1, "last_seq": 5 if wid == "w3" else 3}})
        return cluster_view(c, leader)["groups"]["0"]["term"] == 2

    wait_until(beat_and_check, 10.0, "the controller to fail group 0 over away from silent w1", interval=0.2)
    view = cluster_view(c, leader)
    assert view["groups"]["0"]["leader"] == "w3"  # the most up-to-date live voter
    assert {g: view["groups"][g]["term"] for g in ("1", "2")} == {"1": 1, "2": 1}  # only w1's group changed
    before = {g: (v["term"], v["leader"]) for g, v in view["groups"].items()}
    before_revision = view["revision"]

    # SIGKILL all three at once, restart: every applied revision and group term is still there.
    for m in c.meta:
        c.kill(m.id)
    c.start_meta()
    c.wait_leader(timeout=20)
    for m in c.meta:
        wait_until(lambda: cluster_view(c, m.id)["revision"] >= before_revision, 15.0,
                   f"{m.id} to recover revision {before_revision}")
        after = cluster_view(c, m.id)
        assert after["topology_revision"] == 2
        assert {g: (v["term"], v["leader"]) for g, v in after["groups"].items()} == before
    got = c.topoctl("get")
    assert got.returncode == 0 and "lease_ms: 1400" in got.stdout

    # A replica that cannot serve shows in `topoctl status`, even asked of a meta follower
    # (only the leader holds heartbeat reports).
    leader = c.wait_leader()
    follower = next(m.id for m in c.meta if m.id != leader)
    why = "Unappliable: entry 7: unknown op kind 'put_item_v2'"
    assert heartbeat(c, leader, "w2", {"0": {"term": 2, "last_term": 1, "last_seq": 3},
                                       "1": {"term": 1, "last_term": 1, "last_seq": 3, "failed": why}}) == 200
    st = c.topoctl("status", meta=c.meta_spec(follower).http)
    assert st.returncode in (5, 6), st.stderr  # a failed replica is never green
    # A reason of the verdict (red for a leader, yellow for a voter), and its row in the lag table.
    assert re.search(rf"^  (red|yellow)\s+group 1: (leader|voter) w2 failed: {re.escape(why)}$", st.stdout, re.M), \
        st.stdout
    assert re.search(r"^1\s+w2\s+(leader|voter)\s+failed\s", st.stdout, re.M), st.stdout


def test_topoctl_reports_invalid_file_and_unreachable_meta(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    bad = c.write_topology(c.topology_yaml().replace("replication_factor: 3", "replication_factor: 5"), "bad.yaml")
    res = c.topoctl("apply", str(bad))
    assert res.returncode == 1 and "replication_factor" in res.stderr
    code, body = http_json("GET", f"http://{c.meta[0].http}/v1/cluster")
    assert code == 200 and body["topology_revision"] == 0  # nothing was stored
    dead = c.topoctl("status", meta="127.0.0.1:1", timeout=4)
    assert dead.returncode == 3 and "no meta node answered" in dead.stderr
