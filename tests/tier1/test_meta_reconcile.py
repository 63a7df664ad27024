"""Reconcile (meta/reconcile.py) and the desired placement it drives to (meta/state.py)."""
from __future__ import annotations

from meta.reconcile import reconcile
from meta.state import GroupRecord, MetaStateMachine, OperatorRecord
from tests.tier1.test_meta_repair import LEASE, NOW, WORKERS, soft


def group(voters: tuple[str, ...], desired: tuple[str, ...], leader: str = "w1",
          learners: tuple[str, ...] = ()) -> GroupRecord:
    return GroupRecord(id=0, term=4, leader=leader, voters=list(voters), learners=list(learners), ready_term=4,
                       desired=desired)


def steps(g: GroupRecord, **kw: object) -> list[tuple[str, str]]:
    return [(a.kind, a.worker) for a in reconcile([g], kw.get("ops", {}), WORKERS, kw.get("soft", soft()),  # type: ignore[arg-type]
                                                  NOW, LEASE)]


def test_a_replica_move_adds_first_and_removes_once_the_new_one_votes() -> None:
    assert steps(group(("w1", "w2", "w3"), ("w1", "w2", "w4"))) == [("add", "w4")]
    assert steps(group(("w1", "w2", "w3"), ("w1", "w2", "w4"), learners=("w4",))) == [("add", "w4")]  # promote it
    assert steps(group(("w1", "w2", "w3", "w4"), ("w1", "w2", "w4"))) == [("remove", "w3")]
    assert steps(group(("w1", "w2", "w4"), ("w1", "w2", "w4"))) == []


def test_the_leader_is_removed_last_and_a_stray_learner_goes() -> None:
    assert steps(group(("w1", "w2", "w3", "w4"), ("w2", "w3"))) == [("remove", "w4")]
    assert steps(group(("w1", "w2", "w3"), ("w2", "w3"))) == [("remove", "w1")]  # its operator transfers first
    assert steps(group(("w1", "w2", "w3"), ("w1", "w2", "w3"), learners=("w5",))) == [("remove", "w5")]


def test_a_desired_worker_that_cannot_come_keeps_every_voter() -> None:
    # w4 is gone (silent): nothing to add, and w3 stays until w4 is a voter.
    assert steps(group(("w1", "w2", "w3"), ("w1", "w2", "w4")), soft=soft({"w4": 10 * LEASE})) == []
    drained = dict(WORKERS)
    drained["w4"] = type(WORKERS["w4"])("w4", "x", "a", "draining")
    assert [(a.kind, a.worker) for a in reconcile([group(("w1", "w2", "w3"), ("w1", "w2", "w4"))], {}, drained,
                                                  soft(), NOW, LEASE)] == []


def test_nothing_without_a_placement_a_ready_leader_or_while_an_operator_runs() -> None:
    assert steps(group(("w1", "w2", "w3"), ())) == []  # a record from before desired existed
    assert steps(group(("w1", "w2", "w3"), ("w4",)), ops={0: OperatorRecord(0, "add", "w5", "catch_up")}) == []
    g = group(("w1", "w2", "w3"), ("w1", "w2", "w4"))
    g.ready_term = 3
    assert steps(g) == []


def test_no_removal_that_would_leave_no_live_majority() -> None:
    # Desired w1,w4,w5; voters w1..w5 but w2 and w3... two of the remaining four are silent.
    g = group(("w1", "w2", "w3", "w4", "w5"), ("w1", "w4", "w5"))
    assert steps(g, soft=soft({"w4": 10 * LEASE, "w5": 10 * LEASE})) == []
    assert steps(g) == [("remove", "w2")]


def test_apply_verbs_repair_and_cancel_edit_the_desired_placement() -> None:
    sm = MetaStateMachine()
    sm.groups[0] = group(("w1", "w2", "w3"), ("w1", "w2", "w3"))
    assert sm.apply({"op": "put_operator", "group": 0, "kind": "add", "worker": "w4", "step": "add_learner"})["ok"]
    assert sm.groups[0].desired == ("w1", "w2", "w3", "w4")
    assert sm.apply({"op": "update_operator", "group": 0, "kind": "add", "worker": "w4", "step": "add_learner",
                     "done": True, "cancelled": True})["ok"]
    assert sm.groups[0].desired == ("w1", "w2", "w3")  # a cancelled add is not started again
    sm.apply({"op": "put_operator", "group": 0, "kind": "add", "worker": "w5", "step": "add_learner",
              "replaces": "w3"})
    assert sm.groups[0].desired == ("w1", "w2", "w5")  # repair: w5 takes w3's place
    sm.apply({"op": "update_operator", "group": 0, "kind": "add", "worker": "w5", "step": "promote", "done": True})
    assert sm.groups[0].desired == ("w1", "w2", "w5")  # finished: kept
    sm.apply({"op": "put_operator", "group": 0, "kind": "remove", "worker": "w2", "step": "remove"})
    assert sm.groups[0].desired == ("w1", "w5")
    legacy = group(("w1", "w2", "w3"), ())
    sm.groups[1] = GroupRecord(id=1, term=1, leader="w1", voters=["w1"], ready_term=1)
    sm.apply({"op": "put_operator", "group": 1, "kind": "add", "worker": "w4", "step": "add_learner"})
    assert sm.groups[1].desired == () and legacy.desired == ()  # nothing applied since: no placement to edit
