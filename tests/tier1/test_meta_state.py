"""The metadata state machine's compare-and-set rules."""
from __future__ import annotations

from pathlib import Path

import pytest

from meta.state import MetaStateMachine
from topology.loader import load_topology

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "topology.yaml").read_text()


def put(sm: MetaStateMachine, text: str, expect: int) -> dict:
    return sm.apply({"op": "put_topology", "text": text, "topology": load_topology(text).to_dict(),
                     "expect_revision": expect})


@pytest.fixture
def sm() -> MetaStateMachine:
    s = MetaStateMachine()
    assert put(s, EXAMPLE, 0)["ok"]
    return s


def test_apply_creates_groups_at_term_one_with_declared_leaders(sm: MetaStateMachine) -> None:
    assert sm.topology_revision == 1
    assert {g.id: (g.term, g.leader, g.voters) for g in sm.groups.values()} == {
        0: (1, "w1", ["w1", "w2", "w3"]), 1: (1, "w2", ["w1", "w2", "w3"]), 2: (1, "w3", ["w1", "w2", "w3"])}
    assert {w.id: w.state for w in sm.workers.values()} == {"w1": "active", "w2": "active", "w3": "active"}
    assert not any(g.ready for g in sm.groups.values())


def test_put_topology_is_a_cas_on_the_revision(sm: MetaStateMachine) -> None:
    text = EXAMPLE.replace("lease_ms: 1500", "lease_ms: 2500")
    stale = put(sm, text, 0)
    assert stale["ok"] is False and stale["code"] == "conflict" and stale["topology_revision"] == 1
    assert sm.topology["settings"]["lease_ms"] == 1500
    fresh = put(sm, text, 1)
    assert fresh["ok"] and fresh["topology_revision"] == 2
    assert sm.topology["settings"]["lease_ms"] == 2500


def test_same_topology_twice_is_a_noop(sm: MetaStateMachine) -> None:
    before = sm.revision
    again = put(sm, EXAMPLE + "\n# a comment changes nothing\n", 1)
    assert again["ok"] and again["changed"] is False
    assert sm.revision == before and sm.topology_revision == 1


def test_shard_count_cannot_change_through_the_log(sm: MetaStateMachine) -> None:
    other = load_topology(EXAMPLE.replace("shards: 3", "shards: 4").split("groups:")[0])
    res = sm.apply({"op": "put_topology", "text": "x", "topology": other.to_dict(), "expect_revision": 1})
    assert res["ok"] is False and res["code"] == "bad_request"
    assert sm.topology["shards"] == 3


def test_set_leader_bumps_term_only_with_the_expected_term(sm: MetaStateMachine) -> None:
    ok = sm.apply({"op": "set_leader", "group": 1, "leader": "w3", "expect_term": 1})
    assert ok["ok"] and ok["term"] == 2 and sm.groups[1].leader == "w3"
    # A second decision made on the same stale read must fail: one leader per term.
    stale = sm.apply({"op": "set_leader", "group": 1, "leader": "w1", "expect_term": 1})
    assert stale["ok"] is False and stale["code"] == "conflict" and stale["term"] == 2
    assert sm.groups[1].leader == "w3" and sm.groups[1].term == 2
    # Other groups are untouched.
    assert sm.groups[0].term == 1 and sm.groups[2].term == 1


def test_set_leader_refuses_a_non_voter(sm: MetaStateMachine) -> None:
    res = sm.apply({"op": "set_leader", "group": 0, "leader": "w9", "expect_term": 1})
    assert res["ok"] is False and res["code"] == "bad_request"
    assert sm.groups[0].term == 1


def test_preferred_leader_is_a_voter_and_changes_nothing_else(sm: MetaStateMachine) -> None:
    term, leader, rev = sm.groups[1].term, sm.groups[1].leader, sm.revision
    res = sm.apply({"op": "set_preferred_leader", "group": 1, "leader": "w3"})
    assert res["ok"] and sm.groups[1].preferred_leader == "w3" and sm.revision == rev + 1
    assert (sm.groups[1].term, sm.groups[1].leader) == (term, leader)  # no leadership change by itself
    again = sm.apply({"op": "set_preferred_leader", "group": 1, "leader": "w3"})
    assert again["ok"] and again["changed"] is False and sm.revision == rev + 1
    bad = sm.apply({"op": "set_preferred_leader", "group": 1, "leader": "w9"})
    assert bad["ok"] is False and bad["code"] == "bad_request" and sm.groups[1].preferred_leader == "w3"
    assert sm.apply({"op": "set_preferred_leader", "group": 7, "leader": "w1"})["code"] == "not_found"


