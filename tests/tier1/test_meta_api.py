"""The meta HTTP API in-process, over a single-node PySyncObj group."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import structlog
from aiohttp.test_utils import TestClient

from meta.controller import SoftState, unusable
from meta.raft import MetaRaft, RaftPeer
from meta.server import SERVER_KEY, MetaServer, MetaServerConfig, _now_ms
from tests.support.cluster import free_ports
from tests.support.waiting import until

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "topology.yaml").read_text()
TOKEN = "s3cret-admin"


def _single_meta(tmp_path: Path, config: MetaServerConfig) -> tuple[MetaRaft, MetaServer]:
    (raft_port,) = free_ports(1)
    me = RaftPeer("m1", f"127.0.0.1:{raft_port}", "127.0.0.1:0")
    raft = MetaRaft(me, [], tmp_path / "m1", "pw", asyncio.get_running_loop())
    return raft, MetaServer(raft, config, structlog.get_logger())


@pytest.fixture
async def api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[TestClient]:
    raft, server = _single_meta(tmp_path, MetaServerConfig(admin_token=TOKEN))
    try:
        client = await aiohttp_client(server.app())
        await until(raft.is_leader, "the single meta node to lead")
        yield client
    finally:
        raft.close()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def put(client: TestClient, text: str, **params: str) -> Any:
    return await client.put("/v1/topology", data=text.encode(), params=params, headers=AUTH)


async def test_apply_dry_run_then_apply_then_noop(api: TestClient) -> None:
    dry = await put(api, EXAMPLE, dry_run="1")
    body = await dry.json()
    assert dry.status == 200 and body["changed"] and body["dry_run"]
    assert [a["kind"] for a in body["plan"]] == ["create_group"] * 3
    assert (await (await api.get("/v1/cluster")).json())["topology_revision"] == 0
    applied = await (await put(api, EXAMPLE)).json()
    assert applied["topology_revision"] == 1
    again = await (await put(api, EXAMPLE)).json()
    assert again["changed"] is False and again["plan"] == [] and again["topology_revision"] == 1
    text = await api.get("/v1/topology")
    assert text.headers["x-topology-revision"] == "1" and "cluster: demo" in await text.text()


async def test_invalid_topology_is_400_with_paths_and_stores_nothing(api: TestClient) -> None:
    bad = EXAMPLE.replace("leader: w1, replicas", "leader: w9, replicas")
    resp = await put(api, bad)
    body = await resp.json()
    assert resp.status == 400 and body["error"]["code"] == "bad_request"
    assert any(e["path"] == "groups[0].leader" for e in body["error"]["errors"])
    assert (await api.get("/v1/topology")).status == 404
    garbage = await put(api, "\xff\xfe not yaml: [")
    assert garbage.status == 400


async def test_shards_cannot_change_once_applied(api: TestClient) -> None:
    await put(api, EXAMPLE)
    resharded = EXAMPLE.replace("shards: 3", "shards: 4").split("groups:")[0]
    resp = await put(api, resharded)
    body = await resp.json()
    assert resp.status == 400
    assert any(e["path"] == "shards" for e in body["error"]["errors"])


async def test_stale_expect_revision_is_a_conflict(api: TestClient) -> None:
    await put(api, EXAMPLE)
    resp = await put(api, EXAMPLE.replace("lease_ms: 1500", "lease_ms: 1600"), expect_revision="0")
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "conflict"


async def test_admin_token_is_required_for_apply(api: TestClient) -> None:
    resp = await api.put("/v1/topology", data=EXAMPLE.encode())
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "unauthorized"
    wrong = await api.put("/v1/topology", data=EXAMPLE.encode(), headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    assert (await api.get("/v1/topology")).status == 404


async def test_watch_returns_when_the_revision_passes(api: TestClient) -> None:
    rev = (await (await api.get("/v1/cluster")).json())["revision"]
    waiter = asyncio.create_task(api.get("/v1/cluster", params={"wait": str(rev), "timeout": "10"}))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await put(api, EXAMPLE)
    resp = await asyncio.wait_for(waiter, 5)
    assert (await resp.json())["revision"] > rev
    # A watch with nothing new times out and returns the current view.
    idle = await api.get("/v1/cluster", params={"wait": str(rev + 100), "timeout": "0.2"})
    assert idle.status == 200
    bad = await api.get("/v1/cluster", params={"wait": "x"})
    assert bad.status == 400


async def test_watches_are_capped_and_a_non_finite_timeout_is_refused(api: TestClient,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import meta.server

    server = api.server.app[SERVER_KEY]
    monkeypatch.setattr(meta.server, "MAX_WATCHERS", 1)
    rev = (await (await api.get("/v1/cluster")).json())["revision"]
    for bad in ("nan", "inf", "-inf"):
        resp = await api.get("/v1/cluster", params={"wait": str(rev), "timeout": bad})
        assert resp.status == 400 and "finite" in (await resp.json())["error"]["message"], bad
    first = asyncio.create_task(api.get("/v1/cluster", params={"wait": str(rev), "timeout": "10"}))
    await until(lambda: server._watchers == 1, "the first watch to be held")
    second = await api.get("/v1/cluster", params={"wait": str(rev), "timeout": "10"})
    err = (await second.json())["error"]
    assert second.status == 503 and err["code"] == "overloaded" and err["retry_elsewhere"] is True, err
    assert (await api.get("/v1/cluster")).status == 200  # a plain read is never refused
    await put(api, EXAMPLE)
    assert (await asyncio.wait_for(first, 5)).status == 200
    assert server._watchers == 0


async def test_register_and_heartbeat_validation(api: TestClient) -> None:
    assert (await api.post("/v1/workers/register", data=b"{nope")).status == 400
    assert (await api.post("/v1/workers/register", json={"id": 5})).status == 400
    ok = await api.post("/v1/workers/register", json={"id": "w7", "addr": "127.0.0.1:9", "zone": "z"})
    assert ok.status == 200
    view = await (await api.get("/v1/cluster")).json()
    assert view["workers"]["w7"]["state"] == "available"
    hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {"0": {"last_term": "x"}}})
    assert hb.status == 400
    hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {}, "boot": 7})
    assert hb.status == 400 and "boot" in (await hb.json())["error"]["message"]
    for bad in ({"quorum": "yes"}, {"leader_silence_ms": "long"}, {"snapshot_bytes": "lots"},
                {"snapshot_total": [1]}):
        hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {"0": {"term": 1, **bad}}})
        assert hb.status == 400 and "quorum" in (await hb.json())["error"]["message"]
    hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {"0": {"term": 1, "last_term": 1, "last_seq": 4,
                                                                            "quorum": None, "leader_silence_ms": 250}},
                                                          "boot": "b1"})
    assert hb.status == 200
    view = await (await api.get("/v1/cluster")).json()
    assert view["workers"]["w7"]["live"] is True
    # The version a worker runs, in its heartbeat since issue 29 (none from an older worker, as above).
    for bad in (7, "x" * 65):
        hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {}, "boot": "b1", "version": bad})
        assert hb.status == 400 and "version" in (await hb.json())["error"]["message"]
    hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {}, "boot": "b1", "version": "0.2.0"})
    assert hb.status == 200
    assert (await (await api.get("/v1/cluster")).json())["workers"]["w7"]["report"]["version"] == "0.2.0"
    # Mode B: a worker the topology does not declare advertises what it offers.
    for bad in ({"available_ram": -1}, {"available_ram": "8GB"}, {"available_disk": 2**63}, {"available_disk": True}):
        r = await api.post("/v1/workers/register", json={"id": "w8", "addr": "127.0.0.1:10", **bad})
        assert r.status == 400 and "whole number of bytes" in (await r.json())["error"]["message"]
    r = await api.post("/v1/workers/register", json={"id": "w8", "addr": "127.0.0.1:10", "available_ram": 8 * 10**9,
                                                     "available_disk": 50 * 10**9})
    assert r.status == 200 and (await r.json())["state"] == "available"
    w8 = (await (await api.get("/v1/cluster")).json())["workers"]["w8"]
    assert (w8["state"], w8["ram_bytes"], w8["disk_bytes"]) == ("available", 8 * 10**9, 50 * 10**9)


async def test_unknown_route_and_health_and_metrics(api: TestClient) -> None:
    missing = await api.get("/v1/nope")
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "not_found"
    health = await (await api.get("/healthz")).json()
    assert health["is_leader"] is True and health["leader"] == "m1"
    assert health["version"] == api.server.app[SERVER_KEY].version != ""
    # topoctl status compares the meta nodes' versions (shardgrid/health.py): each says its own.
    assert (await (await api.get("/v1/status")).json())["version"] == health["version"]
    metrics = await (await api.get("/metrics")).text()
    assert "shardgrid_meta_is_leader 1.0" in metrics and "shardgrid_http_requests_total" in metrics
    assert f'shardgrid_build_info{{role="meta",version="{health["version"]}"}} 1.0' in metrics
    assert "process_cpu_seconds_total" in metrics and "python_gc_collections_total" in metrics


# -- transfer and the preferred leader ---------------------------------------------------------


@pytest.fixture
async def meta_and_worker(tmp_path: Path, aiohttp_client: Any, aiohttp_server: Any) -> AsyncIterator[Any]:
    """A single-node meta with the example topology applied, group 0 ready under w1, and
    a fake w1 whose transfer endpoint does what the real one's hand-over ends in: meta
    names the target leader (set_leader) and the target reports ready."""
    from aiohttp import web

    raft, server = _single_meta(tmp_path, MetaServerConfig())
    calls: list[dict[str, Any]] = []
    behaviour = {"answer": 202, "lead": None}

    async def transfer(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(body)
        if behaviour["answer"] >= 300:
            return web.json_response({"error": {"code": "busy"}}, status=behaviour["answer"])
        g = raft.sm.groups[0]
        lead = behaviour["lead"] or body["to"]
        await raft.submit({"op": "set_leader", "group": 0, "leader": lead, "expect_term": g.term}, 5.0)
        await raft.submit({"op": "set_ready", "group": 0, "term": g.term, "leader": lead}, 5.0)
        return web.json_response({"accepted": True}, status=202)

    async def assignments(request: web.Request) -> web.Response:
        calls.append({"assignment": await request.json()})
        reason = behaviour.get("refuse")
        if reason:
            return web.json_response({"error": {"code": "conflict", "reason": reason, "message": "full"}}, status=409)
        return web.json_response({"accepted": True})

    app = web.Application()
    app.router.add_post("/v1/groups/{gid}/transfer", transfer)
    app.router.add_post("/v1/assignments", assignments)
    worker = await aiohttp_server(app)
    try:
        client = await aiohttp_client(server.app())
        await until(raft.is_leader, "the single meta node to lead")
        assert (await put(client, EXAMPLE)).status == 200
        assert (await raft.submit({"op": "register_worker", "id": "w1", "addr": f"127.0.0.1:{worker.port}"}, 5.0))["ok"]
        assert (await raft.submit({"op": "set_ready", "group": 0, "term": 1, "leader": "w1"}, 5.0))["ok"]
        await until(lambda: server.soft is not None, "the controller to start")
        for wid in ("w1", "w2", "w3"):
            hb = await client.post(f"/v1/workers/{wid}/heartbeat", json={"groups": {"0": {
                "term": 1, "last_term": 1, "last_seq": 10, "commit": 10, "applied": 10,
                "role": "leader" if wid == "w1" else "follower"}}})
            assert hb.status == 200
        yield client, server, raft, calls, behaviour
    finally:
        raft.close()


async def test_a_transfer_records_its_target_as_preferred_leader_only_once_it_succeeded(meta_and_worker: Any) -> None:
    client, server, raft, calls, behaviour = meta_and_worker
    assert raft.sm.groups[0].preferred_leader == "w1"
    behaviour["answer"] = 409  # the leader refuses: nothing recorded
    refused = await client.post("/v1/groups/0/transfer", json={"to": "w2"})
    assert refused.status == 503 and raft.sm.groups[0].preferred_leader == "w1"
    behaviour["answer"] = 202
    ok = await client.post("/v1/groups/0/transfer", json={"to": "w2"})
    body = await ok.json()
    assert ok.status == 200 and body["changed"] and body["new_leader"] == "w2"
    g = raft.sm.groups[0]
    assert (g.leader, g.preferred_leader) == ("w2", "w2")  # the operator's choice sticks
    assert calls[-1] == {"to": "w2"} and 0 not in server._busy_groups


async def test_pinning_the_current_leader_and_a_hand_over_that_went_elsewhere(meta_and_worker: Any) -> None:
    client, server, raft, calls, behaviour = meta_and_worker
    await raft.submit({"op": "set_preferred_leader", "group": 0, "leader": "w3"}, 5.0)
    pin = await client.post("/v1/groups/0/transfer", json={"to": "w1"})
    assert pin.status == 200 and (await pin.json())["changed"] is False
    assert raft.sm.groups[0].preferred_leader == "w1" and not calls  # pinned without a hand-over
    behaviour["lead"] = "w3"  # something else won the term: not what the operator asked for
    other = await client.post("/v1/groups/0/transfer", json={"to": "w2"})
    err = (await other.json())["error"]
    assert other.status == 409 and err["code"] == "conflict" and "w3" in err["message"]
    assert raft.sm.groups[0].preferred_leader == "w1"


async def test_a_group_with_a_leader_call_in_flight_refuses_a_second_transfer(meta_and_worker: Any) -> None:
    client, server, raft, calls, behaviour = meta_and_worker
    server._busy_groups.add(0)
    busy = await client.post("/v1/groups/0/transfer", json={"to": "w2"})
    assert busy.status == 409 and (await busy.json())["error"]["code"] == "conflict" and not calls


def test_leader_balance_backs_off_a_move_that_does_not_stick() -> None:
    from meta.server import REBALANCE_BACKOFF_MAX_MS, REBALANCE_COOLDOWN_MS, _BalanceMove

    b = _BalanceMove()
    waits = []
    for i in range(8):
        b.started(i * 1000, term=5)
        waits.append(b.retry_at - i * 1000)
    assert waits[:3] == [REBALANCE_COOLDOWN_MS, 2 * REBALANCE_COOLDOWN_MS, 4 * REBALANCE_COOLDOWN_MS]
    assert waits[-1] == REBALANCE_BACKOFF_MAX_MS and b.term == 5 and b.attempts == 8


async def test_a_removal_right_after_a_meta_failover_counts_only_voters_heard_from(meta_and_worker: Any) -> None:
    """A new meta leader gives workers it has not heard from a grace lease before it fails
    their groups over; a removal must not count them towards the live quorum it leaves."""
    client, server, raft, calls, behaviour = meta_and_worker
    server.soft = SoftState(leader_since_ms=_now_ms())  # as if this node had just been elected
    hb = await client.post("/v1/workers/w1/heartbeat", json={"groups": {"0": {
        "term": 1, "last_term": 1, "last_seq": 10, "commit": 10, "applied": 10, "role": "leader"}}})
    assert hb.status == 200
    view = await (await client.get("/v1/cluster")).json()
    assert view["workers"]["w1"]["live"] is True and view["workers"]["w3"]["live"] is False
    refused = await client.post("/v1/groups/0/replicas", json={"remove": "w2"})
    err = (await refused.json())["error"]
    assert refused.status == 400 and "quorum of live voters (1 live of 2)" in err["message"], err
    assert not raft.sm.operators  # nothing started
    hb = await client.post("/v1/workers/w3/heartbeat", json={"groups": {"0": {
        "term": 1, "last_term": 1, "last_seq": 10, "commit": 10, "applied": 10, "role": "follower"}}})
    assert hb.status == 200
    started = await client.post("/v1/groups/0/replicas", json={"remove": "w2"})
    assert started.status == 202, await started.text()


async def test_a_new_replica_goes_only_to_a_worker_the_meta_leader_has_heard(meta_and_worker: Any) -> None:
    """Registered is not enough: the add names what is missing, a first heartbeat or a recent one."""
    client, server, raft, calls, behaviour = meta_and_worker
    assert (await client.post("/v1/workers/register", json={"id": "w4", "addr": "127.0.0.1:9"})).status == 200
    unheard = await client.post("/v1/groups/0/replicas", json={"add": "w4"})
    err = (await unheard.json())["error"]
    assert unheard.status == 400 and "has not heard its heartbeat yet" in err["message"], err
    assert (await client.post("/v1/workers/w4/heartbeat", json={"groups": {}})).status == 200
    server.soft.workers["w4"].last_seen_ms -= 10 * server._lease_ms()  # heard, long ago
    stale = await client.post("/v1/groups/0/replicas", json={"add": "w4"})
    err = (await stale.json())["error"]
    assert stale.status == 400 and f"no heartbeat in the last {server._lease_ms()} ms" in err["message"], err
    assert not raft.sm.operators
    assert (await client.post("/v1/workers/w4/heartbeat", json={"groups": {}})).status == 200
    started = await client.post("/v1/groups/0/replicas", json={"add": "w4"})
    assert started.status == 202, await started.text()


async def test_a_replica_reported_corrupt_counts_as_failed(meta_and_worker: Any) -> None:
    """A worker that found a group corrupt at start-up reports {"state": "corrupt"}:
    it must not lead (it answers nothing for that group until restarted)."""
    client, server, raft, calls, behaviour = meta_and_worker
    hb = await client.post("/v1/workers/w1/heartbeat",
                           json={"groups": {"0": {"state": "corrupt", "error": "record 7: bad checksum"}}})
    assert hb.status == 200
    rep = server.soft.workers["w1"].groups[0]
    assert rep.failed == "corrupt: record 7: bad checksum" and unusable(rep)


async def test_a_snapshot_download_in_flight_is_read_from_the_report(meta_and_worker: Any) -> None:
    """What worker/group.py reports of a download reaches the controller's GroupReport."""
    client, server, raft, calls, behaviour = meta_and_worker
    hb = await client.post("/v1/workers/w2/heartbeat", json={"groups": {
        "0": {"term": 1, "role": "learner", "snapshot_bytes": 12_000_000, "snapshot_total": 40_000_000,
              "snapshot_waiting": False},
        "1": {"term": 1, "role": "learner", "snapshot_bytes": 0, "snapshot_total": 40_000_000,
              "snapshot_waiting": True},
        "2": {"term": 1, "role": "follower", "snapshot_bytes": None, "snapshot_total": None}}})
    assert hb.status == 200
    reps = server.soft.workers["w2"].groups
    assert (reps[0].snapshot_bytes, reps[0].snapshot_total, reps[0].snapshot_waiting) == (12_000_000, 40_000_000,
                                                                                          False)
    assert (reps[1].snapshot_bytes, reps[1].snapshot_waiting) == (0, True)
    assert (reps[2].snapshot_bytes, reps[2].snapshot_total, reps[2].snapshot_waiting) == (None, None, False)


