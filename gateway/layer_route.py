"""Routes through a layer-sharded model: which groups, from which layer, on which replica.

Pure: numbers in, decisions out; `gateway/models.py` performs the hops.

A model's groups hold inclusive layer ranges that may overlap. A route is a
list of hops whose ranges cover layers 0..L-1; each hop runs from its
`start` (the first layer no earlier hop ran) to the end of its group's
range, so an overlapping layer runs exactly once. `plan_route` takes the
fewest hops: from the current layer it always jumps to the group reaching
farthest (the classic interval-cover greedy, optimal in hop count); among
groups reaching equally far it takes the one `prefer` rates cheapest.

A hop's replica is chosen by three questions, in order (the Czar Grid's):
1. where is the range warm (the replica has applied its log and holds its
   weights in memory);
2. which replicas can answer within the caller's remaining budget given
   what they have already accepted (the gateway's model of each worker's
   time per layer against the calls it has in hand);
3. where would the request join a batch already forming (a call of ours
   to that replica and start layer is in flight: the worker batches calls
   for the same range and start).
Then the lowest estimate. A route whose best estimate exceeds the budget is
refused at once (`OverBudget`) rather than sent to miss its deadline.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from topology.model import render_runs, uncovered_layers

# Before a replica has been measured: the cost of one layer for one batch,
# and of a call's round trip (gateway <-> worker on one machine).
DEFAULT_MS_PER_LAYER = 0.05
DEFAULT_OVERHEAD_MS = 0.5


@dataclass(frozen=True, slots=True)
class RangeGroup:
    gid: int
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class Hop:
    """Run layers `start`..`end` (inclusive) on group `gid`."""

    gid: int
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start + 1


class Uncovered(ValueError):
    """No group (among those still usable) covers these layers."""

    def __init__(self, model: str, missing: list[tuple[int, int]]) -> None:
        super().__init__(f"layers {render_runs(missing)} of model {model!r} are not covered by any available group")
        self.missing = missing


def plan_route(model: str, groups: Sequence[RangeGroup], n_layers: int, start: int = 0,
               avoid: Collection[int] = (), prefer: Callable[[int], float] | None = None) -> list[Hop]:
    """The fewest hops covering layers start..n_layers-1 without the groups in `avoid`.

    Raises Uncovered naming the layers nothing usable covers.
    """
    usable = [g for g in groups if g.gid not in avoid]
    hops: list[Hop] = []
    pos = start
    while pos < n_layers:
        here = [g for g in usable if g.first <= pos <= g.last]
        if not here:
            raise Uncovered(model, uncovered_layers(((g.first, g.last) for g in usable), n_layers, start))
        reach = max(g.last for g in here)
        best = min((g for g in here if g.last == reach),
                   key=lambda g: (prefer(g.gid) if prefer is not None else 0.0, g.gid))
        end = min(best.last, n_layers - 1)
        hops.append(Hop(best.gid, pos, end))
        pos = end + 1
    return hops


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the gateway knows of one replica of one group."""

    worker: str
    warm: bool
    # What one layer of a call sent there now would take, given the calls it
    # already has in hand (the gateway's load model: gateway/models.py).
    ms_per_layer: float = DEFAULT_MS_PER_LAYER
    overhead_ms: float = DEFAULT_OVERHEAD_MS  # a call's fixed cost, while the replica is unmeasured
    forming: bool = False  # a call of ours for the same start layer is in flight there


def estimate_ms(load: ReplicaLoad, layers: int) -> float:
    """When an answer from this replica would come back, in ms from now."""
    return load.overhead_ms + layers * load.ms_per_layer


@dataclass(frozen=True, slots=True)
class Choice:
    worker: str
    estimate_ms: float
    warm: bool
    fits: bool
    forming: bool


def rank_replicas(loads: Iterable[ReplicaLoad], layers: int, budget_ms: float) -> list[Choice]:
    """The replicas in the order to try them: warm, then within the budget,
    then joining a forming batch, then the lowest estimate (then by name, so
    that equal replicas are chosen the same way every time)."""
    out = []
    for load in loads:
        est = estimate_ms(load, layers)
        out.append(Choice(load.worker, est, load.warm, est <= budget_ms, load.forming))
    out.sort(key=lambda c: (not c.warm, not c.fits, not c.forming, c.estimate_ms, c.worker))
    return out


@dataclass(frozen=True, slots=True)
class PlannedHop:
    hop: Hop
    choices: tuple[Choice, ...]  # replicas in the order to try

    @property
    def estimate_ms(self) -> float:
        return self.choices[0].estimate_ms if self.choices else float("inf")


@dataclass(frozen=True, slots=True)
class OverBudget:
    estimate_ms: float
    budget_ms: float
    hops: tuple[PlannedHop, ...]


def plan_hops(hops: Sequence[Hop], loads: Callable[[int, int], Sequence[ReplicaLoad]],
              budget_ms: float) -> tuple[PlannedHop, ...] | OverBudget:
    """Rank the replicas of every hop; OverBudget when even the best choices
    together would take longer than `budget_ms`. `loads(gid, start)` gives
    the replicas of a hop's group (as seen for that start layer)."""
    planned = []
    for hop in hops:
        # The budget of one hop is what the others leave it: rank by the whole
        # budget, the sum is checked below.
        planned.append(PlannedHop(hop, tuple(rank_replicas(loads(hop.gid, hop.start), hop.layers, budget_ms))))
    total = sum(p.estimate_ms for p in planned)
    if total > budget_ms:
        return OverBudget(total, budget_ms, tuple(planned))
    return tuple(planned)
