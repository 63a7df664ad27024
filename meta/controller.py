"""Pure decisions of the metadata service: (state, soft state, now) -> actions.

Runs only on the meta Raft leader, every ~100 ms (`meta/server.py` executes
the actions as compare-and-set commands, so a decision made on stale state
simply fails and is re-made on the next pass). No I/O, no clock, no asyncio.

Failover: a worker silent for `lease_ms` loses every leadership
it holds; the new leader is the live voter with the greatest last (term, seq)
it reported, preferring the group's preferred leader, then the lowest id, on
ties. Only the dead worker's groups change term. A newly elected meta leader
has no heartbeats yet, so it waits one full lease before judging anyone dead
(KAFKA-15019 fenced healthy brokers by doing otherwise).

A leader that restarted within its lease is live but will never lead again in
the term it had on disk (a replica only starts a term above its own). Its
report gives it away: it holds the group's current term as a follower (a
leader that lost its term to a StaleTerm looks the same). Such a group fails
over at once, to another live voter when there is one (a worker that restarts
in a loop must not win its groups back each time; leader balance returns them
once it has stayed up), else back to the restarted worker. Without this a quick
restart, or a restart of the whole cluster, left its groups answering
`not_leader` for good.

An isolated leader: meta may hear a leader that its followers cannot (a cut
between workers, or one direction of it). Check-quorum makes such a leader
refuse writes and report `quorum: false` (worker/replica.py); followers report
how long they have not heard from their term's leader. Either the leader's
own report, or a majority of the group's voters silent on it for `lease_ms`
(a wedged leader cannot report), fails the group over through the same
compare-and-set -- to the most up-to-date live voter, and only when the live
voters other than that leader are a majority on their own (otherwise no move
can help). A partitioned follower alone is never enough. Such a move is held
for ISOLATION_HOLD_LEASES leases (the decision window): a flapping link
moves the leadership at most once per window, and leader balance leaves the
group alone for that long too.

Leader balance (Kafka's preferred-leader election): every group has a
preferred leader — the topology's placement, or the target of the last
operator transfer. Failovers and restarts move leaderships onto the
survivors and nothing would move them back, so one worker ends up leading
most groups (and, being one process, doing most of the write work). Once a
group's preferred leader has been live for `REBALANCE_AFTER_MS` and is caught
up, the controller asks for a graceful transfer back to it, one group at a
time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from meta.progress import snapshot_message
from meta.state import GroupRecord, OperatorRecord

# A group that never had a ready leader holds no data yet: give its first
# leader this long to start (a worker process may need seconds to boot)
# before failing it over, instead of one lease.
BOOTSTRAP_GRACE_MS = 10_000

# A learner within this many entries of the leader's commit may be promoted
# (the group core applies the same bound when it is asked).
CATCH_UP_LAG = 64

# A preferred leader gets its leadership back only after being live this long
# without a gap: a worker that restarts in a loop must not drag leaderships
# back and forth.
REBALANCE_AFTER_MS = 10_000

# The decision window of an isolation failover, in leases: the group is not
# moved again for isolation, nor balanced, for this long after one.
ISOLATION_HOLD_LEASES = 4


def transfer_lag_allowed(leader: GroupReport, lease_ms: int) -> int:
    """How far behind the leader's reported commit a transfer target's reported
    last seq may be. The two reports are taken up to a report interval apart,
    so a busy leader is ahead by about its write rate times that interval;
    the leader itself waits for the target to hold its last entry before it
    hands over, so this only turns away targets that are truly behind."""
    return CATCH_UP_LAG + int(max(0.0, leader.write_rate) * lease_ms / 1000)


@dataclass(frozen=True)
class GroupReport:
    """What a worker last reported about its replica of one group."""

    term: int = 0
    role: str = ""  # "leader", "candidate", "follower", "learner"; "" when not reported
    last_term: int = 0
    last_seq: int = 0
    commit: int = 0
    applied: int = 0
    # The newest membership in the replica's log and the seq of its config entry.
    voters: tuple[str, ...] = ()
    learners: tuple[str, ...] = ()
    config_seq: int = 0
    # The replica lost its log and re-syncs: it must neither lead nor vote.
    resyncing: bool = False
    # The replica's group loop stopped (a disk error): it answers nothing until
    # its worker reopens it (retry in place) or restarts, so it must not lead.
    # Why, as the worker said.
    failed: str | None = None
    write_rate: float = 0.0  # acknowledged writes/s (leaders), for lag allowances
    # Check-quorum: a leader's verdict (None: not leading, or an older worker)
    # and a non-leader's time since it last heard from its term's leader.
    quorum: bool | None = None
    leader_silence_ms: int | None = None
    unheard: tuple[str, ...] = ()  # a leader's voters without an answer within the lease
    disk_bytes: int = 0  # what the replica holds on disk (measured every few seconds; 0: not said)
    # A snapshot download in flight (a learner catching up): bytes received
    # and the snapshot's size, None when there is none; `snapshot_waiting`:
    # its source serves its limit of downloads and this one waits for a turn.
    snapshot_bytes: int | None = None
    snapshot_total: int | None = None
    snapshot_waiting: bool = False

    # Entries queued to durable at this replica (ms; 0: not reported): every
    # replica's, so meta/hotspot.py can compare a leader with its followers.
    persist_p99_ms: float = 0.0
    persist_ema_ms: float = 0.0


@dataclass(frozen=True)
class Refusal:
    """A worker that would not take (or did not finish taking) a replica: the
    controller tries the next worker until `until_ms`."""

    reason: str  # insufficient_disk, insufficient_ram, draining, unreachable, timeout
    until_ms: int


@dataclass
class WorkerLiveness:
    last_seen_ms: int
    groups: dict[int, GroupReport] = field(default_factory=dict)
    up_since_ms: int = 0  # start of the current run of heartbeats: no lease-long gap, the same boot
    boot: str | None = None  # the worker process's boot id, when it sends one


@dataclass
class SoftState:
    """Meta-leader-only state, never replicated: rebuilt from heartbeats."""

    leader_since_ms: int
    workers: dict[str, WorkerLiveness] = field(default_factory=dict)
    # When this meta leader first saw each worker in the replicated state: a
    # worker declared a moment ago gets a full lease to show up.
    first_known_ms: dict[str, int] = field(default_factory=dict)
    # group -> when its leadership was last moved for isolation (the window).
    isolation_moved_ms: dict[int, int] = field(default_factory=dict)
    # group -> when a balancing rule (meta/balance.py) last moved its leadership.
    balance_moved_ms: dict[int, int] = field(default_factory=dict)
    # (worker, group) -> since when that replica has reported `failed`, without a break.
    failed_since_ms: dict[tuple[str, int], int] = field(default_factory=dict)
    # (group, worker) -> a worker that refused (or did not finish) a replica of that group.
    refused: dict[tuple[int, str], Refusal] = field(default_factory=dict)
    # (group, kind, worker) -> when this meta leader first saw that operator in progress.
    operator_seen_ms: dict[tuple[int, str, str], int] = field(default_factory=dict)

    def know(self, worker: str, now_ms: int) -> None:
        self.first_known_ms.setdefault(worker, now_ms)

    def stood_still(self, now_ms: int) -> None:
        """This meta leader did not run for a while (paused, starved of CPU): what it
        heard is old, and heartbeats that waited in its sockets meanwhile are not read
        yet. Judged by their age, every worker would look silent and every follower
        cut off from its leader. So it starts over as a newly elected leader does
        (no worker declared dead for a lease from now), keeping its decision holds
        (isolation and balance windows, refusals) so that no move repeats inside them."""
        self.leader_since_ms = now_ms
        self.workers.clear()
        self.first_known_ms.clear()
        self.failed_since_ms.clear()

    def note_operators(self, keys: Sequence[tuple[int, str, str]], now_ms: int) -> None:
        """Start the clock of each operator in progress (group, kind, worker); forget the ended ones."""
        live = set(keys)
        for key in live:
            self.operator_seen_ms.setdefault(key, now_ms)
        for key in [k for k in self.operator_seen_ms if k not in live]:
            del self.operator_seen_ms[key]

    def refusing(self, group: int, worker: str, now_ms: int) -> bool:
        r = self.refused.get((group, worker))
        return r is not None and now_ms < r.until_ms

    def heard_from(self, worker: str, now_ms: int, groups: Mapping[int, GroupReport],
                   lease_ms: int | None = None, boot: str | None = None) -> None:
        prev = self.workers.get(worker)
        up_since = now_ms
        if prev is not None and (lease_ms is None or now_ms - prev.last_seen_ms < lease_ms) \
                and (boot is None or prev.boot is None or boot == prev.boot):
            up_since = prev.up_since_ms
        self.workers[worker] = WorkerLiveness(now_ms, dict(groups), up_since, boot)
        for gid, rep in groups.items():
            if rep.failed is None:
                self.failed_since_ms.pop((worker, gid), None)
            else:
                self.failed_since_ms.setdefault((worker, gid), now_ms)
        for key in [k for k in self.failed_since_ms if k[0] == worker and k[1] not in groups]:
            del self.failed_since_ms[key]


@dataclass(frozen=True)
class SetLeader:
    group: int
    leader: str
    expect_term: int
    reason: str
    # Why, in one word, for metrics: silent, restarted, unusable, unassigned, isolated.
    cause: str = field(default="silent", compare=False)


@dataclass(frozen=True)
class RecordMembers:
    """The leader's log committed a membership meta has not recorded yet."""

    group: int
    voters: tuple[str, ...]
    learners: tuple[str, ...]
    conf_ver: int
    expect_conf_ver: int


