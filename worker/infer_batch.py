"""When a worker runs the inference requests queued for one range and start layer.

Pure: `plan_batch` looks at the queue, the time and a cost model, and says
which requests to run now as one forward pass, which to refuse (they cannot
finish in time even alone), and otherwise when to look again.

The bound that makes waiting safe: a request is never held past the moment
`deadline - cost(max_rows)`, the latest start from which even the largest
batch it could join still finishes in time. So waiting for more requests to
batch with never makes a queued request miss a budget it could have met when
it was planned, and a request always waits at most `max_wait_s`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Waiting:
    rows: int
    deadline: float  # monotonic seconds by which its answer must be ready
    arrived: float


@dataclass(frozen=True, slots=True)
class BatchPlan:
    run: tuple[int, ...]  # queue indexes to run now, as one pass (empty: not yet)
    expired: tuple[int, ...]  # queue indexes that cannot finish in time even alone: refuse them
    wake_at: float | None  # when to plan again if nothing arrives (None: the queue is empty)


def plan_batch(queue: Sequence[Waiting], now: float, cost_s: Callable[[int], float], max_rows: int,
               max_wait_s: float, expected_gap_s: float = 0.0) -> BatchPlan:
    """`cost_s(rows)` estimates one pass over `rows` rows; `max_rows` bounds a
    pass (a single request larger than it runs alone). `expected_gap_s` is
    the usual time between arrivals: when the next one is not expected
    within `max_wait_s`, waiting would only add latency, so the batch runs."""
    expired = tuple(i for i, w in enumerate(queue) if now + cost_s(w.rows) > w.deadline)
    live = [i for i in range(len(queue)) if i not in expired]
    if not live:
        return BatchPlan((), expired, None)
    batch: list[int] = []
    rows = 0
    tightest = float("inf")
    for i in live:
        more, deadline = rows + queue[i].rows, min(tightest, queue[i].deadline)
        # A request joins only if the larger pass still finishes within every
        # member's budget (its own included); else it waits for the next pass.
        if batch and (more > max_rows or now + cost_s(more) > deadline):
            break
        batch.append(i)
        rows, tightest = more, deadline
    if rows >= max_rows or len(batch) < len(live) or expected_gap_s > max_wait_s:
        # Full, or nobody is expected to join: nothing to wait for.
        return BatchPlan(tuple(batch), expired, now)
    latest = tightest - cost_s(max_rows)
    wake = min(latest, min(queue[i].arrived for i in batch) + max_wait_s)
    if wake <= now:
        return BatchPlan(tuple(batch), expired, now)
    return BatchPlan((), expired, wake)


class PassCost:
    """What one forward pass costs per layer, learnt from the passes run: a
    fixed part (kernel launches, the Python around them) and a part per row,
    each smoothed. A pass of one row measures the fixed part; a larger one
    the rows beyond it."""

    def __init__(self, base_ms: float = 0.05, row_ms: float = 0.0, alpha: float = 0.2) -> None:
        self.base_ms = base_ms  # per layer, per pass
        self.row_ms = row_ms  # per layer, per row beyond the first
        self.alpha = alpha

    @property
    def ms_per_layer(self) -> float:
        """One row, one layer: what a lone request costs."""
        return self.base_ms

    def observe(self, seconds: float, layers: int, rows: int) -> None:
        per_layer = seconds * 1000 / max(1, layers)
        a = self.alpha
        if rows <= 1:
            self.base_ms += a * (per_layer - self.base_ms)
        else:
            self.row_ms += a * (max(0.0, per_layer - self.base_ms) / (rows - 1) - self.row_ms)

    def seconds(self, rows: int, layers: int) -> float:
        return layers * (self.base_ms + self.row_ms * max(0, rows - 1)) / 1000
