"""The asyncio client: aiohttp, the same retry rules (`policy.py`) and calls (`core.py`) as `Client`."""
from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import aiohttp
from yarl import URL

from shardgrid.client.core import BatchRounds, Core, Op, Response, decode
from shardgrid.client.errors import ShardgridError
from shardgrid.client.policy import CallPlan, Outcome, RetryPolicy, Send, WriteWindow
from shardgrid.client.results import (BatchResult, Deleted, Embedding, InferResult, Item, SearchResult,
                                      SignalWritten, Signals, Written)

T = TypeVar("T")
# Below the gateway's own 75 s keep-alive: a pooled connection is dropped before the server drops it.
KEEPALIVE_S = 15.0


@dataclass
class _Conn:
    """Whether the connection an attempt went out on came from the pool (set by aiohttp's trace signals)."""

    reused: bool = False


async def _on_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
    if isinstance(ctx.trace_request_ctx, _Conn):
        ctx.trace_request_ctx.reused = True


async def _on_create(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
    # aiohttp itself retries a GET, PUT or DELETE once on a new connection: the last one is what counts.
    if isinstance(ctx.trace_request_ctx, _Conn):
        ctx.trace_request_ctx.reused = False


class AsyncClient:
    """`AsyncClient(["http://gw1:8080", "http://gw2:8080"])`, used as `async with` (or
    `await client.close()`); the methods of `Client`, awaited. One client per event loop."""

    def __init__(self, gateways: Sequence[str], *, deadline_s: float = 10.0, ack: str | None = None,
                 consistency: str = "strong", read_your_writes: bool = False, policy: RetryPolicy | None = None,
                 ssl_context: ssl.SSLContext | None = None, seed: int | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, limit: int = 100) -> None:
        self._core = Core(gateways, deadline_s=deadline_s, ack=ack, consistency=consistency,
                          read_your_writes=read_your_writes, policy=policy, seed=seed)
        self._ssl = ssl_context
        self._clock = clock
        self._sleep = sleep
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # new connections only: resends after a stale one

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    # -- lifecycle

    def _http(self) -> aiohttp.ClientSession:
        # Made on first use, inside the running loop the session belongs to.
        if self._session is None or self._session.closed:
            trace = aiohttp.TraceConfig()
            trace.on_connection_reuseconn.append(_on_reuse)
            trace.on_connection_create_start.append(_on_create)
            connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=KEEPALIVE_S,
                                             ssl=self._ssl if self._ssl is not None else True)
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                                  trace_configs=[trace])
        return self._session

    def _fresh_http(self) -> aiohttp.ClientSession:
        # force_close: every request gets a new connection, never a pooled one that may be stale too.
        if self._fresh is None or self._fresh.closed:
            connector = aiohttp.TCPConnector(force_close=True, ssl=self._ssl if self._ssl is not None else True)
            self._fresh = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
        return self._fresh

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- items

    async def put(self, id: str, doc: Any, *, ack: str | None = None, request_id: str | None = None,
                  deadline_s: float | None = None) -> Written:
        return await self._run(self._core.put_item(id, doc, ack=ack, request_id=request_id, deadline_s=deadline_s))

    async def get(self, id: str, *, consistency: str | None = None, deadline_s: float | None = None) -> Item:
        return await self._run(self._core.get_item(id, consistency=consistency, deadline_s=deadline_s))

    async def delete(self, id: str, *, ack: str | None = None, request_id: str | None = None,
                     deadline_s: float | None = None) -> Deleted:
        return await self._run(self._core.delete_item(id, ack=ack, request_id=request_id, deadline_s=deadline_s))

    # -- signals

    async def incr(self, entity: str, kind: str, value: int | float = 1, *, ack: str | None = None,
                   request_id: str | None = None, deadline_s: float | None = None) -> SignalWritten:
        return await self._run(self._core.signal(entity, kind, value, "incr", ack=ack, request_id=request_id,
                                                 deadline_s=deadline_s))

    async def set_signal(self, entity: str, kind: str, value: int | float, *, ack: str | None = None,
                         request_id: str | None = None, deadline_s: float | None = None) -> SignalWritten:
        return await self._run(self._core.signal(entity, kind, value, "set", ack=ack, request_id=request_id,
                                                 deadline_s=deadline_s))

    async def signals(self, entity: str, *, consistency: str | None = None,
                      deadline_s: float | None = None) -> Signals:
        return await self._run(self._core.get_signals(entity, consistency=consistency, deadline_s=deadline_s))

    # -- embeddings and search

    async def put_embedding(self, id: str, vector: Sequence[float], *, ack: str | None = None,
                            request_id: str | None = None, deadline_s: float | None = None) -> Written:
        return await self._run(self._core.put_embedding(id, vector, ack=ack, request_id=request_id,
                                                        deadline_s=deadline_s))

    async def get_embedding(self, id: str, *, consistency: str | None = None,
                            deadline_s: float | None = None) -> Embedding:
        return await self._run(self._core.get_embedding(id, consistency=consistency, deadline_s=deadline_s))

    async def delete_embedding(self, id: str, *, ack: str | None = None, request_id: str | None = None,
                               deadline_s: float | None = None) -> Deleted:
        return await self._run(self._core.delete_embedding(id, ack=ack, request_id=request_id,
                                                           deadline_s=deadline_s))

    async def search(self, vector: Sequence[float], k: int = 10, *, consistency: str | None = None,
                     deadline_s: float | None = None) -> SearchResult:
        return await self._run(self._core.search(vector, k, consistency=consistency, deadline_s=deadline_s))

    # -- batch and inference

    async def batch(self, writes: Sequence[Mapping[str, Any]], *, ack: str | None = None,
                    request_id: str | None = None, deadline_s: float | None = None) -> BatchResult:
        """As `Client.batch`."""
        op = self._core.batch(writes, ack=ack, request_id=request_id, deadline_s=deadline_s)
        rounds = BatchRounds(self._core.policy, self._now() + op.deadline_s)
        rounds.took(await self._run(op, rounds.deadline, rounds.window))  # the first round's error is the batch's
        while (at := rounds.resend_at(self._now(), self._core.backoff(rounds.rounds))) is not None:
            await self._sleep(at - self._now())
            try:
                rounds.took(await self._run(op, rounds.deadline, rounds.window))
            except ShardgridError as exc:
                rounds.failed(exc)  # its attempts are spent; what it may have applied is noted
                break
        return rounds.final()

    async def infer(self, model: str, rows: Sequence[Sequence[float]], *,
                    deadline_s: float | None = None) -> InferResult:
        return await self._run(self._core.infer(model, rows, deadline_s=deadline_s))

    async def health(self, *, deadline_s: float | None = None) -> dict[str, Any]:
        return await self._run(self._core.healthz(deadline_s))

    # -- the loop

    async def _run(self, op: Op[T], deadline: float | None = None, window: WriteWindow | None = None) -> T:
        """As `Client._run`: `deadline` the whole call's when it is part of a larger one."""
        core = self._core
        if deadline is None:
            deadline = self._now() + op.deadline_s
        if core.needs_shard_count(op):
            # Charged to the read's own deadline: the caller's budget is for the whole call.
            core.learn_shard_count(await self._run(core.healthz(op.deadline_s), deadline))
        now = self._now()
        plan = core.plan(op, deadline, window)
        step = plan.start(now)
        last: Response | None = None
        while isinstance(step, Send):
            wait = step.at - self._now()
            if wait > 0:
                await self._sleep(wait)
            last, outcome = await self._attempt(step, op, plan)
            step = plan.next(outcome, self._now())
        return core.finish(op, plan, step, last)

    async def _attempt(self, step: Send, op: Op[Any], plan: CallPlan) -> tuple[Response | None, Outcome]:
        base = self._core.gateways[step.gateway].base
        conn = _Conn()
        try:
            try:
                resp = await self._exchange(self._http(), step, op, plan, conn)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if not conn.reused or isinstance(exc, aiohttp.ClientConnectorError) or getattr(exc, "answered", False):
                    raise
                # A pooled connection closed while idle, before any answer: once more on a
                # new one, with the same request id; not an attempt, the gateway not marked down.
                try:
                    resp = await self._exchange(self._fresh_http(), step, op, plan, _Conn())
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                    # The gateway is gone, not merely the idle connection: the request sent on the
                    # pooled one may have reached it (and been applied) before it died. That
                    # attempt's failure stands: outcome unknown, never "nothing was sent".
                    raise exc from None
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # The connection was never made: nothing was sent.
            return None, Outcome(failure="refused", detail=f"{base}: {exc}")
        except asyncio.TimeoutError as exc:
            return None, Outcome(failure="timeout", detail=f"{base}: timed out {exc}")
        except aiohttp.ClientError as exc:
            return None, Outcome(failure="broken", detail=f"{base}: {type(exc).__name__} {exc}")
        return resp, self._core.outcome(resp)

    async def _exchange(self, session: aiohttp.ClientSession, step: Send, op: Op[Any], plan: CallPlan,
                        conn: _Conn) -> Response:
        call = op.call
        # Just before sending: a late wake-up is not promised to the gateway (connecting
        # happens inside aiohttp, after this). The timeout bounds the whole exchange, body included.
        deadline_ms, timeout_s = plan.budget(self._now())
        headers = {**step.headers, "x-deadline-ms": deadline_ms}
        if call.body is not None:
            headers["content-type"] = "application/json"
        async with session.request(call.method, URL(self._core.gateways[step.gateway].base + call.path, encoded=True),
                                   data=call.body, headers=headers, trace_request_ctx=conn,
                                   timeout=aiohttp.ClientTimeout(total=max(0.001, timeout_s))) as r:
            try:
                raw = await r.read()
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                exc.answered = True  # type: ignore[attr-defined]  # part of an answer came: not a stale connection
                raise
            return Response(r.status, {k.lower(): v for k, v in r.headers.items()}, decode(raw))