@dataclass(frozen=True)
class ChangeMembers:
    """Ask the group leader to append one membership change."""

    group: int
    leader: str
    add_learner: str | None = None
    promote: str | None = None
    remove: str | None = None


@dataclass(frozen=True)
class StartTransfer:
    group: int
    leader: str
    target: str


@dataclass(frozen=True)
class UpdateOperator:
    group: int
    kind: str
    worker: str
    step: str
    message: str = ""
    done: bool = False


Action = SetLeader | RecordMembers | ChangeMembers | StartTransfer | UpdateOperator


def is_live(soft: SoftState, worker: str, now_ms: int, lease_ms: int) -> bool:
    seen = soft.workers.get(worker)
    # Never heard from since this meta node became leader (or since the
    # worker was declared): give it a lease.
    last = seen.last_seen_ms if seen is not None else max(soft.leader_since_ms, soft.first_known_ms.get(worker, 0))
    return now_ms - last < lease_ms


def heard_live(soft: SoftState, worker: str, now_ms: int, lease_ms: int) -> bool:
    """Heard from within the lease by this meta leader: no grace for a worker not heard yet.

    What operators see as `live`, and what guards that must not guess (a
    removal's live quorum, a new replica) require."""
    seen = soft.workers.get(worker)
    return seen is not None and now_ms - seen.last_seen_ms < lease_ms


