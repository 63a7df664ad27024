"""The worker's HTTP API: data ops for its groups, replication, snapshots.

Bodies are msgpack when the request says `Content-Type: application/msgpack`
(gateways and peers) and JSON otherwise (operators, curl); answers use the
same encoding as the request. Errors use the one error shape of
`shardgrid.common.wire` with the group's term and leader as context.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from shardgrid.common.peerauth import Principal, SessionTable
from shardgrid.common.peerauth_http import ANY_ROLE, PeerGuard, peer_of
from shardgrid.common.peerauth_http import refusal as auth_refusal
from shardgrid.common.serving import body_deadline
from shardgrid.common.wire import LOGGER_KEY, STATUS_FOR_CODE, ApiError, ItemTooLarge, error_body, error_middleware, \
    json_response, pack_frames, packb, short_repr, unpack_frame, unpack_frame_sized, unpackb
from worker import replica_msgs as m
from worker.capacity import refusal
from worker.codec import MalformedMessage, decode_message
from worker.group import GroupOverloaded
from topology.model import MAX_INFER_ROWS
from worker.infer import infer_warm
from worker.throttle import SNAPSHOT_BUSY
from shardgrid.common.protocol import CALLS_PATH, HEARTBEAT_S, STREAM_PATH
from worker.plugins.base import BadOp

if TYPE_CHECKING:
    from worker.process import WorkerNode

MSGPACK = "application/msgpack"
# Who may call what (shardgrid/common/peerauth_http.py); /healthz, /metrics and
# /v1/status stay open for probes and operators.
_WORKERS, _META = frozenset({"worker"}), frozenset({"meta"})
MAX_BODY = 64 << 20  # a request body, and a message on a peer or call stream (max_msg_size)
# What one write or write_batch may carry, encoded. Each becomes ONE log
# entry, replicated as one message on a peer stream, and a receiver refuses
# a message over MAX_BODY: an entry near that size could never reach a
# follower and would wedge the group. A quarter leaves room for the Append
# around it. The gateway's coalesced calls stay under this too
# (gateway/forward.py MAX_CALL_BYTES).
MAX_WRITE_BYTES = MAX_BODY // 4
# Writes per write_batch: each is validated, tracked and answered on its
# own, so the count bounds the work and memory of one call whatever its
# bytes. The gateway sends at most forward.MAX_CALL_RECORDS (4096).
MAX_BATCH_WRITES = 10_000
DEFAULT_TIMEOUT_S = 5.0
# A served wait is capped at MAX_WAIT_S; a deadline_ms beyond MAX_DEADLINE_MS
# (an hour) is a caller's bug or a hostile value, not a long wait, and is
# refused rather than silently capped.
MAX_WAIT_S = 60.0
MAX_DEADLINE_MS = 3_600_000
_INFER_KEYS = frozenset(("start", "end", "rows", "x", "deadline_ms"))
NODE_KEY: web.AppKey["WorkerNode"] = web.AppKey("worker_node", object)  # type: ignore[arg-type]


async def _body(request: web.Request) -> Any:
    return (await _sized_body(request))[0]


async def _sized_body(request: web.Request) -> tuple[Any, int]:
    """The decoded body and its size in bytes as sent."""
    raw = await request.read()
    if not raw:
        return {}, 0
    try:
        return (unpackb(raw) if request.content_type == MSGPACK else orjson.loads(raw)), len(raw)
    except (ValueError, orjson.JSONDecodeError) as exc:
        raise ApiError("bad_request", f"malformed body: {exc}") from None


async def _write_body(request: web.Request) -> tuple[Any, int]:
    """A write's body: one whose declared length is over MAX_WRITE_BYTES is refused before it is read."""
    if request.content_length is not None and request.content_length > MAX_WRITE_BYTES:
        raise _too_large(request.content_length)
    return await _sized_body(request)


def _too_large(size: int) -> ApiError:
    return ApiError("payload_too_large", f"a write or write_batch carries at most {MAX_WRITE_BYTES} bytes "
                    f"(one log entry must fit a replication message); this one is {size}: split it",
                    limit=MAX_WRITE_BYTES)


def _answer(request: web.Request, data: Any, status: int = 200) -> web.Response:
    if request.content_type == MSGPACK:
        return web.Response(body=packb(data), status=status, content_type=MSGPACK)
    return json_response(data, status=status)


