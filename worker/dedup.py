"""The replicated request-id table of a shard group.

It is a pure function of the applied log (and the snapshot it started from):
every replica applies the same entries in the same order and therefore holds
the same table, which is what makes a write retried at another replica apply
once.  Expiry is driven by entry timestamps (the leader's clock, stamped
into the entry, and non-decreasing along the log), never by a local clock.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from worker.replica_msgs import Entry


# The expiry queue is rebuilt once it holds more than twice as many records
# as live rids, plus this: each rebuild (a pass over the table) then follows
# at least as many writes as the table holds.
ORDER_SLACK = 1024


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
        # rid -> (seq, ts), in apply order: a rid applied again is deleted
        # and re-inserted, so iteration order is apply order. A plain dict,
        # not an OrderedDict: a snapshot exports the whole table on the event
        # loop, and iterating an OrderedDict looks up every key again (about
        # 2.5 times slower over 100,000 rids).
        self._by_rid: dict[str, tuple[int, int]] = {}
        # What expiry takes from the front, oldest first: (at, rids) per entry,
        # with `at` the very tuple stored for those rids. A rid whose stored
        # tuple is no longer `at` was applied again later and is skipped.
        # (Expiring from the dict's own front would scan past every slot
        # deleted since its last resize: O(table) per write once full.)
        self._order: deque[tuple[tuple[int, int], tuple[str | None, ...]]] = deque()
        self._front = 0  # index into the rids of _order[0]: those before it are gone
        for rid, seq, ts in items:
            at = (seq, ts)
            self._by_rid.pop(rid, None)
            self._by_rid[rid] = at
            self._order.append((at, (rid,)))
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
            if rids:
                by_rid = self._by_rid
                at = (entry.seq, entry.ts)
                stored = again = False
                for rid in rids:
                    if rid is None:
                        continue
                    old = by_rid.pop(rid, None)  # re-inserted below: to the young end
                    if old is at:
                        again = True
                    by_rid[rid] = at
                    stored = True
                if again:
                    # A rid twice in this entry is as young as its last
                    # occurrence: expiry must meet the rids in that order.
                    rids = tuple(dict.fromkeys(reversed(rids)))[::-1]
                if stored:
                    self._order.append((at, rids))
                    if len(self._order) > 2 * len(by_rid) + ORDER_SLACK:
                        self._rebuild_order()
        self._expire()

    def _rebuild_order(self) -> None:
        # Records whose rids were all applied again later hold nothing live
        # but stay until the window passes them: with the same few rids
        # retried forever they would grow without bound. One record per
        # live rid, in apply order (the dict's), drops them.
        self._order = deque((at, (rid,)) for rid, at in self._by_rid.items())
        self._front = 0

    def _expire(self) -> None:
        # The oldest go first, for the bound and then for the window: the
        # same rids as testing both conditions on the oldest rid in turn.
        by_rid, order = self._by_rid, self._order
        cutoff = self._newest_ts - self._window
        while order:
            at, rids = order[0]
            if len(by_rid) <= self._max and at[1] >= cutoff:
                return
            i = self._front
            if i < len(rids):
                rid = rids[i]
                self._front = i + 1
                if rid is not None and by_rid.get(rid) is at:
                    del by_rid[rid]
            else:
                order.popleft()
                self._front = 0

    def export(self) -> tuple[tuple[str, int, int], ...]:
        # A list comprehension, not a generator: a third less time over a full table.
        return tuple([(rid, seq, ts) for rid, (seq, ts) in self._by_rid.items()])

    def copy(self) -> DedupTable:
        return DedupTable(self._window, self._max, self.export(), self._newest_ts)
