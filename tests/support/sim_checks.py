"""The invariants both simulators check, in one place.

The core simulator (tests/tier1/replica_sim.py) drives `Replica` objects and
performs their effects itself; the shell simulator (tests/support/shell_sim.py)
drives real `GroupShell`s on simulated disks. Both learn the same two things
from a run: which entry each replica applies at each seq, and which writes a
client was told were acknowledged at which seq. From those alone:

* state machine safety: every replica applies the same entry at a seq;
* the committed log `C` is the sequence of applied entries, and a replica
  applies in order, one seq after the other (a new incarnation starts at
  its snapshot);
* exactly-once: no request id (rid) is in `C` twice, and a write
  re-sent with the same rid is answered with the seq of its first
  acknowledgement;
* an acknowledged write is in `C` at the seq it was acknowledged with.
  Since `C` only grows and every later apply at that seq must match it,
  that covers "no acknowledged write is lost" for every replica that applies
  past it; what a simulator holds at the end (the shell simulator's items)
  is its own final check.

An entry's key is whatever identifies it across replicas: the core
simulator's rolling hash of the log prefix, or the shell simulator's
(term, seq) with the entry's content digest.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


class SimViolation(AssertionError):
    """An invariant broke: a bug in the code under test (or in the simulator)."""


class CommittedLog:
    def __init__(self, fail: Callable[[str], NoReturn], origin: Any = None) -> None:
        self.fail = fail
        # keys[seq]: the entry every replica applied at seq; keys[0] stands
        # for the empty log (the core simulator's prefix hash starts there).
        self.keys: list[Any] = [origin]
        self.rids: list[tuple[str, ...]] = [()]  # the rids each committed entry carries
        self.rid_seq: dict[str, int] = {}
        self.acked: dict[str, int] = {}  # rid -> the seq it was acknowledged at

    @property
    def last(self) -> int:
        return len(self.keys) - 1

    def applied(self, who: str, seq: int, key: Any, rids: tuple[str, ...]) -> bool:
        """`who` applies the entry `key` (carrying `rids`) at `seq`. True when
        that extends the committed log."""
        keys = self.keys
        if seq < len(keys):
            if keys[seq] != key:
                self.fail(f"state machine safety: {who} applies a different entry at {seq}")
            return False
        if seq != len(keys):
            self.fail(f"{who} applies {seq}, but the committed log ends at {len(keys) - 1}")
        keys.append(key)
        self.rids.append(rids)
        for rid in rids:
            if rid in self.rid_seq:
                self.fail(f"exactly-once: rid {rid} committed twice: {self.rid_seq[rid]} and {seq}")
            self.rid_seq[rid] = seq
        return True

    def in_order(self, who: str, seq: int, after: int) -> None:
        """A replica that last applied `after` applies `seq` now."""
        if seq != after + 1:
            self.fail(f"{who} applies {seq} after {after}")

    def acknowledged(self, who: str, rid: str, seq: int, idx: int | None = None) -> bool:
        """`who` told a client that `rid` is applied at `seq` (at position
        `idx` of its entry). True the first time `rid` is acknowledged."""
        if seq >= len(self.keys) or rid not in self.rids[seq]:
            self.fail(f"{who} acknowledged {rid}@{seq} which is not committed there")
        if idx is not None and (idx >= len(self.rids[seq]) or self.rids[seq][idx] != rid):
            self.fail(f"{who} acknowledged {rid}@{seq} at position {idx}, where the entry holds {self.rids[seq]}")
        first = rid not in self.acked
        prev = self.acked.setdefault(rid, seq)
        if prev != seq:
            self.fail(f"exactly-once: {rid} acknowledged at {prev} and at {seq}")
        return first
