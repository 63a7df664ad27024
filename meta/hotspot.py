"""Hot-group relief: move a hot leader, shed a replica off a hot worker. Pure decisions.

Issue 24's "hot-group relief" (TiKV PD's hot-region scheduler, ADR-0011's
GT3), from what workers report in their heartbeats (worker/group.py): each
replica's `persist_p99_ms` (entries queued at that replica to durable there,
p99 over its last 100 passes) and each leader's `write_rate`.

Loads. A group's rate r(g) is the highest `write_rate` a live replica of it
reports (the leader's; right after a move the old leader's figure still
covers the new one's first second). The *leader load* of a worker, L(w), is
the sum of r(g) over the groups it leads: a leader does every client's work
and sends each entry to every follower, so it is what a leadership move
shifts. The *worker load* W(w) counts every replica it hosts, leaderships
twice: W(w) = sum of r(g) over its replicas + L(w) (a follower appends and
fsyncs every entry; a leader does that and the client's work too).

1. Hot leader. A ready group's leader is hot when its persist p99 exceeds
   `hot_latency_ratio` (2.0) times the median persist p99 of the group's
   voters at the current term (itself included; with two voters the median
   is their mean, so a group of two is never hot). Once it has been hot at
   the same (leader, term) for `rebalance_window_ms` without a break, the
   leadership moves (preferred leader first, then a graceful transfer) to the
   voter with the lowest leader load that is live, not leaving, hears the
   leader and is within `transfer_lag_allowed` of the leader's commit -- but
   only when L(A) - L(B) > (1 + MOVE_MARGIN) * r(g).

   Why that cannot ping-pong: the move from A to B changes the loads to
   L(A) - r and L(B) + r, so the way back would need
   L(B) + r - (L(A) - r) > (1 + MOVE_MARGIN) r, i.e.
   L(A) - L(B) < (1 - MOVE_MARGIN) r: the loads would have to shift by more
   than 2 * MOVE_MARGIN * r first. And under steady rates every move lowers
   the sum of the squared leader loads by 2r(L(A) - L(B) - r) > 0, so moves
   stop after finitely many. Latency alone never moves a leadership: a
   leader slower than its followers only because leading is work would be
   moved again from wherever it went. A hot leader whose load no other
   worker can usefully take stays (moving it would only move the hot spot);
   that is the single-hot-group case, and the answer to it is more
   capacity (a faster worker, or shedding, below).

2. Hot worker. A worker whose W stays above the mean W of the workers that
   serve replicas by more than `hot_worker_threshold` (0.5: 50 % above) for
   the window, while an `available` worker (heard live, hosting nothing)
   exists, sheds one replica to it, drain-then-reassign: an add operator on
   the available worker that `replaces` the hot one, so the group's desired
   placement drops the hot worker and reconcile (meta/reconcile.py) removes
   it once the new replica votes (for a group without a desired placement,
   this module asks for that removal itself). It sheds the busiest follower
   replica whose rate is at most half its load (the spare must not end up
   hotter than the hot worker is left), a leader's replica only when it has
   no such follower (the removal hands the leadership over first). The
   target hosts nothing, so the replica can never come back to a worker it
   left, and each available worker takes one shed at most.

Hold. A decision holds its group for the window: no hot move, no shed, and
(`held`, used by meta/server.py for leader balance and available to other
balancers) no other balancing move of it. A shedding worker sheds again
only a window later. A hot leader's clock also restarts with every change of
leader or term, so a group that just moved must be hot for a whole window at
its new leader before anything is judged.

`relieve` is the only entry point that changes anything, and it changes only
its own `HotState` (soft state of the meta leader, never replicated: a new
meta leader starts from nothing, so every window starts over). No I/O, no
clock.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from meta.controller import GroupReport, SoftState, StartTransfer, heard_live, report_of, transfer_lag_allowed, unusable
from meta.repair import StartOperator
from meta.state import GroupRecord, WorkerRecord, placeable

# How much more than the group's own rate the leader-load gap must be: what
# noise in the reported rates must overcome to reverse a move (see above).
MOVE_MARGIN = 0.25


@dataclass(frozen=True)
class HotSettings:
    """The topology's balancing settings (topology/model.py Settings)."""

    window_ms: int = 30_000
    latency_ratio: float = 2.0
    worker_threshold: float = 0.5
    enabled: bool = True

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> "HotSettings":
        """From a stored topology's settings (a topology applied before these existed reads the defaults)."""
        d = cls()
        return cls(int(settings.get("rebalance_window_ms", d.window_ms)),
                   float(settings.get("hot_latency_ratio", d.latency_ratio)),
                   float(settings.get("hot_worker_threshold", d.worker_threshold)),
                   bool(settings.get("hot_relief", d.enabled)))


