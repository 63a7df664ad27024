"""The replicated request-id table of a shard group.

It is a pure function of the applied log (and the snapshot it started from):
every replica applies the same entries in the same order and therefore holds
the same table, which is what makes a write retried at another replica apply
once.  Expiry is driven by entry timestamps (the leader's clock, stamped
into the entry, and non-decreasing along the log), never by a local clock.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from worker.replica_msgs import Entry


class DedupTable:
    def __init__(
        self,
        window_ms: int,
        max_entries: int,
        items: Iterable[tuple[str, int, int]] = (),
        newest_ts: int = 0,
    ) -> None:
        self._window = window_ms
        self._max = max_entries
        # Insertion order is apply order, so the oldest entry is always first.
        # An OrderedDict, not a dict: expiry deletes from the front, and a
        # plain dict's first item is found by scanning past every slot
        # deleted since its last resize, which made each write O(table) once
        # the table was full (throughput fell 3x after dedup_max writes).
        self._by_rid: OrderedDict[str, tuple[int, int]] = OrderedDict((rid, (seq, ts)) for rid, seq, ts in items)
        self._newest_ts = newest_ts

    @property
    def newest_ts(self) -> int:
        return self._newest_ts

    def __len__(self) -> int:
        return len(self._by_rid)

    def lookup(self, rid: str) -> int | None:
        """The seq at which `rid` was applied, if it is still remembered."""
        hit = self._by_rid.get(rid)
        return None if hit is None else hit[0]

    def apply(self, entry: Entry) -> None:
        if entry.ts > self._newest_ts:
            self._newest_ts = entry.ts
        if entry.rid is not None:
            # entry_rids() inline, and one (seq, ts) for all of the entry's
            # rids: this runs on every replica for every write of a batch.
            kind = entry.kind
            rids = (entry.rid,) if kind == "op" else entry.rid if kind == "ops" else ()
            by_rid = self._by_rid
            at = (entry.seq, entry.ts)
            for rid in rids:
                if rid is None:
                    continue
                if rid in by_rid:
                    # Applied again: to the young end, keeping "first is oldest" true.
                    by_rid.move_to_end(rid)
                by_rid[rid] = at
        self._expire()

    def _expire(self) -> None:
        # The oldest go first, for the bound and then for the window: the
        # same entries as testing both conditions on each first entry in turn.
        by_rid = self._by_rid
        excess = len(by_rid) - self._max
        while excess > 0 and by_rid:
            by_rid.popitem(last=False)
            excess -= 1
        cutoff = self._newest_ts - self._window
        while by_rid and by_rid[next(iter(by_rid))][1] < cutoff:
            by_rid.popitem(last=False)

    def export(self) -> tuple[tuple[str, int, int], ...]:
        # A list comprehension, not a generator: a third less time over a full table.
        return tuple([(rid, seq, ts) for rid, (seq, ts) in self._by_rid.items()])

    def copy(self) -> DedupTable:
        return DedupTable(self._window, self._max, self.export(), self._newest_ts)
