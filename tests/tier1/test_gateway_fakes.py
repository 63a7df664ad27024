"""Fake meta and fake workers (small aiohttp apps) for the gateway's in-process tests.

Not a test module itself: the gateway tests import these. The fake worker
speaks the worker's wire protocol (msgpack bodies, x-* headers, the one error
shape) over a tiny in-memory state, and records every call it receives; a
test scripts it by setting `on` (return None to fall back to the default).
The fake meta serves `/v1/cluster` with long-polling and records the verbs.
"""
from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import orjson
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.routes import Gateway, GatewayConfig
from shardgrid.common.wire import STATUS_FOR_CODE, error_body, pack_frames, packb, unpack_frame, unpackb

MSGPACK = "application/msgpack"


@dataclass
class Call:
    kind: str  # write | write_batch | read
    gid: int
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)


Answer = tuple[int, Any]


def err(code: str, gid: int, leader: str | None = None, term: int | None = None, message: str = "") -> Answer:
    return STATUS_FOR_CODE[code], error_body(code, message or code, shard=gid, term=term, leader=leader)


class FakeWorker:
    def __init__(self, wid: str) -> None:
        self.wid = wid
        self.term = 1
        self.calls: list[Call] = []
        self.on: Callable[[Call], Awaitable[Answer | None]] | None = None
        self.items: dict[tuple[int, str], Any] = {}
        self.signals: dict[tuple[int, str], dict[str, Any]] = {}
        self.embeddings: dict[tuple[int, str], list[float]] = {}
        self.search_hits: dict[int, list[dict[str, Any]]] = {}
        self.seq = 0
        self.handshake_delay_s = 0.0  # before accepting a call stream (a slow or busy worker)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/groups/{gid}/write", self._handle("write"))
        app.router.add_post("/v1/groups/{gid}/write_batch", self._handle("write_batch"))
        app.router.add_post("/v1/groups/{gid}/read", self._handle("read"))
        app.router.add_get("/v1/calls", self._calls)
        return app

    async def _answer(self, call: Call) -> Answer:
        self.calls.append(call)
        answer = await self.on(call) if self.on is not None else None
        return answer if answer is not None else self.default(call)

    async def _calls(self, request: web.Request) -> web.WebSocketResponse:
        """The call stream the gateway uses: frames of `[id, op, gid, body]` in, of `[id, status, body]` out."""
        ws = web.WebSocketResponse()
        if self.handshake_delay_s:
            await asyncio.sleep(self.handshake_delay_s)
        await ws.prepare(request)
        tasks: set[asyncio.Task[None]] = set()

        async def one(cid: int, kind: str, gid: int, body: Any) -> None:
            status, answer = await self._answer(Call(kind, gid, body))
            if not ws.closed:
                for frame in pack_frames([[cid, status, answer]]):
                    await ws.send_bytes(frame)

        try:
            async for frame in ws:
                for cid, kind, gid, body in unpack_frame(frame.data):
                    task = asyncio.create_task(one(cid, kind, gid, body))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
        return ws

    def _handle(self, kind: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            assert request.content_type == MSGPACK
            gid = int(request.match_info["gid"])
            status, body = await self._answer(Call(kind, gid, unpackb(await request.read())))
            return web.Response(body=packb(body), status=status, content_type=MSGPACK,
                                headers={"x-shard": str(gid), "x-term": str(self.term), "x-seq": str(self.seq),
                                         "x-served-by": self.wid})
        return handler

    # -- default behaviour: a tiny entities state machine

    def default(self, call: Call) -> Answer:
        if call.kind == "write":
            ok, result = self.apply(call.gid, call.body["op"])
            return (200, {"seq": self.seq, "term": self.term, "result": result}) if ok else result
        if call.kind == "write_batch":
            results = []
            for w in call.body["writes"]:
                ok, result = self.apply(call.gid, w["op"])
                results.append({"seq": self.seq, "term": self.term, "result": result} if ok else result[1])
            return 200, {"results": results}
        return self.query(call.gid, call.body["query"])

    def apply(self, gid: int, op: dict[str, Any]) -> tuple[bool, Any]:
        self.seq += 1
        kind, key = op["kind"], (gid, str(op.get("id") or op.get("entity")))
        if kind == "put_item":
            created = key not in self.items
            self.items[key] = op["doc"]
            return True, {"id": op["id"], "created": created}
        if kind == "put_items":  # docs come as their JSON encoding
            created = []
            for id, doc in zip(op["ids"], op["docs"]):
                created.append((gid, id) not in self.items)
                self.items[(gid, id)] = orjson.loads(doc)
            return True, {"created": created}
        if kind == "delete_item":
            return True, {"id": op["id"], "deleted": self.items.pop(key, None) is not None}
        if kind == "put_embedding":
            created = key not in self.embeddings
            self.embeddings[key] = op["vector"]
            return True, {"id": op["id"], "created": created}
        if kind == "delete_embedding":
            return True, {"id": op["id"], "deleted": self.embeddings.pop(key, None) is not None}
        if kind == "signal":
            sig = self.signals.setdefault(key, {"counters": {}, "last": {}})
            if op["mode"] == "set":
                sig["last"][op["name"]] = op["value"]
                return True, op["value"]
            sig["counters"][op["name"]] = sig["counters"].get(op["name"], 0) + op["value"]
            return True, sig["counters"][op["name"]]
        return False, err("bad_request", gid, message=f"unknown op {kind}")

    def query(self, gid: int, q: dict[str, Any]) -> Answer:
        kind = q["kind"]
        if kind == "search":
            return 200, {"seq": self.seq, "term": self.term, "result": self.search_hits.get(gid, [])[: q["k"]]}
        store = {"get_item": self.items, "get_signals": self.signals, "get_embedding": self.embeddings}[kind]
        key = (gid, str(q.get("id") or q.get("entity")))
        if key not in store:
            return err("not_found", gid, message=f"no {key[1]!r}")
        return 200, {"seq": self.seq, "term": self.term, "result": store[key]}


def make_view(revision: int, shards: int, workers: dict[str, str], groups: dict[int, dict[str, Any]],
              deadline_ms: int = 2000, dim: int = 4) -> dict[str, Any]:
    return {
        "revision": revision,
        "topology_revision": 1,
        "topology": {"cluster": "test", "shards": shards, "plugin": "entities",
                     "settings": {"ack": "quorum", "deadline_ms": deadline_ms, "embedding_dim": dim,
                                  "quorum_timeout_ms": 2000, "lease_ms": 1500},
                     # A model whose one group the fakes do not host: requests that pass
                     # validation would fail at the workers, hostile ones never get there.
                     "models": [{"name": "m", "layers": 4, "d_model": dim, "d_hidden": 8, "seed": 1,
                                 "replication_factor": 1,
                                 "groups": [{"id": shards, "first": 0, "last": 3, "pinned": False}]}]},
        "workers": {wid: {"id": wid, "addr": addr, "zone": "z", "state": "active"} for wid, addr in workers.items()},
        "groups": {str(gid): {"id": gid, "conf_ver": 1, "learners": [], "preferred_leader": g.get("leader"),
                              "ready_term": g.get("term", 1), **g}
                   for gid, g in groups.items()},
        "meta": [{"id": "m1", "raft": "127.0.0.1:1", "http": "127.0.0.1:1"}],
        "meta_leader": "m1",
        "served_by": "m1",
    }


class FakeMeta:
    def __init__(self, view: dict[str, Any]) -> None:
        self.view = view
        self.verbs: list[tuple[str, str, bytes, str | None]] = []  # method, path, body, Authorization
        self.verb_answer: tuple[int, Any] = (501, error_body("not_implemented", "not yet"))
        self.cluster_gets = 0
        self._changed: asyncio.Future[None] | None = None

    def publish(self, mutate: Callable[[dict[str, Any]], None]) -> None:
        """Change the view (a new revision) and wake the long-polls."""
        mutate(self.view)
        self.view["revision"] += 1
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    def set_leader(self, gid: int, leader: str | None, term: int) -> None:
        def mutate(v: dict[str, Any]) -> None:
            g = v["groups"][str(gid)]
            g.update(leader=leader, term=term, ready=leader is not None, ready_term=term)
        self.publish(mutate)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/cluster", self.cluster)
        app.router.add_post("/v1/groups/{gid}/transfer", self.verb)
        app.router.add_post("/v1/groups/{gid}/replicas", self.verb)
        return app

    async def cluster(self, request: web.Request) -> web.Response:
        self.cluster_gets += 1
        wait = request.query.get("wait")
        if wait is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + float(request.query.get("timeout", "30"))
            while self.view["revision"] <= int(wait) and loop.time() < deadline:
                if self._changed is None:
                    self._changed = loop.create_future()
                await asyncio.wait((self._changed,), timeout=deadline - loop.time())
        return web.Response(body=orjson.dumps(self.view), content_type="application/json")

    async def verb(self, request: web.Request) -> web.Response:
        self.verbs.append((request.method, request.path, await request.read(), request.headers.get("Authorization")))
        status, body = self.verb_answer
        return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def dead_addr() -> str:
    """A loopback address nothing listens on (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


@dataclass
class Fakes:
    meta: FakeMeta
    meta_addr: str
    workers: dict[str, FakeWorker]
    addrs: dict[str, str]

    def calls(self) -> list[tuple[str, Call]]:
        return [(wid, c) for wid, w in self.workers.items() for c in w.calls]


async def make_fakes(aiohttp_server: Any, shards: int = 3, wids: tuple[str, ...] = ("w1", "w2", "w3"),
                     deadline_ms: int = 2000, dim: int = 4, extra_addrs: dict[str, str] | None = None) -> Fakes:
    """Workers w1..wn, group g led by wids[g % n] with every worker a voter."""
    workers: dict[str, FakeWorker] = {}
    addrs: dict[str, str] = {}
    for wid in wids:
        workers[wid] = FakeWorker(wid)
        server = await aiohttp_server(workers[wid].app())
        addrs[wid] = f"127.0.0.1:{server.port}"
    addrs.update(extra_addrs or {})
    groups = {g: {"leader": wids[g % len(wids)], "term": 1, "voters": list(wids), "ready": True}
              for g in range(shards)}
    meta = FakeMeta(make_view(1, shards, addrs, groups, deadline_ms, dim))
    meta_server = await aiohttp_server(meta.app())
    return Fakes(meta, f"127.0.0.1:{meta_server.port}", workers, addrs)


class RecordingLog:
    """A structlog-shaped logger that keeps (level, event, fields) in memory."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        def record(event: str, **fields: Any) -> None:
            self.lines.append((level, event, fields))
        return record


async def start_gateway(aiohttp_client: Any, meta_addrs: list[str], log: Any = None,
                        **cfg: Any) -> tuple[TestClient[Any, Any], Gateway]:
    cfg.setdefault("access_log", False)
    gw = Gateway(GatewayConfig(meta=tuple(meta_addrs), **cfg), log if log is not None else structlog.get_logger())
    client: TestClient[Any, Any] = await aiohttp_client(gw.app())
    for _ in range(200):
        if gw.rt.cache.table is not None:
            break
        await asyncio.sleep(0.01)
    assert gw.rt.cache.table is not None, "the gateway never got a routing table"
    return client, gw


__all__ = ["Call", "FakeMeta", "FakeWorker", "Fakes", "RecordingLog", "TestServer", "dead_addr", "err", "make_fakes", "make_view",
           "start_gateway"]