def test_set_ready_only_for_the_current_term_and_leader(sm: MetaStateMachine) -> None:
    assert sm.apply({"op": "set_ready", "group": 0, "term": 1, "leader": "w2"})["code"] == "conflict"
    assert sm.apply({"op": "set_ready", "group": 0, "term": 1, "leader": "w1"})["ok"]
    assert sm.groups[0].ready
    sm.apply({"op": "set_leader", "group": 0, "leader": "w2", "expect_term": 1})
    assert not sm.groups[0].ready
    assert sm.apply({"op": "set_ready", "group": 0, "term": 1, "leader": "w1"})["code"] == "conflict"


def test_set_members_is_a_cas_on_conf_ver(sm: MetaStateMachine) -> None:
    assert sm.groups[2].conf_ver == 0
    res = sm.apply({"op": "set_members", "group": 2, "voters": ["w1", "w2", "w3"], "learners": ["w4"],
                    "expect_conf_ver": 0, "conf_ver": 17})
    assert res["ok"] and res["conf_ver"] == 17 and sm.groups[2].learners == ["w4"]
    stale = sm.apply({"op": "set_members", "group": 2, "voters": ["w1"], "learners": [], "expect_conf_ver": 0,
                      "conf_ver": 20})
    assert stale["code"] == "conflict" and sm.groups[2].voters == ["w1", "w2", "w3"]
    backwards = sm.apply({"op": "set_members", "group": 2, "voters": ["w1"], "learners": [],
                          "expect_conf_ver": 17, "conf_ver": 17})
    assert backwards["code"] == "conflict"
    bad = sm.apply({"op": "set_members", "group": 2, "voters": ["w1"], "learners": ["w1"], "expect_conf_ver": 17,
                    "conf_ver": 30})
    assert bad["code"] == "bad_request"


def test_one_operator_per_group(sm: MetaStateMachine) -> None:
    put = {"op": "put_operator", "group": 1, "kind": "add", "worker": "w4", "step": "add_learner"}
    assert sm.apply(put)["ok"]
    again = sm.apply({**put, "worker": "w5"})
    assert again["code"] == "conflict" and "already has an operator" in again["message"]
    assert sm.apply({"op": "update_operator", "group": 1, "kind": "add", "worker": "w5", "step": "x"})["code"] == \
        "conflict"
    assert sm.apply({"op": "update_operator", "group": 1, "kind": "add", "worker": "w4", "step": "catch_up",
                     "message": "applied 10/100"})["ok"]
    assert sm.view()["operators"][1]["step"] == "catch_up"
    assert sm.apply({"op": "update_operator", "group": 1, "kind": "add", "worker": "w4", "step": "", "done": True})[
        "ok"]
    assert sm.operators == {}


def test_revision_bumps_on_change_only(sm: MetaStateMachine) -> None:
    r = sm.revision
    sm.apply({"op": "register_worker", "id": "w4", "addr": "127.0.0.1:7204", "zone": "d"})
    assert sm.revision == r + 1 and sm.workers["w4"].state == "available"
    sm.apply({"op": "register_worker", "id": "w4", "addr": "127.0.0.1:7204", "zone": "d"})
    assert sm.revision == r + 1
    assert sm.apply({"op": "nope"})["code"] == "bad_request"
    assert sm.revision == r + 1


def test_view_is_plain_data(sm: MetaStateMachine) -> None:
    import orjson

    view = sm.view()
    decoded = orjson.loads(orjson.dumps(view, option=orjson.OPT_NON_STR_KEYS))
    assert decoded["groups"]["1"]["leader"] == "w2"
    assert decoded["topology"]["cluster"] == "demo"


def test_register_without_zone_keeps_the_topology_zone(sm: MetaStateMachine) -> None:
    sm.apply({"op": "register_worker", "id": "w2", "addr": "127.0.0.1:7202", "zone": None})
    assert sm.workers["w2"].zone == "b"
    sm.apply({"op": "register_worker", "id": "w9", "addr": "127.0.0.1:7209", "zone": None})
    assert sm.workers["w9"].zone == "default"


def test_apply_sets_each_live_groups_desired_placement(sm: MetaStateMachine) -> None:
    assert all(g.desired == ("w1", "w2", "w3") for g in sm.groups.values())
    moved = EXAMPLE.replace("  - {id: w3, http: 127.0.0.1:7203, zone: c}",
                            "  - {id: w3, http: 127.0.0.1:7203, zone: c}\n  - {id: w4, http: 127.0.0.1:7204, zone: c}")
    moved = moved.replace("{id: 0, leader: w1, replicas: [w1, w2, w3]}", "{id: 0, leader: w1, replicas: [w1, w2, w4]}")
    assert moved.count("w4") == 2
    assert put(sm, moved, 1)["ok"]
    g = sm.groups[0]
    # The voters stay until reconcile moves them; the placement is what it drives to.
    assert (g.voters, g.desired, sm.groups[1].desired) == (["w1", "w2", "w3"], ("w1", "w2", "w4"), ("w1", "w2", "w3"))


