"""Automatic repair: a voter whose worker is gone gets replaced. Pure decisions.

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

Only a ready group with a live leader and no operator in progress is
touched, and only while the other voters keep a majority. TiKV's PD waits 30
minutes and Elasticsearch 1 minute before replacing a down node; the wait
(60 s by default) is a setting, and the override exists (LESSONS.md).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from meta.controller import SoftState, heard_live, is_live
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
    by: str = "repair"  # which rule started it: repair | reconcile


def gone_for(soft: SoftState, worker: WorkerRecord | None, wid: str, now_ms: int, replace_after_ms: int) -> bool:
    """Is `wid` gone: declared so, or not heard from for replace_after_ms (by
    this meta leader: one it never heard from counts from its election)?"""
    if worker is not None and worker.state == "removed":
        return True
    seen = soft.workers.get(wid)
    last = seen.last_seen_ms if seen is not None else max(soft.leader_since_ms, soft.first_known_ms.get(wid, 0))
    return now_ms - last >= replace_after_ms


def replacement(group: GroupRecord, groups: Sequence[GroupRecord], workers: Mapping[str, WorkerRecord],
                soft: SoftState, now_ms: int, lease_ms: int, busy: Counter[str]) -> str | None:
    """The worker that should take a new replica of `group`, or None."""
    members = set(group.voters) | set(group.learners)
    zones = {workers[v].zone for v in group.voters if v in workers and heard_live(soft, v, now_ms, lease_ms)}
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
           replace_after_ms: int, rf: int) -> list[StartOperator]:
    """The repair steps to start now, in group order (one per group)."""
    actions: list[StartOperator] = []
    # Workers receiving a replica already (one catch-up at a time each).
    busy = Counter(op.worker for op in operators.values() if op.kind == "add")
    for g in sorted(groups, key=lambda g: g.id):
        if g.id in operators or not g.ready or g.leader is None or not is_live(soft, g.leader, now_ms, lease_ms):
            continue
        gone = [v for v in g.voters if v != g.leader
                and gone_for(soft, workers.get(v), v, now_ms, replace_after_ms)]
        if not gone:
            continue
        why = (f"{gone[0]} was declared gone" if workers.get(gone[0]) is not None
               and workers[gone[0]].state == "removed" else f"{gone[0]} silent for {replace_after_ms} ms")
        live = [v for v in g.voters if v not in gone and heard_live(soft, v, now_ms, lease_ms)]
        if len(live) >= rf:
            remaining = len(g.voters) - 1
            if len(live) >= remaining // 2 + 1:
                actions.append(StartOperator(g.id, "remove", gone[0], f"{why}; the group has {len(live)} live voters"))
            continue
        if g.learners:
            continue  # a learner is on its way (an operator cancelled half-way): let it be promoted or removed
        target = replacement(g, groups, workers, soft, now_ms, lease_ms, busy)
        if target is not None:
            busy[target] += 1
            actions.append(StartOperator(g.id, "add", target, f"{why}; replacing it on {target}", replaces=gone[0]))
    return actions
