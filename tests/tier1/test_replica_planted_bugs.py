"""The simulation's checker catches real replication bugs.

Each test plants one classic bug in a subclass of Replica (through the
decision methods the core exposes for this purpose) and asserts that the
ordinary seeded simulation finds it among the first few hundred seeds.
"""
from __future__ import annotations

import dataclasses

import pytest

from tests.tier1.replica_sim import SimViolation, run_seed
from worker.dedup import DedupTable
from worker.replica import Replica
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


def first_failure(cls: type[Replica]) -> tuple[int, str] | None:
    for seed in range(BUDGET):
        try:
            run_seed(seed, cls)
        except SimViolation as exc:
            return seed, str(exc)
    return None


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "cls",
    [CountsOldTermEntries, SkipsBeginRound, AcksBeforePersist, ForgetsDedupInSnapshots],
    ids=lambda c: c.__name__,
)
def test_planted_bug_is_caught(cls: type[Replica]) -> None:
    found = first_failure(cls)
    assert found is not None, f"{cls.__name__} survived {BUDGET} seeds"
    print(f"{cls.__name__}: seed {found[0]}: {found[1]}")
