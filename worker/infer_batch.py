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
    for i in live:
        if batch and rows + queue[i].rows > max_rows:
            break
        batch.append(i)
        rows += queue[i].rows
    if rows >= max_rows or len(batch) < len(live) or expected_gap_s > max_wait_s:
        # Full, or nobody is expected to join: nothing to wait for.
        return BatchPlan(tuple(batch), expired, now)
    latest = min(queue[i].deadline for i in batch) - cost_s(max_rows)
    wake = min(latest, min(queue[i].arrived for i in batch) + max_wait_s)
    if wake <= now:
        return BatchPlan(tuple(batch), expired, now)
    return BatchPlan((), expired, wake)


class PassCost:
    """What one forward pass costs, learnt from the passes run: an EMA of the
    time per layer, scaled by rows beyond the usual batch (conservative: a
    pass's fixed cost is counted again for every extra row)."""

    def __init__(self, ms_per_layer: float = 0.05, alpha: float = 0.2) -> None:
        self.ms_per_layer = ms_per_layer
        self.rows = 1.0
        self.alpha = alpha

    def observe(self, seconds: float, layers: int, rows: int) -> None:
        a = self.alpha
        self.ms_per_layer += a * (seconds * 1000 / max(1, layers) - self.ms_per_layer)
        self.rows += a * (rows - self.rows)

    def seconds(self, rows: int, layers: int) -> float:
        return layers * self.ms_per_layer * max(1.0, rows / max(1.0, self.rows)) / 1000
