"""Inference on a worker's `layers` groups: queues, batches, one compute thread.

Requests for the same group, start and end layer queue together and run as
one forward pass when `worker/infer_batch.py` says so. Forward passes run on
one thread of their own (torch releases the GIL inside its kernels), so the
event loop keeps replicating and answering while a pass runs; one thread,
because on a small machine a second one only takes CPU from the loop.

A pass reads the group's weights once, at its start (`plugin.current()`, an
immutable object that a weights update replaces, never edits): every row of
a pass, and so every answer, is computed with one version, which the answer
names.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from shardgrid.common.wire import ApiError
from worker.group import now_ms
from worker.infer_batch import PassCost, Waiting, plan_batch
from worker.plugins.base import import_torch

DEFAULT_MAX_ROWS = 64
DEFAULT_MAX_WAIT_MS = 2.0
GAP_ALPHA = 0.2
# Requests held (queued or in a pass) by one worker, all groups: past either,
# a new one is refused at once (503 overloaded, nothing queued) while the
# gateway can still try another replica, instead of queueing until budgets run out.
MAX_PENDING = 4096
MAX_PENDING_BYTES = 64 << 20


@dataclass(eq=False)
class _Request:
    x: bytes
    rows: int
    waiting: Waiting
    fut: asyncio.Future[dict[str, Any]]


@dataclass
class _Queue:
    gid: int
    start: int
    end: int
    plugin: Any
    items: list[_Request] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # EMA of the time between arrivals; starts "rare", so a lone request is not held.
    gap_s: float = 1.0
    last_arrival: float | None = None


class InferenceService:
    """`infer(...)` -> the answer of one request; `report(gid)` -> load for heartbeats."""

    def __init__(self, worker_id: str, log: Any, registry: CollectorRegistry,
                 max_rows: int = DEFAULT_MAX_ROWS, max_wait_ms: float = DEFAULT_MAX_WAIT_MS) -> None:
        self.worker_id = worker_id
        self.log = log
        self.max_rows = max(1, max_rows)
        self.max_wait_s = max(0.0, max_wait_ms) / 1000
        self._executor: ThreadPoolExecutor | None = None
        self._queues: dict[tuple[int, int, int], _Queue] = {}
        self._cost: dict[int, PassCost] = {}
        self._busy: dict[int, int] = {}  # gid -> requests queued or running
        self._pending = 0
        self._pending_bytes = 0
        self._running: set[_Request] = set()  # in a pass now: answered by close() if it comes first
        self._builds: dict[int, asyncio.Future[None]] = {}  # id(plugin) -> weights being built off the loop
        self._batch_rows = Histogram("shardgrid_worker_infer_batch_rows", "rows per forward pass",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024), registry=registry)
        self._batch_requests = Histogram("shardgrid_worker_infer_batch_requests", "requests per forward pass",
                                         buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry)
        self._wait = Histogram("shardgrid_worker_infer_wait_seconds", "from arrival to the start of its pass",
                               buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                               registry=registry)
        self._compute = Histogram("shardgrid_worker_infer_pass_seconds", "one forward pass",
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                                  registry=registry)
        self._refused = Counter("shardgrid_worker_infer_refused_total",
                                "inference requests refused before or at their pass, by reason", ["reason"],
                                registry=registry)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="infer", initializer=_init_thread)
        return self._executor

    def report(self, gid: int) -> dict[str, Any]:
        cost = self._cost.get(gid)
        return {"queued": self._busy.get(gid, 0),
                "ms_per_layer": round(cost.ms_per_layer, 4) if cost is not None else None}

    async def ensure_built(self, plugin: Any) -> None:
        """Build the plugin's weights on the compute thread if they are not (a
        version set by seed is generated on first use): generating a range's
        weights takes milliseconds to tens of them, too long for the loop."""
        while (pending := plugin.pending_build()) is not None:
            key = id(plugin)
            fut = self._builds.get(key)
            if fut is None:
                token, build = pending
                fut = self._builds[key] = asyncio.get_running_loop().create_future()
                try:
                    weights = await asyncio.get_running_loop().run_in_executor(self._pool(), build)
                    plugin.install_built(token, weights)
                    fut.set_result(None)
                except BaseException as exc:
                    fut.set_exception(exc)
                    fut.exception()  # retrieved: the waiters below re-raise it
                    raise
                finally:
                    del self._builds[key]
            else:
                await asyncio.shield(fut)

    def _ahead_s(self, gid: int, start: int, end: int) -> float:
        """About how long the passes of the other queues take before ours: the
        compute thread serves one pass at a time, whatever its group."""
        total = 0.0
        for (g, s, e), q in self._queues.items():
            if q.items and (g, s, e) != (gid, start, end):
                rows = min(self.max_rows, sum(r.rows for r in q.items))
                total += self._cost.get(g, PassCost()).seconds(rows, e - s + 1)
        return total

    async def infer(self, gid: int, plugin: Any, start: int, end: int, x: bytes, rows: int,
                    timeout_s: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if self._pending >= MAX_PENDING or self._pending_bytes + len(x) > MAX_PENDING_BYTES:
            self._refused.labels("overloaded").inc()
            raise ApiError("overloaded", f"{self.worker_id} holds {self._pending} inference requests "
                           f"({self._pending_bytes} bytes; limits {MAX_PENDING}, {MAX_PENDING_BYTES}): nothing "
                           "was queued", shard=gid, retry_elsewhere=True)
        cost = self._cost.setdefault(gid, PassCost())
        layers = end - start + 1
        estimate = cost.seconds(rows, layers) + self._ahead_s(gid, start, end)
        if estimate > timeout_s:
            self._refused.labels("over_budget").inc()
            raise ApiError("over_budget", f"layers {start}-{end} would take about {estimate * 1000:.1f} ms here "
                           f"(with the passes ahead); the call allows {timeout_s * 1000:.1f} ms", shard=gid,
                           estimate_ms=round(estimate * 1000, 3), retry_elsewhere=True)
        self._pending += 1
        self._pending_bytes += len(x)
        self._busy[gid] = self._busy.get(gid, 0) + 1
        try:
            await self.ensure_built(plugin)
            key = (gid, start, end)
            q = self._queues.get(key)
            if q is None or q.plugin is not plugin:
                q = self._queues[key] = _Queue(gid, start, end, plugin)
            req = _Request(x, rows, Waiting(rows, now + timeout_s, now), loop.create_future())
            if q.last_arrival is not None:
                q.gap_s += GAP_ALPHA * (min(1.0, now - q.last_arrival) - q.gap_s)
            q.last_arrival = now
            q.items.append(req)
            q.wake.set()
            if q.task is None or q.task.done():
                q.task = asyncio.create_task(self._drain(q))
            return await req.fut
        finally:
            self._pending -= 1
            self._pending_bytes -= len(x)
            self._busy[gid] -= 1

    async def _drain(self, q: _Queue) -> None:
        try:
            await self._serve(q)
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave callers waiting forever
            self.log.exception("infer_queue_failed", group=q.gid, start=q.start, end=q.end)
            for r in q.items:
                if not r.fut.done():
                    r.fut.set_exception(ApiError("internal", f"the inference queue failed: {type(exc).__name__}"))
            q.items = []

    async def _serve(self, q: _Queue) -> None:
        cost = self._cost[q.gid]
        layers = q.end - q.start + 1
        while q.items:
            q.wake.clear()
            now = time.monotonic()
            plan = plan_batch([r.waiting for r in q.items], now, lambda rows: cost.seconds(rows, layers),
                              self.max_rows, self.max_wait_s, q.gap_s)
            for i in plan.expired:
                self._late(q, q.items[i], "the request's budget ran out while it was queued")
            gone = set(plan.run) | set(plan.expired)
            batch = [q.items[i] for i in plan.run]
            q.items = [r for i, r in enumerate(q.items) if i not in gone]
            if batch:
                try:
                    await self._run(q, batch)
                except BaseException:
                    for r in batch:  # out of the queue already: answered here, or never
                        if not r.fut.done():
                            r.fut.set_exception(ApiError("internal", "the inference pass failed"))
                    raise
                continue
            if plan.wake_at is not None:
                try:
                    await asyncio.wait_for(q.wake.wait(), max(0.0, plan.wake_at - time.monotonic()))
                except asyncio.TimeoutError:
                    pass

    def _late(self, q: _Queue, r: _Request, why: str) -> None:
        self._refused.labels("over_budget").inc()
        if not r.fut.done():
            r.fut.set_exception(ApiError("over_budget", f"{why} (layers {q.start}-{q.end})", shard=q.gid,
                                         retry_elsewhere=True))

    async def _run(self, q: _Queue, batch: list[_Request]) -> None:
        live = [r for r in batch if not r.fut.done()]  # a caller that gave up is not computed
        if not live:
            return
        await self.ensure_built(q.plugin)
        weights = q.plugin.current()
        cost = self._cost[q.gid]
        layers = q.end - q.start + 1
        self._running.update(live)
        try:
            # The thread may start this pass later than now (another group's pass
            # first): it skips the rows whose budget is gone by then.
            outs, started, elapsed = await asyncio.get_running_loop().run_in_executor(
                self._pool(), _forward, weights, [(r.x, r.rows, r.waiting.deadline) for r in live], q.start, q.end,
                cost.seconds(sum(r.rows for r in live), layers))
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its requests, not the worker
            self.log.exception("infer_pass_failed", group=q.gid, start=q.start, end=q.end)
            for r in live:
                if not r.fut.done():
                    r.fut.set_exception(ApiError("internal", f"the forward pass failed: {type(exc).__name__}"))
            return
        finally:
            self._running.difference_update(live)
        done = [(r, y) for r, y in zip(live, outs) if y is not None]
        for r, y in zip(live, outs):
            if y is None:
                self._late(q, r, "the request's budget ran out before its pass started")
        if not done:
            return
        rows = sum(r.rows for r, _ in done)
        self._compute.observe(elapsed)
        self._batch_rows.observe(rows)
        self._batch_requests.observe(len(done))
        cost.observe(elapsed, layers, rows)
        finished = time.monotonic()
        for r, y in done:
            self._wait.observe(max(0.0, started - r.waiting.arrived))
            if r.fut.done():
                continue
            if finished > r.waiting.deadline:
                self._late(q, r, "the pass finished after the request's budget")
                continue
            r.fut.set_result({"y": y, "rows": r.rows, "version": weights.version, "first": weights.first,
                              "last": weights.last, "batch": len(done), "batch_rows": rows,
                              "queue_ms": round((started - r.waiting.arrived) * 1000, 3),
                              "compute_ms": round(elapsed * 1000, 3), "queued": self._busy.get(q.gid, 0)})

    async def close(self) -> None:
        stopping = ApiError("unavailable", "the worker is stopping")
        for q in self._queues.values():
            if q.task is not None:
                q.task.cancel()
            for r in q.items:
                if not r.fut.done():
                    r.fut.set_exception(stopping)
        for r in self._running:
            if not r.fut.done():
                r.fut.set_exception(stopping)
        self._running.clear()
        self._queues.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def infer_warm(shell: Any) -> bool:
    """A replica may serve inference: open, not failed, applied up to what it
    knows is committed, and in touch with its group within a lease (a leader
    with its quorum, a follower that heard from its leader), so that a
    replica cut off from its group does not go on serving weights an update
    has since replaced."""
    r = shell.replica
    if r is None or shell.failed is not None or r.applied_seq < r.commit_seq:
        return False
    if r.role in ("leader", "candidate"):
        return bool(r.ready and r.has_quorum)
    heard = r.leader_heard_at
    return heard is not None and now_ms() - heard <= shell.settings.lease_ms


def _init_thread() -> None:
    torch = import_torch()

    # One intra-op thread: the pass already has a thread of its own, and the
    # event loop needs the other core.
    torch.set_num_threads(1)


def _forward(weights: Any, parts: list[tuple[bytes, int, float]], start: int, end: int,
             cost_s: float) -> tuple[list[bytes | None], float, float]:
    """Runs on the compute thread: one pass over the rows of every request
    that can still finish in time. Returns (each request's output or None
    when skipped, when the pass started, how long it took)."""
    torch = import_torch()
    from worker.plugins.layers_model import tensor_from_bytes, tensor_to_bytes

    started = time.monotonic()
    keep = [started + cost_s <= deadline for _, _, deadline in parts]
    run = [(raw, rows) for (raw, rows, _), ok in zip(parts, keep) if ok]
    if not run:
        return [None] * len(parts), started, 0.0
    d = weights.d_model
    x = torch.cat([tensor_from_bytes(raw, rows, d) for raw, rows in run]) if len(run) > 1 \
        else tensor_from_bytes(run[0][0], run[0][1], d)
    y = weights.forward(x, start, end)
    elapsed = time.monotonic() - started
    out: list[bytes | None] = []
    at = 0
    for (_, rows, _), ok in zip(parts, keep):
        if ok:
            out.append(tensor_to_bytes(y[at:at + rows]))
            at += rows
        else:
            out.append(None)
    return out, started, elapsed
