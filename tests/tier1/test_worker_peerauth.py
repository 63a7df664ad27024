"""Every worker route that changes or reveals a group needs a cluster member's
session, of the right role; a replication message speaks only for its sender."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest
import structlog
from aiohttp.test_utils import TestServer

from shardgrid.common.peerauth import AUTH_HEADER, ClusterKeys, Principal
from shardgrid.common.peerauth_http import PeerSigner
from shardgrid.common.wire import packb
from worker import replica_msgs as m
from worker.codec import encode_message
from worker.process import WorkerConfig, WorkerNode
from worker.server import WorkerApi
from shardgrid.common.protocol import CALLS_PATH, STREAM_PATH
from tests.support.waiting import until

KEYS = ClusterKeys(["cluster-s3cret"])
W2, GW, META = Principal("worker", "w2"), Principal("gateway", "g1"), Principal("meta", "m1")


@dataclass
class _Shell:
    gid: int = 0
    delivered: list[Any] = field(default_factory=list)
    queued: list[Any] = field(default_factory=list)

    def deliver(self, msg: Any) -> None:
        self.delivered.append(msg)

    async def write(self, op: Any, ack: str, rid: str | None, timeout_s: float) -> Any:
        self.queued.append(op)
        raise AssertionError("an unauthenticated write reached the group")


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[tuple[TestServer, _Shell, WorkerNode]]:
    node = WorkerNode(WorkerConfig("w1", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path / "w1",
                                   cluster_keys=KEYS), structlog.get_logger())
    shell = _Shell()
    node.groups[0] = shell  # type: ignore[assignment]
    srv = TestServer(WorkerApi(node).app())
    await srv.start_server()
    try:
        yield srv, shell, node
    finally:
        await srv.close()
        await node.meta.close()
        await node.transport.close()


# (method, path, the roles that may call it)
ROUTES = [("POST", "/v1/raft", {"worker"}), ("GET", STREAM_PATH, {"worker"}), ("GET", CALLS_PATH, None),
          ("POST", "/v1/groups/0/write", None), ("POST", "/v1/groups/0/write_batch", None),
          ("POST", "/v1/groups/0/read", None), ("POST", "/v1/groups/0/transfer", {"meta"}),
          ("POST", "/v1/groups/0/members", {"meta"}), ("POST", "/v1/assignments", {"meta"}),
          ("GET", "/v1/groups/0/snapshot", {"worker"}), ("GET", "/v1/groups/0/snapshot/5", {"worker"})]


def _hb(src: str, term: int = 99) -> bytes:
    return packb([encode_message(m.Heartbeat(group=0, src=src, dst="w1", term=term, commit=1, round=0))])


@pytest.mark.parametrize("method,path,roles", ROUTES, ids=[r[1] for r in ROUTES])
async def test_every_member_route_refuses_strangers_and_wrong_roles(worker: Any, method: str, path: str,
                                                                   roles: set[str] | None) -> None:
    srv, shell, _ = worker
    async with aiohttp.ClientSession() as outsider:
        for headers in ({}, {AUTH_HEADER: "0" * 32 + ".1." + "0" * 32}, {AUTH_HEADER: "garbage"}):
            async with outsider.request(method, srv.make_url(path), data=_hb("w2"), headers=headers) as r:
                body = await r.json()
                assert r.status == 401, (path, headers, body)
                assert body["error"]["reason"] in ("missing", "session_unknown", "malformed")
    for who in (W2, GW, META):
        async with aiohttp.ClientSession(middlewares=(PeerSigner(KEYS, who),)) as s:
            async with s.request(method, srv.make_url(path), data=b"") as r:
                allowed = roles is None or who.role in roles
                assert (r.status != 403) == allowed and r.status != 401, (path, who, r.status, await r.text())
    assert shell.delivered == [] and shell.queued == []


async def test_open_routes_stay_open(worker: Any) -> None:
    srv, _, node = worker
    node.groups.clear()  # the fake group has no gauges for /metrics
    async with aiohttp.ClientSession() as s:
        for path in ("/healthz", "/metrics", "/v1/status"):
            async with s.get(srv.make_url(path)) as r:
                assert r.status == 200, path


async def test_a_replication_message_speaks_only_for_its_sender(worker: Any) -> None:
    srv, shell, node = worker
    async with aiohttp.ClientSession(middlewares=(PeerSigner(KEYS, W2),)) as s:
        async with s.post(srv.make_url("/v1/raft"), data=_hb("w3")) as r:  # w2 posing as w3
            assert r.status == 403 and (await r.json())["error"]["reason"] == "wrong_sender"
        assert shell.delivered == []
        async with s.post(srv.make_url("/v1/raft"), data=_hb("w2")) as r:
            assert r.status == 204
        assert [msg.src for msg in shell.delivered] == ["w2"]
        async with s.ws_connect(srv.make_url(STREAM_PATH)) as sock:
            from shardgrid.common.wire import pack_frames
            for frame in pack_frames([encode_message(m.Heartbeat(group=0, src="w3", dst="w1", term=1, commit=1, round=0)),
                                      encode_message(m.Heartbeat(group=0, src="w2", dst="w1", term=1, commit=2, round=0))]):
                await sock.send_bytes(frame)
            await sock.close()
    await until(lambda: len(shell.delivered) == 2, "the stream's good message")
    assert [msg.src for msg in shell.delivered] == ["w2", "w2"]
    assert node.metrics.registry.get_sample_value("shardgrid_peer_auth_refused_total",
                                                  {"reason": "wrong_sender"}) == 2.0


async def test_a_revoked_peer_is_refused_from_the_view_that_says_so(worker: Any) -> None:
    srv, shell, node = worker
    node.view = {"workers": {"w2": {"addr": "127.0.0.1:3", "admission": "admitted"}}, "groups": {}}
    async with aiohttp.ClientSession(middlewares=(PeerSigner(KEYS, W2),)) as s:
        async with s.post(srv.make_url("/v1/raft"), data=_hb("w2")) as r:
            assert r.status == 204
        sock = await s.ws_connect(srv.make_url(STREAM_PATH))  # opened before the revoke
        node.view["workers"]["w2"]["admission"] = "revoked"
        async with s.post(srv.make_url("/v1/raft"), data=_hb("w2")) as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "revoked"
        from shardgrid.common.wire import pack_frames
        for frame in pack_frames([encode_message(m.Heartbeat(group=0, src="w2", dst="w1", term=1, commit=1,
                                                             round=0))]):
            await sock.send_bytes(frame)
        closed = await sock.receive()  # the worker ends the stream instead of delivering
        assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        await sock.close()
    assert len(shell.delivered) == 1
