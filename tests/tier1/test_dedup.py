"""The request-id table (worker/dedup.py) against a one-rid-at-a-time model of its rules."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from worker.dedup import ORDER_SLACK, DedupTable
from worker.replica_msgs import Entry


class _Model:
    """The rules spelled out: each rid of each entry in turn moves to the young
    end; then, while the table is over its bound or its oldest rid is older
    than the window, the oldest goes."""

    def __init__(self, window_ms: int, max_entries: int) -> None:
        self.window, self.max = window_ms, max_entries
        self.by_rid: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.newest = 0

    def apply(self, e: Entry) -> None:
        self.newest = max(self.newest, e.ts)
        rids: tuple[Any, ...] = {"op": (e.rid,), "ops": e.rid or ()}.get(e.kind, ())
        for rid in rids:
            if rid is not None:
                self.by_rid.pop(rid, None)
                self.by_rid[rid] = (e.seq, e.ts)
        while self.by_rid:
            first = next(iter(self.by_rid))
            if len(self.by_rid) <= self.max and self.by_rid[first][1] >= self.newest - self.window:
                break
            del self.by_rid[first]

    def export(self) -> tuple[tuple[str, int, int], ...]:
        return tuple((rid, seq, ts) for rid, (seq, ts) in self.by_rid.items())


_RIDS = st.one_of(st.none(), st.sampled_from([f"r{i}" for i in range(12)]))
_ENTRY = st.one_of(
    st.tuples(st.just("op"), _RIDS),
    st.tuples(st.just("ops"), st.lists(_RIDS, min_size=1, max_size=6).map(tuple)),
    st.tuples(st.sampled_from(["config", "none"]), _RIDS),  # their rid, if any, is not a request id
)


# 1,500 examples: 300 missed an expiry that cut through an entry naming a rid twice.
@settings(max_examples=1500, deadline=None)
@given(window=st.integers(0, 40), bound=st.integers(-1, 8),
       steps=st.lists(st.tuples(_ENTRY, st.integers(0, 15)), max_size=40), cut=st.integers(0, 40))
@example(window=40, bound=1, steps=[(("ops", ("r0", "r1", "r0")), 0)], cut=40)  # r1 is older than r0: it goes
def test_table_follows_the_rules_for_any_log(window: int, bound: int, steps: list[Any], cut: int) -> None:
    table, model = DedupTable(window, bound), _Model(window, bound)
    ts = 0
    for seq, ((kind, rid), gap) in enumerate(steps, start=1):
        if seq == cut + 1:
            # A table restored from a snapshot goes on exactly as the original.
            table = DedupTable(window, bound, table.export(), table.newest_ts)
            assert table.export() == model.export()
        ts += gap  # entry timestamps never decrease along the log
        e = Entry(1, seq, kind, None if kind != "ops" else (None,) * len(rid), rid, ts)
        table.apply(e)
        model.apply(e)
        assert table.export() == model.export()
        assert len(table) == len(model.by_rid)
        assert table.newest_ts == model.newest
        for r in [f"r{i}" for i in range(12)]:
            hit = model.by_rid.get(r)
            assert table.lookup(r) == (None if hit is None else hit[0])


def test_the_expiry_queue_stays_near_the_table_size() -> None:
    # Entries without rids, and the same few rids applied again and again,
    # leave nothing live behind; they must not pile up until the window passes.
    table = DedupTable(600_000, 100)
    for seq in range(1, 20_001):
        table.apply(Entry(1, seq, "ops", (None,) * 4, (None,) * 4, seq))
        table.apply(Entry(1, seq, "op", None, f"r{seq % 10}", seq))
    assert len(table) == 10
    assert len(table._order) <= 2 * len(table) + ORDER_SLACK
    assert table.export() == tuple((f"r{s % 10}", s, s) for s in range(19_991, 20_001))
