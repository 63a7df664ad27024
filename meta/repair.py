"""Automatic repair and drain: a voter whose worker is leaving gets replaced. Pure decisions.

A voter whose worker meta has not heard from for `settings.replace_after_ms`
(or that an operator declared gone: `topoctl worker gone W`, state
`removed`) leaves its groups one replica short for as long as it stays away.
Repair restores the replication factor with the staged operators that
already exist, one membership change at a time, never below RF during the
move:

1. add a replica on another live worker (learner -> catch up -> promote),
   chosen for zone spread first (a zone the group's live voters do not use),
   then fewest replicas hosted (an `available`, capacity-advertising worker
   hosts none), then id; never one already receiving a repair (one snapshot
   at a time per worker);
2. once the group has RF live voters, remove the gone voter (it is not the
   leader: a gone leader was failed over long before).

Drain (`topoctl drain W`, state `draining`) uses the same steps for a live
worker that should leave: its leaderships are handed to the most caught-up
other voter first (StartTransfer), then its replicas are replaced as above;
once it hosts nothing, it is marked `drained` (SetWorkerState).

Only a ready group with a live leader and no operator in progress is
touched, and only while the other voters keep a majority. TiKV's PD waits 30
minutes and Elasticsearch 1 minute before replacing a down node; the wait
(60 s by default) is a setting, and the override exists (LESSONS.md).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from meta.controller import SoftState, StartTransfer, best_transfer_target, heard_live, is_live
from meta.state import GroupRecord, OperatorRecord, WorkerRecord

# Worker states a replacement may come from.
PLACEABLE = ("active", "available")


@dataclass(frozen=True)
class StartOperator:
    """Start a staged operator on a group (what `POST /v1/groups/{id}/replicas` starts)."""

    group: int
    kind: str  # "add" | "remove"
    worker: str
    reason: str
    replaces: str | None = None  # an add that takes a gone voter's place (in the group's desired placement)
    by: str = "repair"  # which rule started it: repair | drain | reconcile


@dataclass(frozen=True)
class SetWorkerState:
    worker: str
    state: str
    reason: str


def draining(workers: Mapping[str, WorkerRecord], wid: str) -> bool:
    w = workers.get(wid)
    return w is not None and w.state == "draining"


def gone_for(soft: SoftState, worker: WorkerRecord | None, wid: str, now_ms: int, replace_after_ms: int) -> bool:
    """Is `wid` gone: declared so, or not heard from for replace_after_ms (by
    this meta leader: one it never heard from counts from its election)?"""
    if worker is not None and worker.state == "removed":
        return True
    seen = soft.workers.get(wid)
    last = seen.last_seen_ms if seen is not None else max(soft.leader_since_ms, soft.first_known_ms.get(wid, 0))
    return now_ms - last >= replace_after_ms


def replacement(group: GroupRecord, groups: Sequence[GroupRecord], workers: Mapping[str, WorkerRecord],
                soft: SoftState, now_ms: int, lease_ms: int, busy: Counter[str],
                leaving: frozenset[str] = frozenset()) -> str | None:
    """The worker that should take a new replica of `group`, or None. The zones
    of the voters that stay (live, not `leaving`) are the ones to avoid."""
    members = set(group.voters) | set(group.learners)
    zones = {workers[v].zone for v in group.voters
             if v in workers and v not in leaving and heard_live(soft, v, now_ms, lease_ms)}
    hosted = Counter(w for g in groups for w in (*g.voters, *g.learners))
    best: tuple[bool, int, str] | None = None
    for w in workers.values():
        if w.id in members or w.state not in PLACEABLE or busy[w.id] or not heard_live(soft, w.id, now_ms, lease_ms):
            continue
        key = (w.zone in zones, hosted[w.id], w.id)
        if best is None or key < best:
            best = key
    return best[2] if best is not None else None


def repair(groups: Sequence[GroupRecord], operators: Mapping[int, OperatorRecord],
           workers: Mapping[str, WorkerRecord], soft: SoftState, now_ms: int, lease_ms: int,
           replace_after_ms: int, rf: int) -> list[StartOperator | StartTransfer | SetWorkerState]:
    """The repair and drain steps to start now, in group order (one per group),
    then the draining workers that host nothing any more."""
    actions: list[StartOperator | StartTransfer | SetWorkerState] = []
    # Workers receiving a replica already (one catch-up at a time each).
    busy = Counter(op.worker for op in operators.values() if op.kind == "add")
    for g in sorted(groups, key=lambda g: g.id):
        if g.id in operators or not g.ready or g.leader is None or not is_live(soft, g.leader, now_ms, lease_ms):
            continue
        if draining(workers, g.leader):
            leaving = frozenset(v for v in g.voters if v not in workers or workers[v].state not in PLACEABLE)
            target = best_transfer_target(g, soft, now_ms, lease_ms, exclude=leaving)
            if target is not None:
                actions.append(StartTransfer(g.id, g.leader, target))
            continue
        gone = [v for v in g.voters if v != g.leader
                and (draining(workers, v) or gone_for(soft, workers.get(v), v, now_ms, replace_after_ms))]
        if not gone:
            continue
        state = workers[gone[0]].state if gone[0] in workers else ""
        why = {"removed": f"{gone[0]} was declared gone", "draining": f"{gone[0]} is draining"}.get(
            state, f"{gone[0]} silent for {replace_after_ms} ms")
        by = "drain" if state == "draining" else "repair"
        live = [v for v in g.voters if v not in gone and heard_live(soft, v, now_ms, lease_ms)]
        if len(live) >= rf:
            remaining = len(g.voters) - 1
            if len(live) >= remaining // 2 + 1:
                actions.append(StartOperator(g.id, "remove", gone[0], f"{why}; the group has {len(live)} live voters",
                                             by=by))
            continue
        if g.learners:
            continue  # a learner is on its way (an operator cancelled half-way): let it be promoted or removed
        target = replacement(g, groups, workers, soft, now_ms, lease_ms, busy, frozenset(gone))
        if target is not None:
            busy[target] += 1
            actions.append(StartOperator(g.id, "add", target, f"{why}; replacing it on {target}", replaces=gone[0],
                                         by=by))
    hosting = {w for g in groups for w in (*g.voters, *g.learners)} | {op.worker for op in operators.values()}
    actions += [SetWorkerState(w.id, "drained", f"{w.id} hosts no replica any more")
                for w in sorted(workers.values(), key=lambda w: w.id) if w.state == "draining" and w.id not in hosting]
    return actions
