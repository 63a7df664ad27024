"""Calls to workers over one WebSocket stream per worker (the worker's `/v1/calls`).

A call is `[id, op, gid, body]` (op: write, write_batch, read); the answer
`[id, status, body]` has the body of the matching HTTP route. Calls made in
the same loop iteration leave in one frame, answers come back as they
finish, and any number may be in flight: a busy gateway pays one socket
write per batch of calls instead of an HTTP request and response per call.

Failures map onto the attempt semantics of `forward.py`: a stream that
cannot be opened is `refused` (nothing was sent), a call with no answer in
time is `timeout`, and a stream that breaks with calls in flight makes them
`broken` (the worker may have applied them). Ping/pong every `HEARTBEAT_S`
notices a peer that vanished without a reset (a partition).
"""
from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

import aiohttp

from shardgrid.wire import packb, unpackb

if TYPE_CHECKING:
    from gateway.forward import WorkerReply
    from gateway.router import Target

CALLS_PATH = "/v1/calls"
HEARTBEAT_S = 1.0
CONNECT_TIMEOUT_S = 1.0
MAX_FRAME = 64 << 20


class _Link:
    """The stream to one worker address."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.url = base + CALLS_PATH
        self.session = session
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.outbox: list[Any] = []
        self.opening: asyncio.Future[None] | None = None
        self.reader: asyncio.Task[None] | None = None
        self.flush_scheduled = False
        self.ids = itertools.count(1)

    async def open(self) -> aiohttp.ClientWebSocketResponse:
        """The live stream, opening it (once, shared by concurrent callers) if needed."""
        if self.ws is not None and not self.ws.closed:
            return self.ws
        if self.opening is None or self.opening.done():
            self.opening = asyncio.ensure_future(self._connect())
        await asyncio.shield(self.opening)
        assert self.ws is not None
        return self.ws

    async def _connect(self) -> None:
        ws = await self.session.ws_connect(self.url, heartbeat=HEARTBEAT_S, max_msg_size=MAX_FRAME,
                                           timeout=aiohttp.ClientWSTimeout(ws_close=1.0))
        self.ws = ws
        self.reader = asyncio.create_task(self._read(ws))

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        try:
            async for frame in ws:
                if frame.type != aiohttp.WSMsgType.BINARY:
                    continue
                for cid, status, body in unpackb(frame.data):
                    fut = self.pending.pop(cid, None)
                    if fut is not None and not fut.done():
                        fut.set_result((status, body))
        except (ValueError, TypeError, aiohttp.ClientError, OSError):
            pass
        finally:
            if self.ws is ws:
                self.ws = None
            # Whatever was in flight on this stream has no answer now.
            broken = ConnectionResetError("the stream to the worker closed")
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(broken)
            self.pending.clear()
            await ws.close()

    def submit(self, ws: aiohttp.ClientWebSocketResponse, op: str, gid: int,
               body: Any) -> tuple[int, asyncio.Future[Any]]:
        cid = next(self.ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[cid] = fut
        self.outbox.append([cid, op, gid, body])
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush, ws)
        return cid, fut

    def _flush(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.flush_scheduled = False
        calls, self.outbox = self.outbox, []
        if not calls:
            return
        if ws.closed:
            for cid, *_ in calls:
                fut = self.pending.pop(cid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(ConnectionResetError("the stream to the worker closed"))
            return
        # send_bytes only waits when the socket's buffer is full; a task keeps ordering simple.
        task = asyncio.ensure_future(ws.send_bytes(packb(calls)))
        task.add_done_callback(_ignore_failure)

    def forget(self, cid: int) -> None:
        self.pending.pop(cid, None)

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.ws is not None:
            await self.ws.close()


def _ignore_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a broken stream fails its calls through the reader


class WorkerCalls:
    """`call(target, op, gid, body, timeout)` -> WorkerReply; transport failures raise AttemptFailed."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._links: dict[str, _Link] = {}

    async def call(self, target: "Target", op: str, gid: int, body: dict[str, Any],
                   timeout_s: float) -> "WorkerReply":
        from gateway.forward import AttemptFailed, reply_from

        link = self._links.get(target.base)
        if link is None:
            link = self._links[target.base] = _Link(target.base, self.session)
        ws = link.ws
        if ws is None or ws.closed:
            try:
                ws = await asyncio.wait_for(link.open(), min(timeout_s, CONNECT_TIMEOUT_S))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                raise AttemptFailed("refused", False,
                                    f"{target.wid} unreachable ({type(exc).__name__}: {exc})") from None
        cid, fut = link.submit(ws, op, gid, body)
        try:
            status, reply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            link.forget(cid)
            raise AttemptFailed("timeout", True, f"{target.wid} did not answer within {timeout_s:.3f}s") from None
        except ConnectionError as exc:
            raise AttemptFailed("broken", True, f"{target.wid}: {exc}") from None
        except asyncio.CancelledError:
            link.forget(cid)
            raise
        return reply_from(status, {}, reply, target, gid)

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()
