"""Drift between a file's pinned `groups:` and the live cluster (shardgrid/drift.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from shardgrid.drift import drift, move_back, pinned_groups, render_drift
from topology.loader import load_topology

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "topology.yaml").read_text()
FILE = load_topology(EXAMPLE).to_dict()  # groups 0,1,2 on w1,w2,w3, leaders w1,w2,w3


def group(voters: list[str], leader: str, *, desired: list[str] | None = None, learners: list[str] | None = None,
          preferred: str | None = None) -> dict[str, Any]:
    return {"term": 3, "leader": leader, "ready": True, "voters": voters, "learners": learners or [],
            "desired": desired if desired is not None else voters, "preferred_leader": preferred or leader}


def view(groups: dict[int, dict[str, Any]], workers: dict[str, dict[str, Any]] | None = None,
         operators: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    ws = {w: {"state": "active", "live": True} for w in ("w1", "w2", "w3", "w4")}
    for wid, over in (workers or {}).items():
        ws[wid] = {**ws.get(wid, {}), **over}
    # JSON keys: a view read over HTTP has string ids.
    return {"groups": {str(k): v for k, v in groups.items()}, "workers": ws, "operators": operators or {}}


def as_file() -> dict[int, dict[str, Any]]:
    return {0: group(["w1", "w2", "w3"], "w1"), 1: group(["w1", "w2", "w3"], "w2"),
            2: group(["w1", "w2", "w3"], "w3")}


def test_no_drift_when_the_cluster_is_the_file() -> None:
    assert drift(FILE, view(as_file())) == []
    # Voter order is not a difference.
    assert drift(FILE, view({**as_file(), 0: group(["w3", "w1", "w2"], "w1")})) == []


def test_automatic_placement_has_nothing_pinned_so_never_drifts() -> None:
    auto = load_topology(EXAMPLE.split("groups:")[0] + "settings: {lease_ms: 1500}\n").to_dict()
    assert auto["groups_explicit"] is False and pinned_groups(auto) == {}
    assert drift(auto, view({**as_file(), 1: group(["w1", "w2", "w4"], "w2")})) == []
    assert drift(None, view(as_file())) == []
    # A stored copy from before the flag: its groups are compared as written.
    legacy = {k: v for k, v in FILE.items() if k != "groups_explicit"}
    assert [d.group for d in drift(legacy, view({**as_file(), 1: group(["w1", "w2", "w4"], "w2")}))] == [1]


def test_a_repair_onto_another_worker_is_drift_with_its_reason() -> None:
    v = view({**as_file(), 1: group(["w1", "w2", "w4"], "w2")}, workers={"w3": {"state": "removed", "live": False}})
    (d,) = drift(FILE, v)
    assert d.group == 1 and d.voters == ("w1", "w2", "w4") and d.file_replicas == ("w1", "w2", "w3")
    assert render_drift(d) == ("group 1: file w1,w2,w3; live w1,w2,w4 (w3 removed: repaired onto w4; "
                               "the controller keeps w1,w2,w4 until the file is applied again)")
    # Groups 0 and 2 still name w3 as a voter: w3 is theirs still, no drift there.
    assert d.to_dict()["line"] == render_drift(d)


def test_a_silent_worker_and_a_drained_one_say_so() -> None:
    v = view({0: group(["w2", "w3", "w4"], "w2", preferred="w1"), 1: group(["w1", "w2", "w4"], "w2"),
              2: group(["w1", "w2", "w3"], "w3")},
             workers={"w1": {"state": "drained"}, "w3": {"live": False}})
    lines = [render_drift(d) for d in drift(FILE, v)]
    assert lines == [
        "group 0: file w1,w2,w3 leader w1; live w2,w3,w4 leader w2 (w1 drained: drained onto w4; "
        "the controller keeps w2,w3,w4 until the file is applied again)",
        "group 1: file w1,w2,w3; live w1,w2,w4 (w3 not live: repaired onto w4; "
        "the controller keeps w1,w2,w4 until the file is applied again)",
    ]


def test_a_move_in_progress_names_its_operator() -> None:
    v = view({**as_file(), 2: group(["w1", "w2", "w3"], "w3", learners=["w4"], desired=["w1", "w2", "w4"])},
             workers={"w3": {"state": "draining"}},
             operators={"2": {"kind": "add", "worker": "w4", "step": "catch_up", "message": ""}})
    (d,) = drift(FILE, v)
    assert render_drift(d) == ("group 2: file w1,w2,w3; live w1,w2,w3 learners w4 (add w4 in progress (catch_up); "
                               "the controller keeps w1,w2,w4 until the file is applied again)")
    # A learner alone (the voters and the target are the file's) is a difference too.
    stray = view({**as_file(), 2: group(["w1", "w2", "w3"], "w3", learners=["w4"], desired=["w1", "w2", "w3"])})
    assert render_drift(drift(FILE, stray)[0]) == "group 2: file w1,w2,w3; live w1,w2,w3 learners w4"


def test_after_reapplying_the_controller_waits_for_the_files_worker() -> None:
    # The file applied again: the target is the file's, but w3 cannot take a replica.
    v = view({**as_file(), 1: group(["w1", "w2", "w4"], "w2", desired=["w1", "w2", "w3"])},
             workers={"w3": {"live": False}})
    (d,) = drift(FILE, v)
    assert d.why == ("w3 not live: repaired onto w4", "the controller waits for w3 to move it back")


def test_leader_drift_says_what_moves_it_back() -> None:
    failover = view({**as_file(), 0: group(["w1", "w2", "w3"], "w2", preferred="w1")})
    (d,) = drift(FILE, failover)
    assert render_drift(d) == ("group 0: file w1,w2,w3 leader w1; live w1,w2,w3 leader w2 "
                               "(leader balance moves it back to w1 once w1 is caught up)")
    transferred = view({**as_file(), 0: group(["w1", "w2", "w3"], "w3")})
    (d,) = drift(FILE, transferred)
    assert d.why == ("preferred leader w3 (topoctl transfer)",)
    balanced = view({**as_file(), 0: {**group(["w1", "w2", "w3"], "w3"), "leader_pinned": False}})
    assert drift(FILE, balanced)[0].why == ("preferred leader w3 (leader balancing)",)
    down = view({**as_file(), 0: group(["w1", "w2", "w3"], "w2", preferred="w1")}, workers={"w1": {"live": False}})
    assert drift(FILE, down)[0].why == ("w1 not live",)


def test_move_back_only_moves_to_a_worker_that_can_take_the_replica() -> None:
    repaired = {**as_file(), 1: group(["w1", "w2", "w4"], "w2")}
    (d,) = drift(FILE, view(repaired, workers={"w3": {"state": "removed", "live": True}}))
    # Applying the file makes the declared w3 active again; it is live: the replica moves back.
    assert move_back(d, view(repaired, workers={"w3": {"state": "removed", "live": True}})["workers"]) == \
        ["~ group 1: replica w4 -> w3"]
    dead = view(repaired, workers={"w3": {"state": "removed", "live": False}})
    assert move_back(drift(FILE, dead)[0], dead["workers"]) == \
        ["~ group 1: replica w4 -> w3 waits for w3 (not live); the group keeps w1,w2,w4 meanwhile"]
    draining = view(repaired, workers={"w3": {"state": "draining", "live": True}})
    assert move_back(drift(FILE, draining)[0], draining["workers"]) == \
        ["~ group 1: replica w4 -> w3 waits for w3 (draining); the group keeps w1,w2,w4 meanwhile"]


def test_move_back_of_a_leader_and_of_a_target_alone() -> None:
    drained = view({**as_file(), 0: group(["w2", "w3", "w4"], "w2", preferred="w1")},
                   workers={"w1": {"state": "drained"}})
    assert move_back(drift(FILE, drained)[0], drained["workers"]) == [
        "~ group 0: replica w4 -> w1 waits for w1 (drained); the group keeps w2,w3,w4 meanwhile",
        "~ group 0: leader w2 -> w1 waits for w1 (drained)",
    ]
    failover = view({**as_file(), 0: group(["w1", "w2", "w3"], "w2", preferred="w1")})
    assert move_back(drift(FILE, failover)[0], failover["workers"]) == \
        ["~ group 0: leader w2 -> w1 once w1 is a caught-up voter (leader balance)"]
    # A repair under way: the voters are still the file's, only the target differs.
    adding = view({**as_file(), 1: group(["w1", "w2", "w3"], "w2", learners=["w4"], desired=["w1", "w2", "w4"])})
    assert move_back(drift(FILE, adding)[0], adding["workers"]) == \
        ["~ group 1: desired w1,w2,w4 -> w1,w2,w3 (the controller's target back to the file)"]


def test_the_dry_run_section_lists_each_drifted_group_and_what_applying_moves() -> None:
    from shardgrid.drift import render_apply_drift

    v = view({**as_file(), 1: group(["w1", "w2", "w4"], "w2")}, workers={"w3": {"state": "removed", "live": False}})
    assert render_apply_drift(FILE, v) == [
        "drift: the live cluster differs from this file's groups (applying it steers them back):",
        "  group 1: file w1,w2,w3; live w1,w2,w4 (w3 removed: repaired onto w4; "
        "the controller keeps w1,w2,w4 until the file is applied again)",
        "    ~ group 1: replica w4 -> w3 waits for w3 (not live); the group keeps w1,w2,w4 meanwhile",
    ]
    assert render_apply_drift(FILE, view(as_file())) == []