async def test_worker_gone_is_refused_for_a_live_or_unknown_worker(api: TestClient) -> None:
    ok = await api.post("/v1/workers/register", json={"id": "w7", "addr": "127.0.0.1:9"})
    assert ok.status == 200
    r = await api.post("/v1/workers/nope/gone", headers=AUTH)
    assert r.status == 404 and "no worker 'nope'" in (await r.json())["error"]["message"]
    assert (await api.post("/v1/workers/register", json={"id": "w8", "addr": "127.0.0.1:10"})).status == 200
    assert (await api.post("/v1/workers/w8/heartbeat", json={"groups": {}})).status == 200
    r = await api.post("/v1/workers/w8/gone", headers=AUTH)
    assert r.status == 400 and "w8 is live" in (await r.json())["error"]["message"]
    assert (await api.post("/v1/workers/w7/gone")).status == 401  # the admin token
    r = await api.post("/v1/workers/w7/gone", headers=AUTH)
    assert r.status == 200 and await r.json() == {"worker": "w7", "state": "removed"}
    view = await (await api.get("/v1/cluster")).json()
    assert view["workers"]["w7"]["state"] == "removed"


async def test_a_settings_change_is_in_the_plan_never_no_changes(api: TestClient) -> None:
    assert (await put(api, EXAMPLE)).status == 200
    changed = EXAMPLE.replace("lease_ms: 1500", "lease_ms: 1400")
    body = await (await put(api, changed, dry_run="1")).json()
    assert body["changed"] and body["plan"] == [] and body["plan_text"] == "~ settings.lease_ms: 1500 -> 1400"


