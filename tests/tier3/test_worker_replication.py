"""Real meta + worker processes: quorum acks, leader SIGKILL under writes, catch-up, leadership back."""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import orjson
import pytest

from meta.controller import REBALANCE_AFTER_MS
from tests.support.cluster import Cluster, wait_until
from shardgrid.common.peerauth import ClusterKeys, Principal
from shardgrid.common.peerauth_http import PeerSigner

pytestmark = pytest.mark.tier3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster.create(tmp_path / "cluster")
    try:
        c.boot(c.topology_yaml(snapshot_every=200))
        yield c
    finally:
        c.close()


def member_session(c: Cluster) -> aiohttp.ClientSession:
    """A session signed as a cluster member: worker routes take no one else."""
    return aiohttp.ClientSession(middlewares=(PeerSigner(ClusterKeys.from_text(c.secret_path.read_text()),
                                                         Principal("gateway", "tests")),))


async def post(session: aiohttp.ClientSession, addr: str, path: str, body: dict[str, Any],
               timeout: float = 3.0) -> tuple[int, dict[str, Any]]:
    async with session.post(f"http://{addr}{path}", data=orjson.dumps(body),
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return r.status, orjson.loads(await r.read())


class Writer:
    """Writes unique items to one group, following its leader and retrying with the same rid."""

    def __init__(self, c: Cluster, gid: int) -> None:
        self.c, self.gid = c, gid
        self.acked: dict[str, int] = {}
        self.leader_addr = ""

    def refresh_leader(self) -> None:
        v = self.c.view()
        leader = v["groups"][str(self.gid)]["leader"]
        self.leader_addr = v["workers"][leader]["addr"]

    async def write(self, session: aiohttp.ClientSession, key: str, deadline_s: float = 10.0) -> bool:
        rid = uuid.uuid4().hex
        body = {"op": {"kind": "put_item", "id": key, "doc": {"v": key}}, "rid": rid, "deadline_ms": 2000}
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            try:
                status, resp = await post(session, self.leader_addr, f"/v1/groups/{self.gid}/write", body)
                if status == 200:
                    self.acked[key] = resp["seq"]
                    return True
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.05)
            await asyncio.to_thread(self.refresh_leader)
        return False


def test_writes_need_a_quorum(cluster: Cluster) -> None:
    c = cluster
    v = c.view()
    leader = v["groups"]["0"]["leader"]
    followers = [w for w in v["groups"]["0"]["voters"] if w != leader]

    async def go() -> None:
        w = Writer(c, 0)
        w.refresh_leader()
        async with member_session(c) as s:
            assert await w.write(s, "before")
            for f in followers:
                c.kill(f)
            status, body = await post(s, w.leader_addr, "/v1/groups/0/write",
                                      {"op": {"kind": "put_item", "id": "lonely", "doc": 1}, "deadline_ms": 1500})
            # The leader alone is not a quorum: never a false ack.
            assert status != 200 and body["error"]["code"] in ("quorum_timeout", "unavailable"), body
    asyncio.run(go())


def test_leader_sigkill_under_writes_then_catch_up(cluster: Cluster) -> None:
    c = cluster
    gid = 0
    # The victim is the group's preferred leader (the topology's placement), so
    # that the end of the test can see the leadership come back to it. A worker
    # slow to start can leave the first leadership elsewhere; leader balance
    # moves it to the preferred leader once that has been up REBALANCE_AFTER_MS.
    victim = c.view()["groups"][str(gid)]["preferred_leader"]

    def led_by_victim() -> bool:
        g = c.view()["groups"][str(gid)]
        return g["leader"] == victim and g["ready_term"] == g["term"]
    wait_until(led_by_victim, REBALANCE_AFTER_MS / 1000 + 20.0, f"group {gid} to be led by its preferred leader {victim}")
    w = Writer(c, gid)
    w.refresh_leader()
    failover_s: list[float] = []

    async def go() -> None:
        async with member_session(c) as s:
            for i in range(600):
                if i == 300:
                    c.kill(victim)
                    killed = time.monotonic()
                    assert await w.write(s, f"k{i}", deadline_s=15.0), "no write acknowledged after the failover"
                    failover_s.append(time.monotonic() - killed)
                    continue
                assert await w.write(s, f"k{i}"), f"write k{i} was never acknowledged"
    asyncio.run(go())
    v = c.view()
    new_leader = v["groups"][str(gid)]["leader"]
    assert new_leader != victim and v["groups"][str(gid)]["term"] >= 2
    assert failover_s[0] < 5.0, f"failover took {failover_s[0]:.2f}s"
    print(f"\nfailover: first acknowledged write {failover_s[0]:.2f}s after SIGKILL of {victim}")

    async def read_all(addr: str, consistency: str) -> dict[str, Any]:
        out = {}
        async with member_session(c) as s:
            for key in w.acked:
                status, body = await post(s, addr, f"/v1/groups/{gid}/read",
                                          {"query": {"kind": "get_item", "id": key}, "consistency": consistency,
                                           "min_seq": max(w.acked.values())})
                out[key] = (status, body.get("result"))
        return out

    got = asyncio.run(read_all(v["workers"][new_leader]["addr"], "strong"))
    missing = [k for k, (st, doc) in got.items() if st != 200 or doc != {"v": k}]
    assert not missing, f"{len(missing)} acknowledged writes not readable from the new leader: {missing[:5]}"

    # Restart the killed worker: it catches up (snapshot_every=200, so via a snapshot or the log).
    c.start_workers([victim])
    target = c.worker_status(new_leader)["groups"][str(gid)]["commit"]
    wait_until(lambda: c.worker_status(victim)["groups"][str(gid)]["applied"] >= target, 20.0,
               f"{victim} to catch up to {target}")
    got = asyncio.run(read_all(c.worker_addr(victim), "follower"))
    missing = [k for k, (st, doc) in got.items() if st != 200 or doc != {"v": k}]
    assert not missing, f"restarted {victim} lacks {len(missing)} acknowledged writes"

    # Once the victim has been up for REBALANCE_AFTER_MS and caught up, meta's
    # controller moves the leadership back to it with a graceful transfer.
    assert v["groups"][str(gid)]["preferred_leader"] == victim
    wait_until(led_by_victim, REBALANCE_AFTER_MS / 1000 + 20.0, f"the leadership of group {gid} to return to {victim}")
    got = asyncio.run(read_all(c.worker_addr(victim), "strong"))
    missing = [k for k, (st, doc) in got.items() if st != 200 or doc != {"v": k}]
    assert not missing, f"{victim}, leading again, lacks {len(missing)} acknowledged writes"