@dataclass(frozen=True)
class Decision:
    """One balancing decision: what to do, and how to count and log it."""

    kind: str  # "hot_leader" | "shed"
    reason: str  # one word, for the metric: latency, load, remove
    action: StartTransfer | StartOperator
    detail: str  # for the log and operators


@dataclass(frozen=True)
class Moved:
    at_ms: int
    left: str  # the worker the group's leadership (or replica) left
    to: str
    kind: str


@dataclass
class HotState:
    """What hot-group relief remembers between passes (meta leader only)."""

    window_ms: int = HotSettings.window_ms
    # group -> (leader, term, since): hot without a break since `since`, at that leader and term.
    hot_since: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    worker_hot_since: dict[str, int] = field(default_factory=dict)
    moved: dict[int, Moved] = field(default_factory=dict)  # the last decision per group
    shed_at: dict[str, int] = field(default_factory=dict)  # worker -> when it last shed a replica
    # group -> (from, to) of a shed whose removal this module must see through (no desired placement).
    sheds: dict[int, tuple[str, str]] = field(default_factory=dict)

    def held(self, group: int, now_ms: int) -> bool:
        """Was `group` moved by a balancing decision less than a window ago? Other balancers leave it alone then."""
        m = self.moved.get(group)
        return m is not None and now_ms - m.at_ms < self.window_ms

    def held_groups(self, now_ms: int) -> frozenset[int]:
        return frozenset(g for g in self.moved if self.held(g, now_ms))


def group_rates(groups: Sequence[GroupRecord], soft: SoftState, now_ms: int, lease_ms: int) -> dict[int, float]:
    """r(g): the highest write rate a live replica of each group reports."""
    rates: dict[int, float] = {}
    for g in groups:
        best = 0.0
        for w in (*g.voters, *g.learners):
            rep = report_of(soft, w, g.id)
            if rep is not None and heard_live(soft, w, now_ms, lease_ms):
                best = max(best, rep.write_rate)
        rates[g.id] = best
    return rates


def leader_loads(groups: Sequence[GroupRecord], rates: Mapping[int, float]) -> dict[str, float]:
    """L(w): the rates of the groups each worker leads."""
    loads: dict[str, float] = {}
    for g in groups:
        if g.leader is not None:
            loads[g.leader] = loads.get(g.leader, 0.0) + rates.get(g.id, 0.0)
    return loads


def worker_loads(groups: Sequence[GroupRecord], rates: Mapping[int, float]) -> dict[str, float]:
    """W(w): the rates of every replica each worker hosts, its leaderships counted twice."""
    loads: dict[str, float] = {}
    for g in groups:
        r = rates.get(g.id, 0.0)
        for w in (*g.voters, *g.learners):
            loads[w] = loads.get(w, 0.0) + r * (2 if w == g.leader else 1)
    return loads


def hot_evidence(group: GroupRecord, soft: SoftState, now_ms: int, lease_ms: int, ratio: float) -> str | None:
    """Why the group's leader is hot now (its p99 against the voters' median), or None."""
    if not group.ready or group.leader is None or not heard_live(soft, group.leader, now_ms, lease_ms):
        return None
    lead = report_of(soft, group.leader, group.id)
    if lead is None or lead.term != group.term or lead.role != "leader" or lead.persist_p99_ms <= 0:
        return None
    p99s = []
    for v in group.voters:
        rep = report_of(soft, v, group.id)
        if rep is not None and rep.term == group.term and rep.persist_p99_ms > 0 \
                and heard_live(soft, v, now_ms, lease_ms):
            p99s.append(rep.persist_p99_ms)
    if len(p99s) < 2:
        return None  # nothing to compare with
    median = statistics.median(p99s)
    if lead.persist_p99_ms <= ratio * median:
        return None
    return (f"leader {group.leader}'s persist p99 {lead.persist_p99_ms:.1f} ms > {ratio:g} x the median "
            f"{median:.1f} ms of its {len(p99s)} voters")


