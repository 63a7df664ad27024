"""When a worker runs queued inference requests (worker/infer_batch.py)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.infer_batch import PassCost, Waiting, plan_batch


def cost(rows: int) -> float:
    return 0.001 + 0.0001 * rows


def test_a_lone_request_waits_for_company_at_most_max_wait() -> None:
    q = [Waiting(1, deadline=10.0, arrived=0.0)]
    plan = plan_batch(q, 0.0, cost, max_rows=64, max_wait_s=0.002)
    assert plan.run == () and plan.wake_at == 0.002
    assert plan_batch(q, 0.002, cost, 64, 0.002).run == (0,)


def test_a_full_batch_runs_at_once_and_leaves_the_rest_queued() -> None:
    q = [Waiting(30, 10.0, 0.0), Waiting(30, 10.0, 0.0), Waiting(30, 10.0, 0.0)]
    plan = plan_batch(q, 0.0, cost, 64, 0.002)
    assert plan.run == (0, 1) and plan.expired == ()


def test_no_wait_when_nobody_is_expected_to_join() -> None:
    q = [Waiting(1, 10.0, 0.0)]
    assert plan_batch(q, 0.0, cost, 64, 0.002, expected_gap_s=0.5).run == (0,)


def test_a_request_that_cannot_finish_even_alone_is_refused() -> None:
    q = [Waiting(1, deadline=0.0005, arrived=0.0), Waiting(1, deadline=10.0, arrived=0.0)]
    plan = plan_batch(q, 0.0, cost, 64, 0.002)
    assert plan.expired == (0,) and plan.run == () and plan.wake_at == 0.002


def test_the_wait_ends_early_when_a_budget_needs_it() -> None:
    # Deadline 3 ms away; the largest batch costs 1 + 6.4 ms: no waiting at all.
    q = [Waiting(1, deadline=0.0074 + 0.0005, arrived=0.0)]
    plan = plan_batch(q, 0.0, cost, 64, 0.002)
    assert plan.wake_at is not None and plan.wake_at <= 0.0005 + 1e-12


@st.composite
def queues(draw: st.DrawFn) -> tuple[list[Waiting], float]:
    now = draw(st.floats(0.0, 1.0))
    q = []
    for _ in range(draw(st.integers(1, 12))):
        arrived = now - draw(st.floats(0.0, 0.01))
        q.append(Waiting(draw(st.integers(1, 40)), now + draw(st.floats(-0.005, 0.05)), arrived))
    return q, now


@settings(max_examples=500, deadline=None)
@given(queues(), st.integers(1, 128), st.floats(0.0, 0.01))
def test_waiting_never_makes_a_request_miss_a_budget_it_could_meet(case: tuple[list[Waiting], float],
                                                                  max_rows: int, max_wait: float) -> None:
    q, now = case
    plan = plan_batch(q, now, cost, max_rows, max_wait)
    for i, w in enumerate(q):
        if now + cost(w.rows) > w.deadline:
            assert i in plan.expired
        else:
            assert i not in plan.expired
    if plan.run:
        rows = sum(q[i].rows for i in plan.run)
        assert rows <= max_rows or len(plan.run) == 1
        if len(plan.run) > 1:
            # Batching never makes a member late that could finish alone.
            assert now + cost(rows) <= min(q[i].deadline for i in plan.run) + 1e-12
        assert list(plan.run) == sorted(plan.run)  # first come, first served
    elif plan.wake_at is not None:
        live = [w for i, w in enumerate(q) if i not in plan.expired]
        # Held until at most the moment the largest batch still finishes in time,
        # and never longer than max_wait after the oldest arrival.
        assert all(plan.wake_at + cost(max_rows) <= w.deadline + 1e-12 for w in live)
        assert plan.wake_at <= min(w.arrived for w in live) + max_wait + 1e-12
        assert plan.wake_at > now


def test_a_request_with_little_budget_is_not_put_in_a_pass_too_large_for_it() -> None:
    q = [Waiting(60, deadline=1.0, arrived=0.0), Waiting(1, deadline=0.005, arrived=0.0)]
    # 61 rows cost 7.1 ms: more than the second request has; it waits for the next pass.
    plan = plan_batch(q, 0.0, cost, 64, 0.002)
    assert plan.run == (0,)


def test_pass_cost_learns_a_fixed_part_and_a_part_per_row() -> None:
    c = PassCost(base_ms=1.0, alpha=0.5)
    c.observe(seconds=0.024, layers=12, rows=1)
    assert c.base_ms == 1.5 and c.seconds(rows=1, layers=10) == 0.015
    c.observe(seconds=0.012 * 1.5 + 0.012 * 0.1 * 9, layers=12, rows=10)  # 0.1 ms per extra row
    assert abs(c.row_ms - 0.05) < 1e-9
    assert abs(c.seconds(rows=1024, layers=12) - 12 * (1.5 + 0.05 * 1023) / 1000) < 1e-9