async def test_drain_and_undrain(api: TestClient) -> None:
    assert (await put(api, EXAMPLE)).status == 200
    assert (await api.post("/v1/workers/w9/drain", headers=AUTH)).status == 404
    assert (await api.post("/v1/workers/w3/drain")).status == 401
    r = await api.post("/v1/workers/w3/undrain", headers=AUTH)
    assert r.status == 400 and "not draining or drained" in (await r.json())["error"]["message"]
    assert await (await api.post("/v1/workers/w3/drain", headers=AUTH)).json() == \
        {"worker": "w3", "state": "draining", "changed": True}
    assert (await (await api.post("/v1/workers/w3/drain", headers=AUTH)).json())["changed"] is False
    view = await (await api.get("/v1/cluster")).json()
    assert view["workers"]["w3"]["state"] == "draining"
    assert await (await api.post("/v1/workers/w3/undrain", headers=AUTH)).json() == {"worker": "w3", "state": "active"}


async def test_the_controller_asks_the_worker_first_and_a_refusal_starts_nothing(meta_and_worker: Any) -> None:
    from meta.repair import CancelAssignment, StartOperator

    client, server, raft, calls, behaviour = meta_and_worker
    await client.post("/v1/workers/w2/heartbeat", json={"groups": {"0": {
        "term": 1, "last_term": 1, "last_seq": 10, "commit": 10, "applied": 10, "role": "follower",
        "disk_bytes": 12345}}})
    raft.sm.groups[0].voters = ["w2", "w3"]  # one short; w1 (the fake) is asked to take it
    behaviour["refuse"] = "insufficient_disk"
    await server._execute(StartOperator(0, "add", "w1", "fill it", by="fill"))
    assert 0 in server._busy_groups  # asked off the controller pass, the group held meanwhile
    await until(lambda: 0 not in server._busy_groups, "the assignment question to end")
    assert calls[-1] == {"assignment": {"group": 0, "bytes": 12345}}  # sized from the biggest voter's report
    assert not raft.sm.operators and server.soft.refused[(0, "w1")].reason == "insufficient_disk"
    assert 'shardgrid_meta_controller_decisions_total{kind="refused",reason="insufficient_disk"} 1.0' in \
        await (await client.get("/metrics")).text()
    behaviour["refuse"] = None
    await server._execute(StartOperator(0, "add", "w1", "fill it", by="fill"))
    await until(lambda: 0 not in server._busy_groups, "the assignment to start")
    op = raft.sm.operators[0]
    assert (op.kind, op.worker, op.by, op.step) == ("add", "w1", "fill", "add_learner")
    # Given up on: cancelled, and w1 refused for the group (reason "timeout").
    await server._execute(CancelAssignment(0, "w1", "too slow"))
    assert not raft.sm.operators and server.soft.refused[(0, "w1")].reason == "timeout"


