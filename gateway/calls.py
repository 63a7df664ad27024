"""Calls to workers over one WebSocket stream per worker (the worker's `/v1/calls`).

A call is `[id, op, gid, body]` (op: write, write_batch, read); the answer
`[id, status, body]` has the body of the matching HTTP route. Calls made in
the same loop iteration leave together (`shardgrid.common.wire.pack_frames`), answers come back as they
finish, and any number may be in flight: a busy gateway pays one socket
write per batch of calls instead of an HTTP request and response per call.

Failures map onto the attempt semantics of `reply.py` (AttemptFailed): a stream that
cannot be opened is `refused` (nothing was sent), a call with no answer in
time is `timeout`, and a stream that breaks with calls in flight makes them
`broken` (the worker may have applied them). Ping/pong every `HEARTBEAT_S`
notices a peer that vanished without a reset (a partition).
"""
from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any, Callable

import aiohttp

import structlog

from gateway.reply import AttemptFailed, WorkerReply, reply_from
from shardgrid.common.protocol import CALLS_PATH, HEARTBEAT_S, MAX_FRAME
from shardgrid.common.wire import ItemTooLarge, error_body, pack_frames, unpack_frame

if TYPE_CHECKING:
    from gateway.router import Target

CONNECT_TIMEOUT_S = 1.0
# The outbox of one stream: calls in flight on it (queued for the next
# flush, being written, or waiting for their answer), and the bytes of
# frames handed to the socket and not yet written. A worker that reads
# slowly or not at all fills them; past either, a new call is answered 503
# `overloaded` at once (nothing sent) instead of growing the gateway's
# memory until every caller's deadline. The bytes are four of the largest
# coalesced write_batch calls (forward.MAX_CALL_BYTES, 16 MiB).
MAX_STREAM_CALLS = 65_536
MAX_UNSENT_BYTES = 64 << 20


class _Stream:
    """One open WebSocket to a worker and the calls in flight on it."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.outbox: list[Any] = []
        self.flush_scheduled = False
        self.reader: asyncio.Task[None] | None = None
        self.unsent = 0  # bytes of frames given to send_bytes that it has not finished writing

    def full(self) -> str | None:
        """Why this stream takes no more calls now (see MAX_STREAM_CALLS), or None."""
        if len(self.pending) >= MAX_STREAM_CALLS:
            return f"{len(self.pending)} calls in flight (limit {MAX_STREAM_CALLS})"
        if self.unsent >= MAX_UNSENT_BYTES:
            return f"{self.unsent} bytes not yet written to the socket (limit {MAX_UNSENT_BYTES})"
        return None

    def fail_all(self, why: str) -> None:
        broken = ConnectionResetError(why)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(broken)
        self.pending.clear()


class _Link:
    """The stream to one worker address, reopened when it breaks."""

    def __init__(self, base: str, session: aiohttp.ClientSession, log: Any) -> None:
        self.url = base + CALLS_PATH
        self.session = session
        self.log = log
        self.stream: _Stream | None = None
        self.opening: asyncio.Future[_Stream] | None = None
        self.ids = itertools.count(1)

    def live(self) -> _Stream | None:
        st = self.stream
        return st if st is not None and not st.ws.closed else None

    async def open(self) -> _Stream:
        """The live stream, opening it (once, shared by concurrent callers) if needed."""
        st = self.live()
        if st is not None:
            return st
        if self.opening is None or self.opening.done():
            self.opening = asyncio.ensure_future(self._connect())
            # Callers may have stopped waiting (their own deadline) before it fails.
            self.opening.add_done_callback(_ignore_failure)
        return await asyncio.shield(self.opening)

    async def _connect(self) -> _Stream:
        # Bounded here, not by the caller: a connect that hangs (a partition)
        # must not stay the shared attempt after the network heals.
        ws = await asyncio.wait_for(
            self.session.ws_connect(self.url, heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME,
                                    timeout=aiohttp.ClientWSTimeout(ws_close=1.0)),
            CONNECT_TIMEOUT_S)
        st = self.stream = _Stream(ws)
        st.reader = asyncio.create_task(self._read(st))
        return st

    async def _read(self, st: _Stream) -> None:
        try:
            async for frame in st.ws:
                if frame.type != aiohttp.WSMsgType.BINARY:
                    continue
                for cid, status, body in unpack_frame(frame.data):
                    fut = st.pending.pop(cid, None)
                    if fut is not None and not fut.done():
                        fut.set_result((status, body))
        except (ValueError, TypeError, aiohttp.ClientError, OSError):
            pass
        finally:
            if self.stream is st:
                self.stream = None
            # What was in flight on this stream has no answer now (calls on a
            # newer stream are not affected).
            st.fail_all("the stream to the worker closed")
            await st.ws.close()

    def submit(self, st: _Stream, op: str, gid: int, body: Any) -> tuple[int, asyncio.Future[Any]]:
        cid = next(self.ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        st.pending[cid] = fut
        st.outbox.append([cid, op, gid, body])
        if not st.flush_scheduled:
            st.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush, st)
        return cid, fut

    def _flush(self, st: _Stream) -> None:
        st.flush_scheduled = False
        calls, st.outbox = st.outbox, []
        if not calls:
            return
        if st.ws.closed:
            for cid, *_ in calls:
                fut = st.pending.pop(cid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(ConnectionResetError("the stream to the worker closed"))
            return
        # send_bytes only waits when the socket's buffer is full; a task keeps ordering simple.
        for frame in pack_frames(calls, on_error=lambda call, exc: self._unpackable(st, call, exc),
                                 max_item=MAX_FRAME):
            st.unsent += len(frame)
            task = asyncio.ensure_future(st.ws.send_bytes(frame))
            task.add_done_callback(lambda t, n=len(frame): _sent(st, n, t))

    def _unpackable(self, st: _Stream, call: list[Any], exc: Exception) -> None:
        """A call msgpack cannot pack is answered 500 on its own and left out
        of the frame: raising here would lose every call of this flush (and
        leave their callers waiting out their deadlines). The gateway builds
        call bodies from JSON it decoded, which always packs, so this is a
        gateway bug, not the client's input."""
        cid, op, gid = call[0], call[1], call[2]
        if isinstance(exc, ItemTooLarge):
            # The worker's message limit would close the stream and fail every call in flight on it.
            self.log.warning("worker_call_too_large", worker=self.url, call=op, group=gid, bytes=exc.size)
            answer = (413, error_body("payload_too_large", f"this call is {exc.size} bytes encoded, over the "
                                      f"stream's limit of {exc.limit}: split it", shard=gid, limit=exc.limit))
        else:
            self.log.error("worker_call_unpackable", worker=self.url, call=op, group=gid,
                           error=f"{type(exc).__name__}: {exc}")
            answer = (500, error_body("internal", "the gateway could not encode this call for the worker; "
                                                  "see the gateway's log", shard=gid))
        fut = st.pending.pop(cid, None)
        if fut is not None and not fut.done():
            fut.set_result(answer)

    async def close(self) -> None:
        st = self.stream
        if st is not None:
            if st.reader is not None:
                st.reader.cancel()
            await st.ws.close()