def failover_candidate(group: GroupRecord, soft: SoftState, now_ms: int, lease_ms: int,
                       include_leader: bool = False, heard_only: bool = False,
                       among: frozenset[str] | None = None) -> str | None:
    """The live voter that should lead `group`, or None when none is live.

    The current leader competes only when it merely restarted. `heard_only`
    leaves out voters given the post-election grace without a heartbeat;
    `among`, when given, is where the candidates must come from."""
    live = heard_live if heard_only else is_live
    best: tuple[tuple[int, int], int, str] | None = None
    for voter in group.voters:
        if (voter == group.leader and not include_leader) or not live(soft, voter, now_ms, lease_ms) \
                or (among is not None and voter not in among):
            continue
        seen = soft.workers.get(voter)
        report = seen.groups.get(group.id) if seen is not None else None
        if report is not None and unusable(report):
            continue
        last = (report.last_term, report.last_seq) if report is not None else (-1, -1)
        preferred = 1 if voter == group.preferred_leader else 0
        # max() over (last log, preferred, -id) -> invert the id by sorting key below.
        key = (last, preferred, voter)
        if best is None or (key[0], key[1]) > (best[0], best[1]) or \
                ((key[0], key[1]) == (best[0], best[1]) and voter < best[2]):
            best = key
    return best[2] if best is not None else None


def unusable(report: GroupReport) -> bool:
    """A replica that must not lead: it re-syncs, or its group failed."""
    return report.resyncing or report.failed is not None


def restarted_leader(report: GroupReport, group: GroupRecord) -> bool:
    """The named leader holds the group's term but as a follower, so it will never lead it.

    It restarted (or adopted the term from a StaleTerm before meta named it).
    A leader meta names takes the new term and starts leading it in the same
    step, so no leader on its way up looks like this."""
    return report.term == group.term and report.role in ("follower", "learner")


@dataclass(frozen=True)
class Isolation:
    """Why a live leader should be replaced, and where its successor must come from."""

    reason: str
    among: frozenset[str] | None  # None: any live voter but the leader


