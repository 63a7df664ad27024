"""Leader-count balance: every eligible worker leads within one of every other. Pure.

Leader balance in meta/controller.py (`rebalance`) returns each group's
leadership to its preferred leader. That is not enough on its own: a
preferred leader that was replaced by repair is no longer a voter, a worker
that joined later is nobody's preferred leader, and a file may pin several
leaders on one worker. Leaderships then pile up, and with them the write
work (a leader parses, orders and fans out every write of its group).

This rule (TiKV PD's balance-leader) moves one leadership at a time from the
worker leading the most groups to a voter of that group on a worker leading
at least two fewer, and makes the target the group's preferred leader, so
that `rebalance` keeps it there instead of moving it back. It moves a group
only when:

- the target is eligible: `active` or `available`, live without a gap for
  REBALANCE_AFTER_MS, reporting the group's current term, not re-syncing or
  failed, hearing the leader, and caught up (within the transfer lag of the
  leader's commit: a leadership is never handed to a replica that is behind);
- the group is ready, has a live leader, no operator or leader call in
  progress, and was not moved (by this rule, isolation or hot relief) within
  the decision window.

Which groups it may move: a group whose preferred leader can never lead
again (not a voter any more, or on a worker that is draining, drained or
removed) first -- no leader anyone can have asked for; then a group led by
its preferred leader that nobody pinned. An operator's transfer and a file
that pins `groups:` pin the leader (`leader_pinned`), and such a group stays
where it was put; a group whose preferred leader is only down or warming up
is left to preference balance (`rebalance`), which brings it home. Among
those, the coldest (lowest write rate) first: moving a cold group's
leadership costs least, and it leaves the hot groups to hot-group relief
(meta/hotspot.py).

Every move reduces the spread and the rule stops at a difference of one, so
it cannot undo its own moves.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from meta.controller import REBALANCE_AFTER_MS, SoftState, is_live, report_of, transfer_lag_allowed, unusable
from meta.state import GroupRecord, WorkerRecord, placeable


@dataclass(frozen=True)
class LeaderCountMove:
    """Make `target` the group's preferred leader, then hand the leadership to it."""

    group: int
    leader: str
    target: str
    reason: str


def eligible_workers(workers: Mapping[str, WorkerRecord], soft: SoftState, now_ms: int, lease_ms: int) -> set[str]:
    """Workers that may take a leadership: placeable, and live without a gap for REBALANCE_AFTER_MS."""
    out = set()
    for w in workers.values():
        seen = soft.workers.get(w.id)
        if placeable(w) and seen is not None and is_live(soft, w.id, now_ms, lease_ms) \
                and now_ms - seen.up_since_ms >= REBALANCE_AFTER_MS:
            out.add(w.id)
    return out


def can_take(group: GroupRecord, soft: SoftState, target: str, lease_ms: int) -> bool:
    """Is `target` a voter that reports the group's term, hears its leader and is caught up?"""
    rep, lead = report_of(soft, target, group.id), report_of(soft, group.leader, group.id)
    if target not in group.voters or rep is None or lead is None or unusable(rep) or rep.term != group.term:
        return False
    if rep.leader_silence_ms is not None and rep.leader_silence_ms >= lease_ms:
        return False
    return rep.last_seq >= lead.commit - transfer_lag_allowed(lead, lease_ms)


def balance_leader_counts(groups: Sequence[GroupRecord], workers: Mapping[str, WorkerRecord], soft: SoftState,
                          now_ms: int, lease_ms: int, busy: Collection[int] = (),
                          moved_ms: Mapping[int, int] | None = None, window_ms: int = 0) -> list[LeaderCountMove]:
    """At most one move that narrows the spread of leaderships over eligible workers.

    `busy`: groups with an operator or leader call in progress; `moved_ms`:
    when each group's leadership was last moved by a balancing rule (none
    is moved again within `window_ms` of it)."""
    if now_ms - soft.leader_since_ms < max(lease_ms, REBALANCE_AFTER_MS):
        return []
    eligible = eligible_workers(workers, soft, now_ms, lease_ms)
    led = [g for g in groups if g.ready and g.leader is not None and is_live(soft, g.leader, now_ms, lease_ms)]
    counts: Counter[str] = Counter({w: 0 for w in eligible})
    counts.update(g.leader for g in led if g.leader in eligible)
    for source in sorted(counts, key=lambda w: (-counts[w], w)):
        best: tuple[tuple[int, float, int, int, str], LeaderCountMove] | None = None
        for g in led:
            moved = (moved_ms or {}).get(g.id)
            if g.leader != source or g.id in busy or (moved is not None and now_ms - moved < window_ms):
                continue
            pref = workers.get(g.preferred_leader or "")
            orphan = g.preferred_leader not in g.voters or not placeable(pref)
            if not orphan and (g.leader_pinned or g.preferred_leader != g.leader):
                continue  # pinned, or on its way back to a preferred leader that is down or warming up
            for v in g.voters:
                if v == source or v not in eligible or counts[v] > counts[source] - 2 or not can_take(g, soft, v,
                                                                                                    lease_ms):
                    continue
                rep, lead = report_of(soft, v, g.id), report_of(soft, g.leader, g.id)
                rate = lead.write_rate if lead is not None else 0.0
                key = (0 if orphan else 1, rate, counts[v], -(rep.last_seq if rep else 0), f"{g.id:09d}/{v}")
                if best is None or key < best[0]:
                    why = (f"{source} leads {counts[source]} groups, {v} leads {counts[v]}"
                           + ("; the preferred leader cannot lead" if orphan else ""))
                    best = (key, LeaderCountMove(g.id, source, v, why))
        if best is not None:
            return [best[1]]
    return []