def _time_out(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


def _sent(st: _Stream, n: int, task: asyncio.Future[Any]) -> None:
    st.unsent -= n
    _ignore_failure(task)


def _ignore_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # seen: a broken stream fails its calls through the reader, a failed open its callers


class WorkerCalls:
    """`call(target, op, gid, body, timeout)` -> WorkerReply; transport failures raise AttemptFailed."""

    def __init__(self, session: aiohttp.ClientSession, log: Any = None,
                 on_overloaded: Callable[[], None] | None = None) -> None:
        self.session = session
        self.log = log if log is not None else structlog.get_logger()
        self._links: dict[str, _Link] = {}
        self.on_overloaded = on_overloaded  # told of each call refused for a full stream (a metric)

    async def call(self, target: "Target", op: str, gid: int, body: dict[str, Any],
                   timeout_s: float) -> "WorkerReply":
        link = self._links.get(target.base)
        if link is None:
            link = self._links[target.base] = _Link(target.base, self.session, self.log)
        st = link.live()
        if st is None:
            # Opening the stream spends the call's budget: what is left after
            # it is what the call may wait, or the answer comes after the deadline.
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout_s
            try:
                st = await asyncio.wait_for(link.open(), min(timeout_s, CONNECT_TIMEOUT_S))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                raise AttemptFailed("refused", False,
                                    f"{target.wid} unreachable ({type(exc).__name__}: {exc})") from None
            timeout_s = end - loop.time()
            if timeout_s <= 0:
                raise AttemptFailed("timeout", False, f"opening the stream to {target.wid} took the whole budget")
        full = st.full()
        if full is not None:
            if self.on_overloaded is not None:
                self.on_overloaded()
            self.log.debug("worker_stream_full", worker=target.wid, why=full)
            # Nothing was sent: another replica may serve it (the forwarder decides), or the client retries.
            return reply_from(503, {}, error_body("overloaded", f"the gateway's stream to {target.wid} is full: "
                                                  f"{full}; nothing was sent", shard=gid, retry_elsewhere=True),
                              target, gid)
        cid, fut = link.submit(st, op, gid, body)
        # A timer on the call's own future, not wait_for (an extra future and
        # callbacks per call).
        timer = asyncio.get_running_loop().call_later(timeout_s, _time_out, fut)
        try:
            status, reply = await fut
        except asyncio.TimeoutError:
            st.pending.pop(cid, None)
            raise AttemptFailed("timeout", True, f"{target.wid} did not answer within {timeout_s:.3f}s") from None
        except ConnectionError as exc:
            raise AttemptFailed("broken", True, f"{target.wid}: {exc}") from None
        except asyncio.CancelledError:
            st.pending.pop(cid, None)
            raise
        finally:
            timer.cancel()
        return reply_from(status, {}, reply, target, gid)

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()