def test_corrupt_wal_resyncs_from_the_leader(cluster: Cluster) -> None:
    c = cluster
    gid = 1
    v = c.view()
    victim = next(w for w in v["groups"][str(gid)]["voters"] if w != v["groups"][str(gid)]["leader"])
    w = Writer(c, gid)
    w.refresh_leader()

    async def write_n(start: int, n: int) -> None:
        async with member_session(c) as s:
            for i in range(start, start + n):
                assert await w.write(s, f"c{i}")
    asyncio.run(write_n(0, 150))
    c.kill(victim)
    # Flip a byte in the middle of the first WAL segment: corruption before the tail.
    seg = sorted((c.root / "workers" / victim / "groups" / str(gid) / "wal").glob("wal-*.seg"))[0]
    raw = bytearray(seg.read_bytes())
    raw[len(raw.rstrip(b"\0")) // 3] ^= 0xFF  # inside the records, not the space allocated after them
    seg.write_bytes(bytes(raw))
    asyncio.run(write_n(150, 50))
    c.start_workers([victim])
    wait_until(lambda: "wal_corrupt_resyncing" in (c.root / "logs" / f"{victim}.log").read_text(), 20,
               "the corruption to be detected")
    target = c.worker_status(v["groups"][str(gid)]["leader"])["groups"][str(gid)]["commit"]
    wait_until(lambda: (g := c.worker_status(victim)["groups"][str(gid)])["applied"] >= target
               and not g["resyncing"], 30.0, f"{victim} to re-sync group {gid}")
    assert not (c.root / "workers" / victim / "groups" / str(gid) / "RESYNC").exists()

    async def read_back() -> list[str]:
        bad = []
        async with member_session(c) as s:
            for key in w.acked:
                status, body = await post(s, c.worker_addr(victim), f"/v1/groups/{gid}/read",
                                          {"query": {"kind": "get_item", "id": key}, "consistency": "follower",
                                           "min_seq": max(w.acked.values())})
                if status != 200 or body["result"] != {"v": key}:
                    bad.append(key)
        return bad
    assert asyncio.run(read_back()) == []


def test_workers_restarted_within_the_lease_get_their_groups_led_again(tmp_path: Path) -> None:
    """A leader back from a restart is live but can never lead the term it had on disk.

    The lease is far longer than a restart, so meta sees no silence: only the
    leader's own report (that term, as a follower) can get its groups led again.
    """
    lease_s = 30.0
    c = Cluster.create(tmp_path / "cluster")
    try:
        c.boot(c.topology_yaml(lease_ms=int(lease_s * 1000)))
        before = {gid: g["term"] for gid, g in c.view()["groups"].items()}
        writers = {int(gid): Writer(c, int(gid)) for gid in before}

        async def write_each(tag: str) -> None:
            async with member_session(c) as s:
                for gid, w in writers.items():
                    await asyncio.to_thread(w.refresh_leader)
                    assert await w.write(s, f"{tag}-{gid}"), f"group {gid}: no write acknowledged ({tag})"

        asyncio.run(write_each("before"))
        for wid, _, _ in c.workers:
            c.kill(wid)
        c.start_workers()

        def led_again() -> bool:
            gs = c.view()["groups"]
            return all(g["ready"] and g["term"] > before[gid] for gid, g in gs.items())
        # Well within the lease: no leader was ever silent for one.
        wait_until(led_again, lease_s - 10.0, "every group to get a ready leader in a new term")
        asyncio.run(write_each("after"))
        for gid, w in writers.items():
            status = c.worker_status(c.view()["groups"][str(gid)]["leader"])["groups"][str(gid)]
            assert status["applied"] >= max(w.acked.values()), (gid, status, w.acked)
    finally:
        c.close()