def _can_lead(group: GroupRecord, soft: SoftState, worker: str, lead: GroupReport, now_ms: int, lease_ms: int,
              workers: Mapping[str, WorkerRecord]) -> bool:
    rec = workers.get(worker)
    if not placeable(rec) or not heard_live(soft, worker, now_ms, lease_ms):
        return False
    rep = report_of(soft, worker, group.id)
    if rep is None or unusable(rep) or rep.term != group.term:
        return False
    if rep.leader_silence_ms is not None and rep.leader_silence_ms >= lease_ms:
        return False  # it cannot hear the leader: the transfer would stall
    return rep.last_seq >= lead.commit - transfer_lag_allowed(lead, lease_ms)


def _observe(state: HotState, groups: Sequence[GroupRecord], soft: SoftState, now_ms: int, lease_ms: int,
             cfg: HotSettings, wloads: Mapping[str, float], serving: Sequence[str]) -> dict[int, str]:
    """Update the hot clocks from this pass's reports; the evidence of each hot group."""
    evidence: dict[int, str] = {}
    for g in groups:
        why = hot_evidence(g, soft, now_ms, lease_ms, cfg.latency_ratio)
        if why is None:
            state.hot_since.pop(g.id, None)
            continue
        evidence[g.id] = why
        assert g.leader is not None
        held = state.hot_since.get(g.id)
        if held is None or held[:2] != (g.leader, g.term):
            state.hot_since[g.id] = (g.leader, g.term, now_ms)
    mean = sum(wloads.get(w, 0.0) for w in serving) / len(serving) if len(serving) >= 2 else 0.0
    for w in list(state.worker_hot_since):
        if w not in serving or mean <= 0 or wloads.get(w, 0.0) <= (1 + cfg.worker_threshold) * mean:
            del state.worker_hot_since[w]
    for w in serving:
        if mean > 0 and wloads.get(w, 0.0) > (1 + cfg.worker_threshold) * mean:
            state.worker_hot_since.setdefault(w, now_ms)
    return evidence


def _hot_leader_move(state: HotState, groups: Sequence[GroupRecord], soft: SoftState, now_ms: int, lease_ms: int,
                     cfg: HotSettings, workers: Mapping[str, WorkerRecord], busy: frozenset[int],
                     rates: Mapping[int, float], evidence: Mapping[int, str]) -> Decision | None:
    loads = leader_loads(groups, rates)
    # The hottest group first (PD's hot-region order), then the lowest id.
    for g in sorted(groups, key=lambda g: (-rates.get(g.id, 0.0), g.id)):
        since = state.hot_since.get(g.id)
        r = rates.get(g.id, 0.0)
        if g.id not in evidence or since is None or now_ms - since[2] < cfg.window_ms or g.id in busy \
                or state.held(g.id, now_ms) or r <= 0 or g.leader is None:
            continue
        lead = report_of(soft, g.leader, g.id)
        assert lead is not None  # evidence needs it
        source = loads.get(g.leader, 0.0)
        best: tuple[float, int, str] | None = None
        for v in g.voters:
            if v == g.leader or not _can_lead(g, soft, v, lead, now_ms, lease_ms, workers):
                continue
            rep = report_of(soft, v, g.id)
            assert rep is not None
            key = (loads.get(v, 0.0), -rep.last_seq, v)
            if source - key[0] > (1 + MOVE_MARGIN) * r and (best is None or key < best):
                best = key
        if best is None:
            continue
        target = best[2]
        detail = (f"{evidence[g.id]} for {now_ms - since[2]} ms; moving it to {target} (leader load "
                  f"{source:.0f} -> {best[0]:.0f} writes/s, the group's {r:.0f})")
        state.moved[g.id] = Moved(now_ms, g.leader, target, "hot_leader")
        state.hot_since.pop(g.id, None)
        return Decision("hot_leader", "latency", StartTransfer(g.id, g.leader, target), detail)
    return None


