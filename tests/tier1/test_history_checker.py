"""The chaos tests' history checker (tests/support/history.py): it must accept
correct histories and reject each planted anomaly for the right reason.

The strongest checks are cross-checks: random small histories (linearizable or
not) judged by the checker and by brute force over every order, and random
linearizable histories produced by simulating a real register and counter.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.history import (
    DUPLICATE_APPLY,
    DUPLICATE_INCR_RESULT,
    INCR_ORDER,
    INCR_RESULT_OUT_OF_RANGE,
    LOST_INCREMENT,
    LOST_WRITE,
    MIXED_KEY,
    NOT_LINEARIZABLE,
    PHANTOM_VALUE,
    PRECHECK_VIOLATIONS,
    READ_BEFORE_WRITE,
    READ_UNWRITTEN_VALUE,
    SEARCH_GAVE_UP,
    STALE_READ,
    History,
    Op,
    Report,
    check_acknowledged,
    check_linearizable,
    outcome_for_error,
)


def W(p: int, key: str, value: Any, invoke: float, complete: float | None, outcome: str = "ok") -> Op:
    return Op(p, "write", key, value, invoke, complete, outcome)  # type: ignore[arg-type]


def R(p: int, key: str, result: Any, invoke: float, complete: float | None, outcome: str = "ok") -> Op:
    return Op(p, "read", key, None, invoke, complete, outcome, result)  # type: ignore[arg-type]


def I(p: int, key: str, invoke: float, complete: float | None, result: Any = None, outcome: str = "ok") -> Op:
    return Op(p, "incr", key, 1, invoke, complete, outcome, result)  # type: ignore[arg-type]


# Histories are drawn from a seeded Random: st.randoms() records every draw,
# which made these tests ten times slower than the checker itself.
SEEDS = st.integers(0, 2**32 - 1)


def kinds(report: Report) -> set[str]:
    return {v.kind for v in report.violations}


# --------------------------------------------------------------------------- recorder


def test_history_records_from_asyncio_tasks() -> None:
    ticks = itertools.count()
    history = History(clock=lambda: float(next(ticks)))

    async def client(p: int) -> None:
        for n in range(20):
            h = history.invoke(p, "write", f"k{p}-{n}", {"v": f"{p}-{n}"})
            await asyncio.sleep(0)
            history.complete(h, "ok", n)
        history.invoke(p, "incr", "c", 1)  # the test "ends" before this one answers

    async def main() -> None:
        await asyncio.gather(*(client(p) for p in range(10)))

    asyncio.run(main())
    ops = history.ops
    assert len(ops) == len(history) == 10 * 21
    assert all(op.complete is not None and op.complete > op.invoke for op in ops if op.kind == "write")
    pending = [op for op in ops if op.kind == "incr"]
    assert all(op.complete is None and op.indefinite and not op.acked for op in pending)
    # Never-completed increments count as unknown: a total of 0..10 is fine.
    final = {op.key: op.value for op in ops if op.kind == "write"}
    for total in (0, 10):
        assert check_acknowledged(history, final, {"c": total}).ok
    assert kinds(check_acknowledged(history, final, {"c": 11})) == {DUPLICATE_APPLY}
    with pytest.raises(ValueError, match="completed twice"):
        history.complete(0, "ok")
    # Round trip through plain records (a generator in another process).
    again = History.from_records(history.to_records())
    assert again.ops == ops


def test_outcome_for_error() -> None:
    assert outcome_for_error("bad_request") == "fail"
    assert outcome_for_error("not_found") == "fail"
    # The gateway's 503: nothing was applied (gateway/router.py, give_up).
    assert outcome_for_error("unavailable") == "fail"
    for code in ("quorum_timeout", "deadline_exceeded", "not_leader", "whatever", None):
        assert outcome_for_error(code) == "unknown"


def test_write_answered_unavailable_that_appears_is_a_violation() -> None:
    # 503 unavailable promises that nothing was applied: a value it carried
    # that shows up later (read back, or in the final state) is a phantom,
    # and an increment it refused that got counted is one too many.
    outcome = outcome_for_error("unavailable")
    w = W(1, "k", "k:ab12", 0.0, 1.0, outcome)
    r = R(2, "k", "k:ab12", 2.0, 3.0)
    report = check_acknowledged([w, r], {"k": "k:ab12"}, {})
    [phantom] = report.phantom_values
    assert "failed definitely" in phantom.message and phantom.ops == (w,)
    [bad_read] = check_linearizable([w, r]).of(READ_UNWRITTEN_VALUE)
    assert "failed definitely" in bad_read.message
    # Absent, it is fine.
    assert check_acknowledged([w], {}, {}).ok
    incrs = [I(1, "c", 0.0, 1.0, 1), I(2, "c", 2.0, 3.0, None, outcome)]
    assert check_acknowledged(incrs, {}, {"c": 1}).ok
    assert kinds(check_acknowledged(incrs, {}, {"c": 2})) == {DUPLICATE_APPLY}
    # The old rule (unavailable = unknown) let both pass.
    lenient = [W(1, "k", "k:ab12", 0.0, 1.0, "unknown"), r]
    assert check_acknowledged(lenient, {"k": "k:ab12"}, {}).ok and check_linearizable(lenient).ok


# --------------------------------------------------------------------------- acknowledged


def test_acknowledged_accepts_correct_final_state() -> None:
    ops = [
        W(1, "a", {"v": 1}, 0.0, 1.0),
        W(2, "b", {"v": 2}, 0.5, 1.5, "unknown"),  # present: applied after all
        W(3, "c", {"v": 3}, 0.5, None, "unknown"),  # absent: never applied
        W(4, "d", {"v": 4}, 0.5, 0.6, "fail"),  # absent: definitely not applied
        I(1, "e/n", 2.0, 2.1, 1),
        I(2, "e/n", 2.0, 2.2, 2),
        I(3, "e/n", 2.0, 2.3, None, "unknown"),
        I(4, "e/n", 2.0, 2.3, None, "fail"),
    ]
    for total in (2, 3):
        report = check_acknowledged(ops, {"a": {"v": 1}, "b": {"v": 2}}, {"e/n": total})
        assert report.ok, str(report)
    summary = report.summary()
    assert "\n" not in summary
    assert summary.startswith("acknowledged: OK ops=8 acked=3 unknown=3 failed=2")
    assert "lost=0 phantom=0 counter_anomalies=0" in summary


def test_lost_acknowledged_write() -> None:
    ops = [W(1, "a", {"v": 1}, 0.0, 1.0), W(2, "b", {"v": 2}, 0.0, 1.0)]
    report = check_acknowledged(ops, {"b": {"v": 2}}, {})
    assert not report.ok
    [lost] = report.lost_writes
    assert lost.key == "a" and "missing" in lost.message and lost.ops == (ops[0],)
    assert "lost=1" in report.summary() and "FAIL" in report.summary()


def test_overwritten_acknowledged_write_is_lost() -> None:
    # Not write-once: b began after a completed, so b's value must be final.
    ops = [W(1, "k", "a", 0.0, 1.0), W(1, "k", "b", 2.0, 3.0)]
    assert check_acknowledged(ops, {"k": "b"}, {}).ok
    [lost] = check_acknowledged(ops, {"k": "a"}, {}).lost_writes
    assert "'b'" in lost.message and "completed before this one began" in lost.message
    # Concurrent writes: either may win.
    ops = [W(1, "k", "a", 0.0, 2.0), W(2, "k", "b", 1.0, 3.0)]
    assert check_acknowledged(ops, {"k": "a"}, {}).ok and check_acknowledged(ops, {"k": "b"}, {}).ok


def test_phantom_values() -> None:
    ops = [W(1, "a", {"v": 1}, 0.0, 1.0), W(2, "f", {"v": 9}, 0.0, 1.0, "fail")]
    report = check_acknowledged(ops, {"a": {"v": 7}, "f": {"v": 9}, "z": 1}, {})
    phantoms = {v.key: v.message for v in report.phantom_values}
    assert set(phantoms) == {"a", "f", "z"}
    assert "written by no write" in phantoms["a"]
    assert "failed definitely" in phantoms["f"]
    # The acknowledged {"v": 1} is gone as well.
    assert [v.key for v in report.lost_writes] == ["a"]
    assert kinds(report) == {PHANTOM_VALUE, LOST_WRITE}


def test_lost_increment() -> None:
    ops = [I(p, "c", 0.0, 1.0, p) for p in (1, 2, 3)] + [I(4, "c", 0.0, 1.0, None, "unknown")]
    report = check_acknowledged(ops, {}, {"c": 2})
    [lost] = report.of(LOST_INCREMENT)
    assert "acked=3 unknown=1 final=2" in lost.message
    # The increment that returned 3 is beyond the final total as well.
    assert [v.ops for v in report.of(INCR_RESULT_OUT_OF_RANGE)] == [(ops[2],)]
    # A counter that is gone altogether is a lost increment too.
    assert LOST_INCREMENT in kinds(check_acknowledged(ops, {}, {}))


def test_duplicate_apply_overcounts() -> None:
    ops = [I(1, "c", 0.0, 1.0, 1), I(2, "c", 0.0, 1.0, 2), I(3, "c", 0.0, 1.0, None, "unknown")]
    assert check_acknowledged(ops, {}, {"c": 3}).ok
    report = check_acknowledged(ops, {}, {"c": 4})
    assert kinds(report) == {DUPLICATE_APPLY}
    assert "exceeds" in report.violations[0].message
    # Increments nobody sent.
    assert kinds(check_acknowledged([], {}, {"ghost": 1})) == {DUPLICATE_APPLY}


def test_duplicate_incr_results() -> None:
    # A retried increment applied twice can leave the final total right when
    # another was lost; the equal totals returned still give it away.
    ops = [I(1, "c", 0.0, 1.0, 1), I(2, "c", 0.0, 1.0, 1), I(3, "c", 0.0, 1.0, None, "unknown")]
    report = check_acknowledged(ops, {}, {"c": 2})
    [dup] = report.of(DUPLICATE_INCR_RESULT)
    assert dup.ops == (ops[0], ops[1]) and "same total 1" in dup.message


def test_incr_results_out_of_range_and_out_of_order() -> None:
    ops = [I(1, "c", 0.0, 1.0, 5), I(2, "c", 0.0, 1.0, 1)]
    [bad] = check_acknowledged(ops, {}, {"c": 2}).of(INCR_RESULT_OUT_OF_RANGE)
    assert bad.ops == (ops[0],) and "outside [1, 2]" in bad.message
    # Sequential increments returning decreasing totals.
    ops = [I(1, "c", 0.0, 1.0, 2), I(1, "c", 2.0, 3.0, 1)]
    report = check_acknowledged(ops, {}, {"c": 2})
    assert kinds(report) == {INCR_ORDER}
    assert report.violations[0].ops == (ops[0], ops[1])
    # The same totals from concurrent increments are fine.
    ops = [I(1, "c", 0.0, 2.0, 2), I(2, "c", 1.0, 3.0, 1)]
    assert check_acknowledged(ops, {}, {"c": 2}).ok


# --------------------------------------------------------------------------- linearizability: accepted


def test_sequential_history_is_linearizable() -> None:
    ops = [
        R(1, "k", None, 0.0, 1.0),
        W(1, "k", "a", 2.0, 3.0),
        R(2, "k", "a", 4.0, 5.0),
        W(2, "k", "b", 6.0, 7.0),
        R(1, "k", "b", 8.0, 9.0),
    ]
    report = check_linearizable(ops)
    assert report.ok, str(report)
    assert report.counts["searched"] == 1
    assert report.summary().startswith("linearizable: OK ops=5 keys=1 searched=1")


def test_concurrent_legal_interleavings() -> None:
    # Two overlapping writes; reads during them may see either, in an order
    # consistent with one write order; after both complete, the last one.
    base = [W(1, "k", "a", 0.0, 4.0), W(2, "k", "b", 1.0, 5.0)]
    for seen in (["a", "b", "b"], ["b", "a", "a"], [None, "a", "a"], [None, None, "b"]):
        ops = base + [R(3, "k", seen[0], 0.5, 1.5), R(3, "k", seen[1], 2.0, 3.0), R(4, "k", seen[2], 2.5, 6.0)]
        assert check_linearizable(ops).ok, seen


def test_unknown_writes_present_or_absent() -> None:
    timed_out = W(1, "k", "a", 0.0, 1.0, "unknown")
    never_answered = W(2, "k", "b", 0.5, None, "unknown")
    for seen in ([None, None], [None, "a"], ["a", "a"], ["b", "a"], ["a", "b"], [None, "b"]):
        ops = [timed_out, never_answered, R(3, "k", seen[0], 2.0, 3.0), R(3, "k", seen[1], 4.0, 5.0)]
        assert check_linearizable(ops).ok, seen
    # An unknown write may land long after its client gave up, even after a
    # later acknowledged write; but it lands once: "a" then "c" then "a" is out.
    ops = [timed_out, W(2, "k", "c", 2.0, 3.0), R(3, "k", "a", 4.0, 5.0)]
    assert check_linearizable(ops).ok
    ops += [R(3, "k", "c", 6.0, 7.0)]
    assert kinds(check_linearizable(ops)) == {NOT_LINEARIZABLE}
    # Unknown reads drop out whatever they returned.
    assert check_linearizable([R(1, "k", "zzz", 0.0, 1.0, "unknown")]).ok


def test_counter_model_accepts_legal_reads() -> None:
    ops = [
        I(1, "c", 0.0, 3.0, 2),
        I(2, "c", 0.5, 2.5, 1),
        I(3, "c", 0.5, None, None, "unknown"),
        R(4, "c", None, 0.1, 0.2),  # not_found: total 0
        R(4, "c", 1, 0.3, 1.5),
        R(4, "c", 3, 4.0, 5.0),  # the unknown increment applied
        R(5, "c", 2, 3.5, 6.0),  # ... concurrently with this read
    ]
    report = check_linearizable(ops)
    assert report.ok, str(report)


# --------------------------------------------------------------------------- linearizability: rejected


def test_read_of_a_value_never_written() -> None:
    ops = [W(1, "k", "a", 0.0, 1.0), W(1, "k", "x", 0.0, 1.0, "fail"), R(2, "k", "b", 2.0, 3.0), R(2, "k", "x", 4.0, 5.0)]
    report = check_linearizable(ops)
    found = report.of(READ_UNWRITTEN_VALUE)
    assert [v.ops[0].result for v in found] == ["b", "x"]
    assert "no write wrote" in found[0].message and "failed definitely" in found[1].message
    assert report.counts["searched"] == 0  # pre-checks decided it


def test_read_before_its_write_began() -> None:
    ops = [R(1, "k", "a", 0.0, 1.0), W(2, "k", "a", 2.0, 3.0)]
    [v] = check_linearizable(ops).violations
    assert v.kind == READ_BEFORE_WRITE and "before that value's write began" in v.message


def test_stale_read() -> None:
    ops = [W(1, "k", "a", 0.0, 1.0), W(1, "k", "b", 2.0, 3.0), R(2, "k", "a", 4.0, 5.0)]
    [v] = check_linearizable(ops).violations
    assert v.kind == STALE_READ and "'b' was written after it" in v.message
    assert v.ops[:2] == (ops[2], ops[1])
    # Not found after an acknowledged write completed.
    [v] = check_linearizable([W(1, "k", "a", 0.0, 1.0), R(2, "k", None, 2.0, 3.0)]).violations
    assert v.kind == STALE_READ and "initial not-found" in v.message
    # A counter read below what was acknowledged before it began.
    [v] = check_linearizable([I(1, "c", 0.0, 1.0, 1), I(1, "c", 1.5, 2.0, 2), R(2, "c", 1, 3.0, 4.0)]).violations
    assert v.kind == STALE_READ and "2 had been acknowledged" in v.message


def test_non_linearizable_history_passing_prechecks() -> None:
    # Classic: two readers see two concurrent writes land in opposite orders.
    ops = [
        W(1, "k", "a", 0.0, 10.0),
        W(2, "k", "b", 0.0, 10.0),
        R(3, "k", "a", 1.0, 2.0),
        R(3, "k", "b", 3.0, 4.0),
        R(4, "k", "b", 1.0, 2.0),
        R(4, "k", "a", 3.0, 4.0),
    ]
    report = check_linearizable(ops)
    [v] = report.violations
    assert v.kind == NOT_LINEARIZABLE and not report.of(*PRECHECK_VIOLATIONS)
    assert "not linearizable" in v.message and "no continuation linearizes the rest" in v.message
    assert report.counts["searched"] == 1


def test_non_linearizable_counter() -> None:
    # A counter read going backwards: within every per-read bound, but no order.
    ops = [I(1, "c", 0.0, 10.0, 1), R(2, "c", 1, 1.0, 2.0), R(2, "c", 0, 3.0, 4.0)]
    report = check_linearizable(ops)
    assert kinds(report) == {NOT_LINEARIZABLE}
    # Two acknowledged increments that returned the same total.
    ops = [I(1, "c", 0.0, 1.0, 1), I(2, "c", 0.0, 1.0, 1)]
    assert kinds(check_linearizable(ops)) == {NOT_LINEARIZABLE}
    # A counter read above anything that had begun.
    [v] = check_linearizable([I(1, "c", 0.0, 1.0, 1), R(2, "c", 2, 0.5, 3.0)]).violations
    assert v.kind == READ_BEFORE_WRITE


def test_mixed_key_is_rejected() -> None:
    report = check_linearizable([W(1, "k", "a", 0.0, 1.0), I(2, "k", 0.0, 1.0, 1)])
    assert kinds(report) == {MIXED_KEY}


def test_exhausted_budget_is_a_failure() -> None:
    ops = _concurrent_key(12, linearizable=False)
    report = check_linearizable(ops, per_key_budget=5)
    assert not report.ok
    [v] = report.gave_up
    assert v.kind == SEARCH_GAVE_UP and "search gave up" in v.message
    assert report.counts["gave_up"] == 1
    # With its budget the same key is decided (and is not linearizable).
    assert kinds(check_linearizable(ops)) == {NOT_LINEARIZABLE}


def _concurrent_key(n: int, linearizable: bool) -> list[Op]:
    """n ops on one key, all overlapping: n/2 writes, n/2 reads of them.

    The reads observe the writes in one order (linearizable) or, when not,
    the last reader sees the first value again after later ones.
    """
    writes = [W(i, "k", f"v{i}", 0.01 * i, 10.0 + 0.01 * i) for i in range(n // 2)]
    reads = [R(100 + i, "k", f"v{i}", 1.0 + i, 1.5 + i) for i in range(n - n // 2)]
    if not linearizable:
        reads[-1].result = "v0"
    return writes + reads


def test_search_on_twelve_concurrent_ops() -> None:
    for linearizable in (True, False):
        started = time.perf_counter()
        report = check_linearizable(_concurrent_key(12, linearizable))
        elapsed = time.perf_counter() - started
        assert report.ok is linearizable
        assert elapsed < 1.0 and report.counts["max_states"] < 20_000, report.summary()


# --------------------------------------------------------------------------- cross-checks


def _precedes(a: Op, b: Op) -> bool:
    return a.acked and a.complete is not None and a.complete < b.invoke


def _brute_linearizable(ops: list[Op]) -> bool:
    """Every subset of unknown updates, every order: the definition itself."""
    counter = any(op.kind == "incr" for op in ops)
    update = "incr" if counter else "write"
    required = [op for op in ops if op.acked and op.kind in ("read", update)]
    optional = [op for op in ops if op.kind == update and op.indefinite]
    for r in range(len(optional) + 1):
        for extra in itertools.combinations(optional, r):
            for order in itertools.permutations(required + list(extra)):
                if any(_precedes(order[j], order[i]) for i in range(len(order)) for j in range(i + 1, len(order))):
                    continue
                state: Any = 0 if counter else None
                for op in order:
                    if op.kind == "read":
                        seen = (op.result or 0) if counter else op.result  # not_found: total 0
                        if seen != state:
                            break
                    elif counter:
                        state += 1
                        if op.acked and op.result is not None and op.result != state:
                            break
                    else:
                        state = op.value
                else:
                    return True
    return False


def _random_small_history(rng: random.Random, counter: bool, max_ops: int = 6) -> list[Op]:
    ops: list[Op] = []
    for p in range(rng.randint(1, 3)):
        t = rng.uniform(0, 3)
        for _ in range(rng.randint(1, 3)):
            if len(ops) == max_ops:
                break
            invoke, t = t, t + rng.uniform(0.1, 4)
            complete: float | None = t
            outcome = rng.choices(["ok", "unknown", "fail"], [8, 2, 1])[0]
            if outcome == "unknown" and rng.random() < 0.5:
                complete = None
            if rng.random() < 0.5:
                ops.append(R(p, "k", rng.choice([None, 0, 1, 2, 3]) if counter else None, invoke, complete, outcome))
            elif counter:
                ops.append(I(p, "k", invoke, complete, rng.choice([None, 1, 2, 3]), outcome))
            else:
                ops.append(W(p, "k", f"v{len(ops)}", invoke, complete, outcome))
            t += rng.uniform(0, 1)
    if not counter:
        # Reads return written values mostly: the interesting histories.
        written = [None, "never"] + [op.value for op in ops if op.kind == "write"] * 3
        for op in ops:
            if op.kind == "read":
                op.result = rng.choice(written)
    return ops


@settings(max_examples=500, deadline=None)
@given(SEEDS, st.booleans())
def test_checker_agrees_with_brute_force(seed: int, counter: bool) -> None:
    ops = _random_small_history(random.Random(seed), counter)
    report = check_linearizable(ops)
    expected = _brute_linearizable(ops)
    assert report.ok is expected, "\n".join([str(report)] + [op.describe() for op in ops])
    # Pre-checks are sound: they only fire on histories that are not linearizable.
    assert not (report.of(*PRECHECK_VIOLATIONS) and expected)


def _simulate(rng: random.Random, n_procs: int, n_ops: int) -> tuple[list[Op], dict[str, Any], dict[str, int]]:
    """Run clients against a real (atomic) register/counter store.

    Each op takes effect at a random instant inside its call; an unknown
    update takes effect with probability 1/2, possibly after its client gave
    up (a gateway retry still in flight); failed updates never do.
    """
    keys = [f"item{i}" for i in range(rng.randint(1, 4))]
    counters = [f"ent{i}/n" for i in range(rng.randint(1, 2))]
    ops: list[Op] = []
    effects: list[tuple[float, Op]] = []
    clock = [rng.uniform(0, 1) for _ in range(n_procs)]
    serial = itertools.count()
    for _ in range(n_ops):
        p = rng.randrange(n_procs)
        invoke = clock[p]
        duration = rng.expovariate(1.0)
        complete: float | None = invoke + duration
        clock[p] = complete + rng.expovariate(2.0)
        outcome = rng.choices(["ok", "unknown", "fail"], [85, 10, 5])[0]
        kind = rng.choice(["write", "read", "incr", "read"])
        key = rng.choice(counters if kind == "incr" or (kind == "read" and rng.random() < 0.4) else keys)
        if kind == "write":
            op = Op(p, "write", key, {"v": next(serial)}, invoke, complete, outcome)  # type: ignore[arg-type]
        else:
            op = Op(p, kind, key, 1 if kind == "incr" else None, invoke, complete, outcome)  # type: ignore[arg-type]
        if outcome == "unknown" and rng.random() < 0.3:
            op.complete = None
        ops.append(op)
        if outcome == "ok" or (outcome == "unknown" and kind == "read"):
            effects.append((rng.uniform(invoke, invoke + duration), op))
        elif outcome == "unknown" and rng.random() < 0.5:
            effects.append((invoke + rng.uniform(0, 3 * duration), op))
    store: dict[str, Any] = {}
    for _, op in sorted(effects, key=lambda e: e[0]):
        if op.kind == "write":
            store[op.key] = op.value
        elif op.kind == "incr":
            store[op.key] = store.get(op.key, 0) + 1
            op.result = store[op.key] if op.acked else None
        elif op.acked:
            op.result = store.get(op.key)
    items = {k: v for k, v in store.items() if k in keys}
    totals = {k: v for k, v in store.items() if k in counters}
    return ops, items, totals


@settings(max_examples=150, deadline=None)
@given(SEEDS, st.integers(1, 6), st.integers(1, 40))
def test_simulated_store_histories_pass(seed: int, n_procs: int, n_ops: int) -> None:
    ops, items, totals = _simulate(random.Random(seed), n_procs, n_ops)
    lin = check_linearizable(ops)
    assert lin.ok, str(lin)
    ack = check_acknowledged(ops, items, totals)
    assert ack.ok, str(ack)


@settings(max_examples=100, deadline=None)
@given(SEEDS)
def test_simulated_histories_with_a_lost_write_fail(seed: int) -> None:
    rng = random.Random(seed)
    ops, items, totals = _simulate(rng, 4, 30)
    acked = [op for op in ops if op.kind == "write" and op.acked and items.get(op.key) == op.value]
    if acked:
        del items[rng.choice(acked).key]
        assert LOST_WRITE in kinds(check_acknowledged(ops, items, totals))
    incremented = [k for k, v in totals.items() if v and any(op.key == k and op.acked for op in ops)]
    if incremented:
        key = rng.choice(incremented)
        totals[key] += sum(1 for op in ops if op.key == key and op.kind == "incr" and not op.acked) + 1
        assert DUPLICATE_APPLY in kinds(check_acknowledged(ops, items, totals))
