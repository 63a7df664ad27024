"""The blocking client: the standard library's http.client, keep-alive
connections per gateway, the retry rules of `policy.py`.

Safe to share between threads: each request takes a connection of its own
(idle ones are kept per gateway), and the state the calls share (which
gateway answers, read-your-writes seqs) is changed under one lock.
"""
from __future__ import annotations

import functools
import http.client
import io
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

from shardgrid.client.core import BatchRounds, Core, Op, Response, decode
from shardgrid.client.errors import ShardgridError
from shardgrid.client.policy import CallPlan, Outcome, RetryPolicy, Send, WriteWindow
from shardgrid.client.results import (BatchResult, Deleted, Embedding, InferResult, Item, SearchResult,
                                      SignalWritten, Signals, Written)

T = TypeVar("T")
# The gateway (aiohttp) closes a connection idle for 75 s; one idle this long is
# dropped rather than reused, so a request rarely meets a connection closed under it.
IDLE_S = 15.0
MAX_IDLE_PER_GATEWAY = 8


@dataclass
class _Read:
    """What one attempt has read of its answer so far (a stale connection reads nothing)."""

    bytes: int = 0


@dataclass(frozen=True)
class _Refused:
    """The connection was never made: nothing was sent."""

    cause: OSError


class _DeadlineReader(io.RawIOBase):
    """The socket of one answer, read with the socket's timeout reset before every
    recv to what is left of the attempt: a server dripping a byte at a time
    cannot hold the call past its deadline (a plain socket timeout is per recv)."""

    def __init__(self, sock: Any, end: float, progress: _Read) -> None:
        super().__init__()
        self._sock = sock
        self._end = end  # time.monotonic(): socket timeouts are real time, whatever clock the client was given
        self._progress = progress

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer did not arrive whole within the call's deadline")
        self._sock.settimeout(left)
        n = self._sock.recv_into(b)
        self._progress.bytes += n
        return n


