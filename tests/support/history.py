"""Operation histories of chaos runs, and the checkers that judge them.

A load generator records every operation it sends through a gateway in a
`History`: invoke time, complete time (`time.monotonic`, seconds; it is
CLOCK_MONOTONIC, so histories recorded by several processes on one machine can
be merged) and outcome:

    "ok"       acknowledged; `result` holds what was returned (the item read,
               the counter's total after an increment, the counter read)
    "fail"     definitely not applied (a documented definite error, see
               `outcome_for_error`: bad_request, not_found, unauthorized,
               unavailable)
    "unknown"  may or may not have taken effect (quorum_timeout,
               deadline_exceeded, connection errors, and every operation that
               never completed because the test ended)

A read that answers `not_found` is an "ok" read with result None: for a
register, not-found *is* the value (the initial state).

Two checkers:

`check_acknowledged(history, final_items, final_counters)`
    Set arithmetic after the cluster has healed: every acknowledged write is
    present with its value, nothing is present that no write could have
    written, and every counter counts each increment exactly once
    (acked <= final <= acked + unknown, and the totals that acknowledged
    increments returned fit one total order).

`check_linearizable(history, per_key_budget)`
    Per key (linearizability is compositional, so keys are independent):
    cheap pre-checks that rely on unique written values and give precise
    messages, then Wing & Gong's search with Lowe's memoisation of
    (set of linearized ops, model state). Items are registers (initial value
    None); a key with increments is a counter (initial value 0). A search that
    exhausts its budget is a failure ("search gave up"), never a pass.

Kinds of operation: "write" (value = what was written), "read" (result = what
was read), "incr" (value = the amount, None meaning 1; result = the counter's
new total).
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence, cast

Kind = Literal["write", "read", "incr"]
Outcome = Literal["ok", "fail", "unknown"]

_KINDS = ("write", "read", "incr")
_OUTCOMES = ("ok", "fail", "unknown")

# Error codes after which the request certainly had no effect. bad_request,
# not_found and unauthorized are answered before anything is proposed to a
# group. unavailable (503) is the gateway's promise that nothing was applied
# (gateway/router.py, `give_up`): a write any of whose attempts may have
# applied is answered 504 quorum_timeout instead, and a worker's refusal with
# not_leader or unavailable appends nothing. So a write or increment answered
# unavailable whose effect shows up later is a phantom or a counter anomaly.
# Everything else (quorum_timeout, deadline_exceeded, not_leader that escaped
# the gateway's retries, a code we do not know, a dropped connection) may have
# been applied, so it is "unknown" — calling it "fail" would turn a correct
# cluster's late apply into a false phantom. Reads are judged only when
# acknowledged, so a read's error outcome does not matter.
DEFINITE_ERRORS = frozenset({"bad_request", "not_found", "unauthorized", "unavailable"})

# Violation kinds (Violation.kind). Tests and reports match on these.
LOST_WRITE = "lost_write"
PHANTOM_VALUE = "phantom_value"
LOST_INCREMENT = "lost_increment"
DUPLICATE_APPLY = "duplicate_apply"
DUPLICATE_INCR_RESULT = "duplicate_incr_result"
INCR_RESULT_OUT_OF_RANGE = "incr_result_out_of_range"
INCR_ORDER = "incr_order"
READ_UNWRITTEN_VALUE = "read_unwritten_value"
READ_BEFORE_WRITE = "read_before_write"
STALE_READ = "stale_read"
NOT_LINEARIZABLE = "not_linearizable"
SEARCH_GAVE_UP = "search_gave_up"
MIXED_KEY = "mixed_key"

COUNTER_ANOMALIES = frozenset(
    {LOST_INCREMENT, DUPLICATE_APPLY, DUPLICATE_INCR_RESULT, INCR_RESULT_OUT_OF_RANGE, INCR_ORDER}
)
PRECHECK_VIOLATIONS = frozenset({READ_UNWRITTEN_VALUE, READ_BEFORE_WRITE, STALE_READ})

_INF = math.inf
_MAX_OPS_SHOWN = 8


def outcome_for_error(code: str | None) -> Outcome:
    """Outcome of a request that got error `code` (None: no answer at all)."""
    return "fail" if code in DEFINITE_ERRORS else "unknown"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- model


@dataclass
class Op:
    """One client operation. `complete` is None while (or if never) answered."""

    process: int
    kind: Kind
    key: str
    value: Any
    invoke: float
    complete: float | None
    outcome: Outcome
    result: Any = None

    @property
    def acked(self) -> bool:
        # "ok" without a completion time cannot happen through History; treat
        # a hand-built one as unknown rather than trusting it.
        return self.outcome == "ok" and self.complete is not None

    @property
    def failed(self) -> bool:
        return self.outcome == "fail"

    @property
    def indefinite(self) -> bool:
        """May or may not have taken effect: unknown, or never completed."""
        return not self.acked and not self.failed

    @property
    def amount(self) -> int:
        """An increment's amount (None means the API's +1)."""
        return 1 if self.value is None else int(self.value)

    def describe(self, t0: float = 0.0) -> str:
        """One line: process, operation, [invoke, complete] relative to t0, outcome."""
        if self.kind == "write":
            what = f"write {self.key}={_short(self.value)}"
        elif self.kind == "read":
            what = f"read {self.key}" + (f" -> {_short(self.result)}" if self.acked else "")
        else:
            what = f"incr {self.key} +{_short(self.value if self.value is not None else 1)}"
            if self.acked:
                what += f" -> {_short(self.result)}"
        end = "never" if self.complete is None else f"{self.complete - t0:.6f}"
        return f"p{self.process} {what} [{self.invoke - t0:.6f}, {end}] {self.outcome}"

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Op:
        return cls(**record)


class History:
    """Append-only recorder of operations.

    Safe from asyncio tasks: `invoke` and `complete` never await, so each runs
    atomically on the event loop. A lock covers threads too (append-then-index
    is two steps). The handle is the op's index.

        h = history.invoke(proc, "write", key, doc)
        try: ...; history.complete(h, "ok", seq)
        except ApiError as e: history.complete(h, outcome_for_error(e.code))
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ops: list[Op] = []
        self._lock = threading.Lock()

    def invoke(self, process: int, kind: Kind, key: str, value: Any = None) -> int:
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        # Recorded as unknown until completed: an op the test never saw
        # answered may still have been applied.
        with self._lock:
            self._ops.append(Op(process, kind, key, value, self._clock(), None, "unknown"))
            return len(self._ops) - 1

    def complete(self, handle: int, outcome: Outcome, result: Any = None) -> Op:
        if outcome not in _OUTCOMES:
            raise ValueError(f"outcome must be one of {_OUTCOMES}, got {outcome!r}")
        with self._lock:
            op = self._ops[handle]
            if op.complete is not None:
                raise ValueError(f"op {handle} completed twice: {op.describe()}")
            op.complete = self._clock()
            op.outcome = outcome
            op.result = result
        return op

    def record(self, op: Op) -> None:
        """Append a finished op as is (hand-built histories, merging)."""
        with self._lock:
            self._ops.append(op)

    def extend(self, ops: Iterable[Op]) -> None:
        with self._lock:
            self._ops.extend(ops)

    @property
    def ops(self) -> list[Op]:
        """A snapshot copy of the list (the ops themselves are shared)."""
        with self._lock:
            return list(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def to_records(self) -> list[dict[str, Any]]:
        """Plain dicts, e.g. to ship a generator process's history as JSON."""
        return [op.to_record() for op in self.ops]

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> History:
        history = cls()
        history.extend(Op.from_record(r) for r in records)
        return history


# --------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class Violation:
    kind: str
    key: str
    message: str
    ops: tuple[Op, ...] = ()

    def render(self, t0: float = 0.0) -> str:
        lines = [f"[{self.kind}] {self.key!r}: {self.message}"]
        lines += [f"    {op.describe(t0)}" for op in self.ops[:_MAX_OPS_SHOWN]]
        if len(self.ops) > _MAX_OPS_SHOWN:
            lines.append(f"    ... and {len(self.ops) - _MAX_OPS_SHOWN} more ops")
        return "\n".join(lines)


@dataclass
class Report:
    """Outcome of one checker. `counts` holds the run's figures for summary()."""

    check: str
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    # Times in violation details are printed relative to the history's start.
    t0: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def of(self, *kinds: str) -> list[Violation]:
        return [v for v in self.violations if v.kind in kinds]

    @property
    def lost_writes(self) -> list[Violation]:
        return self.of(LOST_WRITE)

    @property
    def phantom_values(self) -> list[Violation]:
        return self.of(PHANTOM_VALUE)

    @property
    def counter_anomalies(self) -> list[Violation]:
        return self.of(*COUNTER_ANOMALIES)

    @property
    def gave_up(self) -> list[Violation]:
        return self.of(SEARCH_GAVE_UP)

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for v in self.violations:
            kinds[v.kind] = kinds.get(v.kind, 0) + 1
        figures = " ".join(f"{k}={n}" for k, n in self.counts.items())
        found = " ".join(f"{k}={n}" for k, n in sorted(kinds.items()))
        return f"{self.check}: {'OK' if self.ok else 'FAIL'} {figures}" + (f" | {found}" if found else "")

    def details(self, limit: int = 20) -> str:
        parts = [v.render(self.t0) for v in self.violations[:limit]]
        if len(self.violations) > limit:
            parts.append(f"... and {len(self.violations) - limit} more violations")
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.summary() + ("\n" + self.details() if self.violations else "")


def _ops_of(history: History | Iterable[Op]) -> list[Op]:
    return history.ops if isinstance(history, History) else list(history)


def _t0(ops: Sequence[Op]) -> float:
    return min((op.invoke for op in ops), default=0.0)


# --------------------------------------------------------------------------- acknowledged


def _precedes(a: Op, b: Op) -> bool:
    """a certainly took effect before b began (real-time order)."""
    return a.acked and cast(float, a.complete) < b.invoke


def check_acknowledged(
    history: History | Iterable[Op],
    final_items: Mapping[str, Any],
    final_counters: Mapping[str, int],
) -> Report:
    """Judge the healed cluster's final state against the history.

    `final_items`: key -> value for every item key read back (absent or None:
    not found). `final_counters`: counter key -> total (absent or None: 0).
    Keys present in `final_items` that the history never wrote are phantoms,
    so pass only keys the generator owns (or a cluster that started empty).
    """
    ops = _ops_of(history)
    t0 = _t0(ops)
    violations: list[Violation] = []
    writes: dict[str, list[Op]] = {}
    incrs: dict[str, list[Op]] = {}
    for op in ops:
        if op.kind == "write":
            writes.setdefault(op.key, []).append(op)
        elif op.kind == "incr":
            incrs.setdefault(op.key, []).append(op)

    lost = phantom = 0
    for key in sorted(set(writes) | {k for k, v in final_items.items() if v is not None}):
        key_writes = writes.get(key, [])
        acked = [w for w in key_writes if w.acked]
        final = final_items.get(key)
        if final is None:
            for w in acked:
                violations.append(Violation(LOST_WRITE, key, f"acknowledged write of {_short(w.value)} is missing: the key is not found", (w,)))
                lost += 1
            continue
        sources = [w for w in key_writes if not w.failed and w.value == final]
        if not sources:
            failed = [w for w in key_writes if w.failed and w.value == final]
            why = (
                "written only by writes that failed definitely" if failed
                else "written by no write in the history"
            )
            violations.append(Violation(PHANTOM_VALUE, key, f"final value {_short(final)} was {why}", tuple(failed)))
            phantom += 1
            for w in acked:
                violations.append(Violation(LOST_WRITE, key, f"acknowledged write of {_short(w.value)} is missing: the key holds phantom {_short(final)}", (w,)))
                lost += 1
            continue
        # Keys are write-once in the generator, but a key written more than
        # once is still judged soundly: an acknowledged write is lost only
        # when every write that could have left the final value certainly
        # happened before it (so it should have overwritten that value).
        for w in acked:
            if w.value == final:
                continue
            if all(_precedes(s, w) for s in sources):
                violations.append(Violation(
                    LOST_WRITE, key,
                    f"acknowledged write of {_short(w.value)} is missing: the key holds {_short(final)}, "
                    "whose write completed before this one began",
                    (w, *sources),
                ))
                lost += 1

    anomalies = 0
    for key in sorted(set(incrs) | {k for k, v in final_counters.items() if v}):
        key_incrs = incrs.get(key, [])
        found = _check_counter(key, key_incrs, final_counters.get(key) or 0)
        anomalies += len(found)
        violations += found

    acked_n = sum(1 for op in ops if op.acked and op.kind != "read")
    unknown_n = sum(1 for op in ops if op.indefinite and op.kind != "read")
    failed_n = sum(1 for op in ops if op.failed and op.kind != "read")
    counts = {
        "ops": len(ops),
        "acked": acked_n,
        "unknown": unknown_n,
        "failed": failed_n,
        "items": len(writes),
        "counters": len(incrs),
        "lost": lost,
        "phantom": phantom,
        "counter_anomalies": anomalies,
    }
    return Report("acknowledged", violations, counts, t0)


def _check_counter(key: str, key_incrs: list[Op], final: int) -> list[Violation]:
    """Exactly-once counting of one counter's increments."""
    found: list[Violation] = []
    acked = [op for op in key_incrs if op.acked]
    unknown = [op for op in key_incrs if op.indefinite]
    acked_sum = sum(op.amount for op in acked)
    most = acked_sum + sum(op.amount for op in unknown)
    figures = f"acked={acked_sum} unknown={most - acked_sum} final={final}"
    if final < acked_sum:
        found.append(Violation(LOST_INCREMENT, key, f"final total is below the acknowledged increments ({figures})"))
    if final > most:
        found.append(Violation(DUPLICATE_APPLY, key, f"final total exceeds every increment that may have applied ({figures})"))

    with_result = [op for op in acked if op.result is not None]
    by_result: dict[Any, list[Op]] = {}
    for op in with_result:
        by_result.setdefault(op.result, []).append(op)
    for result, same in sorted(by_result.items(), key=lambda kv: str(kv[0])):
        if len(same) > 1:
            found.append(Violation(
                DUPLICATE_INCR_RESULT, key,
                f"{len(same)} acknowledged increments returned the same total {_short(result)} "
                "(an increment applied twice or one lost in between)",
                tuple(same),
            ))
    for op in with_result:
        if not isinstance(op.result, int) or op.result < op.amount or op.result > most or op.result > final:
            found.append(Violation(
                INCR_RESULT_OUT_OF_RANGE, key,
                f"increment returned total {_short(op.result)}, outside [{op.amount}, "
                f"{min(most, final)}] ({figures})",
                (op,),
            ))

    # Real-time order: an increment that completed before another began must
    # have returned a smaller total. Sweep in invoke order, keeping the largest
    # total among increments that completed before the current one began.
    ordered = [op for op in with_result if isinstance(op.result, int)]
    by_complete = sorted(ordered, key=lambda op: cast(float, op.complete))
    done = 0
    top: Op | None = None
    for op in sorted(ordered, key=lambda op: op.invoke):
        while done < len(by_complete) and cast(float, by_complete[done].complete) < op.invoke:
            cand = by_complete[done]
            if top is None or cand.result > top.result:
                top = cand
            done += 1
        if top is not None and top.result > op.result:
            found.append(Violation(
                INCR_ORDER, key,
                f"increment returned {op.result} although one that completed before it began "
                f"returned {top.result}: no total order explains both",
                (top, op),
            ))
    return found


# --------------------------------------------------------------------------- linearizability


def _freeze(value: Any) -> Any:
    """A hashable stand-in that is equal exactly when the values are (for docs)."""
    try:
        hash(value)
        return value
    except TypeError:
        pass
    if isinstance(value, Mapping):
        return ("__map__", frozenset((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("__seq__", tuple(_freeze(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("__set__", frozenset(_freeze(v) for v in value))
    return ("__repr__", repr(value))


# Search op codes. A register state is a value id (0 = None, the initial
# not-found); a counter state is its total.
_SET = 0  # register write: state := arg
_CHECK = 1  # read: legal iff state == arg; state unchanged
_ADD = 2  # counter increment: state += arg; if expect is set, legal iff new state == expect
_UNREAD = -1  # register state: a value that no read returned


@dataclass
class _Problem:
    """One key's ops prepared for the search, sorted by invoke (index = bit)."""

    ops: list[Op]
    invoke: list[float]
    complete: list[float]  # +inf for ops whose outcome is unknown (optional ops)
    codes: list[int]
    args: list[int]
    expects: list[int | None]
    required: int  # bitmask of acknowledged ops: all must be linearized
    init: int
    show_state: Callable[[int], str]
    # dead(mask, state): some required op can no longer be linearized in any
    # extension, so the configuration need not be explored.
    dead: Callable[[int, int], bool]


@dataclass
class _SearchResult:
    status: Literal["ok", "violation", "gave_up"]
    states: int
    best_order: list[int] = field(default_factory=list)
    best_state: int = 0
    best_next: list[int] = field(default_factory=list)


def _search(p: _Problem, budget: int) -> _SearchResult:
    """Wing & Gong's search with Lowe's memoisation, as an iterative DFS.

    A configuration is (mask of linearized ops, model state). An op may be
    linearized next iff it was invoked no later than the earliest completion
    among the ops not yet linearized (otherwise that op would have to precede
    it). Optional ops (unknown outcome) have complete = +inf, so they never
    hold others back, and success needs only the required ops: an optional
    op left over is one that never took effect.

    Reads that fit the current state are linearized at once without branching:
    a read does not change the state wherever it goes, and taking it out only
    relaxes the real-time constraints on the rest, so any linearization with
    the read later can be rewritten with it now. This collapses the
    interleavings of reads, which dominate real histories.

    `p.dead` cuts configurations early where some pending acknowledged op can
    never fit again (a read of a value whose writes are all used up, a counter
    read below the total): without it, every order of the other concurrent
    ops would be tried before the search noticed.
    """
    n = len(p.ops)
    inv, comp, codes, args, expects = p.invoke, p.complete, p.codes, p.args, p.expects
    required = p.required
    by_complete = sorted(range(n), key=lambda i: comp[i])
    visited: set[tuple[int, int]] = set()
    # Stack entries: (mask, state, op just linearized or -1, depth). `path`
    # holds, per depth, the ops linearized at that step (chosen op + reads
    # folded in after it), so the longest prefix can be reported on failure.
    stack: list[tuple[int, int, int, int]] = [(0, p.init, -1, 0)]
    path: list[list[int]] = []
    states = 0
    best = _SearchResult("violation", 0, [], p.init, [])
    best_done = -1
    while stack:
        mask, state, chosen, depth = stack.pop()
        del path[depth:]
        step = [chosen] if chosen >= 0 else []
        while True:
            # Earliest completion among not-yet-linearized ops.
            limit = _INF
            for i in by_complete:
                if not (mask >> i) & 1:
                    limit = comp[i]
                    break
            first = ((~mask) & (mask + 1)).bit_length() - 1  # lowest unlinearized index
            folded = False
            cands: list[int] = []
            for i in range(first, n):
                if inv[i] > limit:
                    break
                if (mask >> i) & 1:
                    continue
                if codes[i] == _CHECK and args[i] == state:
                    mask |= 1 << i
                    step.append(i)
                    folded = True
                    continue
                cands.append(i)
            if not folded:
                break
        path.append(step)
        if mask & required == required:
            return _SearchResult("ok", states)
        key = (mask, state)
        if key in visited:
            continue
        visited.add(key)
        states += 1
        if states > budget:
            return _SearchResult("gave_up", states)
        done = (mask & required).bit_count()
        if done > best_done:
            best_done = done
            best = _SearchResult("violation", 0, [i for s in path for i in s], state, list(cands))
        if p.dead(mask, state):
            continue
        # Push in reverse so the earliest-invoked candidate is tried first:
        # following invoke order is the likeliest linearization.
        for i in reversed(cands):
            code = codes[i]
            if code == _SET:
                new = args[i]
            elif code == _CHECK:
                continue  # a read that does not fit now (fitting ones were folded)
            else:
                new = state + args[i]
                exp = expects[i]
                if exp is not None and new != exp:
                    continue
            stack.append((mask | (1 << i), new, i, depth + 1))
    best.states = states
    return best


def _register_problem(key_ops: list[Op]) -> tuple[_Problem | None, list[Violation]]:
    """Pre-checks for a register key, and its search problem (None: no need)."""
    violations: list[Violation] = []
    writes = [op for op in key_ops if op.kind == "write" and not op.failed]
    reads = [op for op in key_ops if op.kind == "read" and op.acked]
    # Value ids: 0 is None (the initial not-found state).
    ids: dict[Any, int] = {_freeze(None): 0}
    values: list[Any] = [None]
    writers: dict[int, list[Op]] = {}

    def vid(value: Any) -> int:
        f = _freeze(value)
        if f not in ids:
            ids[f] = len(values)
            values.append(value)
        return ids[f]

    for w in writes:
        writers.setdefault(vid(w.value), []).append(w)
    failed_values = {_freeze(op.value) for op in key_ops if op.kind == "write" and op.failed}
    # Acknowledged writes sorted by completion, with the prefix maximum of
    # their invoke times: "the latest-starting write among those that
    # completed before time t" is then one bisect.
    acked_writes = sorted((w for w in writes if w.acked), key=lambda w: cast(float, w.complete))
    acked_completes = [cast(float, w.complete) for w in acked_writes]
    latest_start: list[Op] = []
    for w in acked_writes:
        latest_start.append(w if not latest_start or w.invoke > latest_start[-1].invoke else latest_start[-1])

    for r in reads:
        v = vid(r.result)
        rc = cast(float, r.complete)
        if v != 0 and v not in writers:
            why = " (only by a write that failed definitely)" if _freeze(r.result) in failed_values else ""
            violations.append(Violation(
                READ_UNWRITTEN_VALUE, r.key, f"read returned {_short(r.result)}, which no write wrote{why}", (r,)))
            continue
        sources = writers.get(v, [])
        if v != 0 and min(w.invoke for w in sources) > rc:
            violations.append(Violation(
                READ_BEFORE_WRITE, r.key,
                f"read returned {_short(r.result)} but it completed before that value's write began",
                (r, *sources)))
            continue
        # Stale read: the value's only source completed before a write B
        # began, and B completed before the read began; unique values mean
        # nothing can have restored the old value in between. For None the
        # source is the initial state, which precedes everything — unless a
        # write of None exists, which makes the source ambiguous.
        if v == 0 and sources:
            continue
        if v != 0 and len(sources) != 1:
            continue
        source_done = -_INF if v == 0 else (
            cast(float, sources[0].complete) if sources[0].acked else _INF)
        upto = bisect.bisect_left(acked_completes, r.invoke)
        if upto and latest_start[upto - 1].invoke > source_done:
            newer = latest_start[upto - 1]
            what = "the initial not-found" if v == 0 else f"{_short(r.result)}"
            violations.append(Violation(
                STALE_READ, r.key,
                f"stale read: returned {what} although {_short(newer.value)} was written after it "
                "and that write completed before the read began",
                (r, newer, *sources)))
    if violations or not reads:
        # Writes alone are always linearizable; a failed pre-check already
        # says precisely what is wrong, and the search would only repeat it.
        return None, violations

    observed = {vid(r.result) for r in reads}
    entries: list[tuple[Op, int, int]] = []
    for w in writes:
        v = vid(w.value)
        if v in observed:
            entries.append((w, _SET, v))
        elif w.acked:
            # Values nobody read are all alike to the search (no read fits
            # them), so they share one state: the orders of such blind writes
            # then collapse in the memo instead of multiplying it.
            entries.append((w, _SET, _UNREAD))
        # An unknown write whose value nobody read is dropped: in any
        # linearization with it, no read sits between it and the next write,
        # so removing it leaves a linearization.
    entries += [(r, _CHECK, vid(r.result)) for r in reads]

    def show(state: int) -> str:
        return "a value no read returned" if state == _UNREAD else _short(values[state])

    problem = _build(entries, init=0, show_state=show, dead=_never_dead)
    writers_left: dict[int, int] = {}
    for i, code in enumerate(problem.codes):
        if code == _SET:
            writers_left[problem.args[i]] = writers_left.get(problem.args[i], 0) | (1 << i)
    read_bits = [(1 << i, problem.args[i]) for i, code in enumerate(problem.codes) if code == _CHECK]

    def dead(mask: int, state: int) -> bool:
        # A pending read of a value other than the current one needs a write
        # of its value still to come; once all of them are linearized (or for
        # not-found, once anything was written) that read can never fit.
        for bit, v in read_bits:
            if not mask & bit and v != state and not writers_left.get(v, 0) & ~mask:
                return True
        return False

    problem.dead = dead
    return problem, violations


def _counter_problem(key_ops: list[Op]) -> tuple[_Problem | None, list[Violation]]:
    """Pre-checks for a counter key, and its search problem."""
    violations: list[Violation] = []
    incrs = [op for op in key_ops if op.kind == "incr" and not op.failed]
    reads = [op for op in key_ops if op.kind == "read" and op.acked]
    acked = sorted((op for op in incrs if op.acked), key=lambda op: cast(float, op.complete))
    acked_completes = [cast(float, op.complete) for op in acked]
    acked_before: list[int] = [0]
    for op in acked:
        acked_before.append(acked_before[-1] + op.amount)
    by_invoke = sorted(incrs, key=lambda op: op.invoke)
    invokes = [op.invoke for op in by_invoke]
    begun_before: list[int] = [0]
    for op in by_invoke:
        begun_before.append(begun_before[-1] + op.amount)

    def total(r: Op) -> int:
        # get_signals of an entity with no signal yet is not_found: total 0.
        return 0 if r.result is None else int(r.result)

    for r in reads:
        got = total(r)
        lower = acked_before[bisect.bisect_left(acked_completes, r.invoke)]
        upper = begun_before[bisect.bisect_right(invokes, cast(float, r.complete))]
        if got > upper:
            violations.append(Violation(
                READ_BEFORE_WRITE, r.key,
                f"counter read returned {got} but only {upper} could have been added before the read completed",
                (r,)))
        elif got < lower:
            violations.append(Violation(
                STALE_READ, r.key,
                f"stale counter read: returned {got} although {lower} had been acknowledged before the read began",
                (r,)))
    if violations or not (reads or any(op.result is not None for op in acked)):
        return None, violations
    entries: list[tuple[Op, int, int]] = [(r, _CHECK, total(r)) for r in reads]
    entries += [(op, _ADD, op.amount) for op in incrs]
    problem = _build(entries, init=0, show_state=str, dead=_never_dead)
    if all(op.amount >= 0 for op in incrs):
        # The total never decreases, so a pending read of less than it, or a
        # pending increment that returned no more than it, can never fit.
        floors = [(1 << i, problem.args[i] if code == _CHECK else cast(int, problem.expects[i]) - problem.args[i])
                  for i, code in enumerate(problem.codes)
                  if code == _CHECK or problem.expects[i] is not None]

        def dead(mask: int, state: int) -> bool:
            for bit, floor in floors:
                if not mask & bit and floor < state:
                    return True
            return False

        problem.dead = dead
    return problem, violations


def _never_dead(mask: int, state: int) -> bool:
    return False


def _build(
    entries: list[tuple[Op, int, int]],
    init: int,
    show_state: Callable[[int], str],
    dead: Callable[[int, int], bool],
) -> _Problem:
    entries.sort(key=lambda e: (e[0].invoke, e[0].complete if e[0].acked else _INF))
    ops = [e[0] for e in entries]
    required = 0
    for i, op in enumerate(ops):
        if op.acked:
            required |= 1 << i
    return _Problem(
        ops=ops,
        invoke=[op.invoke for op in ops],
        complete=[cast(float, op.complete) if op.acked else _INF for op in ops],
        codes=[e[1] for e in entries],
        args=[e[2] for e in entries],
        expects=[int(op.result) if e[1] == _ADD and op.acked and op.result is not None else None
                 for op, e in zip(ops, entries)],
        required=required,
        init=init,
        show_state=show_state,
        dead=dead,
    )


def check_linearizable(history: History | Iterable[Op], per_key_budget: int = 200_000) -> Report:
    """Per-key linearizability of strong reads, writes and increments.

    Reads with an unknown outcome drop out; writes and increments with an
    unknown outcome may take effect at any point after their invoke, or never.
    Follower reads are not linearizable by design: leave them out of the
    history given here. `per_key_budget` bounds the distinct configurations
    searched per key; a key that exceeds it is reported as SEARCH_GAVE_UP.
    """
    ops = _ops_of(history)
    t0 = _t0(ops)
    by_key: dict[str, list[Op]] = {}
    for op in ops:
        by_key.setdefault(op.key, []).append(op)
    violations: list[Violation] = []
    searched = total_states = max_states = max_ops = gave_up = 0
    for key in sorted(by_key):
        key_ops = by_key[key]
        kinds = {op.kind for op in key_ops}
        if {"write", "incr"} <= kinds:
            violations.append(Violation(MIXED_KEY, key, "key has both writes and increments: no single model fits",
                                        tuple(op for op in key_ops if op.kind != "read")))
            continue
        # A key with increments is a counter; otherwise a register.
        build = _counter_problem if "incr" in kinds else _register_problem
        problem, found = build(key_ops)
        violations += found
        if problem is None:
            continue
        searched += 1
        max_ops = max(max_ops, len(problem.ops))
        res = _search(problem, per_key_budget)
        total_states += res.states
        max_states = max(max_states, res.states)
        if res.status == "gave_up":
            gave_up += 1
            violations.append(Violation(
                SEARCH_GAVE_UP, key,
                f"search gave up after {per_key_budget} configurations over {len(problem.ops)} ops: "
                "undecided counts as a failure (shorten per-key histories)",
                tuple(problem.ops)))
        elif res.status == "violation":
            violations.append(_explain(key, problem, res, t0))
    counts = {
        "ops": len(ops),
        "keys": len(by_key),
        "searched": searched,
        "max_key_ops": max_ops,
        "states": total_states,
        "max_states": max_states,
        "gave_up": gave_up,
    }
    return Report("linearizable", violations, counts, t0)


def _explain(key: str, p: _Problem, res: _SearchResult, t0: float) -> Violation:
    """Describe the deepest point the search reached, as Knossos does."""
    n_required = p.required.bit_count()
    done = sum(1 for i in res.best_order if (p.required >> i) & 1)
    order = "; ".join(p.ops[i].describe(t0) for i in res.best_order) or "(none)"
    stuck = [p.ops[i] for i in res.best_next]
    placed = set(res.best_order) | set(res.best_next)
    msg = (
        f"not linearizable: at best {done} of {n_required} acknowledged ops linearize "
        f"(order: {order}); then the state is {p.show_state(res.best_state)} and no "
        f"continuation linearizes the rest (listed: the ops that may come next, then the others)"
    )
    # The ops listed are those that could not go next, then the rest.
    rest = [op for i, op in enumerate(p.ops) if i not in placed]
    return Violation(NOT_LINEARIZABLE, key, msg, tuple(stuck + rest))