def _timeout(body: dict[str, Any]) -> float:
    """The wait `deadline_ms` asks for, in seconds; checked before anything is
    queued (a NaN once reached the group's timer after the write was queued)."""
    ms = body.get("deadline_ms", DEFAULT_TIMEOUT_S * 1000)
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not math.isfinite(ms) \
            or not 0 < ms <= MAX_DEADLINE_MS:
        raise ApiError("bad_request", f"deadline_ms must be a finite number of milliseconds above 0 and at most "
                                      f"{MAX_DEADLINE_MS}, got {str(ms)[:40]}")
    return min(float(ms) / 1000, MAX_WAIT_S)


RID_RULE = "rid must be a non-empty string of at most 128 characters"


def _rid_ok(rid: Any) -> bool:
    return rid is None or (isinstance(rid, str) and 0 < len(rid) <= 128)


@dataclass(slots=True)
class CallResult:
    """One op's answer. The x-* headers are made only for an HTTP reply: the
    call stream carries the body alone, and builds thousands of these a second."""

    status: int
    body: Any
    shard: int | None = None
    term: int = 0
    seq: int = 0


# Answers one call stream holds for its writer. Past it the stream reads no
# more calls until the writer catches up: a gateway that sends calls and
# does not read the answers must not grow this worker's memory without end.
MAX_OUTBOX_ANSWERS = 65_536


class _Outbox:
    """Answers for one call stream, written by one task: those ready together share a frame."""

    def __init__(self, ws: web.WebSocketResponse, log: Any) -> None:
        self.ws = ws
        self.log = log
        self.items: list[Any] = []
        self.wake = asyncio.Event()
        self.room = asyncio.Event()  # set while fewer than MAX_OUTBOX_ANSWERS wait
        self.room.set()
        self.held = 0  # answers taken by the writer and not yet written
        self.task = asyncio.create_task(self._run())

    def put(self, item: Any) -> None:
        self.items.append(item)
        if len(self.items) + self.held >= MAX_OUTBOX_ANSWERS:
            self.room.clear()
        self.wake.set()

    async def _run(self) -> None:
        try:
            while not self.ws.closed:
                await self.wake.wait()
                self.wake.clear()
                while self.items:
                    items, self.items = self.items, []
                    self.held = len(items)
                    try:
                        for frame in pack_frames(items, on_error=self._unpackable, max_item=MAX_BODY):
                            await self.ws.send_bytes(frame)
                    except (ConnectionError, RuntimeError):
                        return  # the gateway went away; its calls fail over on its side
                    self.held = 0
                    if len(self.items) < MAX_OUTBOX_ANSWERS:
                        self.room.set()
        finally:
            self.room.set()  # the reader must not wait on a writer that is gone

    def _unpackable(self, item: Any, exc: Exception) -> Any:
        """The stand-in for an answer msgpack cannot pack: a 500 for that call
        alone. Raising would end this task, and every later answer on the
        stream would be lost with it."""
        cid = item[0] if isinstance(item, list) and item else None
        if not isinstance(cid, int):
            self.log.error("call_answer_unpackable", call_id=None, error=f"{type(exc).__name__}: {exc}")
            return None  # no call to answer: the gateway times it out
        if isinstance(exc, ItemTooLarge):
            # A query's answer (a search's k, a huge document): the caller's to narrow, not a bug.
            self.log.warning("call_answer_too_large", call_id=cid, bytes=exc.size, limit=exc.limit)
            return [cid, 413, error_body("payload_too_large", f"the answer is {exc.size} bytes encoded, over the "
                                         f"call stream's limit of {exc.limit}: ask for less", limit=exc.limit)]
        self.log.error("call_answer_unpackable", call_id=cid, error=f"{type(exc).__name__}: {exc}")
        return [cid, 500, error_body("internal", "the answer could not be encoded; see the worker's log")]

    def close(self) -> None:
        self.task.cancel()


class _Malformed:
    """The malformed replication messages of one peer stream or request:
    each counted (`shardgrid_worker_peer_malformed_total`), the first logged
    with the peer's address, and how many there were in all when it ends."""

    def __init__(self, node: "WorkerNode", peer: str | None, path: str) -> None:
        self.node = node
        self.peer = peer
        self.path = path
        self.count = 0
        self.first: str | None = None

    def add(self, kind: str, reason: str) -> None:
        self.count += 1
        self.node.peer_malformed.labels(kind=kind).inc()
        if self.first is None:
            self.first = f"{kind}: {reason}"
            self.node.log.warning("peer_message_malformed", peer=self.peer, path=self.path, kind=kind,
                                  reason=reason[:200])

    def close(self) -> None:
        if self.count > 1:
            self.node.log.warning("peer_messages_malformed", peer=self.peer, path=self.path, count=self.count,
                                  first=self.first)


