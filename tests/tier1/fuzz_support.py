"""Shared pieces of the hostile-input fuzz suites (tests/tier1/test_fuzz_*.py, issue 25).

Not a test module. Hypothesis drives synchronous property functions while
the servers under test live on pytest-aiohttp's event loop, so `drive` runs
the property in a worker thread and hands each case's requests to the loop.
Every run is derandomized (no example database): CI sees the same cases
every time, and a failure reproduces from the printed example.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import orjson
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shardgrid.common.wire import STATUS_FOR_CODE

# Nesting that orjson reads (up to 1024) but cannot write back (255 and up),
# and nesting orjson refuses to read at all.
ORJSON_MAX_WRITE_DEPTH = 254
ORJSON_MAX_READ_DEPTH = 1024

# A case must finish within this on the loop; a hang is a failure, not a slow test.
CASE_TIMEOUT_S = 5.0


@dataclass
class Tally:
    """How many cases ran, in all and per kind: the suite prints it (pytest -s)."""

    surface: str
    kinds: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def line(self) -> str:
        detail = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items()))
        return f"[fuzz] {self.surface}: {self.total} cases, each also replayed once outside hypothesis ({detail})"


def drive(loop: asyncio.AbstractEventLoop, strategy: st.SearchStrategy[Any],
          check: Callable[[Any], Awaitable[None]], max_examples: int, tally: Tally,
          kind_of: Callable[[Any], str]) -> None:
    """Run `check` (a coroutine function, on `loop`) for each example of `strategy`,
    then once more for each outside hypothesis.

    The second pass is not redundant: hypothesis raises the interpreter's
    recursion limit (for every thread) while it runs, which hides the
    RecursionError a value nested ~1000 levels deep causes in a server that
    repr()s or str()s it. Called from a thread other than the loop's (see `fuzz`)."""
    ran: list[Any] = []

    def run(case: Any) -> None:
        asyncio.run_coroutine_threadsafe(check(case), loop).result(CASE_TIMEOUT_S)

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate, Phase.shrink),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.large_base_example])
    @given(strategy)
    def prop(case: Any) -> None:
        tally.kinds[kind_of(case)] += 1
        ran.append(case)
        run(case)

    prop()
    for case in ran:
        run(case)


def drive_sync(strategy: st.SearchStrategy[Any], check: Callable[[Any], None], max_examples: int, tally: Tally,
               kind_of: Callable[[Any], str]) -> None:
    """`drive` for a synchronous check (a pure function under test): the same
    settings, and the same second pass outside hypothesis."""
    ran: list[Any] = []

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate, Phase.shrink),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.large_base_example])
    @given(strategy)
    def prop(case: Any) -> None:
        tally.kinds[kind_of(case)] += 1
        ran.append(case)
        check(case)

    prop()
    for case in ran:
        check(case)


async def fuzz(strategy: st.SearchStrategy[Any], check: Callable[[Any], Awaitable[None]], max_examples: int,
               tally: Tally, kind_of: Callable[[Any], str]) -> None:
    """`drive` from inside a test running on the loop: the loop keeps serving meanwhile."""
    await asyncio.to_thread(drive, asyncio.get_running_loop(), strategy, check, max_examples, tally, kind_of)


