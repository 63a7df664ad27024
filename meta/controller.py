"""Pure decisions of the metadata service: (state, soft state, now) -> actions.

Runs only on the meta Raft leader, every ~100 ms (`meta/server.py` executes
the actions as compare-and-set commands, so a decision made on stale state
simply fails and is re-made on the next pass). No I/O, no clock, no asyncio.

Failover (DESIGN.md §4): a worker silent for `lease_ms` loses every leadership
it holds; the new leader is the live voter with the greatest last (term, seq)
it reported, preferring the group's preferred leader, then the lowest id, on
ties. Only the dead worker's groups change term. A newly elected meta leader
has no heartbeats yet, so it waits one full lease before judging anyone dead
(KAFKA-15019 fenced healthy brokers by doing otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from meta.state import GroupRecord


@dataclass(frozen=True)
class GroupReport:
    """What a worker last reported about its replica of one group."""

    term: int = 0
    role: str = "follower"
    last_term: int = 0
    last_seq: int = 0
    commit: int = 0
    applied: int = 0


@dataclass
class WorkerLiveness:
    last_seen_ms: int
    groups: dict[int, GroupReport] = field(default_factory=dict)


@dataclass
class SoftState:
    """Meta-leader-only state, never replicated: rebuilt from heartbeats."""

    leader_since_ms: int
    workers: dict[str, WorkerLiveness] = field(default_factory=dict)

    def heard_from(self, worker: str, now_ms: int, groups: Mapping[int, GroupReport]) -> None:
        self.workers[worker] = WorkerLiveness(now_ms, dict(groups))


@dataclass(frozen=True)
class SetLeader:
    group: int
    leader: str
    expect_term: int
    reason: str


Action = SetLeader


def is_live(soft: SoftState, worker: str, now_ms: int, lease_ms: int) -> bool:
    seen = soft.workers.get(worker)
    # Never heard from since this meta node became leader: give it a lease.
    last = seen.last_seen_ms if seen is not None else soft.leader_since_ms
    return now_ms - last < lease_ms


def failover_candidate(group: GroupRecord, soft: SoftState, now_ms: int, lease_ms: int) -> str | None:
    """The live voter that should lead `group`, or None when none is live."""
    best: tuple[tuple[int, int], int, str] | None = None
    for voter in group.voters:
        if voter == group.leader or not is_live(soft, voter, now_ms, lease_ms):
            continue
        seen = soft.workers.get(voter)
        report = seen.groups.get(group.id) if seen is not None else None
        last = (report.last_term, report.last_seq) if report is not None else (-1, -1)
        preferred = 1 if voter == group.preferred_leader else 0
        # max() over (last log, preferred, -id) -> invert the id by sorting key below.
        key = (last, preferred, voter)
        if best is None or (key[0], key[1]) > (best[0], best[1]) or \
                ((key[0], key[1]) == (best[0], best[1]) and voter < best[2]):
            best = key
    return best[2] if best is not None else None


def decide(groups: Sequence[GroupRecord], soft: SoftState, now_ms: int, lease_ms: int) -> list[Action]:
    """Every action the controller wants now, in group order."""
    if now_ms - soft.leader_since_ms < lease_ms:
        return []
    actions: list[Action] = []
    for group in sorted(groups, key=lambda g: g.id):
        if group.leader is not None and is_live(soft, group.leader, now_ms, lease_ms):
            continue
        candidate = failover_candidate(group, soft, now_ms, lease_ms)
        if candidate is None:
            continue
        reason = "leader_unassigned" if group.leader is None else f"leader {group.leader} silent for {lease_ms} ms"
        actions.append(SetLeader(group.id, candidate, group.term, reason))
    return actions