class WorkerApi:
    def __init__(self, node: "WorkerNode") -> None:
        self.node = node
        self._call_ops = {"write": self.do_write, "write_batch": self.do_write_batch, "read": self.do_read,
                          "infer": self.do_infer}
        self._streams: set[web.WebSocketResponse] = set()  # open raft and call streams, closed on shutdown

    def peer_policy(self) -> dict[str, frozenset[str]]:
        return {"/v1/raft": _WORKERS, STREAM_PATH: _WORKERS, CALLS_PATH: ANY_ROLE,
                "/v1/groups/{gid}/write": ANY_ROLE, "/v1/groups/{gid}/write_batch": ANY_ROLE,
                "/v1/groups/{gid}/read": ANY_ROLE, "/v1/groups/{gid}/infer": ANY_ROLE,
                # Leadership and membership move only by meta's decision (its operators, repair, transfer).
                "/v1/groups/{gid}/transfer": _META, "/v1/groups/{gid}/members": _META, "/v1/assignments": _META,
                "/v1/groups/{gid}/snapshot": _WORKERS, "/v1/groups/{gid}/snapshot/{seq}": _WORKERS}

    def app(self) -> web.Application:
        keys = self.node.cfg.cluster_keys
        table = SessionTable(keys, self.node.principal, time.monotonic, revoked=self.node.revoked) \
            if keys is not None else None
        self.guard = PeerGuard(table, self.peer_policy(), self.node.log, registry=self.node.metrics.registry)
        app = web.Application(middlewares=[self.node.metrics.middleware, error_middleware, self.guard.middleware,
                                           body_deadline],
                              client_max_size=MAX_BODY)
        app[NODE_KEY] = self.node
        app[LOGGER_KEY] = self.node.log
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/v1/status", self.status)
        r.add_post("/v1/raft", self.raft)
        r.add_get(STREAM_PATH, self.raft_stream)
        r.add_get(CALLS_PATH, self.calls)
        r.add_post("/v1/groups/{gid}/write", self.write)
        r.add_post("/v1/groups/{gid}/write_batch", self.write_batch)
        r.add_post("/v1/groups/{gid}/read", self.read)
        r.add_post("/v1/groups/{gid}/infer", self.infer)
        r.add_post("/v1/groups/{gid}/transfer", self.transfer)
        r.add_post("/v1/groups/{gid}/members", self.members)
        r.add_post("/v1/assignments", self.assignment)
        r.add_get("/v1/groups/{gid}/snapshot", self.snapshot_manifest)
        r.add_get("/v1/groups/{gid}/snapshot/{seq}", self.snapshot_data)
        app.on_shutdown.append(self._close_streams)
        return app

    async def _close_streams(self, app: web.Application) -> None:
        # Long-lived streams would otherwise hold the shutdown for its whole
        # grace period; peers and gateways reconnect elsewhere or later.
        for ws in list(self._streams):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"worker stopping")

    def _group(self, request: web.Request) -> Any:
        try:
            gid = int(request.match_info["gid"])
        except ValueError:
            raise ApiError("bad_request", "group id must be an integer") from None
        shell = self.node.groups.get(gid)
        if shell is None:
            raise ApiError("not_leader", f"worker {self.node.id} hosts no replica of group {gid}", shard=gid,
                           leader=self.node.leader_of(gid))
        return shell

    async def metrics(self, request: web.Request) -> web.Response:
        self.node.update_gauges()
        return await self.node.metrics.handle_metrics(request)

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({"ok": True, "id": self.node.id, "version": self.node.version,
                              "groups": sorted(self.node.groups), "registered": self.node.registered})

    async def status(self, request: web.Request) -> web.Response:
        return json_response({"id": self.node.id, "groups": self.node.group_reports(),
                              "corrupt": self.node.corrupt})

    def _decode_raft(self, batch: Any, seen: "_Malformed") -> list[m.Message]:
        """The well-formed messages of `batch`; the others are counted in `seen`.

        A peer's message of the wrong shape never reaches a core: a wrong type
        or an Append whose entries do not follow its prev would fail the group."""
        if type(batch) is not list:
            seen.add("batch", "a batch of messages must be a list")
            return []
        msgs: list[m.Message] = []
        for raw in batch:
            try:
                msgs.append(decode_message(raw))
            except MalformedMessage as exc:
                seen.add(exc.kind, exc.reason)
            except (KeyError, TypeError, ValueError) as exc:
                # A shape decode_message failed to check (a bug there): still
                # this message's problem alone, not the stream's.
                seen.add("unknown", f"{type(exc).__name__}: {exc}")
        return msgs

    def _deliver_raft(self, msgs: list[m.Message], sender: Principal | None) -> int:
        """Hand each message to its group; one that names a `src` other than
        the authenticated sender is dropped (one worker cannot speak for
        another). Returns how many were dropped so."""
        groups = self.node.groups
        dropped = 0
        for msg in msgs:
            if sender is not None and msg.src != sender.name:
                dropped += 1
                self.guard.refused.labels("wrong_sender").inc()
                self.node.log.warning("raft_message_wrong_sender", sender=str(sender), src=msg.src, group=msg.group)
                continue
            shell = groups.get(msg.group)
            if shell is not None:
                shell.deliver(msg)
        return dropped

    async def raft(self, request: web.Request) -> web.Response:
        """`POST /v1/raft`: a msgpack list of messages, for tools. A body with
        any malformed message (400) or any message another worker's (403) is
        refused as a whole and changes nothing."""
        seen = _Malformed(self.node, request.remote, "/v1/raft")
        try:
            batch = unpackb(await request.read())
        except (ValueError, TypeError) as exc:  # TypeError: a map with an unhashable key
            seen.add("batch", f"not msgpack: {exc}")
            raise ApiError("bad_request", "the body must be a msgpack list of replication messages") from None
        msgs = self._decode_raft(batch, seen)
        if seen.count:
            raise ApiError("bad_request", f"{seen.count} malformed replication message(s); first: {seen.first}")
        sender = peer_of(request)
        if sender is not None and any(msg.src != sender.name for msg in msgs):
            self.guard.refused.labels("wrong_sender").inc()
            raise auth_refusal("wrong_sender", f"replication messages from {sender} must carry src {sender.name}")
        self._deliver_raft(msgs, sender)
        return web.Response(status=204)

    async def raft_stream(self, request: web.Request) -> web.StreamResponse:
        """A peer's message stream (worker/transport.py): binary frames of encoded messages.

        What is malformed (a frame that is not msgpack, a message of the
        wrong shape, a text frame) is dropped and counted, and the rest of
        the stream goes on: frames are independent, and the core
        retransmits whatever a message dropped here carried."""
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_BODY)
        await ws.prepare(request)
        self._streams.add(ws)
        seen = _Malformed(self.node, request.remote, STREAM_PATH)
        try:
            sender = peer_of(request)
            async for frame in ws:
                if sender is not None and self.node.revoked(sender):
                    # Authenticated when the stream opened, revoked since: the
                    # stream ends here and its reconnect is refused.
                    self.guard.refused.labels("revoked").inc()
                    self.node.log.warning("raft_stream_revoked", sender=str(sender), peer_addr=request.remote)
                    break
                if frame.type == WSMsgType.BINARY:
                    try:
                        batch = unpack_frame(frame.data)
                    except ValueError as exc:
                        seen.add("frame", str(exc))
                        continue
                    self._deliver_raft(self._decode_raft(batch, seen), sender)
                elif frame.type == WSMsgType.TEXT:
                    seen.add("frame", "a text frame on a binary stream")
        finally:
            self._streams.discard(ws)
            seen.close()
        return ws

    # -- data ops: one implementation for HTTP and for the call stream -------------

    async def write(self, request: web.Request) -> web.Response:
        shell = self._group(request)
        return self._respond(request, await self.do_write(shell, *await _write_body(request)))

    async def write_batch(self, request: web.Request) -> web.Response:
        shell = self._group(request)
        return self._respond(request, await self.do_write_batch(shell, *await _write_body(request)))

    async def read(self, request: web.Request) -> web.Response:
        shell = self._group(request)
        return self._respond(request, await self.do_read(shell, *await _sized_body(request)))

    async def infer(self, request: web.Request) -> web.Response:
        shell = self._group(request)
        return self._respond(request, await self.do_infer(shell, *await _sized_body(request)))

    def _respond(self, request: web.Request, res: "CallResult") -> web.Response:
        resp = _answer(request, res.body, status=res.status)
        if res.shard is not None:
            resp.headers.update({"x-shard": str(res.shard), "x-term": str(res.term), "x-seq": str(res.seq),
                                 "x-served-by": self.node.id})
        return resp

    # Each op validates the whole call before anything reaches the group:
    # a refusal means nothing was queued, so nothing can apply. `size` is
    # the call's encoded size in bytes.

    async def do_write(self, shell: Any, body: Any, size: int = 0) -> "CallResult":
        if size > MAX_WRITE_BYTES:
            raise _too_large(size)
        if not isinstance(body, dict) or not isinstance(body.get("op"), dict):
            raise ApiError("bad_request", "write needs {\"op\": {...}, \"ack\"?, \"rid\"?, \"deadline_ms\"?}")
        ack = self._ack(body)
        rid = body.get("rid")
        if not _rid_ok(rid):
            raise ApiError("bad_request", RID_RULE)
        timeout = _timeout(body)
        try:
            out = await shell.write(body["op"], ack, rid, timeout, size)
        except BadOp as exc:
            raise ApiError("bad_request", exc.message, shard=shell.gid) from None
        except GroupOverloaded as exc:
            raise _overloaded(shell, exc, elsewhere=False) from None
        return self._outcome(shell, out)

    async def do_write_batch(self, shell: Any, body: Any, size: int = 0) -> "CallResult":
        """Many writes to one group in one round trip; one result per write, in order.

        Each write is validated and committed on its own (a bad one does not
        fail the others); they enter the group's queue together, so the
        pipeline carries them in as few appends as possible.
        """
        writes = body.get("writes") if isinstance(body, dict) else None
        if not isinstance(writes, list) or not writes:
            raise ApiError("bad_request", "write_batch needs {\"writes\": [{\"op\": {...}, \"rid\"?}, ...]}")
        if len(writes) > MAX_BATCH_WRITES:
            raise ApiError("payload_too_large", f"a write_batch carries at most {MAX_BATCH_WRITES} writes, "
                           f"this one has {len(writes)}: split it", limit=MAX_BATCH_WRITES)
        if size > MAX_WRITE_BYTES:
            raise _too_large(size)
        ack = self._ack(body)
        timeout = _timeout(body)
        results: list[Any] = [None] * len(writes)
        todo: list[tuple[int, Any, str | None]] = []
        for i, w in enumerate(writes):
            if not isinstance(w, dict) or not isinstance(w.get("op"), dict):
                results[i] = error_body("bad_request", "each write needs {\"op\": {...}}")
            elif not _rid_ok(w.get("rid")):
                results[i] = error_body("bad_request", RID_RULE)
            else:
                todo.append((i, w["op"], w.get("rid")))
        try:
            outcomes = await shell.write_many([(op, rid) for _, op, rid in todo], ack, timeout, size)
        except GroupOverloaded as exc:
            raise _overloaded(shell, exc, elsewhere=False) from None
        for (i, _, _), out in zip(todo, outcomes):
            if isinstance(out, BadOp):
                results[i] = error_body("bad_request", out.message, shard=shell.gid)
            elif out.ok:
                results[i] = {"seq": out.seq, "term": out.term, "result": out.result}
            else:
                results[i] = self._error(shell, out)
        return CallResult(200, {"results": results})

    async def do_read(self, shell: Any, body: Any, size: int = 0) -> "CallResult":
        if not isinstance(body, dict) or not isinstance(body.get("query"), dict):
            raise ApiError("bad_request", "read needs {\"query\": {...}, \"consistency\"?, \"min_seq\"?}")
        consistency = body.get("consistency", "strong")
        if consistency not in ("strong", "follower"):
            raise ApiError("bad_request", "consistency must be strong or follower")
        min_seq = body.get("min_seq", 0)
        if not isinstance(min_seq, int) or isinstance(min_seq, bool) or min_seq < 0:
            raise ApiError("bad_request", "min_seq must be a non-negative integer")
        timeout = _timeout(body)
        try:
            out = await shell.read(body["query"], consistency, min_seq, timeout, size)
        except GroupOverloaded as exc:
            # A follower read may go to another replica; a write or a strong
            # read has only the leader.
            raise _overloaded(shell, exc, elsewhere=consistency == "follower") from None
        return self._outcome(shell, out)

    async def do_infer(self, shell: Any, body: Any, size: int = 0) -> "CallResult":
        """Run layers `start`..`end` of a model group over `rows` rows of float32 `x`.

        Any replica serves it (no log entry, no leader): one that is warm
        (`infer_warm`) answers with the version its weights are at.
        """
        if shell.plugin.name != "layers":
            raise ApiError("bad_request", f"group {shell.gid} holds no model layers", shard=shell.gid)
        if not isinstance(body, dict) or set(body) - _INFER_KEYS or not _INFER_KEYS - {"deadline_ms"} <= set(body):
            raise ApiError("bad_request", "infer needs {\"start\", \"end\", \"rows\", \"x\", \"deadline_ms\"?}")
        start, end, rows, x = body["start"], body["end"], body["rows"], body["x"]
        if not all(type(v) is int for v in (start, end, rows)) or not isinstance(x, bytes):
            raise ApiError("bad_request", "start, end and rows must be integers and x bytes of float32")
        if not infer_warm(shell):
            raise ApiError("unavailable", f"{self.node.id}'s replica of group {shell.gid} is not warm "
                           "(opening, failed or behind its commit)", shard=shell.gid, retry_elsewhere=True)
        weights = shell.plugin.current()
        if not weights.first <= start <= end <= weights.last:
            raise ApiError("bad_request", f"layers {start}-{end} are not within group {shell.gid}'s "
                           f"{weights.first}-{weights.last}", shard=shell.gid)
        if not 1 <= rows <= MAX_INFER_ROWS or len(x) != rows * weights.d_model * 4:
            raise ApiError("bad_request", f"x must hold rows (1..{MAX_INFER_ROWS}) x {weights.d_model} float32 "
                           f"values, got {len(x)} bytes for {rows} rows", shard=shell.gid)
        out = await self.node.infer.infer(shell.gid, shell.plugin, start, end, x, rows, _timeout(body))
        out["worker"] = self.node.id
        r = shell.replica
        return CallResult(200, out, shell.gid, r.term if r is not None else 0, r.applied_seq if r is not None else 0)

    def _ack(self, body: dict[str, Any]) -> str:
        ack = body.get("ack", self.node.default_ack)
        if ack not in ("leader", "quorum", "all"):
            raise ApiError("bad_request", "ack must be leader, quorum or all")
        return str(ack)

    def _error(self, shell: Any, out: Any) -> dict[str, Any]:
        code, reason = _wire_code(out.error_code)
        leader = out.leader if out.leader is not None else shell.replica.leader
        return error_body(code, out.message or _MESSAGES.get(reason or code, code), shard=shell.gid,
                          term=out.term or shell.replica.term, leader=leader, reason=reason,
                          maybe_applied=True if out.maybe_applied else None)

    def _outcome(self, shell: Any, out: Any) -> "CallResult":
        if out.ok:
            return CallResult(200, {"seq": out.seq, "term": out.term, "result": out.result},
                              shell.gid, out.term, out.seq)
        code, _ = _wire_code(out.error_code)
        return CallResult(STATUS_FOR_CODE.get(code, 503), self._error(shell, out), shell.gid, out.term, out.seq)

    async def calls(self, request: web.Request) -> web.StreamResponse:
        """The gateways' call stream: frames of `[id, op, gid, body]` calls in, of `[id, status, body]` answers out.

        The same data ops as the HTTP routes, without a request and a
        response per call: calls are answered as they finish, and answers
        that finish together leave in one frame.
        """
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_BODY)
        await ws.prepare(request)
        self._streams.add(ws)
        out = _Outbox(ws, self.node.log)
        tasks: set[asyncio.Task[None]] = set()
        try:
            async for frame in ws:
                if frame.type != WSMsgType.BINARY:
                    continue
                if not out.room.is_set():
                    await out.room.wait()
                try:
                    batch = unpack_frame_sized(frame.data)
                except ValueError as exc:
                    self.node.log.warning("call_frame_malformed", error=str(exc))
                    break
                for call, size in batch:
                    task = asyncio.create_task(self._call(call, size, out))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            self._streams.discard(ws)
            for task in list(tasks):
                task.cancel()
            out.close()
        return ws

    async def _call(self, call: Any, size: int, out: "_Outbox") -> None:
        try:
            cid, op, gid, body = call
        except (TypeError, ValueError):
            self.node.log.warning("call_malformed")
            return
        try:
            # op and gid are a client's values: checked before they are hashed,
            # and never repr()'d or logged whole (one nested ~1000 deep raises
            # RecursionError, which would kill this task unanswered).
            fn = self._call_ops.get(op) if type(op) is str else None
            if fn is None:
                raise ApiError("bad_request", f"unknown call {short_repr(op)}")
            shell = self.node.groups.get(gid) if type(gid) is int else None
            if shell is None:
                if type(gid) is not int:
                    raise ApiError("bad_request", f"group id must be an integer, got {short_repr(gid)}")
                raise ApiError("not_leader", f"worker {self.node.id} hosts no replica of group {gid}", shard=gid,
                               leader=self.node.leader_of(gid))
            res = await fn(shell, body, size)
            out.put([cid, res.status, res.body])
        except ApiError as err:
            out.put([cid, err.status, err.body()])
        except Exception:  # noqa: BLE001 - like the HTTP error middleware: log, answer 500
            self.node.log.exception("unhandled_error", call=op, group=gid)
            out.put([cid, 500, error_body("internal", "internal error; see the server log")])

    async def transfer(self, request: web.Request) -> web.Response:
        shell = self._group(request)
        body = await _body(request)
        target = body.get("to") if isinstance(body, dict) else None
        if not isinstance(target, str) or not target:
            raise ApiError("bad_request", "transfer needs {\"to\": WORKER}")
        shell.deliver(m.TransferLeader(target))
        return json_response({"accepted": True, "group": shell.gid, "to": target}, status=202)

    async def members(self, request: web.Request) -> web.Response:
        """One membership change through the group's log (meta's operators call this)."""
        shell = self._group(request)
        body = await _body(request)
        change = {k: body.get(k) for k in ("add_learner", "promote", "remove") if isinstance(body, dict) and body.get(k)}
        if len(change) != 1 or not all(isinstance(v, str) for v in change.values()):
            raise ApiError("bad_request", "members needs exactly one of add_learner, promote, remove")
        out = await shell.change_members(change, DEFAULT_TIMEOUT_S)
        return self._respond(request, self._outcome(shell, out))

    async def assignment(self, request: web.Request) -> web.Response:
        """Meta asks before it places a replica here: 200 when this worker can
        take it, 409 `refused` with a reason (worker/capacity.py) when not."""
        body = await _body(request)
        gid = body.get("group") if isinstance(body, dict) else None
        need = body.get("bytes", 0) if isinstance(body, dict) else None
        if not isinstance(gid, int) or isinstance(gid, bool) or not isinstance(need, int) or isinstance(need, bool) \
                or need < 0:
            raise ApiError("bad_request", "assignments needs {\"group\": int, \"bytes\": int >= 0}")
        why = refusal(await self.node.capacity(), need)
        if why is not None:
            self.node.log.info("assignment_refused", group=gid, reason=why.reason, message=why.message)
            raise ApiError("conflict", f"{self.node.id} cannot take a replica of group {gid}: {why.message}",
                           reason=why.reason, group=gid)
        return json_response({"accepted": True, "group": gid, "worker": self.node.id})

    async def snapshot_manifest(self, request: web.Request) -> web.Response:
        """The snapshot at `?seq=` (the one a replication message published),
        or the latest without it."""
        shell = self._group(request)
        raw = request.query.get("seq")
        if raw is not None and not (raw.isascii() and raw.isdigit() and len(raw) <= 20):
            raise ApiError("bad_request", f"seq must be a non-negative integer, got {raw[:40]!r}")
        snap = shell.snapshot(int(raw) if raw is not None else None)
        if snap is None:
            raise ApiError("not_found", f"group {shell.gid} has no snapshot{'' if raw is None else ' at ' + raw} "
                           f"on {self.node.id}")
        return json_response({"seq": snap.seq, "term": snap.term, "size": snap.size, "digest": snap.digest})

    async def snapshot_data(self, request: web.Request) -> web.StreamResponse:
        """The snapshot's bytes, from the requested Range on (downloads resume
        where they broke off), within this worker's snapshot limits
        (worker/throttle.py): a download beyond `snapshot_concurrency` is
        answered busy at once, and every download served shares the
        `snapshot_rate_mb_s` bucket."""
        shell = self._group(request)
        raw = request.match_info["seq"]
        snap = shell.snapshot(int(raw)) if raw.isascii() and raw.isdigit() and len(raw) <= 20 else None
        if snap is None:
            raise ApiError("not_found", "that snapshot is gone; re-read the manifest")
        start, stop = _byte_range(request, snap.size)
        serving = self.node.snapshot_serving
        if not serving.try_start():
            raise ApiError("unavailable", f"{self.node.id} already serves {serving.serving} snapshot downloads "
                           f"(settings.snapshot_concurrency: {serving.concurrency}); retry later",
                           reason=SNAPSHOT_BUSY, shard=shell.gid, serving=serving.serving,
                           limit=serving.concurrency)
        try:
            return await self._stream_file(request, shell.gid, snap.path, start, stop, snap.size)
        finally:
            serving.finish()

    async def _stream_file(self, request: web.Request, gid: int, path: Path, start: int, stop: int,
                           size: int) -> web.StreamResponse:
        # Opened before the answer starts: a snapshot pruned meanwhile stays
        # readable through this handle, and a missing one is still a 404.
        try:
            f = await asyncio.to_thread(open, path, "rb")
        except FileNotFoundError:
            raise ApiError("not_found", "that snapshot is gone; re-read the manifest") from None
        resp = web.StreamResponse(status=206 if "Range" in request.headers else 200)
        resp.content_type = "application/octet-stream"
        resp.content_length = stop - start
        resp.headers["Accept-Ranges"] = "bytes"
        if resp.status == 206:
            resp.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        serving = self.node.snapshot_serving
        sent = start
        try:
            await resp.prepare(request)
            f.seek(start)
            while sent < stop:
                n = min(serving.chunk(), stop - sent)
                wait = serving.reserve(n, time.monotonic())
                if wait > 0:
                    await asyncio.sleep(wait)
                chunk = await asyncio.to_thread(f.read, n)
                if not chunk:
                    raise OSError(f"snapshot file ended at {sent} of {size} bytes")
                await resp.write(chunk)
                sent += len(chunk)
            await resp.write_eof()
        except OSError as exc:
            # The answer has begun: no error body can follow it. Closing the
            # connection leaves the downloader a short body, and it resumes
            # from what it has (a reset by the downloader lands here too).
            self.node.log.info("snapshot_serve_interrupted", group=gid, sent=sent - start, of=stop - start,
                               error=f"{type(exc).__name__}: {exc}")
            if request.transport is not None:
                request.transport.close()
        finally:
            f.close()
        return resp


