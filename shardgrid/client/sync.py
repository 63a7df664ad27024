"""The blocking client: the standard library's http.client, keep-alive
connections per gateway, the retry rules of `policy.py`.

Safe to share between threads: each request takes a connection of its own
(idle ones are kept per gateway), and the state the calls share (which
gateway answers, read-your-writes seqs) is changed under one lock.
"""
from __future__ import annotations

import http.client
import ssl
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence, TypeVar

from shardgrid.client.core import Core, Op, Response, batch_retryable, decode, merge_batch
from shardgrid.client.errors import ShardgridError
from shardgrid.client.policy import Outcome, RetryPolicy, Send
from shardgrid.client.results import (BatchResult, Deleted, Embedding, InferResult, Item, SearchResult,
                                      SignalWritten, Signals, Written)

T = TypeVar("T")
# The gateway (aiohttp) closes a connection idle for 75 s; one idle this long is
# dropped rather than reused, so a request rarely meets a connection closed under it.
IDLE_S = 15.0
MAX_IDLE_PER_GATEWAY = 8


class Client:
    """`Client(["http://gw1:8080", "http://gw2:8080"])`: items, signals, embeddings,
    search, batch and inference through any of the gateways, with the retry rules
    built in (runbook/client.md).

    `deadline_s`: each call's whole budget, retries included (per call:
    `deadline_s=`). `read_your_writes=True`: reads carry `x-min-seq`, the
    highest seq this client saw on the entity's shard (use it with
    `consistency="follower"`; strong reads see every acknowledged write anyway).
    """

    def __init__(self, gateways: Sequence[str], *, deadline_s: float = 10.0, ack: str | None = None,
                 consistency: str = "strong", read_your_writes: bool = False, policy: RetryPolicy | None = None,
                 ssl_context: ssl.SSLContext | None = None, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self._core = Core(gateways, deadline_s=deadline_s, ack=ack, consistency=consistency,
                          read_your_writes=read_your_writes, policy=policy, seed=seed)
        self._ssl = ssl_context
        self._clock = clock
        self._sleep = sleep
        self._idle: list[list[tuple[http.client.HTTPConnection, float]]] = [[] for _ in self._core.gateways]
        self._conn_lock = threading.Lock()

    # -- lifecycle

    def close(self) -> None:
        with self._conn_lock:
            idle, self._idle = self._idle, [[] for _ in self._core.gateways]
        for conns in idle:
            for conn, _ in conns:
                conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- items

    def put(self, id: str, doc: Any, *, ack: str | None = None, request_id: str | None = None,
            deadline_s: float | None = None) -> Written:
        return self._run(self._core.put_item(id, doc, ack=ack, request_id=request_id, deadline_s=deadline_s))

    def get(self, id: str, *, consistency: str | None = None, deadline_s: float | None = None) -> Item:
        """Raises NotFound for a missing item."""
        return self._run(self._core.get_item(id, consistency=consistency, deadline_s=deadline_s))

    def delete(self, id: str, *, ack: str | None = None, request_id: str | None = None,
               deadline_s: float | None = None) -> Deleted:
        """Raises NotFound when there was nothing to delete."""
        return self._run(self._core.delete_item(id, ack=ack, request_id=request_id, deadline_s=deadline_s))

    # -- signals

    def incr(self, entity: str, kind: str, value: int | float = 1, *, ack: str | None = None,
             request_id: str | None = None, deadline_s: float | None = None) -> SignalWritten:
        return self._run(self._core.signal(entity, kind, value, "incr", ack=ack, request_id=request_id,
                                           deadline_s=deadline_s))

    def set_signal(self, entity: str, kind: str, value: int | float, *, ack: str | None = None,
                   request_id: str | None = None, deadline_s: float | None = None) -> SignalWritten:
        return self._run(self._core.signal(entity, kind, value, "set", ack=ack, request_id=request_id,
                                           deadline_s=deadline_s))

    def signals(self, entity: str, *, consistency: str | None = None, deadline_s: float | None = None) -> Signals:
        return self._run(self._core.get_signals(entity, consistency=consistency, deadline_s=deadline_s))

    # -- embeddings and search

    def put_embedding(self, id: str, vector: Sequence[float], *, ack: str | None = None,
                      request_id: str | None = None, deadline_s: float | None = None) -> Written:
        return self._run(self._core.put_embedding(id, vector, ack=ack, request_id=request_id, deadline_s=deadline_s))

    def get_embedding(self, id: str, *, consistency: str | None = None, deadline_s: float | None = None) -> Embedding:
        return self._run(self._core.get_embedding(id, consistency=consistency, deadline_s=deadline_s))

    def delete_embedding(self, id: str, *, ack: str | None = None, request_id: str | None = None,
                         deadline_s: float | None = None) -> Deleted:
        return self._run(self._core.delete_embedding(id, ack=ack, request_id=request_id, deadline_s=deadline_s))

    def search(self, vector: Sequence[float], k: int = 10, *, consistency: str | None = None,
               deadline_s: float | None = None) -> SearchResult:
        return self._run(self._core.search(vector, k, consistency=consistency, deadline_s=deadline_s))

    # -- batch and inference

    def batch(self, writes: Sequence[Mapping[str, Any]], *, ack: str | None = None, request_id: str | None = None,
              deadline_s: float | None = None) -> BatchResult:
        """`writes` as the gateway takes them (`{"op": "put_item", "id", "doc"}`, `delete_item`,
        `signal`, `put_embedding`, `delete_embedding`). Entries that failed in a way a resend
        may fix are resent, the whole batch with the same request id, within the deadline;
        what still failed is in `errors`."""
        op = self._core.batch(writes, ack=ack, request_id=request_id, deadline_s=deadline_s)
        end = self._clock() + op.deadline_s
        result = self._run(op)
        rounds = 1
        while batch_retryable(result) and rounds < self._core.policy.max_attempts:
            wait = self._core.backoff(rounds)
            remaining = end - self._clock() - wait
            if remaining < self._core.policy.min_attempt_s:
                break
            self._sleep(wait)
            try:
                again = self._run(replace(op, deadline_s=remaining))
            except ShardgridError:
                break  # keep what the first rounds got; the failed entries keep their errors
            result = merge_batch(result, again)
            rounds += 1
        return result

    def infer(self, model: str, rows: Sequence[Sequence[float]], *, deadline_s: float | None = None) -> InferResult:
        return self._run(self._core.infer(model, rows, deadline_s=deadline_s))

    def health(self, *, deadline_s: float | None = None) -> dict[str, Any]:
        return self._run(self._core.healthz(deadline_s))

    # -- the loop

    def _run(self, op: Op[T]) -> T:
        core = self._core
        if core.needs_shard_count(op):
            core.learn_shard_count(self._run(core.healthz(op.deadline_s)))
        now = self._clock()
        plan = core.plan(op, now + op.deadline_s)
        with core.lock:
            step = plan.start(now)
        last: Response | None = None
        while isinstance(step, Send):
            wait = step.at - self._clock()
            if wait > 0:
                self._sleep(wait)
            last, outcome = self._attempt(step, op)
            with core.lock:
                step = plan.next(outcome, self._clock())
        return core.finish(op, plan, step, last)

    def _attempt(self, step: Send, op: Op[Any]) -> tuple[Response | None, Outcome]:
        call = op.call
        conn = self._checkout(step.gateway, step.timeout_s)
        headers = dict(step.headers)
        if call.body is not None:
            headers["content-type"] = "application/json"
        try:
            if conn.sock is None:
                conn.connect()
        except OSError as exc:  # nothing was sent: safe to send anywhere else
            conn.close()
            return None, Outcome(failure="refused", detail=f"{self._core.gateways[step.gateway].base}: {exc}")
        try:
            conn.request(call.method, call.path, body=call.body, headers=headers)
            r = conn.getresponse()
            raw = r.read()
        except TimeoutError as exc:
            conn.close()
            return None, Outcome(failure="timeout", detail=f"{self._core.gateways[step.gateway].base}: {exc}")
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            return None, Outcome(failure="broken",
                                 detail=f"{self._core.gateways[step.gateway].base}: {type(exc).__name__} {exc}")
        if r.will_close:
            conn.close()
        else:
            self._checkin(step.gateway, conn)
        resp = Response(r.status, {k.lower(): v for k, v in r.getheaders()}, decode(raw))
        return resp, self._core.outcome(resp)

    def _checkout(self, g: int, timeout_s: float) -> http.client.HTTPConnection:
        now = self._clock()
        stale: list[http.client.HTTPConnection] = []
        conn: http.client.HTTPConnection | None = None
        with self._conn_lock:
            idle = self._idle[g]
            while idle:
                c, since = idle.pop()
                if now - since < IDLE_S:
                    conn = c
                    break
                stale.append(c)
        for c in stale:
            c.close()
        if conn is None:
            gw = self._core.gateways[g]
            if gw.scheme == "https":
                conn = http.client.HTTPSConnection(gw.host, gw.port, timeout=timeout_s, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(gw.host, gw.port, timeout=timeout_s)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _checkin(self, g: int, conn: http.client.HTTPConnection) -> None:
        with self._conn_lock:
            if len(self._idle[g]) < MAX_IDLE_PER_GATEWAY:
                self._idle[g].append((conn, self._clock()))
                return
        conn.close()