def _shed(state: HotState, groups: Sequence[GroupRecord], soft: SoftState, now_ms: int, lease_ms: int,
          cfg: HotSettings, workers: Mapping[str, WorkerRecord], busy: frozenset[int], rates: Mapping[int, float],
          wloads: Mapping[str, float], hosting: frozenset[str]) -> Decision | None:
    spares = sorted(w.id for w in workers.values() if w.state == "available" and placeable(w) and w.id not in hosting
                    and heard_live(soft, w.id, now_ms, lease_ms))
    if not spares:
        return None
    target = spares[0]
    for hot, since in sorted(state.worker_hot_since.items(), key=lambda kv: (-wloads.get(kv[0], 0.0), kv[0])):
        last = state.shed_at.get(hot)
        if now_ms - since < cfg.window_ms or (last is not None and now_ms - last < cfg.window_ms):
            continue
        load = wloads.get(hot, 0.0)
        candidates = []
        for g in groups:
            if hot not in g.voters or g.id in busy or state.held(g.id, now_ms) or not g.ready or g.leader is None \
                    or g.learners or not all(heard_live(soft, v, now_ms, lease_ms) for v in g.voters):
                continue
            r = rates.get(g.id, 0.0)
            weight = r * (2 if g.leader == hot else 1)
            if r > 0 and weight <= load / 2:
                candidates.append((g.leader == hot, -r, g.id))
        if not candidates:
            continue
        _, neg_rate, gid = min(candidates)
        detail = (f"{hot}'s load {load:.0f} stayed above {1 + cfg.worker_threshold:g} x the mean for "
                  f"{now_ms - since} ms; moving its replica of group {gid} ({-neg_rate:.0f} writes/s) to {target}")
        state.moved[gid] = Moved(now_ms, hot, target, "shed")
        state.shed_at[hot] = now_ms
        state.sheds[gid] = (hot, target)
        del state.worker_hot_since[hot]
        return Decision("shed", "load", StartOperator(gid, "add", target, detail, replaces=hot, by="shed"), detail)
    return None


def _finish_sheds(state: HotState, groups: Mapping[int, GroupRecord], soft: SoftState, now_ms: int,
                  lease_ms: int, busy: frozenset[int]) -> Decision | None:
    """The removal that follows a shed's add, for a group reconcile does not drive (no desired placement)."""
    for gid, (hot, target) in sorted(state.sheds.items()):
        g = groups.get(gid)
        if g is None or hot not in (*g.voters, *g.learners):
            del state.sheds[gid]  # done (reconcile removed it), or the group is gone
            continue
        if g.desired or gid in busy or not g.ready or target not in g.voters:
            continue  # reconcile's to remove, or the add is not done yet
        remaining = [v for v in g.voters if v != hot]
        if sum(1 for v in remaining if heard_live(soft, v, now_ms, lease_ms)) < len(remaining) // 2 + 1:
            continue
        detail = f"{target} votes in group {gid} now: removing the shed replica on {hot}"
        return Decision("shed", "remove", StartOperator(gid, "remove", hot, detail, by="shed"), detail)
    return None


def relieve(state: HotState, groups: Sequence[GroupRecord], workers: Mapping[str, WorkerRecord], soft: SoftState,
            now_ms: int, lease_ms: int, cfg: HotSettings, busy: frozenset[int] = frozenset(),
            quiet: bool = True) -> list[Decision]:
    """Update the hot clocks from this pass's reports, then (only when `quiet`:
    no failover, operator or balancing move under way) at most one decision:
    a shed's pending removal, a hot leader's move, or a shed. `busy`: groups
    with an operator or a leader call in progress."""
    state.window_ms = cfg.window_ms
    if not cfg.enabled:
        state.hot_since.clear()
        state.worker_hot_since.clear()
        return []
    rates = group_rates(groups, soft, now_ms, lease_ms)
    wloads = worker_loads(groups, rates)
    hosting = frozenset(w for g in groups for w in (*g.voters, *g.learners))
    serving = sorted(w for w in hosting if w in workers and placeable(workers[w])
                     and heard_live(soft, w, now_ms, lease_ms))
    evidence = _observe(state, groups, soft, now_ms, lease_ms, cfg, wloads, serving)
    if not quiet:
        return []
    by_id = {g.id: g for g in groups}
    decision = _finish_sheds(state, by_id, soft, now_ms, lease_ms, busy) \
        or _hot_leader_move(state, groups, soft, now_ms, lease_ms, cfg, workers, busy, rates, evidence) \
        or _shed(state, groups, soft, now_ms, lease_ms, cfg, workers, busy, rates, wloads, hosting)
    return [decision] if decision is not None else []
