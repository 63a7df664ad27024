"""The gateway's public API: validation, handlers, operator verbs.

Everything a request carries is validated here, before anything is sent to a
worker: a malformed request gets 400 `bad_request` and changes nothing; a
`/batch` with one bad write is rejected whole, naming the index of the bad
write. Limits: body <= `max_body_bytes` (413 `payload_too_large`), ids
non-empty and <= 256 UTF-8 bytes, vectors of exactly the topology's
`embedding_dim` finite float32-range numbers (not all zero: search is
cosine), batches of 1..1000 writes, `k` in 1..1000.

Request headers: `x-ack` (leader|quorum|all; default the topology's ack),
`x-consistency` (strong|follower; reads and search), `x-min-seq` (follower
point reads wait until the replica applied it; ignored by search, whose
shards have unrelated seqs), `x-deadline-ms` (1..300000; default the
topology's `settings.deadline_ms`), `x-request-id` (1..100 visible ASCII
characters, no `#`; a uuid4 hex is generated when absent). Every header is
validated on every data request, used or not. The request id is the write's
dedup id at the workers: a retry with the same id applies once, so a client
must never reuse one for a different write. `/batch` write i uses
`<request id>#<i>`, except that a shard's puts go together as one write,
`<request id>#s<shard>` (gateway/batching.py).

Response headers: `x-request-id` on data requests once their headers are
valid (`_begin`; not on a 400 for a header, nor on a 408/413 for the body,
which `body_deadline` answers first); `x-shard`, `x-term`, `x-seq`,
`x-served-by` on single-entity requests (from the worker that answered);
`retry-after` on 503.

Answers: `PUT /items/{id}` -> `{"id", "created", "seq"}`; `DELETE` ->
`{"id", "deleted": true, "seq"}` or 404 when there was nothing to delete
(`deleted` is null when the worker answered a retried write from its dedup
table and the original result is gone); `GET` -> the doc. `POST /signals` ->
`{"entity", "kind", "mode", "value": the counter's new total or the set value,
"seq"}`; `GET /signals/{entity}` -> `{"entity", "counters", "last"}`.
Embeddings mirror items (`GET` -> `{"id", "vector"}`). `POST /search` ->
`{"results": [{"id", "score"}], "degraded", "unavailable_shards"}` (503 when
no shard answered). `POST /batch` -> `{"results": [...]}` in request order,
each `{"shard", "seq", "term", "served_by", "result"}` or an error body.

`GET /openapi.json` serves this API as an OpenAPI document (gateway/openapi.py,
rendered as runbook/api.md); a route added here must be documented there, or
tests/tier1/test_openapi.py fails.

Operator endpoints under `/cluster/` need the admin token when the gateway
has one (`--admin-token-file`); the POST verbs also forward the client's
bearer token to meta, which decides, and their status and body come back
as meta sent them.
"""
from __future__ import annotations

import asyncio
import math
import re
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import orjson
from aiohttp import web

from gateway.batching import ShardWrites, shard_writes, spread_results
from gateway.calls import WorkerCalls
from gateway.forward import Forwarder, GatewayMetrics, RouteCache, Trace, WorkerReply
from gateway.limits import (ACKS, CONSISTENCIES, MAX_BATCH, MAX_BODY_BYTES, MAX_DEADLINE_MS, MAX_DOC_BYTES,
                            MAX_DOC_DEPTH, MAX_ID_BYTES, MAX_K, MAX_REQUEST_ID, OPERATOR_DEADLINE_MS, SIGNAL_MODES)
from gateway.models import MAX_WEIGHTS_BYTES, ModelApi
from gateway.openapi import document_bytes
from gateway.router import DEFAULT_DEADLINE_MS, RESPONSE_MARGIN_S, RETRY_AFTER_S, RoutingTable, merge_top_k
from gateway.admission import AdmissionState, keep_admitted
from meta.client import MetaClient, MetaUnreachable
from shardgrid.common.auth import bearer_token, check_bearer
from shardgrid.common.identity import SoftwareIdentity, package_version
from shardgrid.common.peerauth import ClusterKeys, Principal
from shardgrid.common.peerauth_http import PeerSigner
from shardgrid.common.ids import id_problem
from shardgrid.common.httpmetrics import route_of
from shardgrid.common.serving import body_deadline
from shardgrid.common.tls import NO_TLS, Tls, connector_ssl
from shardgrid.common.wire import LOGGER_KEY, ApiError, error_body, error_for, json_response, short_repr
from topology.routing import shard_function

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_RID = re.compile(rf"[\x21-\x22\x24-\x7e]{{1,{MAX_REQUEST_ID}}}")  # visible ASCII except '#', which batch rids use
_DIGITS = re.compile(r"[0-9]{1,19}")

