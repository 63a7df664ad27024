"""The simulation's checker catches real replication bugs.

Each test plants one classic bug in a subclass of Replica (through the
decision methods the core exposes for this purpose) and asserts that the
ordinary seeded simulation finds it among the first few hundred seeds.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest

from tests.tier1.replica_sim import SimViolation, run_seed
from worker.dedup import DedupTable
from worker.replica import Replica, _Leadership
from worker.replica_msgs import Message, Persist, Send, SnapshotMeta

BUDGET = 300


class CountsOldTermEntries(Replica):
    """Raft Figure 8: commit an entry of an earlier term by counting the
    replicas that hold it."""

    def _counts_for_commit(self, seq: int) -> bool:
        return True


class SkipsBeginRound(Replica):
    """Trust meta's pick: lead with our own log, no promises, no adoption."""

    def _begin_round_required(self) -> bool:
        return False


class AcksBeforePersist(Replica):
    """Answer (AppendReply, BeginOk) before the Persist it vouches for."""

    def _ack_durable(self, msg: Message) -> None:
        out = self._out
        for i in range(len(out) - 1, -1, -1):
            if type(out[i]) is Persist:
                out.insert(i, Send(msg))
                return
        out.append(Send(msg))


class ForgetsDedupInSnapshots(Replica):
    """Compaction drops the request-id table: a write retried at a replica
    restored from a snapshot is appended a second time."""

    def _snapshot_meta_at(self, seq: int, exact: DedupTable | None = None) -> SnapshotMeta:
        return dataclasses.replace(super()._snapshot_meta_at(seq, exact), dedup=())


class StampsWallClock(Replica):
    """The design before log time: entries carry the leader's wall clock
    (never going back along the log), so one leader whose clock runs fast
    stamps an entry far ahead and dedup expiry forgets every request id."""

    wall_clock: Callable[[], int] = staticmethod(lambda: 0)  # the simulation gives each node its own

    def _next_ts(self) -> int:
        last = self._log[-1].ts if self._log else self._dedup.newest_ts
        return max(self.wall_clock(), last)


class NoCheckQuorum(Replica):
    """A leader that never notices it lost its followers: cut so that they
    still hear it but it cannot hear them, it holds the group down."""

    def _quorum_contact(self, lead: _Leadership) -> bool:
        return True


class TrustsMessageTerms(Replica):
    """The design before the term cap: a message's higher term is adopted on
    its word, so a forged one fences the real leader with a term meta
    never published."""

    def _adopts_message_terms(self) -> bool:
        return True


def first_failure(cls: type[Replica], profile: str | None = None) -> tuple[int, str] | None:
    for seed in range(BUDGET):
        try:
            run_seed(seed, cls, profile=profile)
        except SimViolation as exc:
            return seed, str(exc)
    return None


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "cls, profile",
    [(CountsOldTermEntries, None), (SkipsBeginRound, None), (AcksBeforePersist, None),
     (ForgetsDedupInSnapshots, None), (StampsWallClock, "clocks"), (NoCheckQuorum, "isolation"),
     (TrustsMessageTerms, None)],
    ids=lambda c: c.__name__ if isinstance(c, type) else str(c),
)
def test_planted_bug_is_caught(cls: type[Replica], profile: str | None) -> None:
    found = first_failure(cls, profile)
    assert found is not None, f"{cls.__name__} survived {BUDGET} seeds"
    print(f"{cls.__name__}: seed {found[0]}: {found[1]}")
    if cls is StampsWallClock:
        assert "exactly-once" in found[1], found[1]
    if cls is NoCheckQuorum:
        assert "availability" in found[1], found[1]
    if cls is TrustsMessageTerms:
        assert "above meta's" in found[1], found[1]