async def test_the_same_pinned_file_again_steers_back_what_the_controller_moved(tmp_path: Path,
                                                                                aiohttp_client: Any) -> None:
    raft, server = _single_meta(tmp_path, MetaServerConfig())
    try:
        api = await aiohttp_client(server.app())
        await until(raft.is_leader, "the single meta node to lead")
        assert (await put(api, EXAMPLE)).status == 200
        # Repair's trace: group 1's target took w4 in w3's place; the add is still on its way.
        assert (await raft.submit({"op": "put_operator", "group": 1, "kind": "add", "worker": "w4",
                                   "step": "add_learner", "replaces": "w3"}, 5.0))["ok"]
        assert (await raft.submit({"op": "update_operator", "group": 1, "kind": "add", "worker": "w4",
                                   "step": "done", "done": True, "cancelled": False}, 5.0))["ok"]
        dry = await (await put(api, EXAMPLE, dry_run="1")).json()
        # The voters are still the file's: no move, but the plan says what changes.
        assert dry["changed"] and dry["plan"] == []
        assert dry["plan_text"] == "~ group 1: desired w1,w2,w4 -> w1,w2,w3 (the file's placement again)"
        applied = await (await put(api, EXAMPLE)).json()
        assert applied["changed"] and applied["topology_revision"] == 1
        assert raft.sm.groups[1].desired == ("w1", "w2", "w3")
        again = await (await put(api, EXAMPLE)).json()
        assert again["changed"] is False and again["plan_text"] == "no changes"
    finally:
        raft.close()



