"""Meta's admission: who may register, heartbeat and report, revoke/admit, and the
controller's treatment of a revoked worker (meta/server.py, meta/state.py, meta/controller.py)."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest
import structlog
from aiohttp.test_utils import TestServer

from meta.controller import GroupReport, SetLeader, SoftState, decide
from meta.raft import MetaRaft, RaftPeer
from meta.repair import StartOperator, repair
from meta.server import MetaServer, MetaServerConfig
from meta.state import GroupRecord, MetaStateMachine, WorkerRecord, placeable
from shardgrid.common.peerauth import ClusterKeys, Principal
from shardgrid.common.peerauth_http import PeerSigner
from tests.support.cluster import free_ports
from topology.errors import TopologyError
from topology.loader import load_topology
from tests.support.waiting import until

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "topology.yaml").read_text()
TOKEN = "admin-tok"
KEYS = ClusterKeys(["cluster-s3cret"])
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def meta(tmp_path: Path) -> AsyncIterator[tuple[str, MetaServer]]:
    (raft_port,) = free_ports(1)
    raft = MetaRaft(RaftPeer("m1", f"127.0.0.1:{raft_port}", "127.0.0.1:0"), [], tmp_path / "m1", "pw",
                    asyncio.get_running_loop())
    server = MetaServer(raft, MetaServerConfig(admin_token=TOKEN, cluster_keys=KEYS, node_id="m1"),
                        structlog.get_logger())
    srv = TestServer(server.app())
    await srv.start_server()
    try:
        await until(raft.is_leader, "the single meta node to lead")
        text = EXAMPLE.replace("settings: {", "settings: {allowed_versions: [\"1.0\", \"1.1\"], ", 1)
        async with aiohttp.ClientSession() as s:
            async with s.put(str(srv.make_url("/v1/topology")), data=text.encode(), headers=AUTH) as r:
                assert r.status == 200, await r.text()
        yield str(srv.make_url("")).rstrip("/"), server
    finally:
        await srv.close()
        raft.close()


def member(who: Principal, keys: ClusterKeys = KEYS) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(middlewares=(PeerSigner(keys, who),))


def _reg(wid: str, version: str = "1.0") -> dict[str, Any]:
    return {"id": wid, "addr": f"127.0.0.1:{9000 + int(wid[1:])}", "version": version, "code_digest": "ab" * 16}


async def test_only_a_worker_with_the_secret_and_an_allowed_version_is_admitted(meta: Any) -> None:
    base, server = meta
    async with aiohttp.ClientSession() as outsider:
        async with outsider.post(base + "/v1/workers/register", json=_reg("w7")) as r:
            assert r.status == 401 and (await r.json())["error"]["reason"] == "missing"
        async with outsider.post(base + "/v1/workers/w1/heartbeat", json={}) as r:
            assert r.status == 401
    async with member(Principal("worker", "w7"), ClusterKeys(["guessed"])) as s:
        async with s.post(base + "/v1/workers/register", json=_reg("w7")) as r:
            assert r.status == 401 and (await r.json())["error"]["reason"] == "unknown_credentials"
    async with member(Principal("worker", "w7")) as s:
        async with s.post(base + "/v1/workers/register", json=_reg("w7", "0.9")) as r:
            body = await r.json()
            assert r.status == 403 and body["error"]["reason"] == "version_mismatch"
            assert body["error"]["allowed_versions"] == ["1.0", "1.1"]
        assert "w7" not in server.raft.sm.workers
        async with s.post(base + "/v1/workers/register", json=_reg("w7", "1.1")) as r:
            assert r.status == 200 and (await r.json())["admission"] == "admitted"
    rec = server.raft.sm.workers["w7"]
    assert (rec.admission, rec.version, rec.code_digest) == ("admitted", "1.1", "ab" * 16)
    reasons = [(x["principal"], x["reason"]) for x in server.refusals]
    assert ("worker:w7", "unknown_credentials") in reasons and ("worker:w7", "version_mismatch") in reasons


async def test_a_worker_speaks_only_for_itself(meta: Any) -> None:
    base, server = meta
    async with member(Principal("worker", "w2")) as s:
        async with s.post(base + "/v1/workers/register", json=_reg("w1")) as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "wrong_sender"
        async with s.post(base + "/v1/workers/w1/heartbeat", json={"groups": {}}) as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "wrong_sender"
        async with s.post(base + "/v1/groups/0/ready", json={"term": 1, "leader": "w1"}) as r:
            assert r.status == 403
        # Group 0 is led by w1 in the example: only w1 names a successor.
        async with s.post(base + "/v1/groups/0/leader", json={"leader": "w2", "expect_term": 1}) as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "wrong_sender"
    async with member(Principal("gateway", "g1")) as s:
        async with s.post(base + "/v1/workers/w1/heartbeat", json={"groups": {}}) as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "wrong_role"
    assert server.soft is None or "w1" not in server.soft.workers
    assert server.raft.sm.groups[0].term == 1 and server.raft.sm.groups[0].leader == "w1"


async def test_revoke_refuses_the_worker_everywhere_and_admit_undoes_it(meta: Any) -> None:
    base, server = meta
    async with member(Principal("worker", "w1")) as s:
        declared = server.raft.sm.workers["w1"].addr
        async with s.post(base + "/v1/workers/register", json={**_reg("w1"), "addr": declared}) as r:
            assert r.status == 200
        async with aiohttp.ClientSession() as op:
            async with op.post(base + "/v1/workers/w1/revoke") as r:
                assert r.status == 401  # the admin token is needed
            async with op.post(base + "/v1/workers/w1/revoke", headers=AUTH) as r:
                assert r.status == 200 and (await r.json())["admission"] == "revoked"
        async with s.post(base + "/v1/workers/w1/heartbeat", json={"groups": {}}) as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "revoked"
        assert not placeable(server.raft.sm.workers["w1"])
        async with aiohttp.ClientSession() as op:
            async with op.post(base + "/v1/workers/w1/admit", headers=AUTH) as r:
                assert r.status == 200 and (await r.json())["admission"] == "admitted"
        async with s.post(base + "/v1/workers/w1/heartbeat", json={"groups": {}}) as r:
            assert r.status == 200
    assert server.cluster_view()["workers"]["w1"]["admission"] == "admitted"


async def test_a_gateway_registers_and_is_listed(meta: Any) -> None:
    base, server = meta
    async with member(Principal("gateway", "g1")) as s:
        body = {"id": "g1", "addr": "127.0.0.1:8080", "version": "1.0", "code_digest": "cd" * 16}
        async with s.post(base + "/v1/gateways/register", json=body) as r:
            assert r.status == 200
        async with s.post(base + "/v1/gateways/register", json={**body, "id": "g2"}) as r:
            assert r.status == 403  # g1 cannot register as g2
        async with s.post(base + "/v1/gateways/register", json={**body, "version": "2.0"}) as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "version_mismatch"
    gws = server.cluster_view()["gateways"]
    assert [(g["id"], g["admission"], g["version"]) for g in gws] == [("g1", "admitted", "1.0")]


# -- the controller ------------------------------------------------------------------------


def _report(term: int, role: str, seq: int) -> GroupReport:
    return GroupReport(term=term, role=role, last_term=term, last_seq=seq, commit=seq, applied=seq)


def _soft(now: int, workers: list[str], term: int, leader: str) -> SoftState:
    soft = SoftState(leader_since_ms=0)
    for w in workers:
        soft.heard_from(w, now, {0: _report(term, "leader" if w == leader else "follower", 10)}, 1500, None)
    return soft


def test_a_revoked_leader_fails_over_at_once_to_an_admitted_voter() -> None:
    now = 100_000
    group = GroupRecord(0, 3, "w1", ["w1", "w2", "w3"], ready_term=3)
    soft = _soft(now, ["w1", "w2", "w3"], 3, "w1")
    assert decide([group], soft, now, 1500) == []  # a live leader stays
    [move] = decide([group], soft, now, 1500, revoked=frozenset({"w1"}))
    assert isinstance(move, SetLeader) and move.leader in ("w2", "w3") and move.cause == "revoked"
    [move] = decide([group], soft, now, 1500, revoked=frozenset({"w1", "w2"}))
    assert isinstance(move, SetLeader) and move.leader == "w3"
    # A silent leader's successor is never a revoked voter either.
    quiet = _soft(now + 5000, ["w2", "w3"], 3, "w1")
    [move] = decide([group], quiet, now + 5000, 1500, revoked=frozenset({"w2"}))
    assert isinstance(move, SetLeader) and move.leader == "w3"


def test_a_revoked_voter_is_replaced_at_once_and_never_chosen() -> None:
    now = 100_000
    workers = {w: WorkerRecord(w, f"a:{i}", "abcd"[i]) for i, w in enumerate(["w1", "w2", "w3", "w4"])}
    workers["w3"].admission = "revoked"
    group = GroupRecord(0, 3, "w1", ["w1", "w2", "w3"], ready_term=3)
    soft = _soft(now, ["w1", "w2", "w3", "w4"], 3, "w1")
    steps = repair([group], {}, workers, soft, now, 1500, 60_000, 3)
    assert steps and isinstance(steps[0], StartOperator) and steps[0].worker == "w4" and steps[0].kind == "add"
    assert "revoked" in steps[0].reason


def test_set_admission_and_registration_of_a_revoked_worker() -> None:
    sm = MetaStateMachine()
    assert sm.apply({"op": "register_worker", "id": "w1", "addr": "a:1", "version": "1.0"})["ok"]
    assert sm.apply({"op": "set_admission", "id": "w1", "admission": "banned"})["code"] == "bad_request"
    assert sm.apply({"op": "set_admission", "id": "w1", "admission": "revoked"})["ok"]
    again = sm.apply({"op": "register_worker", "id": "w1", "addr": "a:1", "version": "1.0"})
    assert not again["ok"] and again["reason"] == "revoked"
    assert sm.apply({"op": "set_admission", "id": "w1", "admission": "admitted"})["ok"]
    assert sm.apply({"op": "register_worker", "id": "w1", "addr": "a:1", "version": "1.1"})["ok"]
    assert sm.workers["w1"].version == "1.1"


def test_allowed_versions_is_validated() -> None:
    base = EXAMPLE.replace("settings: {", "settings: {allowed_versions: VALUE, ", 1)
    assert load_topology(base.replace("VALUE", '["0.1.0", "0.2.0rc1+local"]')).settings.allowed_versions == \
        ("0.1.0", "0.2.0rc1+local")
    for bad in ('"0.1.0"', "[1]", '[""]', '["a b"]'):
        with pytest.raises(TopologyError):
            load_topology(base.replace("VALUE", bad))


async def test_the_leaders_view_says_how_long_it_has_led(meta: Any) -> None:
    # shardgrid/health.py reads a worker not heard yet within the first lease as unknown, not down.
    from meta.server import _now_ms
    _, server = meta
    server.soft = SoftState(leader_since_ms=_now_ms() - 500)
    view = server.cluster_view()
    assert 500 <= view["meta_leader_for_ms"] < 5000
    server.soft = None  # not (yet) the leader's soft state: no reports, no such field
    assert "meta_leader_for_ms" not in server.cluster_view()
