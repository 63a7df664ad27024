"""Leader-count balance (meta/balance.py): within one of even, never to a replica that is behind."""
from __future__ import annotations

import dataclasses
import random

from meta.balance import LeaderCountMove, balance_leader_counts
from meta.controller import GroupReport, SoftState
from meta.state import GroupRecord, WorkerRecord

LEASE, NOW = 1500, 100_000
IDS = ("w1", "w2", "w3", "w4")


def workers(*states: tuple[str, str]) -> dict[str, WorkerRecord]:
    return {wid: WorkerRecord(wid, "x", "z", state) for wid, state in states}


WORKERS = workers(*((w, "active") for w in IDS))


def groups(leaders: list[str], voters: tuple[str, ...] = IDS[:3], preferred: str | None = "same") -> list[GroupRecord]:
    return [GroupRecord(id=i, term=2, leader=lead, voters=list(voters), ready_term=2,
                        preferred_leader=lead if preferred == "same" else preferred)
            for i, lead in enumerate(leaders)]


def soft(gs: list[GroupRecord], behind: dict[tuple[str, int], int] | None = None,
         silent: frozenset[str] = frozenset()) -> SoftState:
    """Every worker up for long and reporting each group it hosts at its term, caught up
    (commit 1000) but for `behind` ((worker, group) -> last_seq)."""
    s = SoftState(leader_since_ms=0)
    for w in IDS:
        if w in silent:
            continue
        reps = {g.id: GroupReport(term=g.term, role="leader" if g.leader == w else "follower", last_seq=(behind or {})
                                  .get((w, g.id), 1000), commit=1000) for g in gs if w in g.voters}
        s.heard_from(w, 0, reps)
        s.heard_from(w, NOW, reps)
    return s


def test_nothing_to_do_within_one() -> None:
    gs = groups(["w1", "w2", "w3", "w1"])
    assert balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE) == []


def test_the_busiest_leader_gives_one_to_the_idlest_voter() -> None:
    gs = groups(["w1", "w1", "w1", "w2"])
    (move,) = balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE)
    assert (move.leader, move.target) == ("w1", "w3") and "w1 leads 3 groups, w3 leads 0" in move.reason


def test_never_to_a_replica_that_is_behind_nor_one_that_cannot_hear_the_leader() -> None:
    gs = groups(["w1", "w1", "w1", "w2"])
    behind = {("w3", g): 100 for g in range(4)}
    (move,) = balance_leader_counts(gs, WORKERS, soft(gs, behind), NOW, LEASE)
    assert move.target == "w2"  # w2 leads 1: 3 - 1 >= 2
    behind.update({("w2", g): 100 for g in range(4)})
    assert balance_leader_counts(gs, WORKERS, soft(gs, behind), NOW, LEASE) == []


def test_a_group_without_a_leader_anyone_asked_for_moves_first() -> None:
    gs = groups(["w1", "w1", "w1", "w2"])
    gs[2].preferred_leader = "w9"  # replaced by repair: not a voter any more
    (move,) = balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE)
    assert move.group == 2 and "cannot lead" in move.reason


def test_ineligible_workers_take_nothing_and_holds_are_respected() -> None:
    gs = groups(["w1", "w1", "w1", "w2"])
    ws = workers(("w1", "active"), ("w2", "active"), ("w3", "draining"), ("w4", "active"))
    (move,) = balance_leader_counts(gs, ws, soft(gs), NOW, LEASE)
    assert move.target == "w2"
    assert balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE, busy={0, 1, 2}) == []
    moved = {0: NOW - 999, 1: NOW - 999, 2: NOW - 1000}
    (move,) = balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE, moved_ms=moved, window_ms=1000)
    assert move.group == 2
    # A fresh meta leader, or a worker just back, is not judged yet.
    s = soft(gs)
    s.leader_since_ms = NOW - 5000
    assert balance_leader_counts(gs, WORKERS, s, NOW, LEASE) == []


def test_repeated_moves_converge_within_one_and_never_reverse() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 12)
        gs = [GroupRecord(id=i, term=2, leader=None, voters=rng.sample(IDS, 3), ready_term=2) for i in range(n)]
        for g in gs:
            g.leader = g.preferred_leader = rng.choice(g.voters)
        seen: set[tuple[int, str, str]] = set()
        for _step in range(50):
            moves = balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE)
            if not moves:
                break
            (m,) = moves
            assert isinstance(m, LeaderCountMove) and (m.group, m.target, m.leader) not in seen  # no reversal
            seen.add((m.group, m.leader, m.target))
            g = gs[m.group]
            g.leader = g.preferred_leader = m.target
        else:
            raise AssertionError("did not converge")
        counts = {w: sum(g.leader == w for g in gs) for w in IDS}
        # Within one, unless no voter of the busiest worker's groups is lighter by two.
        for w, c in counts.items():
            for g in gs:
                if g.leader == w:
                    assert all(counts[v] >= c - 1 for v in g.voters), (counts, [(g.leader, g.voters) for g in gs])


def test_an_operators_pinned_leader_stays() -> None:
    gs = groups(["w1", "w1", "w1", "w2"])
    for g in gs[:3]:
        g.leader_pinned = True
    assert balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE) == []
    gs[1].preferred_leader = "w2"  # on its way to w2: preference balance's business
    gs[1].leader_pinned = False
    assert balance_leader_counts(gs, WORKERS, soft(gs), NOW, LEASE) == []
    # Unless that preferred leader can never lead again.
    ws = workers(("w1", "active"), ("w2", "drained"), ("w3", "active"), ("w4", "active"))
    (move,) = balance_leader_counts(gs, ws, soft(gs), NOW, LEASE)
    assert (move.group, move.target) == (1, "w3")


def test_the_coldest_group_moves_and_the_hot_one_is_left_to_hot_relief() -> None:
    gs = groups(["w1", "w1", "w1", "w2"])
    s = soft(gs)
    reps = dict(s.workers["w1"].groups)
    for gid, rate in ((0, 900.0), (1, 5.0), (2, 300.0)):
        reps[gid] = dataclasses.replace(reps[gid], write_rate=rate)
    s.heard_from("w1", NOW, reps)
    (move,) = balance_leader_counts(gs, WORKERS, s, NOW, LEASE)
    assert move.group == 1
