"""Automatic placement (topology/placement.py)."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topology.model import GroupSpec, WorkerSpec
from topology.placement import natural_key, place_groups


def workers_in(zones: list[str]) -> list[WorkerSpec]:
    return [WorkerSpec(f"w{i + 1}", f"127.0.0.1:{7201 + i}", z) for i, z in enumerate(zones)]


def check_invariants(workers: list[WorkerSpec], shards: int, rf: int, groups: tuple[GroupSpec, ...]) -> None:
    """What must hold for every input."""
    zone = {w.id: w.zone for w in workers}
    n_zones = len(set(zone.values()))
    assert [g.id for g in groups] == list(range(shards))
    for g in groups:
        assert len(g.replicas) == rf and len(set(g.replicas)) == rf
        assert set(g.replicas) <= set(zone)
        assert list(g.replicas) == sorted(g.replicas)
        assert g.leader in g.replicas
        # Spread: as many zones as possible, as evenly as zone sizes allow.
        per_zone = Counter(zone[r] for r in g.replicas)
        assert len(per_zone) == min(rf, n_zones)
        zone_size = Counter(zone.values())
        unfilled = [c for z, c in per_zone.items() if c < zone_size[z]]
        if unfilled:
            assert max(per_zone.values()) - min(unfilled) <= 1, per_zone
    # Within one zone, workers always carry within one replica of each other.
    load = Counter(r for g in groups for r in g.replicas)
    for z in set(zone.values()):
        counts = [load[w] for w in zone if zone[w] == z]
        assert max(counts) - min(counts) <= 1


def spread(counter: Counter[str], workers: list[WorkerSpec]) -> int:
    counts = [counter[w.id] for w in workers]
    return max(counts) - min(counts)


def test_design_example() -> None:
    groups = place_groups(workers_in(["a", "b", "c"]), 3, 3)
    assert groups == (
        GroupSpec(0, "w1", ("w1", "w2", "w3")),
        GroupSpec(1, "w2", ("w1", "w2", "w3")),
        GroupSpec(2, "w3", ("w1", "w2", "w3")),
    )


def test_auto_example_is_pinned() -> None:
    # Auto-placed clusters are re-placed from this function on every apply:
    # a change of its output moves data on upgrade. Change this on purpose only.
    groups = place_groups(workers_in(["a", "b", "c", "a", "b"]), 6, 3)
    assert groups == (
        GroupSpec(0, "w1", ("w1", "w2", "w3")),
        GroupSpec(1, "w4", ("w3", "w4", "w5")),
        GroupSpec(2, "w2", ("w1", "w2", "w3")),
        GroupSpec(3, "w5", ("w3", "w4", "w5")),
        GroupSpec(4, "w3", ("w1", "w2", "w3")),
        GroupSpec(5, "w4", ("w3", "w4", "w5")),
    )


def test_single_zone_balances_replicas_and_leaders() -> None:
    groups = place_groups(workers_in(["z"] * 4), 4, 2)
    assert groups == (
        GroupSpec(0, "w2", ("w1", "w2")),
        GroupSpec(1, "w3", ("w3", "w4")),
        GroupSpec(2, "w4", ("w2", "w4")),
        GroupSpec(3, "w1", ("w1", "w3")),
    )


def test_rf5_over_three_zones_is_2_2_1() -> None:
    workers = workers_in(["a", "a", "b", "b", "c", "c"])
    zone = {w.id: w.zone for w in workers}
    groups = place_groups(workers, 6, 5)
    for g in groups:
        assert sorted(Counter(zone[r] for r in g.replicas).values()) == [1, 2, 2]
    # Losing any one zone leaves 3 of 5: a quorum.
    for z in "abc":
        assert all(sum(zone[r] != z for r in g.replicas) >= 3 for g in groups)


def test_spread_wins_over_balance_with_a_lone_zone() -> None:
    workers = workers_in(["a", "a", "a", "b"])
    groups = place_groups(workers, 6, 2)
    load = Counter(r for g in groups for r in g.replicas)
    assert load["w4"] == 6  # the only worker of zone b is in every group
    assert sorted(load[w] for w in ("w1", "w2", "w3")) == [2, 2, 2]
    leads = Counter(g.leader for g in groups)
    assert sorted(leads.values()) == [1, 1, 2, 2]


def test_order_of_workers_does_not_matter() -> None:
    workers = workers_in(["a", "b", "c", "a", "b", "c", "a"])
    expected = place_groups(workers, 17, 3)
    assert place_groups(list(reversed(workers)), 17, 3) == expected
    assert place_groups(workers[3:] + workers[:3], 17, 3) == expected
    assert place_groups(tuple(workers), 17, 3) == expected


def test_natural_order_of_ids() -> None:
    assert sorted(["w10", "w2", "w1", "a"], key=natural_key) == ["a", "w1", "w2", "w10"]
    workers = [WorkerSpec(f"w{i}", f"h:{7000 + i}") for i in (10, 9, 1)]
    assert place_groups(workers, 3, 1) == (
        GroupSpec(0, "w1", ("w1",)), GroupSpec(1, "w9", ("w9",)), GroupSpec(2, "w10", ("w10",)),
    )


@pytest.mark.parametrize(
    ("zones", "shards", "rf"),
    [
        (["a", "b", "c"], 3, 3),
        (["a", "b", "c"], 64, 3),
        (["a", "b", "c", "a", "b", "c"], 12, 3),
        (["a", "b", "c", "a", "b", "c"], 7, 3),
        (["a", "b", "a", "b"], 5, 3),
        (["a", "b", "c", "d", "e"], 8, 3),
        (["z"] * 10, 3, 3),
        (["z"] * 7, 100, 5),
        (["a", "b"] * 5, 4096, 3),
        (["a", "b", "c"] * 3, 10, 1),
        (["a", "b", "c", "d"] * 2, 9, 8),
    ],
)
def test_balance_with_equal_zones(zones: list[str], shards: int, rf: int) -> None:
    workers = workers_in(zones)
    groups = place_groups(workers, shards, rf)
    check_invariants(workers, shards, rf, groups)
    assert spread(Counter(r for g in groups for r in g.replicas), workers) <= 1
    leads = Counter(g.leader for g in groups)
    assert spread(leads, workers) <= 1
    assert max(leads[w.id] for w in workers) == -(-shards // len(workers))
    assert place_groups(workers, shards, rf) == groups


@pytest.mark.parametrize(
    ("workers", "shards", "rf", "message"),
    [
        (workers_in(["a", "b"]), 3, 3, "rf must be in 1..2"),
        (workers_in(["a", "b"]), 3, 0, "rf must be in 1..2"),
        (workers_in(["a", "b"]), 0, 1, "shards must be >= 1"),
        ([WorkerSpec("w1", "h:1"), WorkerSpec("w1", "h:2")], 1, 1, "unique"),
    ],
)
def test_rejects_impossible_requests(workers: list[WorkerSpec], shards: int, rf: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        place_groups(workers, shards, rf)


@st.composite
def placements(draw: st.DrawFn) -> tuple[list[WorkerSpec], int, int, bool]:
    equal = draw(st.booleans())
    if equal:
        n_zones = draw(st.integers(1, 4))
        per_zone = draw(st.integers(1, 3))
        zones = [f"z{i}" for _ in range(per_zone) for i in range(n_zones)]
    else:
        zones = draw(st.lists(st.sampled_from(["z0", "z1", "z2", "z3"]), min_size=1, max_size=9))
        equal = len(set(Counter(zones).values())) == 1
    rf = draw(st.integers(1, min(len(zones), 5)))
    shards = draw(st.integers(1, 40))
    return workers_in(zones), shards, rf, equal


@settings(max_examples=150, deadline=None)
@given(placements())
def test_placement_properties(case: tuple[list[WorkerSpec], int, int, bool]) -> None:
    workers, shards, rf, equal_zones = case
    groups = place_groups(workers, shards, rf)
    check_invariants(workers, shards, rf, groups)
    if equal_zones:
        assert spread(Counter(r for g in groups for r in g.replicas), workers) <= 1
        assert spread(Counter(g.leader for g in groups), workers) <= 1
    assert place_groups(list(reversed(workers)), shards, rf) == groups
