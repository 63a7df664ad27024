"""`models:` in a topology: layer-range groups beside the entity shards."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from meta.state import MetaStateMachine
from topology.errors import TopologyError
from topology.model import Topology, model_groups, replication_factors
from topology.plan import other_changes
from topology.validate import build_topology

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "layers.yaml"


def doc() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def errors(d: dict[str, Any], live: Topology | None = None) -> list[tuple[str, str]]:
    with pytest.raises(TopologyError) as info:
        build_topology(d, live=live)
    return [(e.path, e.message) for e in info.value.errors]


def test_the_example_gives_model_groups_ids_after_the_shards_and_places_them_with_the_models_factor() -> None:
    t = build_topology(doc())
    (m,) = t.models
    assert (m.name, m.layers, m.d_model, m.d_hidden, m.seed, m.replication_factor) == ("tiny", 24, 64, 256, 7, 2)
    assert [(g.id, g.first, g.last) for g in m.groups] == [(3, 0, 11), (4, 8, 17), (5, 14, 23)]
    model_specs = [g for g in t.groups if g.id >= 3]
    assert [len(g.replicas) for g in model_specs] == [2, 2, 2]
    assert all(g.leader in g.replicas for g in model_specs)
    # Leaders spread over the three workers within the model.
    assert len({g.leader for g in model_specs}) == 3
    assert t.model_group(4) == (m, m.groups[1]) and t.model_group(0) is None
    assert not t.pinned(3) and not t.pinned(0)
    assert Topology.from_dict(t.to_dict()) == t
    assert set(model_groups(t.to_dict())) == {3, 4, 5}
    assert replication_factors(t.to_dict()) == {3: 2, 4: 2, 5: 2}


def test_declared_replicas_pin_that_group_and_default_the_leader_to_the_first() -> None:
    d = doc()
    d["models"][0]["groups"][1].update(replicas=["w3", "w1"])
    t = build_topology(d)
    g4 = next(g for g in t.groups if g.id == 4)
    assert (g4.leader, g4.replicas, t.pinned(4), t.pinned(3)) == ("w3", ("w3", "w1"), True, False)


def test_a_gap_in_the_ranges_names_the_uncovered_layers() -> None:
    d = doc()
    d["models"][0]["groups"] = [{"layers": [0, 9]}, {"layers": [14, 20]}]
    assert errors(d) == [("models[0].groups", "layers 10-13, 21-23 are not covered by any group: "
                                              "every layer 0..23 needs one")]


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda m: m["groups"][0].update(layers=[5, 2]), ("models[0].groups[0].layers", "first layer 5 is after last")),
    (lambda m: m["groups"][0].update(layers=[0, 24]), ("models[0].groups[0].layers[1]", "between 0 and 23")),
    (lambda m: m["groups"][0].update(layers="0-11"), ("models[0].groups[0].layers", "expected [first, last]")),
    (lambda m: m["groups"][0].update(leader="w1"), ("models[0].groups[0].leader", "needs the group's replicas")),
    (lambda m: m["groups"][0].update(replicas=["w1"]), ("models[0].groups[0].replicas", "has 1 replicas but")),
    (lambda m: m["groups"][0].update(replicas=["w1", "w9"]), ("models[0].groups[0].replicas[1]", "unknown worker")),
    (lambda m: m.update(replication_factor=4), ("models[0].replication_factor", "exceeds the number of workers")),
    (lambda m: m.update(groups=[]), ("models[0].groups", "at least one group")),
    (lambda m: m.update(colour="red"), ("models[0].colour", "unknown key")),
    (lambda m: m.update(d_model=512, d_hidden=4096), ("models[0].groups[0].layers", "MiB of weights")),
])
def test_bad_models_are_refused_with_the_path_of_the_field(edit: Any, expected: tuple[str, str]) -> None:
    d = doc()
    edit(d["models"][0])
    got = errors(d)
    assert got[0][0] == expected[0] and expected[1] in got[0][1], got


def test_duplicate_model_names_are_refused() -> None:
    d = doc()
    d["models"].append(copy.deepcopy(d["models"][0]))
    assert errors(d) == [("models[1].name", "duplicate model name 'tiny' (also models[0].name)")]


def test_a_live_model_keeps_its_shape_and_ranges_but_a_new_one_may_be_appended() -> None:
    live = build_topology(doc())
    d = doc()
    d["models"][0]["seed"] = 8
    d["models"][0]["groups"][0]["layers"] = [0, 12]
    got = errors(d, live)
    assert got[0] == ("models[0].seed", "cannot change from 7 to 8 on a live cluster "
                                        "(change weights with POST /v1/models/NAME/weights)")
    assert got[1][0] == "models[0].groups" and "cannot change" in got[1][1]
    d = doc()
    d["models"] = []
    assert errors(d, live) == [("models", "model 'tiny' cannot be removed from a live cluster")]
    d = doc()
    extra = copy.deepcopy(d["models"][0])
    extra.update(name="small", layers=4, groups=[{"layers": [0, 3]}])
    d["models"].append(extra)
    t = build_topology(d, live=live)
    assert [g.id for g in t.models[1].groups] == [6]
    assert other_changes(live.to_dict(), t.to_dict()) == ["+ model small (4 layers, d_model 64; groups 6: 0-3)"]


def test_meta_creates_the_model_groups_with_their_own_replicas_and_pins_only_declared_ones() -> None:
    d = doc()
    d["models"][0]["groups"][2].update(replicas=["w1", "w2"], leader="w2")
    t = build_topology(d)
    state = MetaStateMachine()
    out = state.apply({"op": "put_topology", "expect_revision": 0, "text": "x", "topology": t.to_dict()})
    assert out["ok"] and out["created_groups"] == [0, 1, 2, 3, 4, 5], out
    assert sorted(state.groups[5].voters) == ["w1", "w2"] and state.groups[5].leader == "w2"
    assert state.groups[5].leader_pinned and not state.groups[3].leader_pinned and not state.groups[0].leader_pinned
    assert len(state.groups[3].voters) == 2 and len(state.groups[0].voters) == 3
