"""Route planning through a layer-sharded model (gateway/layer_route.py)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.layer_route import (
    Hop,
    OverBudget,
    RangeGroup,
    ReplicaLoad,
    Uncovered,
    estimate_ms,
    plan_hops,
    plan_route,
    rank_replicas,
)

EXAMPLE = [RangeGroup(3, 0, 11), RangeGroup(4, 8, 17), RangeGroup(5, 14, 23)]


def test_the_example_runs_each_layer_once_with_start_layers_after_the_overlaps() -> None:
    assert plan_route("tiny", EXAMPLE, 24) == [Hop(3, 0, 11), Hop(4, 12, 17), Hop(5, 18, 23)]


def test_a_wide_group_is_preferred_over_two_narrow_ones() -> None:
    groups = [RangeGroup(1, 0, 5), RangeGroup(2, 6, 11), RangeGroup(3, 0, 11)]
    assert plan_route("m", groups, 12) == [Hop(3, 0, 11)]


def test_a_failed_group_is_routed_around_from_the_layer_where_the_route_stopped() -> None:
    groups = [*EXAMPLE, RangeGroup(6, 10, 20)]
    # Group 4 failed at layer 12: 6 covers 12..20, then 5 from 21.
    assert plan_route("tiny", groups, 24, start=12, avoid={4}) == [Hop(6, 12, 20), Hop(5, 21, 23)]


def test_uncovered_layers_are_named() -> None:
    with pytest.raises(Uncovered) as info:
        plan_route("tiny", EXAMPLE, 24, avoid={4})
    assert info.value.missing == [(12, 13)]
    assert str(info.value) == "layers 12-13 of model 'tiny' are not covered by any available group"


def test_among_groups_reaching_as_far_the_preferred_one_is_taken() -> None:
    groups = [RangeGroup(1, 0, 11), RangeGroup(2, 0, 11)]
    assert plan_route("m", groups, 12, prefer={1: 5.0, 2: 1.0}.__getitem__) == [Hop(2, 0, 11)]
    assert plan_route("m", groups, 12) == [Hop(1, 0, 11)]


def _min_hops(groups: list[RangeGroup], n: int) -> int:
    for k in range(1, len(groups) + 1):
        for combo in itertools.permutations(groups, k):
            pos = 0
            for g in combo:
                if g.first > pos or g.last < pos:
                    break
                pos = g.last + 1
            if pos >= n:
                return k
    raise AssertionError("not coverable")


@st.composite
def covering(draw: st.DrawFn) -> tuple[list[RangeGroup], int]:
    n = draw(st.integers(1, 16))
    groups = []
    for gid in range(draw(st.integers(1, 5))):
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a, n - 1))
        groups.append(RangeGroup(gid, a, b))
    return groups, n


@settings(max_examples=300, deadline=None)
@given(covering())
def test_a_route_runs_every_layer_exactly_once_in_the_fewest_hops(case: tuple[list[RangeGroup], int]) -> None:
    groups, n = case
    by_id = {g.gid: g for g in groups}
    try:
        hops = plan_route("m", groups, n)
    except Uncovered as exc:
        covered = {i for g in groups for i in range(g.first, g.last + 1)}
        assert {i for a, b in exc.missing for i in range(a, b + 1)} == set(range(n)) - covered
        return
    ran = [i for h in hops for i in range(h.start, h.end + 1)]
    assert ran == list(range(n))
    for h in hops:
        assert by_id[h.gid].first <= h.start <= h.end == by_id[h.gid].last
    assert len(hops) == _min_hops(groups, n)


def load(worker: str, **kw: object) -> ReplicaLoad:
    base: dict[str, object] = {"warm": True, "ms_per_layer": 0.1, "overhead_ms": 1.0}
    base.update(kw)
    return ReplicaLoad(worker, **base)  # type: ignore[arg-type]


def test_replicas_rank_warm_then_within_budget_then_forming_batch_then_estimate() -> None:
    loads = [
        load("cold", warm=False),
        load("slow", ms_per_layer=10.0),  # 101 ms for 10 layers: over a 50 ms budget
        load("busy", ms_per_layer=2.0),  # 21 ms
        load("forming", ms_per_layer=3.0, forming=True),  # 31 ms, but it joins a pass forming there
        load("idle"),
    ]
    order = [c.worker for c in rank_replicas(loads, 10, 50.0)]
    assert order == ["forming", "idle", "busy", "slow", "cold"]


def test_an_estimate_is_the_fixed_cost_and_the_layers() -> None:
    assert estimate_ms(load("a"), 10) == pytest.approx(2.0)
    assert estimate_ms(load("a", overhead_ms=0.0, ms_per_layer=0.4), 5) == pytest.approx(2.0)


def test_a_route_that_cannot_fit_the_budget_is_refused_with_its_estimate() -> None:
    hops = plan_route("tiny", EXAMPLE, 24)
    out = plan_hops(hops, lambda gid, start: [load("w1")], 3.0)
    assert isinstance(out, OverBudget)
    # 1 ms overhead + layers * 0.1 ms, per hop: 2.2 + 1.6 + 1.6
    assert out.estimate_ms == pytest.approx(5.4)
    fits = plan_hops(hops, lambda gid, start: [load("w1"), load("w2", warm=False)], 100.0)
    assert not isinstance(fits, OverBudget)
    assert [[c.worker for c in p.choices] for p in fits] == [["w1", "w2"]] * 3


def test_a_hop_with_no_replica_makes_the_route_over_budget() -> None:
    out = plan_hops([Hop(3, 0, 11)], lambda gid, start: [], 1000.0)
    assert isinstance(out, OverBudget) and out.estimate_ms == float("inf")
