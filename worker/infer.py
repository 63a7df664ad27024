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

from shardgrid.wire import ApiError
from worker.group import now_ms
from worker.infer_batch import PassCost, Waiting, plan_batch
from worker.plugins.base import import_torch

DEFAULT_MAX_ROWS = 64
DEFAULT_MAX_WAIT_MS = 2.0
MAX_REQUEST_ROWS = 1024
GAP_ALPHA = 0.2


@dataclass
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
    # EMA of the time between arrivals; starts "rare", so a lone request is not held.
    gap_s: float = 1.0
    last_arrival: float | None = None
    task: asyncio.Task[None] | None = None


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
        self._batch_rows = Histogram("shardgrid_worker_infer_batch_rows", "rows per forward pass",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024), registry=registry)
        self._batch_requests = Histogram("shardgrid_worker_infer_batch_requests", "requests per forward pass",
                                         buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry)
        self._wait = Histogram("shardgrid_worker_infer_wait_seconds", "queue wait before a request's pass starts",
                               buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                               registry=registry)
        self._compute = Histogram("shardgrid_worker_infer_pass_seconds", "one forward pass",
                                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                                  registry=registry)
        self._refused = Counter("shardgrid_worker_infer_refused_total",
                                "inference requests refused before a pass, by reason", ["reason"], registry=registry)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="infer", initializer=_init_thread)
        return self._executor

    def warm_up(self) -> None:
        """Import torch on the compute thread now, not on the first request."""
        self._pool().submit(_init_thread)

    def report(self, gid: int) -> dict[str, Any]:
        cost = self._cost.get(gid)
        return {"queued": self._busy.get(gid, 0),
                "ms_per_layer": round(cost.ms_per_layer, 4) if cost is not None else None}

    async def infer(self, gid: int, plugin: Any, start: int, end: int, x: bytes, rows: int,
                    timeout_s: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        cost = self._cost.setdefault(gid, PassCost())
        layers = end - start + 1
        if cost.seconds(rows, layers) > timeout_s:
            self._refused.labels("over_budget").inc()
            raise ApiError("over_budget", f"layers {start}-{end} take about {cost.seconds(rows, layers) * 1000:.1f} "
                           f"ms here; the call allows {timeout_s * 1000:.1f} ms", shard=gid,
                           estimate_ms=round(cost.seconds(rows, layers) * 1000, 3), retry_elsewhere=True)
        key = (gid, start, end)
        q = self._queues.get(key)
        if q is None or q.plugin is not plugin:
            q = self._queues[key] = _Queue(gid, start, end, plugin)
        req = _Request(x, rows, Waiting(rows, now + timeout_s, now), loop.create_future())
        if q.last_arrival is not None:
            q.gap_s += GAP_ALPHA * (min(1.0, now - q.last_arrival) - q.gap_s)
        q.last_arrival = now
        q.items.append(req)
        self._busy[gid] = self._busy.get(gid, 0) + 1
        q.wake.set()
        if q.task is None or q.task.done():
            q.task = asyncio.create_task(self._drain(q))
        try:
            return await req.fut
        finally:
            self._busy[gid] -= 1

    async def _drain(self, q: _Queue) -> None:
        cost = self._cost[q.gid]
        layers = q.end - q.start + 1
        while q.items:
            q.wake.clear()
            now = time.monotonic()
            plan = plan_batch([r.waiting for r in q.items], now, lambda rows: cost.seconds(rows, layers),
                              self.max_rows, self.max_wait_s, q.gap_s)
            for i in plan.expired:
                r = q.items[i]
                self._refused.labels("over_budget").inc()
                if not r.fut.done():
                    r.fut.set_exception(ApiError("over_budget", "the request's budget ran out while it was queued "
                                                 f"for layers {q.start}-{q.end}", shard=q.gid, retry_elsewhere=True))
            if plan.run:
                batch = [q.items[i] for i in plan.run]
                gone = set(plan.run) | set(plan.expired)
                q.items = [r for i, r in enumerate(q.items) if i not in gone]
                await self._run(q, batch, now)
                continue
            if plan.expired:
                gone = set(plan.expired)
                q.items = [r for i, r in enumerate(q.items) if i not in gone]
            if plan.wake_at is not None:
                try:
                    await asyncio.wait_for(q.wake.wait(), max(0.0, plan.wake_at - time.monotonic()))
                except asyncio.TimeoutError:
                    pass

    async def _run(self, q: _Queue, batch: list[_Request], planned: float) -> None:
        live = [r for r in batch if not r.fut.done()]  # a caller that gave up is not computed
        if not live:
            return
        weights = q.plugin.current()
        rows = sum(r.rows for r in live)
        for r in live:
            self._wait.observe(planned - r.waiting.arrived)
        self._batch_rows.observe(rows)
        self._batch_requests.observe(len(live))
        t0 = time.monotonic()
        try:
            outs = await asyncio.get_running_loop().run_in_executor(
                self._pool(), _forward, weights, [(r.x, r.rows) for r in live], q.start, q.end)
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its requests, not the worker
            self.log.exception("infer_pass_failed", group=q.gid, start=q.start, end=q.end, rows=rows)
            for r in live:
                if not r.fut.done():
                    r.fut.set_exception(ApiError("internal", f"the forward pass failed: {type(exc).__name__}"))
            return
        elapsed = time.monotonic() - t0
        self._compute.observe(elapsed)
        self._cost[q.gid].observe(elapsed, q.end - q.start + 1, rows)
        for r, y in zip(live, outs):
            if not r.fut.done():
                r.fut.set_result({"y": y, "rows": r.rows, "version": weights.version, "first": weights.first,
                                  "last": weights.last, "batch": len(live), "batch_rows": rows,
                                  "queue_ms": round((t0 - r.waiting.arrived) * 1000, 3),
                                  "compute_ms": round(elapsed * 1000, 3), "queued": self._busy.get(q.gid, 0)})

    async def close(self) -> None:
        for q in self._queues.values():
            if q.task is not None:
                q.task.cancel()
            for r in q.items:
                if not r.fut.done():
                    r.fut.set_exception(ApiError("unavailable", "the worker is stopping"))
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


def _forward(weights: Any, parts: list[tuple[bytes, int]], start: int, end: int) -> list[bytes]:
    """Runs on the compute thread: one pass over every request's rows."""
    torch = import_torch()
    from worker.plugins.layers_model import tensor_from_bytes, tensor_to_bytes

    d = weights.d_model
    x = torch.cat([tensor_from_bytes(raw, rows, d) for raw, rows in parts]) if len(parts) > 1 \
        else tensor_from_bytes(parts[0][0], parts[0][1], d)
    y = weights.forward(x, start, end)
    out, at = [], 0
    for _, rows in parts:
        out.append(tensor_to_bytes(y[at:at + rows]))
        at += rows
    return out