def isolation_evidence(voters: Sequence[str], leader: str, leader_quorum: bool | None,
                       silence_ms: Mapping[str, int | None], lease_ms: int,
                       leader_unheard: Sequence[str] = ()) -> Isolation | None:
    """Whether `leader` is cut off from its group's voters: why, and where a
    successor must come from; None when it is not.

    `leader_quorum` is the leader's own check-quorum at the group's term
    (None: unknown), and `leader_unheard` the voters it has had no answer
    from; `silence_ms` maps each other voter to how long it has not heard
    from that leader at that term (None or absent: unknown). When the voters
    on the far side of the cut (unheard by the leader, or silent on it) are a
    majority, the successor is one of them: a voter the leader still hears is
    on its side (five voters split {L, D} | {A, B, C}: D may hold L's newest
    tail, and leading, it could not gather a majority either). Pure and
    shared with the replication simulation (tests/tier1/replica_sim.py).
    """
    majority = len(voters) // 2 + 1
    silent = sorted(v for v in voters if v != leader and (silence_ms.get(v) or 0) >= lease_ms)
    far = set(silent) | (set(leader_unheard) - {leader} if leader_quorum is False else set())
    among = frozenset(far) if len(far) >= majority else None
    if leader_quorum is False:
        return Isolation(f"leader {leader} reports no round trip with a majority of its voters within {lease_ms} ms",
                         among)
    if among is not None:
        return Isolation(f"voters {', '.join(silent)} have not heard from leader {leader} for {lease_ms} ms", among)
    return None


def isolated_leader(group: GroupRecord, soft: SoftState, now_ms: int, lease_ms: int) -> Isolation | None:
    """Why the group's live leader should be replaced for isolation, or None.

    Judged from this meta leader's reports at the group's current term: a
    follower's silence grows by the age of its report. None while the
    decision window of an earlier isolation move holds, and when the live,
    usable voters other than the leader are no majority (no move can help).
    """
    leader = group.leader
    if leader is None:
        return None
    moved = soft.isolation_moved_ms.get(group.id)
    if moved is not None and now_ms - moved < ISOLATION_HOLD_LEASES * lease_ms:
        return None
    if group.ready_term == 0 and now_ms - soft.leader_since_ms < BOOTSTRAP_GRACE_MS:
        return None  # a new group's voters may still be starting
    lead = report_of(soft, leader, group.id)
    current = lead is not None and lead.term == group.term
    leader_quorum = lead.quorum if current else None
    unheard = lead.unheard if current else ()
    silence: dict[str, int | None] = {}
    others = 0
    for v in group.voters:
        if v == leader or not heard_live(soft, v, now_ms, lease_ms):
            continue
        seen = soft.workers[v]
        rep = seen.groups.get(group.id)
        if rep is None or unusable(rep):
            continue
        others += 1
        if rep.term == group.term and rep.leader_silence_ms is not None:
            silence[v] = rep.leader_silence_ms + (now_ms - seen.last_seen_ms)
    if others < len(group.voters) // 2 + 1:
        return None
    return isolation_evidence(group.voters, leader, leader_quorum, silence, lease_ms, unheard)


def report_of(soft: SoftState, worker: str | None, group: int) -> GroupReport | None:
    seen = soft.workers.get(worker) if worker is not None else None
    return seen.groups.get(group) if seen is not None else None


def record_members(groups: Sequence[GroupRecord], soft: SoftState) -> list[RecordMembers]:
    """Memberships the current leaders have committed but meta has not recorded.

    Learning them from heartbeats (rather than from the reply to the change)
    means a change committed while meta was failing over is still recorded.
    """
    actions = []
    for g in sorted(groups, key=lambda g: g.id):
        rep = report_of(soft, g.leader, g.id)
        if rep is None or rep.term != g.term or rep.role != "leader":
            continue
        if rep.config_seq > g.conf_ver and rep.config_seq <= rep.commit and rep.voters:
            actions.append(RecordMembers(g.id, rep.voters, rep.learners, rep.config_seq, g.conf_ver))
    return actions


