"""The asyncio client: aiohttp, the same retry rules (`policy.py`) and calls (`core.py`) as `Client`."""
from __future__ import annotations

import asyncio
import ssl
from dataclasses import replace
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar

import aiohttp
from yarl import URL

from shardgrid.client.core import Core, Op, Response, batch_retryable, decode, merge_batch
from shardgrid.client.errors import ShardgridError
from shardgrid.client.policy import Outcome, RetryPolicy, Send
from shardgrid.client.results import (BatchResult, Deleted, Embedding, InferResult, Item, SearchResult,
                                      SignalWritten, Signals, Written)

T = TypeVar("T")
# Below the gateway's own 75 s keep-alive: a pooled connection is dropped before the server drops it.
KEEPALIVE_S = 15.0


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

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    # -- lifecycle

    def _http(self) -> aiohttp.ClientSession:
        # Made on first use, inside the running loop the session belongs to.
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=KEEPALIVE_S,
                                             ssl=self._ssl if self._ssl is not None else True)
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        end = self._now() + op.deadline_s
        result = await self._run(op)
        rounds = 1
        while batch_retryable(result) and rounds < self._core.policy.max_attempts:
            wait = self._core.backoff(rounds)
            remaining = end - self._now() - wait
            if remaining < self._core.policy.min_attempt_s:
                break
            await self._sleep(wait)
            try:
                again = await self._run(replace(op, deadline_s=remaining))
            except ShardgridError:
                break  # keep what the first rounds got; the failed entries keep their errors
            result = merge_batch(result, again)
            rounds += 1
        return result

    async def infer(self, model: str, rows: Sequence[Sequence[float]], *,
                    deadline_s: float | None = None) -> InferResult:
        return await self._run(self._core.infer(model, rows, deadline_s=deadline_s))

    async def health(self, *, deadline_s: float | None = None) -> dict[str, Any]:
        return await self._run(self._core.healthz(deadline_s))

    # -- the loop

    async def _run(self, op: Op[T]) -> T:
        core = self._core
        if core.needs_shard_count(op):
            core.learn_shard_count(await self._run(core.healthz(op.deadline_s)))
        now = self._now()
        plan = core.plan(op, now + op.deadline_s)
        step = plan.start(now)
        last: Response | None = None
        while isinstance(step, Send):
            wait = step.at - self._now()
            if wait > 0:
                await self._sleep(wait)
            last, outcome = await self._attempt(step, op)
            step = plan.next(outcome, self._now())
        return core.finish(op, plan, step, last)

    async def _attempt(self, step: Send, op: Op[Any]) -> tuple[Response | None, Outcome]:
        call = op.call
        base = self._core.gateways[step.gateway].base
        headers = dict(step.headers)
        if call.body is not None:
            headers["content-type"] = "application/json"
        try:
            async with self._http().request(call.method, URL(base + call.path, encoded=True), data=call.body,
                                            headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=step.timeout_s)) as r:
                raw = await r.read()
                resp = Response(r.status, {k.lower(): v for k, v in r.headers.items()}, decode(raw))
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # The connection was never made: nothing was sent.
            return None, Outcome(failure="refused", detail=f"{base}: {exc}")
        except asyncio.TimeoutError as exc:
            return None, Outcome(failure="timeout", detail=f"{base}: timed out {exc}")
        except aiohttp.ClientError as exc:
            return None, Outcome(failure="broken", detail=f"{base}: {type(exc).__name__} {exc}")
        return resp, self._core.outcome(resp)
