"""A worker's disk fills up under write load, then frees: its replicas fail,
leaderships move away, and once space is back the replicas return (retry in
place, worker/retry.py) without the worker process restarting, caught up by
their leaders; nothing acknowledged is lost.

The full disk is an LD_PRELOAD shim on w1 (tests/support/diskfault.py): every
write, fsync and allocation under its data directory fails with ENOSPC while
the fault is on.
"""
from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.cluster import Cluster, wait_until
from tests.support.diskfault import DiskFault
from tests.support.load import LoadGenerator
from tests.tier3.test_chaos import Background, caught_up, judge

pytestmark = pytest.mark.tier3

GROUPS = [(0, "w1", ["w1", "w2", "w3"]), (1, "w2", ["w1", "w2", "w3"]), (2, "w3", ["w1", "w2", "w3"])]
VICTIM = "w1"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Cluster, DiskFault]]:
    c = Cluster.create(tmp_path / "cluster", n_workers=3, n_gateways=2)
    disk = DiskFault(tmp_path / "disk", c.root / "workers" / VICTIM)
    c.worker_env[VICTIM] = disk.env()
    try:
        c.boot(c.topology_yaml(snapshot_every=500, groups=GROUPS), gateways=True)
        yield c, disk
    finally:
        disk.free()
        c.close()


def failed_groups(c: Cluster) -> set[str]:
    return {gid for gid, g in c.worker_status(VICTIM)["groups"].items() if g.get("failed")}


def retries(c: Cluster, outcome: str) -> float:
    with urllib.request.urlopen(f"http://{c.worker_addr(VICTIM)}/metrics", timeout=2) as r:
        text = r.read().decode()
    found = re.search(rf'^shardgrid_group_retries_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def reopened(c: Cluster) -> float:
    return retries(c, "reopened")


def probes_failed(c: Cluster) -> float:
    return retries(c, "probe_failed")


def test_a_worker_whose_disk_fills_up_gets_its_replicas_back_when_space_returns(
        cluster: tuple[Cluster, DiskFault]) -> None:
    c, disk = cluster
    pid = c.children[VICTIM].pid
    load = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=81))
    try:
        load.wait_more(200)
        disk.fill()
        filled = time.monotonic()
        # Every group has writes, so each of w1's replicas hits the full disk.
        wait_until(lambda: failed_groups(c) == {"0", "1", "2"}, 15.0, f"{VICTIM}'s replicas to fail", interval=0.1)
        wait_until(lambda: (g := c.view()["groups"]["0"])["leader"] != VICTIM and g["ready"], 10.0,
                   "group 0's leadership to leave the full disk", interval=0.05)
        moved = time.monotonic() - filled
        status = c.worker_status(VICTIM)["groups"]
        assert all("No space left on device" in status[g]["failed"] for g in ("0", "1", "2")), status
        # The disk is still full: probed (twice per group: 1 s, then 2 s later), never reopened.
        wait_until(lambda: probes_failed(c) >= 6, 20.0, f"{VICTIM} to probe its disk", interval=0.2)
        assert failed_groups(c) == {"0", "1", "2"} and reopened(c) == 0
        load.wait_more(100)

        disk.free()
        freed = time.monotonic()
        wait_until(lambda: not failed_groups(c) and caught_up(c, VICTIM), 60.0,
                   f"{VICTIM}'s replicas to come back and catch up", interval=0.2)
        back = time.monotonic() - freed
        assert c.children[VICTIM].alive() and c.children[VICTIM].pid == pid, "the worker restarted"
        assert reopened(c) >= 3
        load.wait_more(200)
    finally:
        result = load.finish()
    # A write in flight at the failed leader is retried by the gateway at the new
    # leader (same request id): clients see no error.
    assert sum(result.errors.values()) == 0, f"client-visible errors: {result.errors}"
    judge(c, result, "disk-full", f"leadership_moved={moved:.2f}s replicas_back={back:.2f}s")