def best_transfer_target(group: GroupRecord, soft: SoftState, now_ms: int, lease_ms: int,
                         exclude: str | frozenset[str] | None = None) -> str | None:
    """The live, most caught-up voter other than the leader (and `exclude`: one or several)."""
    skip = {exclude} if isinstance(exclude, str) else set(exclude or ())
    best: tuple[int, int, str] | None = None
    for v in group.voters:
        if v == group.leader or v in skip or not is_live(soft, v, now_ms, lease_ms):
            continue
        rep = report_of(soft, v, group.id)
        seq = rep.last_seq if rep is not None else -1
        key = (seq, 1 if v == group.preferred_leader else 0, v)
        if best is None or (key[0], key[1]) > (best[0], best[1]) or \
                ((key[0], key[1]) == (best[0], best[1]) and v < best[2]):
            best = key
    return best[2] if best is not None else None


def caught_up(group: GroupRecord, soft: SoftState, worker: str) -> tuple[bool, int, int]:
    """(within CATCH_UP_LAG of the leader's commit?, worker's applied, leader's commit)."""
    lead = report_of(soft, group.leader, group.id)
    rep = report_of(soft, worker, group.id)
    commit = lead.commit if lead is not None else 0
    applied = rep.applied if rep is not None else 0
    return lead is not None and rep is not None and applied >= commit - CATCH_UP_LAG, applied, commit


def advance_operator(op: OperatorRecord, group: GroupRecord, soft: SoftState, now_ms: int,
                     lease_ms: int) -> list[Action]:
    """The next move of one staged operator, from what meta knows now."""

    def update(step: str, message: str = "", done: bool = False) -> UpdateOperator:
        return UpdateOperator(group.id, op.kind, op.worker, step, message, done)

    w = op.worker
    if not group.ready or group.leader is None:
        return [update(op.step, "waiting for the group to have a ready leader")]
    if op.kind == "add":
        if op.step == "add_learner":
            if w in group.learners or w in group.voters:
                return [update("catch_up", f"{w} is a learner")]
            return [ChangeMembers(group.id, group.leader, add_learner=w), update(op.step, f"adding {w} as a learner")]
        if op.step == "catch_up":
            if w in group.voters:
                return [update("promote")]
            ok, applied, commit = caught_up(group, soft, w)
            if ok:
                return [update("promote", f"{w} caught up: applied {applied} of {commit}")]
            rep = report_of(soft, w, group.id)
            if rep is not None and rep.snapshot_total is not None and rep.snapshot_bytes is not None:
                # In 5% steps, so that the message (a meta log entry per change) does not follow every report.
                return [update("catch_up", snapshot_message(w, rep.snapshot_bytes, rep.snapshot_total,
                                                            rep.snapshot_waiting))]
            return [update("catch_up", f"{w} catching up: applied {applied} of {commit}")]
        if op.step == "promote":
            if w in group.voters:
                return [update("done", f"{w} is a voter", done=True)]
            return [ChangeMembers(group.id, group.leader, promote=w), update(op.step, f"promoting {w}")]
    if op.kind == "remove":
        if op.step == "transfer":
            if group.leader != w:
                return [update("remove", f"{w} does not lead; removing it")]
            target = best_transfer_target(group, soft, now_ms, lease_ms, exclude=w)
            if target is None:
                return [update(op.step, "no live voter can take over the leadership")]
            return [StartTransfer(group.id, w, target), update(op.step, f"moving the leadership to {target}")]
        if op.step == "remove":
            if group.leader == w:
                return [update("transfer", f"{w} leads again; moving the leadership first")]
            if w not in group.voters and w not in group.learners:
                return [update("done", f"{w} removed", done=True)]
            return [ChangeMembers(group.id, group.leader, remove=w), update(op.step, f"removing {w}")]
    return [update(op.step, f"unknown operator step {op.step!r}")]