TRACE_KEY: web.RequestKey[Trace] = web.RequestKey("gateway_trace", Trace)
# Paths a gateway meta refused still serves: they say why, and touch no data.
_SERVED_WHEN_REFUSED = ("/healthz", "/metrics", "/openapi.json")


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = "127.0.0.1:8080"
    meta: tuple[str, ...] = ()
    admin_token: str | None = field(default=None, repr=False)  # never in a log line or traceback
    access_log: bool = False  # one info line per request: an operator opt-in (CPU on every request)
    max_body_bytes: int = MAX_BODY_BYTES
    pool_size: int = 4096  # connections to workers and meta, all hosts together
    watch_timeout_s: float = 25.0
    # Its name in the cluster (principal gateway:ID; default: its listen address).
    id: str = ""
    # The cluster secret(s) (None: intra-cluster calls are not signed, tests only).
    cluster_keys: ClusterKeys | None = field(default=None, repr=False)
    identity: SoftwareIdentity = SoftwareIdentity("", "")
    tls: Tls = field(default=NO_TLS)  # server: the listener; client: calls to workers and meta


# -- validation ---------------------------------------------------------------------------


def _bad(message: str) -> ApiError:
    return ApiError("bad_request", message)


def _tname(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                         int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    return short_repr(value)


def check_id(value: Any, where: str) -> str:
    problem = id_problem(value, where, MAX_ID_BYTES, _tname)
    if problem is not None:
        raise _bad(problem)
    return str(value)


def check_number(value: Any, where: str) -> int | float:
    # bool is an int in Python (and true/false are not numbers in JSON).
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{where} must be a number, got {_tname(value)}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise _bad(f"{where} = {_short(value)} is outside the int64 range")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(f"{where} must be finite")
    return value


def check_vector(value: Any, where: str, dim: int) -> list[int | float]:
    if not isinstance(value, list):
        raise _bad(f"{where} must be an array of {dim} numbers, got {_tname(value)}")
    if len(value) != dim:
        raise _bad(f"{where} has {len(value)} values; the cluster's embedding_dim is {dim}")
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise _bad(f"{where}[{i}] must be a number, got {_tname(x)}")
    fmt = f"<{dim}f"
    try:
        # The workers store float32: what does not fit is refused here, not there.
        packed = struct.pack(fmt, *value)
    except (OverflowError, struct.error):
        raise _bad(f"{where} has a value outside the float32 range") from None
    if not any(struct.unpack(fmt, packed)):
        raise _bad(f"{where} is all zeros (in float32); cosine similarity needs a non-zero vector")
    return value


def check_k(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"k must be an integer, got {_tname(value)}")
    if not 1 <= value <= MAX_K:
        raise _bad(f"k must be between 1 and {MAX_K}, got {_short(value)}")
    return value


def check_keys(obj: Any, required: tuple[str, ...], optional: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _bad(f"{where} must be a JSON object, got {_tname(obj)}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise _bad(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    extra = [k for k in obj if k not in required and k not in optional]
    if extra:
        raise _bad(f"{where}: unexpected key(s) {', '.join(_short(k) for k in extra)}; "
                   f"allowed: {', '.join((*required, *optional))}")
    return obj


def check_doc(doc: Any, raw_len: int | None = None) -> None:
    # Encoding costs time; a doc whose request body is small cannot be over the limit
    # (compact orjson output is at most ~2x its JSON input, e.g. `1e2` -> `100.0`).
    # raw_len None: encode and measure (see doc_hint for when a body must be).
    if raw_len is not None and raw_len * 2 < MAX_DOC_BYTES:
        return
    try:
        size = len(orjson.dumps(doc))
    except orjson.JSONEncodeError:
        # orjson reads JSON nested up to 1024 levels but writes at most
        # MAX_DOC_DEPTH: such a doc could be stored and never served again.
        raise _bad(f"the document is nested deeper than {MAX_DOC_DEPTH} levels") from None
    if size > MAX_DOC_BYTES:
        raise _bad(f"the document is {size} bytes of JSON; the limit is {MAX_DOC_BYTES}")


def doc_hint(raw: bytes) -> int | None:
    """The `raw_len` for `check_doc` of a doc read from `raw`: its length, or
    None when the body has brackets enough to nest past MAX_DOC_DEPTH (then
    only encoding the doc can tell). Counting is a C loop over the bytes,
    far cheaper than an encode."""
    if raw.count(b"[") + raw.count(b"{") > MAX_DOC_DEPTH:
        return None
    return len(raw)


def parse_json(raw: bytes) -> Any:
    if not raw:
        raise _bad("the body is empty; a JSON value is expected")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"malformed JSON: {exc}") from None


def signal_op(body: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """(entity, op) of a signal `{entity, kind, value, mode?}`; kind is the signal's name."""
    entity = check_id(body["entity"], f"{where}entity")
    name = check_id(body["kind"], f"{where}kind")
    value = check_number(body["value"], f"{where}value")
    mode = body.get("mode")
    if mode is None:
        mode = "incr"
    elif mode not in SIGNAL_MODES:
        raise _bad(f"{where}mode must be 'incr' or 'set', got {_short(mode)}")
    return entity, {"kind": "signal", "entity": entity, "name": name, "value": value, "mode": mode}


_BATCH_SHAPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "put_item": (("op", "id", "doc"), ()),
    "delete_item": (("op", "id"), ()),
    "signal": (("op", "entity", "kind", "value"), ("mode",)),
    "put_embedding": (("op", "id", "vector"), ()),
    "delete_embedding": (("op", "id"), ()),
}


_PUT_ITEM_KEYS = frozenset(("op", "id", "doc"))


def batch_write(item: Any, index: int, dim: int, raw_len: int | None = None) -> tuple[str, dict[str, Any]]:
    """(routing key, worker op) of `writes[index]`; 400 naming the index when it is bad."""
    # The common write, with exactly the checks of the general path below
    # (keys, an ASCII id of 1..MAX_ID_BYTES, a doc a small body cannot make
    # too large): a batch runs this for each of its writes.
    if (type(item) is dict and item.get("op") == "put_item" and item.keys() == _PUT_ITEM_KEYS
            and raw_len is not None and raw_len * 2 < MAX_DOC_BYTES):
        key = item["id"]
        if type(key) is str and 0 < len(key) <= MAX_ID_BYTES and key.isascii():
            return key, {"kind": "put_item", "id": key, "doc": item["doc"]}
    where = f"writes[{index}]"
    if not isinstance(item, dict):
        raise _bad(f"{where} must be a JSON object, got {_tname(item)}")
    kind = item.get("op")
    if not isinstance(kind, str) or kind not in _BATCH_SHAPES:
        raise _bad(f"{where}: unknown op {_short(kind)}; expected one of {', '.join(_BATCH_SHAPES)}")
    check_keys(item, *_BATCH_SHAPES[kind], where=where)
    if kind == "signal":
        return signal_op(item, f"{where}.")
    key = check_id(item["id"], f"{where}.id")
    if kind == "put_item":
        check_doc(item["doc"], raw_len)
        return key, {"kind": "put_item", "id": key, "doc": item["doc"]}
    if kind == "put_embedding":
        return key, {"kind": "put_embedding", "id": key, "vector": check_vector(item["vector"], f"{where}.vector", dim)}
    return key, {"kind": kind, "id": key}


@dataclass(frozen=True, slots=True)
class RequestOptions:
    started: float  # loop time the request arrived: the deadline counts from here
    ack: str | None
    consistency: str
    min_seq: int
    deadline_ms: int | None
    request_id: str


def _header_int(headers: Any, name: str, low: int, high: int) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    value = raw.strip()
    if not _DIGITS.fullmatch(value) or not low <= int(value) <= high:
        raise _bad(f"{name} must be an integer between {low} and {high}, got {_short(raw)}")
    return int(value)


def parse_options(headers: Any, started: float) -> RequestOptions:
    ack = headers.get("x-ack")
    if ack is not None and ack not in ACKS:
        raise _bad(f"x-ack must be one of {', '.join(ACKS)}, got {_short(ack)}")
    consistency = headers.get("x-consistency", "strong")
    if consistency not in CONSISTENCIES:
        raise _bad(f"x-consistency must be one of {', '.join(CONSISTENCIES)}, got {_short(consistency)}")
    min_seq = _header_int(headers, "x-min-seq", 0, INT64_MAX)
    deadline_ms = _header_int(headers, "x-deadline-ms", 1, MAX_DEADLINE_MS)
    rid = headers.get("x-request-id")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not _RID.fullmatch(rid):
        raise _bad("x-request-id must be 1 to 100 visible ASCII characters other than '#'")
    return RequestOptions(started, ack, consistency, min_seq or 0, deadline_ms, rid)


# -- answers -----------------------------------------------------------------------------------

Render = Callable[[WorkerReply], tuple[int, Any]]


def _reply_headers(reply: WorkerReply) -> dict[str, str]:
    headers: dict[str, str] = {}
    if reply.shard is not None:
        headers["x-shard"] = str(reply.shard)
    if reply.term is not None:
        headers["x-term"] = str(reply.term)
    if reply.seq is not None:
        headers["x-seq"] = str(reply.seq)
    if reply.served_by is not None:
        headers["x-served-by"] = reply.served_by
    return headers


def _field(result: Any, key: str) -> Any:
    return result.get(key) if isinstance(result, dict) else None


def _render_put(id_: str) -> Render:
    return lambda r: (200, {"id": id_, "created": _field(r.result, "created"), "seq": r.seq})


def _render_delete(id_: str, what: str) -> Render:
    def render(r: WorkerReply) -> tuple[int, Any]:
        deleted = _field(r.result, "deleted")
        if deleted is False:
            return 404, error_body("not_found", f"no {what} {id_!r}", shard=r.shard)
        return 200, {"id": id_, "deleted": deleted, "seq": r.seq}
    return render


def shard_summary(view: dict[str, Any]) -> list[dict[str, Any]]:
    """Per group: term, leader, ready, members, and per replica its progress and lag.

    Lag is the leader's commit minus the replica's applied seq, from the
    workers' heartbeat reports (present when the meta leader served the view).
    """
    workers = view.get("workers") or {}

    def report(wid: str, gid: int) -> dict[str, Any]:
        w = workers.get(wid)
        groups = (w.get("report") or {}).get("groups") if isinstance(w, dict) else None
        rep = groups.get(str(gid)) if isinstance(groups, dict) else None
        return rep if isinstance(rep, dict) else {}

    out = []
    for key, g in sorted((view.get("groups") or {}).items(), key=lambda kv: int(kv[0])):
        gid = int(key)
        leader = g.get("leader")
        leader_commit = report(leader, gid).get("commit") if leader else None
        replicas = []
        for role, members in (("voter", g.get("voters") or []), ("learner", g.get("learners") or [])):
            for wid in members:
                rep = report(wid, gid)
                applied = rep.get("applied")
                lag = (max(0, leader_commit - applied)
                       if isinstance(leader_commit, int) and isinstance(applied, int) else None)
                w = workers.get(wid)
                replicas.append({"worker": wid, "role": role, "leader": wid == leader,
                                 "live": w.get("live") if isinstance(w, dict) else None,
                                 "term": rep.get("term"), "last_seq": rep.get("last_seq"),
                                 "commit": rep.get("commit"), "applied": applied, "lag": lag})
        out.append({"id": gid, "term": g.get("term"), "leader": leader, "ready": g.get("ready"),
                    "preferred_leader": g.get("preferred_leader"), "voters": g.get("voters"), "learners": g.get("learners"), "conf_ver": g.get("conf_ver"),
                    "replicas": replicas})
    return out


# -- the gateway ----------------------------------------------------------------------------------


@dataclass
class _Runtime:
    """What exists only while the app runs (made in on_startup, inside the loop)."""

    session: aiohttp.ClientSession
    meta: MetaClient
    cache: RouteCache
    fwd: Forwarder


class Gateway:
    def __init__(self, cfg: GatewayConfig, log: Any) -> None:
        if not cfg.meta:
            raise ValueError("the gateway needs at least one meta address")
        self.cfg = cfg
        self.log = log
        self.version = cfg.identity.version or package_version()
        self.metrics = GatewayMetrics(self.version)
        self._rt: _Runtime | None = None
        self.gateway_id = cfg.id or cfg.listen
        self.admission = AdmissionState()
        self._admission_task: asyncio.Task[None] | None = None
        self.models = ModelApi(self)
        self._openapi = document_bytes()  # built once: the document depends on nothing that changes at run time

    @property
    def rt(self) -> _Runtime:
        assert self._rt is not None, "the gateway app is not running"
        return self._rt

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._edge, self._large_bodies, body_deadline],
                              client_max_size=self.cfg.max_body_bytes)
        app[LOGGER_KEY] = self.log
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics.http.handle_metrics)
        r.add_get("/openapi.json", self.openapi)
        # {id:.*}: ids may contain '/', and an empty id gets a 400 rather than a 404.
        r.add_put("/items/{id:.*}", self.put_item)
        r.add_get("/items/{id:.*}", self.get_item)
        r.add_delete("/items/{id:.*}", self.delete_item)
        r.add_post("/signals", self.post_signal)
        r.add_get("/signals/{entity:.*}", self.get_signals)
        r.add_put("/embeddings/{id:.*}", self.put_embedding)
        r.add_get("/embeddings/{id:.*}", self.get_embedding)
        r.add_delete("/embeddings/{id:.*}", self.delete_embedding)
        r.add_post("/search", self.search)
        r.add_post("/batch", self.batch)
        r.add_post("/cluster/shards/{gid}/transfer", self.transfer)
        r.add_post("/cluster/shards/{gid}/replicas", self.replicas)
        r.add_get("/cluster/status", self.cluster_status)
        r.add_get("/cluster/shards", self.cluster_shards)
        self.models.add_routes(app)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=self.cfg.pool_size, limit_per_host=0, keepalive_timeout=30,
                                         ssl=connector_ssl(self.cfg.tls.client))
        # No cookie jar: workers and meta set none, and it costs CPU per request.
        keys = self.cfg.cluster_keys
        signer = (PeerSigner(keys, Principal("gateway", self.gateway_id)),) if keys is not None else ()
        session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(), middlewares=signer)
        meta = MetaClient(list(self.cfg.meta), session=session, tls=self.cfg.tls.client)
        cache = RouteCache(meta, self.log, self.metrics, self.cfg.watch_timeout_s)
        calls = WorkerCalls(session, self.log, self.metrics.stream_full.inc)
        self._rt = _Runtime(session, meta, cache, Forwarder(cache, calls, self.metrics))
        cache.start()
        if keys is not None:
            self._admission_task = asyncio.create_task(keep_admitted(
                meta, self.gateway_id, self.cfg.listen, self.cfg.identity, self.admission, self.log))

    async def _cleanup(self, app: web.Application) -> None:
        if self._admission_task is not None:
            self._admission_task.cancel()
            try:
                await self._admission_task
            except asyncio.CancelledError:
                pass
            self._admission_task = None
        if self._rt is None:
            return
        await self._rt.cache.close()
        await self._rt.fwd.close()
        await self._rt.session.close()
        self._rt = None

    # -- middleware

    @web.middleware
    async def _edge(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The gateway's one middleware: trace, the error shape, x-request-id echo,
        retry-after, HTTP metrics and the access log line (one layer, not three: it
        runs for every request)."""
        trace = Trace()
        request[TRACE_KEY] = trace
        t0 = time.perf_counter()
        status = 500
        resp: web.StreamResponse
        try:
            try:
                if self.admission.state == "refused" and not request.path.startswith(_SERVED_WHEN_REFUSED):
                    self.admission.check()
                resp = await handler(request)
            except Exception as exc:  # noqa: BLE001 - error_for answers (500 for the unexpected) or re-raises
                if isinstance(exc, ApiError):
                    trace.outcome = exc.code
                resp = error_for(exc, request)
            status = resp.status
            if status == 503:
                resp.headers["retry-after"] = str(RETRY_AFTER_S)
            if trace.request_id is not None:
                resp.headers["x-request-id"] = trace.request_id
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            route = route_of(request)
            elapsed = time.perf_counter() - t0
            self.metrics.http.observe(route, status, elapsed)
            if self.cfg.access_log:
                self.log.info("access", method=request.method, route=route if route != "unmatched" else request.path,
                              status=status, shard=trace.shard, leader=trace.leader, attempts=trace.attempts,
                              outcome=trace.outcome or ("ok" if status < 400 else str(status)),
                              ms=round(elapsed * 1000, 3), rid=trace.request_id)

    @web.middleware
    async def _large_bodies(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A model's weights file is larger than any data request may be."""
        if request.method == "POST" and request.path.startswith("/v1/models/") and request.path.endswith("/weights"):
            request = request.clone(client_max_size=max(self.cfg.max_body_bytes, MAX_WEIGHTS_BYTES))
        return await handler(request)

    # -- helpers

    def _begin(self, request: web.Request) -> tuple[RequestOptions, Trace]:
        trace = request[TRACE_KEY]
        opts = parse_options(request.headers, asyncio.get_running_loop().time())
        trace.request_id = opts.request_id
        return opts, trace

    async def _table(self, opts: RequestOptions) -> tuple[RoutingTable, float]:
        """The routing table and this request's deadline (loop time)."""
        table = self.rt.cache.table
        if table is None or table.shards < 1:
            wait_ms = opts.deadline_ms or DEFAULT_DEADLINE_MS
            table = await self.rt.cache.wait_for_table(opts.started + wait_ms / 1000 - RESPONSE_MARGIN_S)
            if table is None:
                raise ApiError("unavailable", "no routing table yet: meta has not answered, or no topology "
                               "has been applied (topoctl apply)")
        return table, opts.started + (opts.deadline_ms or table.deadline_ms) / 1000

    def _answer(self, trace: Trace, reply: WorkerReply, render: Render) -> web.Response:
        headers = _reply_headers(reply)
        if not reply.ok:
            trace.outcome = reply.code
            return json_response(reply.body, status=reply.status, headers=headers)
        status, body = render(reply)
        if status >= 400:
            trace.outcome = body["error"]["code"]
        return json_response(body, status=status, headers=headers)

    async def _write(self, opts: RequestOptions, trace: Trace, key: str, op: dict[str, Any], render: Render,
                     routed: tuple[RoutingTable, float] | None = None, size: int = 0) -> web.Response:
        table, deadline = routed if routed is not None else await self._table(opts)
        gid = table.shard_for(key)
        trace.shard = gid
        reply = await self.rt.fwd.write(gid, op, opts.request_id, opts.ack or table.ack, deadline, trace, size)
        return self._answer(trace, reply, render)

    async def _read(self, opts: RequestOptions, trace: Trace, key: str, query: dict[str, Any],
                    render: Render) -> web.Response:
        table, deadline = await self._table(opts)
        gid = table.shard_for(key)
        trace.shard = gid
        reply = await self.rt.fwd.read(gid, query, opts.consistency, opts.min_seq, deadline, trace)
        return self._answer(trace, reply, render)

    # -- items

    async def put_item(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        id_ = check_id(request.match_info["id"], "item id")
        raw = await request.read()
        doc = parse_json(raw)
        check_doc(doc, doc_hint(raw))
        table, deadline = await self._table(opts)
        return await self._write(opts, trace, id_, {"kind": "put_item", "id": id_, "doc": doc}, _render_put(id_),
                                 (table, deadline), len(raw))

    async def get_item(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        id_ = check_id(request.match_info["id"], "item id")
        return await self._read(opts, trace, id_, {"kind": "get_item", "id": id_}, lambda r: (200, r.result))

    async def delete_item(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        id_ = check_id(request.match_info["id"], "item id")
        return await self._write(opts, trace, id_, {"kind": "delete_item", "id": id_}, _render_delete(id_, "item"))

    # -- signals

    async def post_signal(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        body = check_keys(parse_json(await request.read()), ("entity", "kind", "value"), ("mode",), "the body")
        entity, op = signal_op(body, "")
        table, deadline = await self._table(opts)

        def render(r: WorkerReply) -> tuple[int, Any]:
            return 200, {"entity": entity, "kind": op["name"], "mode": op["mode"], "value": r.result, "seq": r.seq}

        return await self._write(opts, trace, entity, op, render, (table, deadline))

    async def get_signals(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        entity = check_id(request.match_info["entity"], "entity")

        def render(r: WorkerReply) -> tuple[int, Any]:
            res = r.result if isinstance(r.result, dict) else {}
            return 200, {"entity": entity, "counters": res.get("counters", {}), "last": res.get("last", {})}

        return await self._read(opts, trace, entity, {"kind": "get_signals", "entity": entity}, render)

    # -- embeddings

    async def put_embedding(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        id_ = check_id(request.match_info["id"], "embedding id")
        raw = await request.read()
        body = check_keys(parse_json(raw), ("vector",), (), "the body")
        table, deadline = await self._table(opts)
        vector = check_vector(body["vector"], "vector", table.embedding_dim)
        return await self._write(opts, trace, id_, {"kind": "put_embedding", "id": id_, "vector": vector},
                                 _render_put(id_), (table, deadline), len(raw))

    async def get_embedding(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        id_ = check_id(request.match_info["id"], "embedding id")
        return await self._read(opts, trace, id_, {"kind": "get_embedding", "id": id_},
                                lambda r: (200, {"id": id_, "vector": r.result}))

    async def delete_embedding(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        id_ = check_id(request.match_info["id"], "embedding id")
        return await self._write(opts, trace, id_, {"kind": "delete_embedding", "id": id_},
                                 _render_delete(id_, "embedding"))

    # -- search and batch

    async def search(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        body = check_keys(parse_json(await request.read()), ("vector", "k"), (), "the body")
        k = check_k(body["k"])
        table, deadline = await self._table(opts)
        vector = check_vector(body["vector"], "vector", table.embedding_dim)
        out = await self.rt.fwd.search(table.shards, {"kind": "search", "vector": vector, "k": k},
                                       opts.consistency, deadline)
        trace.attempts = out.attempts
        if out.error is not None:
            trace.outcome = out.error.code
            return json_response(out.error.body, status=out.error.status)
        unavailable = sorted(out.unavailable)
        if len(unavailable) == table.shards:
            raise ApiError("unavailable", "no shard answered the search within the deadline",
                           unavailable_shards=unavailable)
        if unavailable:
            trace.outcome = "degraded"
        return json_response({"results": merge_top_k(out.hits, k), "degraded": bool(unavailable),
                              "unavailable_shards": unavailable})

    async def batch(self, request: web.Request) -> web.Response:
        opts, trace = self._begin(request)
        raw = await request.read()
        body = check_keys(parse_json(raw), ("writes",), (), "the body")
        writes = body["writes"]
        if not isinstance(writes, list) or not writes:
            raise _bad("writes must be a non-empty array")
        if len(writes) > MAX_BATCH:
            raise _bad(f"a batch holds at most {MAX_BATCH} writes, got {len(writes)}")
        table, deadline = await self._table(opts)
        # Docs nested too deep to encode are refused by shard_writes, which encodes every put.
        parsed = [batch_write(item, i, table.embedding_dim, len(raw)) for i, item in enumerate(writes)]
        by_shard: dict[int, list[int]] = {}
        shard_for = shard_function(table.shards)
        for i, (key, _) in enumerate(parsed):
            by_shard.setdefault(shard_for(key), []).append(i)
        ack = opts.ack or table.ack
        ops = [op for _, op in parsed]
        # Every shard's writes before any is sent: a doc over the limit is a 400 that changed nothing.
        parts = {gid: shard_writes(ops, idxs, opts.request_id, gid, MAX_DOC_BYTES) for gid, idxs in by_shard.items()}

        async def one(gid: int, sw: ShardWrites) -> tuple[ShardWrites, list[dict[str, Any]]]:
            return sw, await self.rt.fwd.write_batch(gid, sw.writes, ack, deadline, trace, len(raw))

        results: list[Any] = [None] * len(parsed)
        for sw, res in await asyncio.gather(*(one(g, sw) for g, sw in parts.items())):
            spread_results(sw, ops, res, results)
        if any("error" in r for r in results):
            trace.outcome = "partial"
        if len(by_shard) == 1:
            trace.shard = next(iter(by_shard))
        return json_response({"results": results})

    # -- health

    async def healthz(self, request: web.Request) -> web.Response:
        table = self._rt.cache.table if self._rt is not None else None
        if table is None or table.shards < 1:
            return json_response({"ok": False, "version": self.version,
                                  "revision": table.revision if table is not None else None,
                                  "message": "no routing table from meta yet" if table is None
                                  else "meta has no topology applied yet"}, status=503)
        if self.admission.state == "refused":
            return json_response({"ok": False, "version": self.version, "admission": "refused",
                                  "reason": self.admission.reason, "message": self.admission.message}, status=503)
        body: dict[str, Any] = {"ok": True, "version": self.version, "revision": table.revision,
                                "shards": table.shards,
                                "groups_without_ready_leader": table.groups_without_ready_leader()}
        if self.cfg.cluster_keys is not None:
            body["admission"] = self.admission.state
        return json_response(body)

    async def openapi(self, request: web.Request) -> web.Response:
        """The API reference (gateway/openapi.py); public, like /healthz: it holds no cluster data."""
        return web.Response(body=self._openapi, content_type="application/json")

    # -- operator verbs

    def _admin(self, request: web.Request) -> str | None:
        """Check the admin token (when this gateway has one); return the client's bearer token."""
        header = request.headers.get("Authorization")
        check_bearer(header, self.cfg.admin_token)
        try:
            return bearer_token(header)
        except ApiError:
            # No token here to check it against: forward nothing and let meta
            # decide (a malformed header proves nothing to meta either).
            return None

    @staticmethod
    def _gid(request: web.Request) -> int:
        raw = request.match_info["gid"]
        if not _DIGITS.fullmatch(raw):
            raise _bad(f"shard id must be a non-negative integer, got {_short(raw)}")
        return int(raw)

    def _operator_deadline_s(self, request: web.Request) -> float:
        ms = _header_int(request.headers, "x-deadline-ms", 1, MAX_DEADLINE_MS)
        return (ms or OPERATOR_DEADLINE_MS) / 1000

    async def _proxy(self, request: web.Request, path: str) -> web.Response:
        token = self._admin(request)
        deadline_s = self._operator_deadline_s(request)
        body = await request.read()
        # A client of its own per call: it carries this caller's token, not ours.
        client = MetaClient(self.rt.meta.addrs, admin_token=token, session=self.rt.session, tls=self.rt.meta.tls)
        try:
            status, answer, _ = await client.request("POST", path, data=body or None, deadline_s=deadline_s,
                                                     admin=token is not None)
        except MetaUnreachable as exc:
            raise ApiError("unavailable", f"no meta node answered: {exc}") from None
        if isinstance(answer, (dict, list)):
            return json_response(answer, status=status)
        return web.Response(text=str(answer), status=status)

    async def transfer(self, request: web.Request) -> web.Response:
        return await self._proxy(request, f"/v1/groups/{self._gid(request)}/transfer")

    async def replicas(self, request: web.Request) -> web.Response:
        return await self._proxy(request, f"/v1/groups/{self._gid(request)}/replicas")

    async def _fresh_view(self, request: web.Request) -> dict[str, Any]:
        """The cluster view from meta now, preferring the meta leader's (it has liveness)."""
        self._admin(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._operator_deadline_s(request)
        try:
            status, view, _ = await self.rt.meta.request("GET", "/v1/cluster", deadline_s=deadline - loop.time())
        except MetaUnreachable as exc:
            raise ApiError("unavailable", f"no meta node answered: {exc}") from None
        if status != 200 or not isinstance(view, dict):
            raise ApiError("unavailable", f"meta answered {status} to GET /v1/cluster")
        leader = view.get("meta_leader")
        if leader and view.get("served_by") != leader:
            http = next((m.get("http") for m in view.get("meta") or [] if m.get("id") == leader), None)
            remaining = deadline - loop.time()
            if http and remaining > 0:
                try:
                    async with self.rt.session.get(f"{self.cfg.tls.scheme}://{http}/v1/cluster",
                                                   timeout=aiohttp.ClientTimeout(total=min(1.0, remaining))) as r:
                        if r.status == 200:
                            fresh = orjson.loads(await r.read())
                            if isinstance(fresh, dict) and fresh.get("revision", -1) >= view.get("revision", 0):
                                view = fresh
                except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
                    self.log.debug("meta_leader_view_failed", leader=leader, error=str(exc))
        return view

    async def cluster_status(self, request: web.Request) -> web.Response:
        view = await self._fresh_view(request)
        # Liveness is soft state on the meta leader: null when the view came from elsewhere.
        for w in (view.get("workers") or {}).values():
            if isinstance(w, dict):
                w.setdefault("live", None)
        view["liveness_known"] = bool(view.get("meta_leader")) and view.get("served_by") == view.get("meta_leader")
        table = self.rt.cache.table
        view["gateway"] = {"routing_revision": table.revision if table is not None else None}
        return json_response(view)

    async def cluster_shards(self, request: web.Request) -> web.Response:
        view = await self._fresh_view(request)
        return json_response({"revision": view.get("revision"), "shards": shard_summary(view)})
