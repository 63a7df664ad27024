"""Plans: desired vs current groups (topology/plan.py)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topology.model import GroupSpec
from topology.plan import (
    AddReplica,
    CreateGroup,
    MoveLeader,
    RemoveReplica,
    action_from_dict,
    action_to_dict,
    plan,
    render_plan,
)

G = GroupSpec
CURRENT = (G(0, "w1", ("w1", "w2", "w3")), G(1, "w2", ("w1", "w2", "w3")), G(2, "w3", ("w1", "w2", "w3")))


def test_no_changes() -> None:
    assert plan(CURRENT, CURRENT) == []
    assert plan([], []) == []
    assert render_plan([]) == "no changes"


def test_replica_order_is_not_a_change() -> None:
    assert plan([G(0, "w1", ("w1", "w2"))], [G(0, "w1", ("w2", "w1"))]) == []


def test_create_all_groups_on_an_empty_cluster() -> None:
    actions = plan([], list(reversed(CURRENT)))
    assert actions == [
        CreateGroup(0, ("w1", "w2", "w3"), "w1"),
        CreateGroup(1, ("w1", "w2", "w3"), "w2"),
        CreateGroup(2, ("w1", "w2", "w3"), "w3"),
    ]
    assert render_plan(actions) == (
        "+ create group 0: replicas w1,w2,w3 leader w1\n"
        "+ create group 1: replicas w1,w2,w3 leader w2\n"
        "+ create group 2: replicas w1,w2,w3 leader w3"
    )


def test_creates_come_before_changes_to_existing_groups() -> None:
    current = [G(1, "w1", ("w1", "w2"))]
    desired = [G(0, "w1", ("w1", "w2")), G(1, "w1", ("w1", "w3")), G(2, "w2", ("w2", "w3"))]
    assert plan(current, desired) == [
        CreateGroup(0, ("w1", "w2"), "w1"),
        CreateGroup(2, ("w2", "w3"), "w2"),
        AddReplica(1, "w3"),
        RemoveReplica(1, "w2"),
    ]


def test_adds_before_removes_per_group_in_id_order() -> None:
    desired = (G(0, "w1", ("w1", "w2", "w3")), G(1, "w2", ("w2", "w4", "w5")), G(2, "w3", ("w1", "w3", "w4")))
    actions = plan(CURRENT, desired)
    assert actions == [
        AddReplica(1, "w4"),
        AddReplica(1, "w5"),
        RemoveReplica(1, "w1"),
        RemoveReplica(1, "w3"),
        AddReplica(2, "w4"),
        RemoveReplica(2, "w2"),
    ]
    assert render_plan(actions).splitlines() == [
        "+ group 1: add replica w4",
        "+ group 1: add replica w5",
        "- group 1: remove replica w1",
        "- group 1: remove replica w3",
        "+ group 2: add replica w4",
        "- group 2: remove replica w2",
    ]


def test_leader_moves_after_adds_and_before_removing_it() -> None:
    # Group 2's leader w3 leaves the group for the new replica w4.
    desired = (CURRENT[0], CURRENT[1], G(2, "w4", ("w1", "w2", "w4")))
    actions = plan(CURRENT, desired)
    assert actions == [AddReplica(2, "w4"), MoveLeader(2, "w3", "w4"), RemoveReplica(2, "w3")]
    assert render_plan(actions) == (
        "+ group 2: add replica w4\n~ group 2: move leader w3 -> w4\n- group 2: remove replica w3"
    )


def test_leader_move_only() -> None:
    desired = (CURRENT[0], CURRENT[1], G(2, "w1", ("w1", "w2", "w3")))
    actions = plan(CURRENT, desired)
    assert actions == [MoveLeader(2, "w3", "w1")]
    assert render_plan(actions) == "~ group 2: move leader w3 -> w1"


def test_groups_missing_from_desired_are_ignored() -> None:
    assert plan(CURRENT, CURRENT[:2]) == []


def test_duplicate_group_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="group 0 appears twice"):
        plan([CURRENT[0], CURRENT[0]], CURRENT)


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (CreateGroup(0, ("w1", "w2"), "w2"), {"kind": "create_group", "group": 0, "replicas": ["w1", "w2"], "leader": "w2"}),
        (AddReplica(3, "w4"), {"kind": "add_replica", "group": 3, "worker": "w4"}),
        (RemoveReplica(3, "w1"), {"kind": "remove_replica", "group": 3, "worker": "w1"}),
        (MoveLeader(2, "w1", "w3"), {"kind": "move_leader", "group": 2, "from_worker": "w1", "to_worker": "w3"}),
    ],
)
def test_action_dicts(action: object, expected: dict[str, object]) -> None:
    assert action_to_dict(action) == expected  # type: ignore[arg-type]
    assert action_from_dict(json.loads(json.dumps(expected))) == action


def test_unknown_actions_are_rejected() -> None:
    with pytest.raises(TypeError):
        action_to_dict("add")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        action_from_dict({"kind": "drop_table"})


WORKERS = ["w1", "w2", "w3", "w4", "w5", "w6"]


@st.composite
def group_sets(draw: st.DrawFn) -> tuple[list[GroupSpec], list[GroupSpec]]:
    rf = draw(st.integers(1, 4))
    shards = draw(st.integers(1, 6))

    def group(gid: int) -> GroupSpec:
        replicas = tuple(draw(st.lists(st.sampled_from(WORKERS), min_size=rf, max_size=rf, unique=True)))
        return G(gid, draw(st.sampled_from(replicas)), replicas)

    desired = [group(g) for g in range(shards)]
    current = [group(g) for g in range(shards) if draw(st.booleans())]
    return current, desired


@settings(max_examples=200, deadline=None)
@given(group_sets())
def test_replaying_a_plan_is_safe_and_reaches_desired(case: tuple[list[GroupSpec], list[GroupSpec]]) -> None:
    current, desired = case
    state = {g.id: (g.leader, set(g.replicas)) for g in current}
    rf = {g.id: len(g.replicas) for g in desired}
    for a in plan(current, desired):
        if isinstance(a, CreateGroup):
            assert a.group not in state
            state[a.group] = (a.leader, set(a.replicas))
            continue
        leader, replicas = state[a.group]
        if isinstance(a, AddReplica):
            assert a.worker not in replicas
            replicas.add(a.worker)
        elif isinstance(a, RemoveReplica):
            assert a.worker in replicas and a.worker != leader  # never remove the leader
            replicas.discard(a.worker)
            assert len(replicas) >= rf[a.group]  # never below the replica count
        else:
            assert a.from_worker == leader and a.to_worker in replicas
            state[a.group] = (a.to_worker, replicas)
    assert state == {g.id: (g.leader, set(g.replicas)) for g in desired}
    assert plan(desired, desired) == []


def test_other_changes_name_settings_workers_and_the_rest() -> None:
    from topology.plan import other_changes

    old = {"cluster": "c", "settings": {"lease_ms": 1500, "ack": "quorum"},
           "workers": [{"id": "w1", "http": "h:1", "zone": "a"}, {"id": "w3", "http": "h:3", "zone": "c"}],
           "groups": [], "plugin": "entities"}
    new = {"cluster": "c", "settings": {"lease_ms": 1400, "ack": "quorum"},
           "workers": [{"id": "w1", "http": "h:9", "zone": "a"}, {"id": "w4", "http": "h:4", "zone": "c"}],
           "groups": [], "plugin": "layers"}
    assert other_changes(old, new) == [
        "~ settings.lease_ms: 1500 -> 1400",
        "+ worker w4 (h:4, zone c)",
        "- worker w3 (leaves the file; its replicas move to the placement above)",
        "~ worker w1: h:1, zone a -> h:9, zone a",
        "~ plugin changed",
    ]
    assert other_changes(old, old) == [] and other_changes(None, new) == []