class _BoundedResponse(http.client.HTTPResponse):
    """An HTTPResponse reading through `_DeadlineReader` (status line, headers and body)."""

    def __init__(self, sock: Any, *args: Any, end: float, progress: _Read, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self.fp.close()  # the plain makefile() of the base class, not read from yet
        self.fp = io.BufferedReader(_DeadlineReader(sock, end, progress))


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
        rounds = BatchRounds(self._core.policy, self._clock() + op.deadline_s)
        rounds.took(self._run(op, rounds.deadline, rounds.window))  # the first round's error is the batch's
        while (at := rounds.resend_at(self._clock(), self._core.backoff(rounds.rounds))) is not None:
            self._sleep(at - self._clock())
            try:
                rounds.took(self._run(op, rounds.deadline, rounds.window))
            except ShardgridError as exc:
                rounds.failed(exc)  # its attempts are spent; what it may have applied is noted
                break
        return rounds.final()

    def infer(self, model: str, rows: Sequence[Sequence[float]], *, deadline_s: float | None = None) -> InferResult:
        return self._run(self._core.infer(model, rows, deadline_s=deadline_s))

    def health(self, *, deadline_s: float | None = None) -> dict[str, Any]:
        return self._run(self._core.healthz(deadline_s))

    # -- the loop

    def _run(self, op: Op[T], deadline: float | None = None, window: WriteWindow | None = None) -> T:
        """One call. `deadline` (monotonic): the whole call's, given when this call is part of a
        larger one (a batch round, the shard-count lookup of a read); `window`: a batch's dedup window."""
        core = self._core
        if deadline is None:
            deadline = self._clock() + op.deadline_s
        if core.needs_shard_count(op):
            # Charged to the read's own deadline: the caller's budget is for the whole call.
            core.learn_shard_count(self._run(core.healthz(op.deadline_s), deadline))
        now = self._clock()
        plan = core.plan(op, deadline, window)
        with core.lock:
            step = plan.start(now)
        last: Response | None = None
        while isinstance(step, Send):
            wait = step.at - self._clock()
            if wait > 0:
                self._sleep(wait)
            last, outcome = self._attempt(step, op, plan)
            with core.lock:
                step = plan.next(outcome, self._clock())
        return core.finish(op, plan, step, last)

    def _attempt(self, step: Send, op: Op[Any], plan: CallPlan) -> tuple[Response | None, Outcome]:
        base = self._core.gateways[step.gateway].base
        conn, reused = self._checkout(step.gateway)
        result, progress = self._exchange(conn, step, op, plan)
        if reused and isinstance(result, Exception) and not isinstance(result, TimeoutError) and not progress.bytes:
            # A pooled connection the server (or a proxy) closed while it sat idle fails
            # before any byte of an answer: that says nothing of the gateway. Once, on a
            # fresh connection, with the same request id (so a write that did arrive is
            # answered from the dedup table): not an attempt, the gateway not marked down.
            conn = self._connection(step.gateway)
            first = result
            result, progress = self._exchange(conn, step, op, plan)
            if isinstance(result, _Refused):
                # The gateway is gone, not merely the idle connection: the request it was sent
                # on the pooled one may have reached it (and been applied) before it died. That
                # attempt's failure stands: outcome unknown, never "nothing was sent".
                result = first
        if isinstance(result, Response):
            return result, self._core.outcome(result)
        if isinstance(result, _Refused):
            return None, Outcome(failure="refused", detail=f"{base}: {result.cause}")
        if isinstance(result, TimeoutError):
            return None, Outcome(failure="timeout", detail=f"{base}: {result}")
        return None, Outcome(failure="broken", detail=f"{base}: {type(result).__name__} {result}")

    def _exchange(self, conn: http.client.HTTPConnection, step: Send, op: Op[Any],
                  plan: CallPlan) -> tuple[Response | Exception | _Refused, _Read]:
        """One request on `conn`: the answer, or the exception that ended it (the connection closed)."""
        call = op.call
        progress = _Read()
        try:
            if conn.sock is None:
                conn.timeout = max(0.001, plan.budget(self._clock())[1])
                conn.connect()
        except OSError as exc:  # nothing was sent: safe to send anywhere else
            conn.close()
            return _Refused(exc), progress
        # Just before writing: connecting and oversleeping are not promised to the gateway.
        deadline_ms, timeout_s = plan.budget(self._clock())
        headers = {**step.headers, "x-deadline-ms": deadline_ms}
        if call.body is not None:
            headers["content-type"] = "application/json"
        # The response reads through _DeadlineReader: this bounds the whole answer, not each recv.
        conn.response_class = functools.partial(_BoundedResponse, end=time.monotonic() + timeout_s,
                                                progress=progress)  # type: ignore[assignment]
        try:
            assert conn.sock is not None
            conn.sock.settimeout(max(0.001, timeout_s))  # bounds sending (sendall's timeout is its total)
            conn.request(call.method, call.path, body=call.body, headers=headers)
            r = conn.getresponse()
            raw = r.read()
        except (OSError, http.client.HTTPException) as exc:  # TimeoutError is an OSError
            conn.close()
            return exc, progress
        if r.will_close:
            conn.close()
        else:
            self._checkin(step.gateway, conn)
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, decode(raw)), progress

    def _checkout(self, g: int) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to gateway `g` (True: reused) or a new one, not yet connected (False)."""
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
        if conn is not None and conn.sock is not None:
            return conn, True
        return self._connection(g), False

    def _connection(self, g: int) -> http.client.HTTPConnection:
        gw = self._core.gateways[g]
        if gw.scheme == "https":
            return http.client.HTTPSConnection(gw.host, gw.port, context=self._ssl)
        return http.client.HTTPConnection(gw.host, gw.port)

    def _checkin(self, g: int, conn: http.client.HTTPConnection) -> None:
        conn.response_class = http.client.HTTPResponse  # type: ignore[assignment]  # drop the attempt's bound
        with self._conn_lock:
            if len(self._idle[g]) < MAX_IDLE_PER_GATEWAY:
                self._idle[g].append((conn, self._clock()))
                return
        conn.close()
