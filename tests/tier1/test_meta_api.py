"""The meta HTTP API in-process, over a single-node PySyncObj group."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import structlog
from aiohttp.test_utils import TestClient

from meta.raft import MetaRaft, RaftPeer
from meta.server import MetaServer, MetaServerConfig
from tests.support.cluster import free_ports

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "topology.yaml").read_text()
TOKEN = "s3cret-admin"


@pytest.fixture
async def api(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[TestClient]:
    (raft_port,) = free_ports(1)
    me = RaftPeer("m1", f"127.0.0.1:{raft_port}", "127.0.0.1:0")
    raft = MetaRaft(me, [], tmp_path / "m1", "pw", asyncio.get_running_loop())
    server = MetaServer(raft, MetaServerConfig(admin_token=TOKEN), structlog.get_logger())
    try:
        client = await aiohttp_client(server.app())
        for _ in range(200):
            if raft.is_leader():
                break
            await asyncio.sleep(0.05)
        assert raft.is_leader()
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


async def test_register_and_heartbeat_validation(api: TestClient) -> None:
    assert (await api.post("/v1/workers/register", data=b"{nope")).status == 400
    assert (await api.post("/v1/workers/register", json={"id": 5})).status == 400
    ok = await api.post("/v1/workers/register", json={"id": "w7", "addr": "127.0.0.1:9", "zone": "z"})
    assert ok.status == 200
    view = await (await api.get("/v1/cluster")).json()
    assert view["workers"]["w7"]["state"] == "available"
    hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {"0": {"last_term": "x"}}})
    assert hb.status == 400
    hb = await api.post("/v1/workers/w7/heartbeat", json={"groups": {"0": {"term": 1, "last_term": 1, "last_seq": 4}}})
    assert hb.status == 200
    view = await (await api.get("/v1/cluster")).json()
    assert view["workers"]["w7"]["live"] is True


async def test_unknown_route_and_health_and_metrics(api: TestClient) -> None:
    missing = await api.get("/v1/nope")
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "not_found"
    health = await (await api.get("/healthz")).json()
    assert health["is_leader"] is True and health["leader"] == "m1"
    metrics = await (await api.get("/metrics")).text()
    assert "shardgrid_meta_is_leader 1.0" in metrics and "shardgrid_http_requests_total" in metrics