def test_a_file_that_pins_groups_pins_their_leaders_and_an_automatic_one_does_not() -> None:
    from meta.state import MetaStateMachine
    from topology.loader import load_topology

    text = EXAMPLE
    sm = MetaStateMachine()
    topo = load_topology(text)
    assert sm.apply({"op": "put_topology", "expect_revision": 0, "topology": topo.to_dict(), "text": text})["ok"]
    assert topo.groups_explicit and all(g.leader_pinned for g in sm.groups.values())
    assert sm.apply({"op": "set_preferred_leader", "group": 0, "leader": sm.groups[0].voters[1], "pinned": False})["ok"]
    assert not sm.groups[0].leader_pinned
    assert sm.apply({"op": "set_preferred_leader", "group": 0, "leader": sm.groups[0].voters[1]})["ok"]
    assert sm.groups[0].leader_pinned  # an operator's choice


def _repair_group_1_onto_w4(sm: MetaStateMachine) -> None:
    """What repair leaves behind: w3 declared gone, group 1's w3 replaced by w4."""
    assert sm.apply({"op": "set_worker_state", "id": "w3", "state": "removed"})["ok"]
    assert sm.apply({"op": "put_operator", "group": 1, "kind": "add", "worker": "w4", "step": "add_learner",
                     "replaces": "w3"})["ok"]
    assert sm.apply({"op": "update_operator", "group": 1, "kind": "add", "worker": "w4", "step": "done",
                     "done": True})["ok"]
    assert sm.groups[1].desired == ("w1", "w2", "w4")


def test_reasserting_the_same_pinned_file_steers_moved_groups_back(sm: MetaStateMachine) -> None:
    _repair_group_1_onto_w4(sm)
    sm.apply({"op": "set_preferred_leader", "group": 2, "leader": "w1"})  # a transfer
    assert sm.stale_placement(load_topology(EXAMPLE)) == [1, 2]
    # An entry without the flag (logged before it existed) keeps meaning "no-op".
    assert put(sm, EXAMPLE, 1)["changed"] is False and sm.groups[1].desired == ("w1", "w2", "w4")
    rev = sm.revision
    res = sm.apply({"op": "put_topology", "text": EXAMPLE, "topology": load_topology(EXAMPLE).to_dict(),
                    "expect_revision": 1, "reassert": True})
    assert res["ok"] and res["reasserted"] == [1, 2] and res["topology_revision"] == 1 and sm.revision == rev + 1
    assert sm.groups[1].desired == ("w1", "w2", "w3") and sm.groups[2].preferred_leader == "w3"
    assert sm.workers["w3"].state == "active"  # the file names it: eligible again once it is live
    again = sm.apply({"op": "put_topology", "text": EXAMPLE, "topology": load_topology(EXAMPLE).to_dict(),
                      "expect_revision": 1, "reassert": True})
    assert again["changed"] is False and sm.stale_placement(load_topology(EXAMPLE)) == []


def test_automatic_placement_is_never_reasserted(sm: MetaStateMachine) -> None:
    auto = EXAMPLE.split("groups:")[0] + "settings: {lease_ms: 1500}\n"
    assert put(sm, auto, 1)["ok"] and sm.topology_revision == 2
    _repair_group_1_onto_w4(sm)
    assert sm.stale_placement(load_topology(auto)) == []
    res = sm.apply({"op": "put_topology", "text": auto, "topology": load_topology(auto).to_dict(),
                    "expect_revision": 2, "reassert": True})
    assert res["changed"] is False and sm.groups[1].desired == ("w1", "w2", "w4")


def test_register_moves_a_worker_only_from_the_address_the_server_admitted(sm: MetaStateMachine) -> None:
    base = {"op": "register_worker", "id": "w4", "zone": "d"}
    assert sm.apply({**base, "addr": "127.0.0.1:7204", "allow_repoint": None})["ok"]
    refused = sm.apply({**base, "addr": "127.0.0.1:9999", "allow_repoint": None})
    assert refused["code"] == "conflict" and refused["registered_addr"] == "127.0.0.1:7204"
    # Admitted from another address than the one now registered: it changed meanwhile.
    assert sm.apply({**base, "addr": "127.0.0.1:9999", "allow_repoint": "127.0.0.1:1"})["code"] == "conflict"
    assert sm.workers["w4"].addr == "127.0.0.1:7204"
    assert sm.apply({**base, "addr": "127.0.0.1:9999", "allow_repoint": "127.0.0.1:7204"})["ok"]
    assert sm.workers["w4"].addr == "127.0.0.1:9999"
    # A command logged before the rule (no key) replays as it was applied then.
    assert sm.apply({**base, "addr": "127.0.0.1:7204"})["ok"] and sm.workers["w4"].addr == "127.0.0.1:7204"
