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

A voter whose own worker reports its replica `failed` (a disk error: the
worker retries it in place when the cause clears) is replaced the same way
once it has stayed failed for `replace_after_ms`. Gap fill: a group with
fewer than RF voters and none gone (a replica removed by hand, RF raised)
gets a replica added the same way (availability before obedience: the
file's pinned placement then differs, shown as drift).

Assignments may be refused: before an add the meta leader asks the chosen
worker, which answers `insufficient_disk`, `insufficient_ram` or
`draining` when it cannot take the replica; that worker is then skipped
for the group for REFUSAL_HOLD_MS and the next pass picks the next one. An
add the controller started that has not caught up within
`settings.assignment_timeout_ms` is cancelled the same way
(`expired_assignments`), and its learner removed.

Only a ready group with a live leader and no operator in progress is
touched, and only while the other voters keep a majority. TiKV's PD waits 30
minutes and Elasticsearch 1 minute before replacing a down node; the wait
(60 s by default) is a setting, and the override exists (an operator who knows a worker is gone for good need not wait).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from meta.controller import SoftState, StartTransfer, best_transfer_target, heard_live, is_live, report_of
from meta.state import GroupRecord, OperatorRecord, WorkerRecord, placeable, revoked

# The rules whose assignments time out (settings.assignment_timeout_ms).
TIMED_RULES = ("repair", "fill", "drain", "shed")

# A worker that refused a replica of a group is not offered it again for this long.
REFUSAL_HOLD_MS = 60_000


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
class CancelAssignment:
    """Give up on the controller's add of `worker` to `group` (cancel the operator, refuse the worker)."""

    group: int
    worker: str
    reason: str


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
    if worker is not None and (worker.state == "removed" or revoked(worker)):
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
        if w.id in members or not placeable(w) or busy[w.id] or not heard_live(soft, w.id, now_ms, lease_ms) \
                or soft.refusing(group.id, w.id, now_ms):
            continue
        key = (w.zone in zones, hosted[w.id], w.id)
        if best is None or key < best:
            best = key
    return best[2] if best is not None else None


def failed_for(soft: SoftState, wid: str, gid: int, now_ms: int, replace_after_ms: int) -> bool:
    """Has `wid`'s replica of `gid` reported `failed` without a break for replace_after_ms?
    (Its worker retries it in place meanwhile; a recovered replica stops counting.)"""
    since = soft.failed_since_ms.get((wid, gid))
    return since is not None and now_ms - since >= replace_after_ms


def expired_assignments(operators: Mapping[int, OperatorRecord], soft: SoftState, now_ms: int,
                        timeout_ms: int) -> list[CancelAssignment]:
    """The controller's own replica assignments (repair, fill, drain, shed) that
    have not reached promotion within `timeout_ms` of this meta leader seeing
    them: each is cancelled and its worker refused for the group, so the next
    pass places the replica elsewhere. An operator's own verbs and the
    file's placement (reconcile) are never given up on."""
    out = []
    for op in sorted(operators.values(), key=lambda o: o.group):
        if op.kind != "add" or op.by not in TIMED_RULES or op.step == "promote":
            continue
        seen = soft.operator_seen_ms.get((op.group, op.kind, op.worker))
        if seen is not None and now_ms - seen >= timeout_ms:
            out.append(CancelAssignment(op.group, op.worker,
                                        f"{op.worker} did not catch up with group {op.group} within {timeout_ms} ms"))
    return out


def repair(groups: Sequence[GroupRecord], operators: Mapping[int, OperatorRecord],
           workers: Mapping[str, WorkerRecord], soft: SoftState, now_ms: int, lease_ms: int,
           replace_after_ms: int, rf: int, rf_of: Mapping[int, int] | None = None,
           ) -> list[StartOperator | StartTransfer | SetWorkerState]:
    """The repair, gap-fill and drain steps to start now, in group order (one
    per group), then the draining workers that host nothing any more. `rf_of`
    gives the groups whose factor is not `rf` (a model's groups)."""
    actions: list[StartOperator | StartTransfer | SetWorkerState] = []
    # Workers receiving a replica already (one catch-up at a time each).
    busy = Counter(op.worker for op in operators.values() if op.kind == "add")
    default_rf = rf
    for g in sorted(groups, key=lambda g: g.id):
        if g.id in operators or not g.ready or g.leader is None or not is_live(soft, g.leader, now_ms, lease_ms):
            continue
        rf = rf_of.get(g.id, default_rf) if rf_of else default_rf
        if draining(workers, g.leader):
            leaving = frozenset(v for v in g.voters if not placeable(workers.get(v)))
            target = best_transfer_target(g, soft, now_ms, lease_ms, exclude=leaving)
            if target is not None:
                actions.append(StartTransfer(g.id, g.leader, target))
            continue
        refused = [w for w in g.learners if soft.refusing(g.id, w, now_ms)]
        if refused:
            # An assignment given up on (timed out) left its learner behind.
            reason = soft.refused[(g.id, refused[0])].reason
            actions.append(StartOperator(g.id, "remove", refused[0],
                                         f"{refused[0]} gave up on group {g.id} ({reason})", by="repair"))
            continue
        gone = [v for v in g.voters if v != g.leader
                and (draining(workers, v) or gone_for(soft, workers.get(v), v, now_ms, replace_after_ms)
                     or failed_for(soft, v, g.id, now_ms, replace_after_ms))]
        if not gone:
            if len(g.voters) < rf and not g.learners:
                target = replacement(g, groups, workers, soft, now_ms, lease_ms, busy)
                if target is not None:
                    busy[target] += 1
                    actions.append(StartOperator(g.id, "add", target, f"group {g.id} has {len(g.voters)} of {rf} "
                                                 f"voters; adding one on {target}", by="fill"))
            continue
        state = workers[gone[0]].state if gone[0] in workers else ""
        failed = failed_for(soft, gone[0], g.id, now_ms, replace_after_ms) and state != "removed"
        rep = report_of(soft, gone[0], g.id)
        why = (f"{gone[0]}'s replica has failed for {replace_after_ms} ms ({rep.failed if rep else 'failed'})"
               if failed else f"{gone[0]} was revoked" if revoked(workers.get(gone[0])) else
               {"removed": f"{gone[0]} was declared gone", "draining": f"{gone[0]} is draining"}.get(
                   state, f"{gone[0]} silent for {replace_after_ms} ms"))
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
