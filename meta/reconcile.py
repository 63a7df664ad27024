"""Reconcile: drive each group's voters to its desired placement. Pure decisions.

`topoctl apply` stores a placement per group (`GroupRecord.desired`: the
file's `groups:`, or the automatic placement), and the replica verbs and
repair edit it (meta/state.py). This is the controller's half of kubectl's
contract: the file is the desired state, and the cluster converges to it,
with the staged operators, one membership change at a time, never below the
replication factor:

1. a desired worker that is not a voter yet is added (learner -> catch up ->
   promote) when it is live and placeable -- a gone or draining worker is
   not, so a placement naming a dead worker waits (repair keeps the group at
   RF meanwhile, and the difference is drift, shown by `topoctl status`);
2. a learner nobody wants is removed;
3. only once every desired worker is a voter, the voters nobody wants are
   removed, the leader last (its operator hands the leadership over first),
   and only while the voters left keep a live majority.

The leader itself follows the placement's preferred leader through leader
balance (meta/controller.py `rebalance`), which moves it only to a caught-up
voter.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from meta.controller import SoftState, heard_live, is_live
from meta.repair import StartOperator
from meta.state import GroupRecord, OperatorRecord, WorkerRecord, placeable


def reconcile(groups: Sequence[GroupRecord], operators: Mapping[int, OperatorRecord],
              workers: Mapping[str, WorkerRecord], soft: SoftState, now_ms: int, lease_ms: int) -> list[StartOperator]:
    """The next step toward each group's desired placement, in group order (one per group)."""
    actions: list[StartOperator] = []
    for g in sorted(groups, key=lambda g: g.id):
        if not g.desired or g.id in operators or not g.ready or g.leader is None \
                or not is_live(soft, g.leader, now_ms, lease_ms):
            continue
        want = set(g.desired)
        voters, learners = set(g.voters), set(g.learners)
        # A desired learner is promoted by an add operator too (it resumes at catch-up).
        addable = [w for w in g.desired if w not in voters and (w in learners or (
            placeable(workers.get(w)) and heard_live(soft, w, now_ms, lease_ms)
            and not soft.refusing(g.id, w, now_ms)))]
        if addable:
            actions.append(StartOperator(g.id, "add", addable[0],
                                         f"the desired placement of group {g.id} includes {addable[0]}", by="reconcile"))
            continue
        stray = sorted(learners - want)
        if stray:
            actions.append(StartOperator(g.id, "remove", stray[0], f"{stray[0]} is a learner nobody placed", by="reconcile"))
            continue
        if not want <= voters:
            continue  # a desired worker cannot be added now: keep every voter
        extra = sorted(voters - want, key=lambda v: (v == g.leader, v))
        if not extra:
            continue
        gone = extra[0]
        remaining = [v for v in g.voters if v != gone]
        live = [v for v in remaining if heard_live(soft, v, now_ms, lease_ms)]
        if len(live) >= len(remaining) // 2 + 1:
            actions.append(StartOperator(g.id, "remove", gone,
                                         f"the desired placement of group {g.id} no longer includes {gone}",
                                         by="reconcile"))
    return actions
