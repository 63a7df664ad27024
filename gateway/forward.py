"""Forwarding: the routing cache that follows meta, and the calls to workers.

`RouteCache` keeps the current `RoutingTable`: a long-poll watch of meta's
`/v1/cluster` (MetaClient follows meta leader changes and node failures), plus
a direct `GET /v1/cluster` whenever a request suspects the table is stale
(`nudge`, rate-limited). Requests that pause between attempts wait on
`changed_future()` rather than sleeping blind, so a failover reaches them as
soon as meta publishes it.

`Forwarder` runs the retry loop of one request against one group, with the
pure policy of `gateway/router.py`. Every attempt at a leader is registered
with the cache; if meta names a different leader while it is in flight (a
hung worker), the cache cancels it and the request moves on at once. A write
keeps its request id across attempts, so the workers' replicated dedup table
applies it once.

Calls go over `gateway/calls.py` (one stream per worker). `GroupCaller`
sends a group's writes: single writes, and each `/batch`'s part for the
group. While a call to the group's leader is in flight, further writes to it
queue and leave together as ONE `write_batch` when it returns (no timers: an
idle gateway adds no latency; a busy one turns N round trips into one). The
leader makes one log entry of each call's fresh writes, so the parts of many
concurrent `/batch` requests cost one call, one entry and one reply instead
of one each (runbook/benchmarking.md has the figures). Lanes are per (group, leader
address), so a hung old leader never holds up writes for the new one.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp
from prometheus_client import Counter, Gauge

from gateway.calls import WorkerCalls
# WorkerReply, AttemptFailed and reply_from are re-exported: routes, models and the tests take them from here.
from gateway.reply import AttemptFailed, WorkerReply, int_or_none, item_reply, reply_from  # noqa: F401
from gateway.router import (MIN_ATTEMPT_S, NO_QUORUM, WORKER_MARGIN_S, AttemptBudget, Hint, Next, RetryState,
                            RoutingTable, Target, accept_hint, after_reply, attempt_budget, backoff_s, give_up,
                            prune_hints)
from meta.client import MetaClient, MetaUnreachable
from shardgrid.common.httpmetrics import HttpMetrics
from shardgrid.common.tls import scheme
from shardgrid.common.wire import ApiError, error_body

# Bounds of one coalesced write_batch (the rest wait for the next call): client
# records (a put_items counts its ids; the leader's Appends carry 4096), and
# what the requests that carried its writes weighed, so that a call of many
# large documents stays far below the stream's 64 MiB frame limit.
MAX_CALL_RECORDS = 4096
MAX_CALL_BYTES = 16 << 20
# Coalesced calls in flight per (group, leader). One: what arrives meanwhile
# leaves together in the next call, so the leader runs fewer, larger rounds
# (each round is an fsync on every replica and a dozen process wake-ups);
# measured against 2 in runbook/benchmarking.md, "Measurements behind constants".
LANE_DEPTH = 1
REFRESH_MIN_INTERVAL_S = 0.05  # at most ~20 direct GET /v1/cluster per second, however many nudges
REFRESH_DEADLINE_S = 1.0



class GatewayMetrics:
    """HTTP metrics (per route and code) plus the gateway's own counters, one registry."""

    def __init__(self, version: str = "") -> None:
        self.http = HttpMetrics("gateway", version)
        reg = self.http.registry
        self.retries = Counter("shardgrid_gateway_retries", "attempts retried, by reason", ["reason"], registry=reg)
        self.refusals = Counter("shardgrid_gateway_refusals",
                                "the gateway's own answers when the deadline budget ran out, by code",
                                ["code"], registry=reg)
        self.write_batches = Counter("shardgrid_gateway_write_batches", "write_batch calls to workers, by source",
                                     ["source"], registry=reg)
        self.coalesced = Counter("shardgrid_gateway_coalesced_writes",
                                 "writes sent in a write_batch that carried more than one caller's "
                                 "(a /batch part's put_items counts once)", registry=reg)
        self.stream_full = Counter("shardgrid_gateway_stream_full",
                                   "calls answered 503 overloaded by the gateway because its stream to the worker "
                                   "was full (gateway/calls.py MAX_STREAM_CALLS, MAX_UNSENT_BYTES)", registry=reg)
        self.degraded = Counter("shardgrid_gateway_search_degraded", "searches answered without some shard",
                                registry=reg)
        self.revision = Gauge("shardgrid_gateway_routing_revision", "meta revision of the routing table",
                              registry=reg)
        self.leaderless = Gauge("shardgrid_gateway_groups_without_ready_leader",
                                "groups whose leader is unknown or not ready", registry=reg)