async def test_hot_relief_prefers_then_transfers_and_counts_the_decision(meta_and_worker: Any) -> None:
    """w1 leads groups 0 (hot: persist p99 5x its followers') and 1; after
    rebalance_window_ms the controller names w2 preferred leader of group 0, has
    w1 hand it over, and counts the decision on /metrics -- once."""
    client, server, raft, calls, behaviour = meta_and_worker
    fast = EXAMPLE.replace("fsync: batch}", "fsync: batch, rebalance_window_ms: 1000}")
    addr = raft.sm.workers["w1"].addr  # the fake w1's, which the apply below resets to the file's
    assert fast != EXAMPLE and (await put(client, fast)).status == 200
    assert (await raft.submit({"op": "register_worker", "id": "w1", "addr": addr}, 5.0))["ok"]
    assert (await raft.submit({"op": "set_leader", "group": 1, "leader": "w1", "expect_term": 1}, 5.0))["ok"]
    for gid, term, lead in ((1, 2, "w1"), (2, 1, "w3")):
        assert (await raft.submit({"op": "set_ready", "group": gid, "term": term, "leader": lead}, 5.0))["ok"]

    async def beat() -> None:
        while True:
            for wid in ("w1", "w2", "w3"):
                reps = {}
                for gid, g in raft.sm.groups.items():
                    lead = g.leader == wid
                    reps[str(gid)] = {"term": g.term, "last_term": g.term, "last_seq": 10, "commit": 10,
                                      "applied": 10, "role": "leader" if lead else "follower",
                                      "write_rate": {0: 100.0, 1: 60.0}.get(gid, 0.0) if lead else 0.0,
                                      "persist_p99_ms": 20.0 if lead and (gid, wid) == (0, "w1") else 4.0}
                await client.post(f"/v1/workers/{wid}/heartbeat", json={"groups": reps})
            await asyncio.sleep(0.2)

    beating = asyncio.create_task(beat())
    try:
        await until(lambda: raft.sm.groups[0].leader == "w2", "group 0's leadership to move to w2")
        assert raft.sm.groups[0].preferred_leader == "w2" and calls[-1] == {"to": "w2"}
        assert server._hot.held(0, _now_ms())
        await asyncio.sleep(1.5)  # more than a window: nothing moves back, group 1 stays
        assert (raft.sm.groups[0].leader, raft.sm.groups[1].leader) == ("w2", "w1") and len(calls) == 1
        metrics = await (await client.get("/metrics")).text()
        assert 'shardgrid_meta_controller_decisions_total{kind="hot_leader",reason="latency"} 1.0' in metrics
    finally:
        beating.cancel()