def rebalance(groups: Sequence[GroupRecord], soft: SoftState, now_ms: int, lease_ms: int,
              busy: frozenset[int] = frozenset(), unwanted: frozenset[str] = frozenset()) -> list[StartTransfer]:
    """At most one transfer back to a preferred leader (lowest group id first).

    Only for a ready group with a live leader and no operator or call in
    progress (`busy`), whose preferred leader is a voter, live without a gap for
    REBALANCE_AFTER_MS, reports the group's current term, is not re-syncing,
    and is within the transfer lag of the leader's commit, and is not a
    worker on its way out (`unwanted`: draining, drained, removed).
    """
    if now_ms - soft.leader_since_ms < max(lease_ms, REBALANCE_AFTER_MS):
        return []
    for g in sorted(groups, key=lambda g: g.id):
        pref = g.preferred_leader
        if not g.ready or g.leader is None or pref is None or pref == g.leader or pref not in g.voters \
                or g.id in busy or pref in unwanted or not is_live(soft, g.leader, now_ms, lease_ms):
            continue  # (a silent leader is failover's business)
        moved = soft.isolation_moved_ms.get(g.id)
        if moved is not None and now_ms - moved < max(ISOLATION_HOLD_LEASES * lease_ms, REBALANCE_AFTER_MS):
            continue  # moved away for isolation: the window holds
        seen = soft.workers.get(pref)
        if seen is None or not is_live(soft, pref, now_ms, lease_ms) or now_ms - seen.up_since_ms < REBALANCE_AFTER_MS:
            continue
        rep, lead = report_of(soft, pref, g.id), report_of(soft, g.leader, g.id)
        if rep is None or lead is None or unusable(rep) or rep.term != g.term:
            continue
        if rep.leader_silence_ms is not None and rep.leader_silence_ms >= lease_ms:
            continue  # it cannot hear the leader: a transfer to it would stall
        if rep.last_seq < lead.commit - transfer_lag_allowed(lead, lease_ms):
            continue
        return [StartTransfer(g.id, g.leader, pref)]
    return []


def decide(groups: Sequence[GroupRecord], soft: SoftState, now_ms: int, lease_ms: int,
           revoked: frozenset[str] = frozenset()) -> list[Action]:
    """Every failover and membership-record action the controller wants now, in group order.

    A `revoked` worker leads nothing: its leaderships fail over at once, to
    a voter heard from within the lease (no grace: its peers already refuse it)."""
    actions: list[Action] = list(record_members(groups, soft))
    # Silence can be judged only a lease after election; a restart is reported.
    judge_silence = now_ms - soft.leader_since_ms >= lease_ms
    for group in sorted(groups, key=lambda g: g.id):
        grace = lease_ms if group.ready_term > 0 else max(lease_ms, BOOTSTRAP_GRACE_MS)
        lead_report = report_of(soft, group.leader, group.id)
        usable = lead_report is None or not unusable(lead_report)
        restarted = lead_report is not None and usable and restarted_leader(lead_report, group)
        isolated = None
        # None: every voter may lead; a revoked one never does.
        allowed = frozenset(group.voters) - revoked if revoked else None
        if group.leader in revoked:
            candidate = failover_candidate(group, soft, now_ms, lease_ms, heard_only=True, among=allowed)
            if candidate is not None:
                actions.append(SetLeader(group.id, candidate, group.term, f"leader {group.leader} was revoked",
                                         "revoked"))
            continue
        if restarted:
            # Judged from a report, maybe right after a meta election: only
            # voters that have reported too, the restarted one last.
            candidate = failover_candidate(group, soft, now_ms, lease_ms, heard_only=True, among=allowed) or \
                failover_candidate(group, soft, now_ms, lease_ms, include_leader=True, heard_only=True, among=allowed)
        elif group.leader is not None and usable and is_live(soft, group.leader, now_ms, grace):
            isolated = isolated_leader(group, soft, now_ms, lease_ms)
            if isolated is None:
                continue
            among = allowed if isolated.among is None else isolated.among if allowed is None \
                else isolated.among & allowed
            candidate = failover_candidate(group, soft, now_ms, lease_ms, heard_only=True, among=among)
        elif not judge_silence:
            continue
        else:
            candidate = failover_candidate(group, soft, now_ms, lease_ms, among=allowed)
        if candidate is None:
            continue
        if group.leader is None:
            reason, cause = "leader_unassigned", "unassigned"
        elif isolated is not None:
            reason, cause = isolated.reason, "isolated"
        elif restarted:
            reason, cause = f"leader {group.leader} holds term {group.term} as a follower (restarted)", "restarted"
        elif lead_report is not None and lead_report.resyncing:
            reason, cause = f"leader {group.leader} lost its log and re-syncs", "unusable"
        elif lead_report is not None and lead_report.failed is not None:
            reason, cause = f"leader {group.leader}'s replica failed: {lead_report.failed}", "unusable"
        else:
            reason, cause = f"leader {group.leader} silent for {grace} ms", "silent"
        actions.append(SetLeader(group.id, candidate, group.term, reason, cause))
    return actions