@dataclass(slots=True)
class Trace:
    """What one client request did, for the access log and response headers."""

    request_id: str | None = None
    shard: int | None = None
    leader: str | None = None  # the last worker tried
    attempts: int = 0
    outcome: str | None = None


class LeaderMoved(Exception):
    """Meta named another leader while an attempt was in flight; it was abandoned."""


@dataclass(eq=False, slots=True)
class Attempt:
    """One try at one worker. `sent`: the request may have reached it (outcome
    unknown on failure). `task`/`wid`/`moved`: while it is in flight to a leader,
    the route cache cancels it (and sets `moved`) when meta names another one."""

    sent: bool = False
    task: asyncio.Task[Any] | None = None
    wid: str = ""
    moved: bool = False


# -- the routing cache ------------------------------------------------------------------------------


class RouteCache:
    def __init__(self, meta: MetaClient, log: Any, metrics: GatewayMetrics, watch_timeout_s: float = 25.0) -> None:
        self.meta = meta
        self.log = log
        self.metrics = metrics
        self.watch_timeout_s = watch_timeout_s
        self.table: RoutingTable | None = None
        self.hints: dict[int, Hint] = {}
        self._changed: asyncio.Future[None] | None = None
        self._inflight: dict[int, set[Attempt]] = {}  # gid -> attempts in flight to its leader
        self._refresh = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # -- updates

    def update(self, view: Any) -> bool:
        """Adopt `view` if it is newer than the table; wake every waiting request."""
        try:
            table = RoutingTable.from_view(view, scheme(self.meta.tls))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            self.log.warning("routing_view_unusable", error=f"{type(exc).__name__}: {exc}")
            return False
        if self.table is not None and table.revision <= self.table.revision:
            return False
        self.hints = prune_hints(self.hints, table)
        self.table = table
        self.metrics.revision.set(table.revision)
        self.metrics.leaderless.set(len(table.groups_without_ready_leader()))
        self.log.debug("routing_table", revision=table.revision, shards=table.shards)
        fut, self._changed = self._changed, None
        if fut is not None and not fut.done():
            fut.set_result(None)
        self._abandon_moved()
        return True

    def _abandon_moved(self) -> None:
        """Cancel attempts still waiting on a worker that no longer leads their group
        (a hung leader would otherwise hold them until their budget is gone)."""
        for gid, attempts in self._inflight.items():
            if not attempts:
                continue
            target = self.leader_target(gid)
            if target is None:
                continue
            for a in attempts:
                if a.wid != target.wid and not a.moved and a.task is not None:
                    a.moved = True
                    a.task.cancel()

    def track(self, gid: int, attempt: Attempt) -> None:
        self._inflight.setdefault(gid, set()).add(attempt)

    def untrack(self, gid: int, attempt: Attempt) -> None:
        attempts = self._inflight.get(gid)
        if attempts is not None:
            attempts.discard(attempt)

    def apply_hint(self, gid: int, leader: Any, term: Any) -> None:
        table = self.table
        if table is None:
            return
        hint = accept_hint(table.groups.get(gid), self.hints.get(gid), leader, term)
        if hint is not None and hint.leader in table.workers:
            self.hints[gid] = hint
        else:
            self.nudge()  # a leader we cannot reach by name: meta knows more

    def nudge(self) -> None:
        """Ask for a direct GET /v1/cluster soon (coalesced and rate-limited)."""
        self._refresh.set()

    # -- lookups

    def leader_target(self, gid: int) -> Target | None:
        table = self.table
        return None if table is None else table.leader_target(gid, self.hints.get(gid))

    def changed_future(self) -> asyncio.Future[None]:
        """Resolved at the next table change (shared by every waiter)."""
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    async def wait_changed(self, timeout_s: float) -> None:
        if timeout_s > 0:
            await asyncio.wait((self.changed_future(),), timeout=timeout_s)

    async def wait_for_table(self, deadline: float) -> RoutingTable | None:
        """The table once it has a topology, waiting (at most until `deadline`) if needed."""
        loop = asyncio.get_running_loop()
        while self.table is None or self.table.shards < 1:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            self.nudge()
            await self.wait_changed(min(remaining, 0.1))
        return self.table

    # -- background

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(), name="gateway-watch"),
                       asyncio.create_task(self._refresher(), name="gateway-refresh")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _watch(self) -> None:
        # MetaClient.watch retries forever across meta failures and leader changes.
        async for view in self.meta.watch(after=-1, poll_timeout_s=self.watch_timeout_s):
            if self.update(view):
                self.log.info("routing_updated", revision=view.get("revision"))

    async def _refresher(self) -> None:
        while True:
            await self._refresh.wait()
            self._refresh.clear()
            try:
                status, body, _ = await self.meta.request("GET", "/v1/cluster", deadline_s=REFRESH_DEADLINE_S,
                                                          attempt_timeout_s=REFRESH_DEADLINE_S / 2)
            except MetaUnreachable as exc:
                self.log.debug("routing_refresh_failed", error=str(exc))
            else:
                if status == 200 and isinstance(body, dict) and self.update(body):
                    self.log.info("routing_updated", revision=body.get("revision"), via="refresh")
            await asyncio.sleep(REFRESH_MIN_INTERVAL_S)