BAD_AUTH = [b"Authorization: Bearer \xff\xfe", b"Authorization: Bearer s3cret-admin\xff", b"Authorization: ",
            b"Authorization: s3cret-admin", b"Authorization: Bearer  s3cret-admin", b"Authorization: Basic eDp5",
            b"Authorization: Bearer \xc3\xa9"]


@pytest.mark.parametrize("header", BAD_AUTH)
async def test_a_malformed_authorization_header_is_401_never_500(api: TestClient, header: bytes) -> None:
    from tests.support.rawhttp import raw_status

    status, body = await raw_status(api.host, api.port, "PUT", "/v1/topology", [header], EXAMPLE.encode())
    assert status == 401 and b'"unauthorized"' in body
    assert (await api.get("/v1/topology")).status == 404
    status, _ = await raw_status(api.host, api.port, "POST", "/v1/workers/w1/gone", [header])
    assert status == 401


async def _addr(client: TestClient, wid: str) -> str:
    view = await (await client.get("/v1/cluster")).json()
    return str(view["workers"][wid]["addr"])


async def _register(client: TestClient, wid: str, addr: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/v1/workers/register", json={"id": wid, "addr": addr}, **kw)
    return resp.status, await resp.json()


async def test_re_pointing_a_registered_worker_needs_the_admin_token(api: TestClient) -> None:
    assert (await _register(api, "w7", "127.0.0.1:9"))[0] == 200
    # A restart at the same address (new capacity, say) re-registers freely.
    status, body = await _register(api, "w7", "127.0.0.1:9")
    assert status == 200 and body["changed"] is False
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer"}):
        status, body = await _register(api, "w7", "127.0.0.1:99", headers=headers)
        assert status == 401 and body["error"]["code"] == "unauthorized", (headers, body)
        assert "registered at 127.0.0.1:9" in body["error"]["message"]
        assert body["error"]["registered_addr"] == "127.0.0.1:9"
    assert await _addr(api, "w7") == "127.0.0.1:9"
    status, _ = await _register(api, "w7", "127.0.0.1:99", headers=AUTH)
    assert status == 200 and await _addr(api, "w7") == "127.0.0.1:99"
    # A live worker is not moved, token or not: two processes claim one id.
    assert (await api.post("/v1/workers/w7/heartbeat", json={"groups": {}})).status == 200
    status, body = await _register(api, "w7", "127.0.0.1:100", headers=AUTH)
    assert status == 409 and body["error"]["code"] == "conflict" and "w7 is live" in body["error"]["message"]
    assert await _addr(api, "w7") == "127.0.0.1:99"
    # ... while the live one itself re-registers at its own address freely.
    assert (await _register(api, "w7", "127.0.0.1:99"))[0] == 200


async def test_a_topology_declared_address_is_known_too(api: TestClient) -> None:
    assert (await put(api, EXAMPLE)).status == 200
    assert await _addr(api, "w1") == "127.0.0.1:7201"
    status, body = await _register(api, "w1", "10.9.9.9:7201")
    assert status == 401 and await _addr(api, "w1") == "127.0.0.1:7201"
    assert (await _register(api, "w1", "127.0.0.1:7201"))[0] == 200
    assert (await _register(api, "w9", "10.9.9.9:7209"))[0] == 200  # a new id needs nothing


async def test_without_an_admin_token_a_silent_worker_may_move_a_live_one_may_not(
        tmp_path: Path, aiohttp_client: Any) -> None:
    import structlog.testing

    raft, server = _single_meta(tmp_path, MetaServerConfig())
    try:
        client = await aiohttp_client(server.app())
        await until(raft.is_leader, "the single meta node to lead")
        assert (await _register(client, "w7", "127.0.0.1:9"))[0] == 200
        with structlog.testing.capture_logs() as logs:
            assert (await _register(client, "w7", "127.0.0.1:99"))[0] == 200
        assert await _addr(client, "w7") == "127.0.0.1:99"
        moved = [e for e in logs if e["event"] == "worker_repointed"]
        assert moved and moved[0]["log_level"] == "warning" and moved[0]["authenticated"] is False
        assert (moved[0]["old_addr"], moved[0]["new_addr"]) == ("127.0.0.1:9", "127.0.0.1:99")
        assert (await client.post("/v1/workers/w7/heartbeat", json={"groups": {}})).status == 200
        status, body = await _register(client, "w7", "127.0.0.1:100")
        assert status == 409 and "another process claims its id from 127.0.0.1:100" in body["error"]["message"]
        assert await _addr(client, "w7") == "127.0.0.1:99"
    finally:
        raft.close()


# -- found by tests/tier1/test_fuzz_meta.py -----------------------------------------------------------

async def _leading(api: TestClient) -> None:
    """Heartbeats go to the leader once its controller loop has started (its soft state exists)."""
    server = api.server.app[SERVER_KEY]
    await until(lambda: server.soft is not None, "the controller to start on the leader")


async def test_a_heartbeat_nested_past_what_orjson_writes_is_400_and_cluster_keeps_serving(api: TestClient) -> None:
    # Meta kept the raw report and served it in /v1/cluster: every read of it became a 500.
    await _leading(api)
    deep = b"[" * 300 + b"]" * 300
    hb = await api.post("/v1/workers/w7/heartbeat", data=b'{"groups": {}, "extra": ' + deep + b"}")
    assert hb.status == 400 and (await hb.json())["error"]["code"] == "bad_request"
    assert (await api.get("/v1/cluster")).status == 200
    # Nesting orjson still writes is a heartbeat like any other.
    ok = b"[" * 200 + b"]" * 200
    assert (await api.post("/v1/workers/w7/heartbeat", data=b'{"groups": {}, "extra": ' + ok + b"}")).status == 200
    assert (await api.get("/v1/cluster")).status == 200


WRONG_TYPES: list[dict[str, Any]] = [
    {"persist_p99_ms": []}, {"persist_ema_ms": "0.5"}, {"write_rate": {}}, {"term": "12"}, {"term": 1.5},
    {"term": True}, {"last_seq": -1}, {"commit": None}, {"disk_bytes": "100"}, {"resyncing": "no"},
    {"snapshot_waiting": 1}, {"role": ["leader"]}, {"voters": "w1"}, {"unheard": [1]}, {"failed": ["disk"]},
    {"leader_silence_ms": 2.5}]


async def test_a_heartbeat_field_of_the_wrong_type_is_400_not_coerced(api: TestClient) -> None:
    # int("12"), float([] or 0), bool("no"): each was read as a number or a flag.
    # (One meta node for every case: starting one per case costs a second each.)
    await _leading(api)
    for bad in WRONG_TYPES:
        hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {"0": {"term": 1, **bad}}})
        assert hb.status == 400, (bad, await hb.text())
    for key in ["١", "１", " 0", "+0", "0_0"]:
        hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {key: {"term": 1}}})
        assert hb.status == 400, (key, await hb.text())
    view = await (await api.get("/v1/cluster")).json()
    assert "w7" not in view["workers"]


async def test_a_group_id_int_reads_but_no_client_writes_is_400_and_changes_nothing(api: TestClient) -> None:
    # int() reads other scripts' digits ("١", "１" are 1), blanks, "+" and "_":
    # POST /v1/groups/１/leader moved group 1's leadership.
    await _leading(api)
    await put(api, EXAMPLE)
    before = (await (await api.get("/v1/cluster")).json())["groups"]
    for gid in ["%D9%A1", "%EF%BC%91", "%201", "+1", "1_0", "1%C2%A0"]:
        for route, body in [("leader", {"leader": "w2", "expect_term": 1}), ("ready", {"term": 1, "leader": "w2"}),
                            ("transfer", {"to": "w2"}), ("replicas", {"add": "w4"})]:
            resp = await api.post(f"/v1/groups/{gid}/{route}", json=body, headers=AUTH)
            assert resp.status == 400, (gid, route, await resp.text())
        assert (await api.delete(f"/v1/groups/{gid}/operator", headers=AUTH)).status == 400
    assert (await (await api.get("/v1/cluster")).json())["groups"] == before
    resp = await put(api, EXAMPLE.replace("lease_ms: 1500", "lease_ms: 1600"), expect_revision="１")
    assert resp.status == 400