def _overloaded(shell: Any, exc: GroupOverloaded, elsewhere: bool) -> ApiError:
    """The 503 for a call refused by a full group: nothing was queued, so any retry is safe."""
    rep = getattr(shell, "replica", None)
    return ApiError("overloaded", str(exc), shard=shell.gid, term=rep.term if rep else None,
                    leader=rep.leader if rep else None, limit=exc.limit,
                    limit_bytes=exc.limit_bytes, retry_elsewhere=True if elsewhere else None)


def _byte_range(request: web.Request, size: int) -> tuple[int, int]:
    """[start, stop) of a `size`-byte file the request's Range header asks for (the whole file without one)."""
    try:
        rng = request.http_range
    except ValueError as exc:
        raise ApiError("bad_request", f"Range: {exc}") from None
    start = rng.start if rng.start is not None else 0
    if start < 0:
        start = max(0, size + start)  # a suffix range, "bytes=-N": the last N bytes
    stop = min(size, rng.stop) if rng.stop is not None else size
    if "Range" in request.headers and start >= stop:
        raise ApiError("bad_request", f"Range: starts at byte {start}, the snapshot has {size}")
    return start, stop


def _wire_code(core_code: str | None) -> tuple[str, str | None]:
    """(error code, reason) on the wire for the core's error code: the core's
    no_quorum is an `unavailable` whose reason says which (clients and
    gateways know `unavailable`; nothing was applied)."""
    if core_code == m.NO_QUORUM:
        return "unavailable", m.NO_QUORUM
    return core_code or "unavailable", None


_MESSAGES = {
    m.NO_QUORUM: "the group's leader has had no round trip with a majority of its replicas within lease_ms "
               "(check-quorum); nothing was applied, meta moves the leadership",
    "not_leader": "this replica is not the group's ready leader",
    "quorum_timeout": "not acknowledged by a quorum in time; outcome unknown: retry with the same request id",
    "deadline_exceeded": "could not be served within the deadline",
    "unavailable": "the group is unavailable on this worker",
}