# -- per-group write calls (coalescing) ------------------------------------------------------------


@dataclass(eq=False, slots=True)
class QueuedWrites:
    """One caller's writes in a lane: a single write, or a `/batch`'s part for the group (`many`)."""

    writes: list[dict[str, Any]]  # as sent: {"op", "rid"}
    many: bool  # answered with {"results": [...]} for exactly its writes, not as one write
    records: int  # client records (a put_items counts its ids)
    size: int  # bytes of the request(s) it came from: an upper bound of what it adds to a call
    ack: str
    deadline: float  # loop time by which its owner stops waiting
    fut: asyncio.Future[WorkerReply | AttemptFailed]
    attempt: Attempt


@dataclass(slots=True)
class _Lane:
    inflight: int = 0
    flush_scheduled: bool = False
    queue: list[QueuedWrites] = field(default_factory=list)


class GroupCaller:
    """Writes to one group, coalesced per leader.

    Writes that arrive in the same loop iteration leave together; at most
    `LANE_DEPTH` calls per leader are in flight, and what arrives while the
    lane is full waits for the next free slot, so a busy gateway sends few,
    large batches and an idle one adds no latency (no timers).
    """

    def __init__(self, gid: int, calls: WorkerCalls, metrics: GatewayMetrics) -> None:
        self.gid = gid
        self.calls = calls
        self.metrics = metrics
        self._lanes: dict[str, _Lane] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def write(self, target: Target, op: dict[str, Any], rid: str, ack: str, budget: AttemptBudget,
                    attempt: Attempt, size: int = 0) -> WorkerReply:
        """One write; its answer as if it had gone alone."""
        return await self._queue(target, [{"op": op, "rid": rid}], False, 1, size, ack, budget, attempt)

    async def write_many(self, target: Target, writes: list[dict[str, Any]], ack: str, budget: AttemptBudget,
                         attempt: Attempt, size: int = 0) -> WorkerReply:
        """Several writes (`{"op", "rid"}`), answered like a write_batch of exactly these:
        `{"results": [...]}` in order, or one group-level refusal."""
        # Client records, as the leader counts them for its Appends: a put_items counts its ids.
        records = sum(len(w["op"]["ids"]) if w["op"].get("kind") == "put_items" else 1 for w in writes)
        return await self._queue(target, writes, True, records, size, ack, budget, attempt)

    async def _queue(self, target: Target, writes: list[dict[str, Any]], many: bool, records: int, size: int,
                     ack: str, budget: AttemptBudget, attempt: Attempt) -> WorkerReply:
        lane = self._lanes.get(target.base)
        if lane is None:
            lane = self._lanes[target.base] = _Lane()
        loop = asyncio.get_running_loop()
        item = QueuedWrites(writes, many, records, size, ack, loop.time() + budget.http_timeout_s,
                            loop.create_future(), attempt)
        lane.queue.append(item)
        self._schedule(target, lane)
        # One timer that settles the item, rather than wait_for's extra future
        # and callbacks: this runs for every single write.
        timer = loop.call_at(item.deadline, _expire, item, target.wid, budget.http_timeout_s)
        try:
            outcome = await item.fut
        finally:
            timer.cancel()
        if isinstance(outcome, AttemptFailed):
            # A fresh exception: raising the one this frame holds would make a
            # cycle (exception -> traceback -> frame -> exception) that keeps
            # the writes alive until a collection.
            raise AttemptFailed(outcome.kind, outcome.sent, outcome.detail)
        return outcome

    def _schedule(self, target: Target, lane: _Lane) -> None:
        if lane.queue and lane.inflight < LANE_DEPTH and not lane.flush_scheduled:
            lane.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush, target, lane)

    def _flush(self, target: Target, lane: _Lane) -> None:
        """Send what queued in this loop iteration (or while the lane was full) as one call."""
        lane.flush_scheduled = False
        # A settled future is an owner that has its answer already (it timed
        # out, or its request was cancelled): its writes must not leave now.
        live = [q for q in lane.queue if not q.fut.done()]
        if not live:
            lane.queue.clear()
            if lane.inflight == 0 and self._lanes.get(target.base) is lane:
                del self._lanes[target.base]  # idle lanes cost nothing; keep the dict small
            return
        batch = take_call(live)
        chosen = set(batch)
        lane.queue = [q for q in live if q not in chosen]
        lane.inflight += 1
        task = asyncio.get_running_loop().create_task(self._send_batch(target, lane, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._schedule(target, lane)

    async def _send_batch(self, target: Target, lane: _Lane, taken: list[QueuedWrites]) -> None:
        # Owners answered since the flush (an expiry or a cancellation in the
        # same loop iteration) were told "not sent": keep it true.
        batch = [q for q in taken if not q.fut.done()]
        try:
            if not batch:
                return
            timeout = max(q.deadline for q in batch) - asyncio.get_running_loop().time()
            if timeout < MIN_ATTEMPT_S:
                return  # every owner has given up or is about to; the finally answers them
            for q in batch:
                q.attempt.sent = True
            deadline_ms = max(1, int((timeout - WORKER_MARGIN_S) * 1000))
            try:
                if len(batch) == 1 and not batch[0].many:
                    q = batch[0]
                    w = q.writes[0]
                    _settle(q, await self.calls.call(target, "write", self.gid, {"op": w["op"], "ack": q.ack,
                                                     "rid": w["rid"], "deadline_ms": deadline_ms}, timeout))
                    return
                if len(batch) == 1:
                    writes = batch[0].writes
                    self.metrics.write_batches.labels("batch").inc()
                else:
                    writes = [w for q in batch for w in q.writes]
                    self.metrics.write_batches.labels("coalesced").inc()
                    self.metrics.coalesced.inc(len(writes))
                payload = {"writes": writes, "ack": batch[0].ack, "deadline_ms": deadline_ms}
                reply = await self.calls.call(target, "write_batch", self.gid, payload, timeout)
            except AttemptFailed as failed:
                for q in batch:
                    _settle(q, AttemptFailed(failed.kind, failed.sent, failed.detail))
                return
            results = reply.body.get("results") if reply.ok and isinstance(reply.body, dict) else None
            if not reply.ok:
                for q in batch:
                    _settle(q, reply)  # a group-level refusal (not_leader, ...) applies to each
            elif not isinstance(results, list) or len(results) != len(writes):
                for q in batch:
                    _settle(q, item_reply(None, target, self.gid))
            else:
                at = 0
                for q in batch:
                    n = len(q.writes)
                    if q.many:
                        _settle(q, WorkerReply(reply.status, None, {"results": results[at:at + n]}, reply.served_by,
                                               self.gid, reply.term, reply.seq))
                    else:
                        _settle(q, item_reply(results[at], target, self.gid))
                    at += n
        finally:
            for q in batch:
                _settle(q, AttemptFailed("broken", q.attempt.sent, "the coalesced call ended without an answer"))
            lane.inflight -= 1
            self._schedule(target, lane)
            if not lane.queue and lane.inflight == 0 and self._lanes.get(target.base) is lane:
                del self._lanes[target.base]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def take_call(live: list[QueuedWrites]) -> list[QueuedWrites]:
    """The queued writes the next call carries: the oldest, then those after
    it with the same ack (one ack per write_batch) while the call stays within
    MAX_CALL_RECORDS and MAX_CALL_BYTES; the rest wait, in order, for the next."""
    first = live[0]
    batch = [first]
    records, size = first.records, first.size
    for q in live[1:]:
        if q.ack != first.ack:
            continue
        records += q.records
        size += q.size
        if records > MAX_CALL_RECORDS or size > MAX_CALL_BYTES:
            break
        batch.append(q)
    return batch


def _expire(q: QueuedWrites, wid: str, timeout_s: float) -> None:
    _settle(q, AttemptFailed("timeout", q.attempt.sent, f"{wid} did not answer within {timeout_s:.3f}s (coalesced)"))


def _settle(q: QueuedWrites, outcome: WorkerReply | AttemptFailed) -> None:
    # A failure is delivered as a value, not set_exception: an owner that has
    # already left would otherwise leave a "never retrieved" exception behind.
    if not q.fut.done():
        q.fut.set_result(outcome)


# -- the retry loops ----------------------------------------------------------------------------------

Send = Callable[[Target, AttemptBudget, Attempt], Awaitable[WorkerReply]]


@dataclass(slots=True)
class SearchOutcome:
    hits: list[list[dict[str, Any]]]  # per answering group
    unavailable: list[int]
    attempts: int
    error: WorkerReply | None  # a definite client error from a group (4xx)


class Forwarder:
    def __init__(self, cache: RouteCache, calls: WorkerCalls, metrics: GatewayMetrics) -> None:
        self.cache = cache
        self.calls = calls
        self.metrics = metrics
        self._callers: dict[int, GroupCaller] = {}
        self._rotation = itertools.count()  # spreads follower reads over replicas

    def caller(self, gid: int) -> GroupCaller:
        c = self._callers.get(gid)
        if c is None:
            c = self._callers[gid] = GroupCaller(gid, self.calls, self.metrics)
        return c

    async def close(self) -> None:
        for c in self._callers.values():
            await c.close()
        await self.calls.close()

    # -- public operations

    async def write(self, gid: int, op: dict[str, Any], rid: str, ack: str, deadline: float,
                    trace: Trace, size: int = 0) -> WorkerReply:
        """`size`: the bytes of the client's request (bounds what a coalesced call carries)."""
        caller = self.caller(gid)

        def send(target: Target, budget: AttemptBudget, attempt: Attempt) -> Awaitable[WorkerReply]:
            return caller.write(target, op, rid, ack, budget, attempt, size)

        return await self._run(gid, send, deadline, trace, write=True, follower=False)

    async def read(self, gid: int, query: dict[str, Any], consistency: str, min_seq: int, deadline: float,
                   trace: Trace) -> WorkerReply:
        def send(target: Target, budget: AttemptBudget, attempt: Attempt) -> Awaitable[WorkerReply]:
            return self.calls.call(target, "read", gid, {"query": query, "consistency": consistency,
                                                         "min_seq": min_seq, "deadline_ms": budget.worker_deadline_ms},
                                   budget.http_timeout_s)

        return await self._run(gid, send, deadline, trace, write=False, follower=consistency == "follower")

    async def search(self, shards: int, query: dict[str, Any], consistency: str, deadline: float) -> SearchOutcome:
        """Scatter to one replica per group; every group's loop ends before the deadline."""

        async def one(gid: int) -> tuple[int, WorkerReply | None, int]:
            sub = Trace(shard=gid)
            try:
                return gid, await self.read(gid, query, consistency, 0, deadline, sub), sub.attempts
            except ApiError:
                return gid, None, sub.attempts

        out = SearchOutcome([], [], 0, None)
        for gid, reply, attempts in await asyncio.gather(*(one(g) for g in range(shards))):
            out.attempts += attempts
            if reply is not None and reply.ok and isinstance(reply.result, list):
                out.hits.append(reply.result)
            elif reply is not None and 400 <= reply.status < 500:
                out.error = out.error or reply
            else:
                out.unavailable.append(gid)
        if out.unavailable:
            self.metrics.degraded.inc()
        return out

    async def write_batch(self, gid: int, writes: list[tuple[dict[str, Any], str]], ack: str, deadline: float,
                          trace: Trace, size: int = 0) -> list[dict[str, Any]]:
        """The writes of one group (a `/batch`'s part for it) over the group's lane,
        so that they share a call with other requests' writes; per attempt, only
        the writes that need it go again. `size`: the bytes of the client's request.

        Returns one result per write, in order: `{"shard", "seq", "term",
        "served_by", "result"}` or an error body with `shard`.
        """
        loop = asyncio.get_running_loop()
        caller = self.caller(gid)
        results: list[dict[str, Any] | None] = [None] * len(writes)
        pending = list(range(len(writes)))
        st = RetryState()
        while pending:
            remaining = deadline - loop.time()
            budget = attempt_budget(remaining)
            if budget is None:
                err = self._give_up(st, True, gid)
                for i in pending:
                    results[i] = err.body()
                break
            target = self.cache.leader_target(gid)
            if target is None:
                st.last_problem = f"group {gid} has no known leader"
                await self._pause(st, "no_leader", remaining, refresh=True)
                continue
            st.attempts += 1
            trace.attempts += 1
            trace.leader = target.wid
            attempt = Attempt()
            wire = [{"op": writes[i][0], "rid": writes[i][1]} for i in pending]
            try:
                reply = await self._race(caller.write_many(target, wire, ack, budget, attempt, size), gid, target,
                                         attempt)
            except (LeaderMoved, AttemptFailed) as exc:
                await self._after_failure(st, exc, attempt, target, True, remaining)
                continue
            if not reply.ok:
                nxt = self._after_error(st, reply, gid, target, write=True)
                if nxt is Next.DONE or nxt is Next.GIVE_UP:
                    body = reply.body if nxt is Next.DONE else self._give_up(st, True, gid).body()
                    for i in pending:
                        results[i] = body
                    break
                await self._retry_pause(st, nxt, remaining)
                continue
            items = reply.body.get("results") if isinstance(reply.body, dict) else None
            if not isinstance(items, list) or len(items) != len(pending):
                bad = item_reply(None, target, gid).body
                for i in pending:
                    results[i] = bad
                break
            again: list[int] = []
            decisions: set[Next] = set()
            wid = target.wid
            for i, raw in zip(pending, items):
                if type(raw) is dict and "error" not in raw:
                    # item_reply's success case without a WorkerReply: this runs for every write of a batch.
                    seq, term, result = raw.get("seq"), raw.get("term"), raw.get("result")
                    if type(seq) is not int:
                        seq = int_or_none(seq)
                    if type(term) is not int:
                        term = int_or_none(term)
                else:
                    r = item_reply(raw, target, gid)
                    if not r.ok:
                        nxt = self._after_error(st, r, gid, target, write=True)
                        if nxt is Next.GIVE_UP:
                            results[i] = self._give_up(st, True, gid).body()
                        elif nxt is Next.DONE:
                            body = r.body
                            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                                body["error"].setdefault("shard", gid)
                            results[i] = body
                        else:
                            again.append(i)
                            decisions.add(nxt)
                        continue
                    seq, term, result = r.seq, r.term, r.result
                results[i] = {"shard": gid, "seq": seq, "term": term, "served_by": wid, "result": result}
            pending = again
            if pending:
                # The most cautious decision of the items wins: refresh > backoff > retry now.
                nxt = next(n for n in (Next.REFRESH, Next.BACKOFF, Next.RETRY) if n in decisions)
                await self._retry_pause(st, nxt, remaining)
        return [r if r is not None else error_body("internal", "no result", shard=gid) for r in results]

    # -- the loop

    async def _run(self, gid: int, send: Send, deadline: float, trace: Trace, *, write: bool,
                   follower: bool) -> WorkerReply:
        loop = asyncio.get_running_loop()
        st = RetryState()
        start = next(self._rotation) if follower else 0
        while True:
            remaining = deadline - loop.time()
            budget = attempt_budget(remaining)
            if budget is None:
                raise self._give_up(st, write, gid)
            target = self._pick(gid, follower, start + st.attempts)
            if target is None:
                st.last_problem = f"group {gid} has no known {'replica' if follower else 'leader'}"
                await self._pause(st, "no_leader", remaining, refresh=True)
                continue
            st.attempts += 1
            trace.attempts += 1
            trace.leader = target.wid
            attempt = Attempt()
            try:
                if follower:
                    reply = await send(target, budget, attempt)
                else:
                    reply = await self._race(send(target, budget, attempt), gid, target, attempt)
            except (LeaderMoved, AttemptFailed) as exc:
                if follower and not self._cycle_done(gid, st):
                    self._note_failure(st, exc, attempt, target, write)
                    continue  # another replica may answer at once
                await self._after_failure(st, exc, attempt, target, write, remaining)
                continue
            if reply.ok:
                return reply
            nxt = self._after_error(st, reply, gid, target, write=write and not follower)
            if follower and reply.code == "overloaded":
                # Another replica may have room; once every one has refused, that is the answer
                # now rather than more load until the deadline.
                nxt = Next.DONE if self._cycle_done(gid, st) else Next.RETRY
            elif follower and nxt is not Next.DONE:
                # Any retryable refusal from a replica: the next replica; pause after a full round.
                nxt = Next.BACKOFF if self._cycle_done(gid, st) else Next.RETRY
            if nxt is Next.DONE:
                return reply
            if nxt is Next.GIVE_UP:
                raise self._give_up(st, write, gid)
            await self._retry_pause(st, nxt, remaining)

    def _pick(self, gid: int, follower: bool, index: int) -> Target | None:
        if not follower:
            return self.cache.leader_target(gid)
        table = self.cache.table
        replicas = table.replica_targets(gid) if table is not None else ()
        return replicas[index % len(replicas)] if replicas else None

    def _cycle_done(self, gid: int, st: RetryState) -> bool:
        table = self.cache.table
        n = len(table.replica_targets(gid)) if table is not None else 0
        return n == 0 or st.attempts % n == 0

    async def _race(self, coro: Awaitable[WorkerReply], gid: int, target: Target, attempt: Attempt) -> WorkerReply:
        """Await the attempt; the route cache cancels it if meta names another leader meanwhile.

        The cache cancels the request's own task (no task per attempt on the
        hot path); the cancellation it caused is taken back here and becomes
        LeaderMoved, while any other cancellation propagates.
        """
        me = asyncio.current_task()
        attempt.task, attempt.wid = me, target.wid
        self.cache.track(gid, attempt)
        try:
            reply = await coro
        except asyncio.CancelledError:
            if attempt.moved and me is not None and me.uncancel() == 0:
                now = self.cache.leader_target(gid)
                raise LeaderMoved(f"meta moved group {gid} from {target.wid} to "
                                  f"{now.wid if now is not None else 'nobody'}") from None
            raise
        finally:
            self.cache.untrack(gid, attempt)
        if attempt.moved and me is not None and me.cancelling():
            # The cache's cancel was swallowed on the way (a wait_for, such
            # as the stream open's, that returned its result instead):
            # take the request back.
            me.uncancel()
        return reply

    def _note_failure(self, st: RetryState, exc: Exception, attempt: Attempt, target: Target, write: bool) -> str:
        if isinstance(exc, LeaderMoved):
            reason = "leader_moved"
            st.last_problem = str(exc)
            sent = attempt.sent
        else:
            assert isinstance(exc, AttemptFailed)
            reason = exc.kind
            st.last_problem = exc.detail
            sent = exc.sent or (attempt.sent and exc.kind != "refused")
            if exc.kind == "timeout" and not write:
                st.timed_out = True
        if write and sent:
            st.maybe_applied = True
        st.last_leader = target.wid
        self.metrics.retries.labels(reason).inc()
        return reason

    async def _after_failure(self, st: RetryState, exc: Exception, attempt: Attempt, target: Target, write: bool,
                             remaining: float) -> None:
        reason = self._note_failure(st, exc, attempt, target, write)
        if reason == "leader_moved":
            return  # the new leader is known: go now
        # Dead or hung leader: ask meta and wait for it to name another (or back off).
        self.cache.nudge()
        await self.cache.wait_changed(backoff_s(st.retries, remaining))
        st.retries += 1

    def _after_error(self, st: RetryState, reply: WorkerReply, gid: int, target: Target, write: bool) -> Next:
        err = reply.error
        st.last_term = reply.term if reply.term is not None else st.last_term
        hinted_other = moved = False
        reason = err.get("reason") if isinstance(err.get("reason"), str) else None
        if reply.code == "not_leader":
            self.cache.apply_hint(gid, err.get("leader"), err.get("term"))
            now = self.cache.leader_target(gid)
            hinted_other = now is not None and now.wid != target.wid
            st.last_leader = err.get("leader") if isinstance(err.get("leader"), str) else st.last_leader
        elif reply.code == "unavailable" and reason == NO_QUORUM:
            # Meta may have named another leader already (the old one answers
            # until it hears so); if not, ask it now for the next request.
            now = self.cache.leader_target(gid)
            moved = now is not None and (now.wid != target.wid or now.term > target.term)
            if not moved:
                self.cache.nudge()
            st.last_leader = target.wid
        nxt = after_reply(reply.code, write, hinted_other, reason, moved)
        if nxt is not Next.DONE:
            if reply.code == "quorum_timeout" or (write and err.get("maybe_applied") is True):
                st.maybe_applied = True
            elif reply.code == "deadline_exceeded":
                st.timed_out = True
            st.last_reason = reason
            st.last_problem = f"{target.wid} answered {reply.code}" + (f" ({reason})" if reason else "")
            if nxt is not Next.GIVE_UP:
                self.metrics.retries.labels(str(reason or reply.code)).inc()
        return nxt

    async def _retry_pause(self, st: RetryState, nxt: Next, remaining: float) -> None:
        if nxt is Next.RETRY:
            st.retries += 1
            return
        await self._pause(st, None, remaining, refresh=nxt is Next.REFRESH)

    async def _pause(self, st: RetryState, reason: str | None, remaining: float, refresh: bool) -> None:
        if reason is not None:
            self.metrics.retries.labels(reason).inc()
        if refresh:
            self.cache.nudge()
        await self.cache.wait_changed(backoff_s(st.retries, remaining))
        st.retries += 1

    def _give_up(self, st: RetryState, write: bool, gid: int) -> ApiError:
        err = give_up(st, write, gid)
        self.metrics.refusals.labels(err.code).inc()
        return err