def brief(value: Any, limit: int = 300) -> str:
    """A case for an assertion message: a megabyte body must not flood the report."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def assert_error_answer(status: int, headers: dict[str, str], body: bytes, what: Any,
                        low: int = 400, high: int = 499) -> dict[str, Any]:
    """The answer is a `low`..`high` with the one error body (shardgrid/common/wire.py); its `error` object."""
    what = brief(what)
    assert low <= status <= high, (what, status, body[:300])
    assert b"Traceback" not in body, (what, body[:300])
    assert headers.get("content-type", "").startswith("application/json"), (what, headers, body[:300])
    answer = orjson.loads(body)
    assert isinstance(answer, dict) and set(answer) == {"error"}, (what, answer)
    error = answer["error"]
    assert isinstance(error.get("code"), str) and isinstance(error.get("message"), str), (what, answer)
    assert STATUS_FOR_CODE.get(error["code"]) == status, (what, status, error)
    return error


# -- hostile values -----------------------------------------------------------------------

# Ints msgpack and orjson cannot carry (beyond 64 bits), and the int64 edges.
HUGE_INTS = st.one_of(st.integers(min_value=1 << 64, max_value=1 << 200),
                      st.integers(max_value=-(1 << 63) - 1, min_value=-(1 << 200)),
                      st.sampled_from([(1 << 63), (1 << 64) - 1, -(1 << 63) - 1]))
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def deep_text(depth: int, kinds: list[bool], leaf: str = "1") -> str:
    """JSON text nested `depth` levels (lists where kinds[i % len] is True, objects otherwise).

    Built as text: encoders recurse and refuse (or overflow the stack) at these depths."""
    opens, closes = [], []
    for i in range(depth):
        if kinds[i % len(kinds)]:
            opens.append("[")
            closes.append("]")
        else:
            opens.append('{"k":')
            closes.append("}")
    return "".join(opens) + leaf + "".join(reversed(closes))


@st.composite
def deep_json(draw: st.DrawFn, min_depth: int = ORJSON_MAX_WRITE_DEPTH + 1,
              max_depth: int = ORJSON_MAX_READ_DEPTH + 200) -> str:
    # The edges: the first depth orjson cannot write, and near Python's
    # recursion limit (repr or str of such a value raises RecursionError),
    # up to the last depth orjson reads.
    edges = [min_depth, 990, 1000, 1010, 1018, 1020, 1022, ORJSON_MAX_READ_DEPTH - 1, ORJSON_MAX_READ_DEPTH,
             ORJSON_MAX_READ_DEPTH + 1]
    at_edge = st.sampled_from([d for d in edges if min_depth <= d <= max_depth])
    depth = draw(st.one_of(st.integers(min_depth, max_depth), at_edge, at_edge))
    kinds = draw(st.lists(st.booleans(), min_size=1, max_size=4))
    return deep_text(depth, kinds)


def dumps(value: Any) -> str:
    """JSON text of `value` as a careless or hostile client writes it: ints of any
    size, NaN and Infinity literals (stdlib json; orjson refuses both)."""
    return json.dumps(value, allow_nan=True)


# Any JSON-ish value, including what strict JSON cannot hold.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), HUGE_INTS, st.floats(allow_nan=True),
                    st.text(max_size=20))
JSONISH = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                       max_leaves=12)


def not_json(raw: bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    return False


# Bytes no JSON parser accepts: random bytes, invalid UTF-8 inside a string,
# lone surrogates, NaN/Infinity literals, numbers beyond a double, truncations.
BAD_JSON_BYTES = st.one_of(
    st.binary(min_size=1, max_size=64),
    st.binary(min_size=1, max_size=16).map(lambda b: b'"' + b"\xff" + b + b'"'),
    st.binary(min_size=1, max_size=16).map(lambda b: b'{"k": "' + b"\xc3\x28" + b + b'"}'),
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"[NaN]", b'{"value": Infinity}', b"1e400",
                     b"-1e999", b'"\\ud800"', b"\xef\xbb\xbf{}", b"{", b"[1,", b'{"a" 1}', b"nul", b"01",
                     b"{'a': 1}", b"[1,]", b"\x00", b" ", b"a=1&b=2"]),
    JSONISH.map(lambda v: dumps(v).encode()).flatmap(
        lambda raw: st.integers(0, max(0, len(raw) - 1)).map(lambda n: raw[:n] + b"\x80")),
).filter(not_json)


def header_value(valid: Callable[[bytes], bool]) -> st.SearchStrategy[bytes]:
    """Header values a client can send that `valid` refuses: any visible byte,
    obs-text (not UTF-8), blanks. Control bytes are left out: the HTTP parser
    itself refuses those before any handler runs."""
    raw = st.binary(max_size=120).map(lambda b: bytes(c for c in b if c == 9 or 32 <= c <= 126 or c >= 128))
    printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=120).map(str.encode)
    return st.one_of(raw, printable, st.sampled_from([b"", b" ", b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])) \
        .filter(lambda v: not valid(v.strip(b" \t")))


@dataclass(frozen=True)
class Case:
    """One hostile request: its kind (for the tally), method, target, body,
    headers, and the range its status must fall in."""

    kind: str
    method: str
    target: bytes
    body: bytes = b""
    headers: tuple[bytes, ...] = ()
    status: tuple[int, int] = (400, 499)
