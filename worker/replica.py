"""The replication core of one shard group, sans-I/O.

`Replica.handle(msg_or_event, now) -> list[Effect]` is a pure state machine in
the style of etcd's `raft`: no sockets, files, clocks, randomness or logging.
Time comes in as `now`: integer milliseconds of this replica's monotonic
clock, non-decreasing within an incarnation, never compared with another
replica's (a restart may begin anywhere); everything the outside world must
do comes out as effects (see worker/replica_msgs.py).

Model
-----
Raft log replication with leader election replaced by meta-assigned terms.
Meta compare-and-sets `term = expect + 1` with a named leader, so a term has
exactly one leader; replicas learn terms from MetaView events (late, out of
order or never).  Meta may name any replica, even a stale one, so the new
leader first runs a start-of-term round (like Viewstamped Replication's view
change):

1. persist T, send Begin(T) to the voters; a replica that accepts persists T
   before answering (BeginOk: its last (term, seq) and commit) and from then
   on rejects older terms;
2. with a majority of the voters meta named (and of the voters of the newest
   config entry in the leader's log, when meta has not recorded that one
   yet), adopt the most up-to-date log among them (greatest last term, then
   seq), fetching what is missing (Fetch/FetchReply);
3. append a term-start entry and replicate it; once it commits, everything
   before it is committed, the leader is ready: it reports ReportReady(T)
   and admits writes and strong reads.

Commit rule: an entry of the current term commits once a majority of voters
hold it durably; earlier entries commit with it, never by counting replicas
(Raft §5.4.2, Figure 8).  Learners receive appends and never count.

Durability contract with the I/O shell
--------------------------------------
* The shell performs effects in the order they are returned, across calls,
  and performs no effect before every `Persist` returned earlier (in this or
  any earlier call) is durable according to the fsync mode.  It may coalesce
  consecutive Persists (group commit): run more handle() calls while an fsync
  is in flight and queue their effects behind it.
* Hence the leader counts its own append as durable the moment it emits the
  Persist: whatever depends on it (replies, Apply, a commit index that
  counts it) is queued behind that Persist.  A follower's AppendReply, a
  BeginOk and any answer at a newly adopted term likewise follow the Persist
  they vouch for.
* Effects returned *before* a Persist may be performed before it is
  durable.  The leader uses that for fresh entries: the Appends carrying a
  new client entry come before the Persist of that entry, so followers write
  it while the leader does (the leader writing its log in parallel with
  replicating, Raft dissertation §10.2.1).  That is safe because those
  Appends carry only a commit index computed before the entry existed, and
  a leader that loses the unsynced entry in a crash never leads that term
  again (a term starts only above the durable one): the entry is then
  merely uncommitted, kept or dropped by the next leader's Begin round.
* Within one Persist: record the term first, then install the snapshot
  (drop entries up to its seq), drop entries after `truncate_after`, append
  `entries`, record `commit`.  A torn Persist is harmless: nothing that
  depends on it has been performed.

Check-quorum
------------
Meta names leaders, but meta can still hear a leader its followers cannot
(a cut between workers, or one direction of it): that leader would hold its
group down for as long as the cut lasts.  So a leader keeps the time of the
last reply from each voter (AppendReply, HeartbeatReply; the idle
heartbeat makes one every heartbeat_ms).  Without replies from a majority
(itself included) within `lease_ms` -- or, while it collects promises, with
no majority of them within `lease_ms` of starting the term -- it stops
admitting writes, strong reads, transfers and membership changes (NO_QUORUM,
at once, instead of a quorum_timeout later), answers the writes it was
waiting on with QUORUM_TIMEOUT (their outcome is unknown), and emits
ReportQuorum(ok=False) so that the shell tells meta; meta's controller then
names another leader (meta/controller.py).  It keeps sending, and the first
replies from a majority make it admit again (ReportQuorum(ok=True)).  A
follower keeps the time it last heard from its term's leader
(`leader_heard_at`), and the shell reports that silence to meta as well: a
leader whose replica is wedged cannot report anything itself.

Log time
--------
Entry timestamps (`Entry.ts`, what dedup expiry compares) are the group's
log time, not anybody's wall clock: a leader stamps the term-start entry
with the last timestamp of the log it adopted, and every later entry with
that plus the time elapsed since, on its own monotonic clock.  Along the log
timestamps never decrease, and log time never runs faster than real time
(the gaps between leaders are not counted at all): so a request id is
remembered for at least `dedup_window_ms` of real time after its write was
appended, whatever the wall clocks of the workers say, stepped or skewed by
hours (runbook/operations.md, "request ids").

Terms come from meta
--------------------
A replica adopts a term only from a MetaView (the term cap: never above what
meta has published for the group).  Its term is therefore at least the
highest term any view showed it, and a message from a higher term is one
meta has not shown it yet: it is not acted on (no term persisted, no
leader stepping down); the core asks the shell for meta's current view
(NeedMetaView) and keeps the message.  When a view shows that term the kept
message is handled, if it came from the leader the view names, so the
usual race (a new leader's Begin arriving before this replica's view)
costs one fetch from meta, not a retransmit.  Without this, one forged
message with a high term would fence the real leader and persist a term
meta can only reach one compare-and-set at a time: the group would stay
leaderless.

Idempotency
-----------
Entries carry the client's request id; a replicated DedupTable (worker/
dedup.py), derived from the applied log and the snapshot, remembers
rid -> seq.  A write whose rid is applied is answered with its original seq;
one whose rid is pending in the log is attached to that entry.  Writes that
arrive together (ClientWriteMany) share one "ops" entry, which carries one
rid per op; those new to the log wait as one and succeed as one ReplyMany.

Membership
----------
One change at a time, as single-server changes (Raft §4.2 of the
dissertation): a config entry takes effect when appended.  A new change is
refused until the previous one has committed *and* meta has recorded it
(MetaView.conf_ver), so meta's voters are never more than one change behind
the log; that is what lets the start-of-term round rely on meta's voter set.
Only a ready leader changes membership, which also gives Ongaro's fix (an
entry of the leader's term commits before any config change).

Snapshots
---------
With `snapshot_every` set, the core picks snapshot points itself: it ends an
Apply at the entry that completes that many client writes and asks for
`TakeSnapshot(seq)`, keeping the SnapshotMeta as of seq (cheap then, a
replay of the dedup table later).  The shell snapshots the plugin and
answers `Compact(seq)`; it may also send Compact at any applied seq.
`Compact(seq)` drops the log up to seq, keeping a SnapshotMeta (term, seq,
dedup table, config); a leader holds it back, for at most compact_hold_ms,
while a follower still lacks entries it would drop.  A follower whose next
entry the leader no longer has gets SnapshotNeeded; it emits DownloadSnapshot,
and the shell answers with SnapshotInstalled once the plugin has been restored.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.dedup import DedupTable
from worker.replica_msgs import (
    BAD_REQUEST,
    BUSY,
    DEADLINE_EXCEEDED,
    LAGGING,
    NO_QUORUM,
    NOT_LEADER,
    QUORUM_TIMEOUT,
    Append,
    AppendReply,
    Apply,
    Begin,
    BeginOk,
    ChangeMembership,
    ClientRead,
    ClientWrite,
    ClientWriteMany,
    Compact,
    Config,
    DownloadSnapshot,
    Effect,
    Entry,
    Event,
    Fetch,
    FetchReply,
    Heartbeat,
    HeartbeatReply,
    Message,
    MetaView,
    NeedMetaView,
    Persist,
    ReplicaConfig,
    Reply,
    ReplyMany,
    ReportQuorum,
    ReportReady,
    Send,
    ServeRead,
    SetTimer,
    SnapshotInstalled,
    SnapshotMeta,
    SnapshotNeeded,
    StaleTerm,
    StoredState,
    TakeSnapshot,
    Tick,
    TransferLeader,
    TransferReady,
    entry_rids,
)

__all__ = ["Replica"]

# Leadership phases, in order.  Only _Ready admits writes and strong reads.
# Each holds only what means something in that phase, so that state left over
# from an earlier phase cannot be read by mistake (slots: an AttributeError).


@dataclass(slots=True)
class _Begin:
    """Collecting BeginOk from a majority."""

    retry_at: int = 0  # when Begin goes again to those that have not promised


@dataclass(slots=True)
class _Fetch:
    """Copying the most up-to-date log of the majority that promised."""

    src: str  # the voter that promised that log
    goal: tuple[int, int]  # (term, seq) of its last entry, as promised
    prev: int  # our next Fetch asks for what follows this seq
    heard_at: int  # the source's last answer: silent for lease_ms, we ask a majority again
    retry_at: int = 0


@dataclass(frozen=True, slots=True)
class _Starting:
    """Term-start entry appended, not yet committed."""

    term_start_seq: int


@dataclass(frozen=True, slots=True)
class _Ready:
    """Term-start entry committed: every earlier leader's acknowledged write is
    in our committed log, so writes and strong reads are admitted."""


_Phase = _Begin | _Fetch | _Starting | _Ready

# The only phase changes there are (h11's _state.py style); _Leadership.enter
# refuses any other, as a bug.  A failed fetch goes back to collecting
# promises; a leader leaves _Ready only by stepping down (the _Leadership goes).
_TRANSITIONS: dict[type, frozenset[type]] = {
    _Begin: frozenset({_Fetch, _Starting}),  # _Starting: we hold the best log already
    _Fetch: frozenset({_Begin, _Starting}),
    _Starting: frozenset({_Ready}),
    _Ready: frozenset(),
}


@dataclass(slots=True)
class _Progress:
    """The leader's view of one follower."""

    match: int = 0  # highest seq known to equal ours, durably
    next: int = 1  # first seq to send
    inflight: int | None = None  # last seq covered by the outstanding Append / snapshot
    inflight_prev: int = -1  # prev_seq of the outstanding Append
    retry_at: int = 0
    told_commit: int = 0  # highest commit we sent it that it can use (bounded by what we sent it)
    told_at: int = 0  # when we last sent it an Append or a Heartbeat
    heard_at: int = 0  # when its last reply arrived (check-quorum)


@dataclass(slots=True)
class _WriteWaiter:
    req: Any  # with `many`, a tuple: the reqs of positions 0.. of the "ops" entry at seq
    seq: int
    ack: str
    deadline: int
    done: bool = False
    idx: int | None = None
    many: bool = False


@dataclass(slots=True)
class _Read:
    req: Any
    at_seq: int
    deadline: int


@dataclass(slots=True)
class _Transfer:
    target: str
    deadline: int
    reported: bool = False


@dataclass(slots=True)
class _Leadership:
    """Everything that exists only while this replica leads its term."""

    quorums: tuple[tuple[str, ...], ...]  # Begin needs a majority of each
    begin_to: tuple[str, ...]
    # The fields below span phases.  started_at and promised belong to the
    # latest Begin round, yet outlive it: _Fetch and after report who never
    # promised (unheard_voters), and a follower's progress, made in
    # _Starting or later, counts a promise as a round trip and its log end
    # as a likely match point.
    started_at: int  # when the Begin round (re)started
    phase: _Phase = field(default_factory=_Begin)  # changed only by enter()
    promised: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Log time: entries are stamped ts_base + (now - now_base) (see "Log time").
    # Set on entering _Starting, read by every append after it.
    ts_base: int = 0
    now_base: int = 0
    # Check-quorum applies in every phase (each phase decides what counts as
    # contact: _quorum_contact).  False while no majority answered within lease_ms.
    quorum_ok: bool = True
    quorum_lost_at: int | None = None
    # Until then the quorum holds even if no reply comes (0: look now). Every
    # event asks; this keeps the answer a comparison on the write path.
    quorum_until: int = 0
    # Heartbeats go out in every phase (to begin_to while collecting promises
    # or fetching, so voters do not report us silent), on one schedule.
    next_heartbeat: int = 0
    # Leading proper (_Starting, _Ready).  Empty before: the handlers that
    # read them in earlier phases (heartbeat replies, a lost quorum failing
    # waiters) then find nothing to do.
    progress: dict[str, _Progress] = field(default_factory=dict)
    notice_at: int | None = None  # when a follower that lags our commit is told it
    waiters: dict[int, list[_WriteWaiter]] = field(default_factory=dict)
    waiter_seqs: list[int] = field(default_factory=list)  # heap of keys of `waiters`
    waiter_deadlines: deque[_WriteWaiter] = field(default_factory=deque)
    all_waiters: list[_WriteWaiter] = field(default_factory=list)
    read_round: int = 0
    round_inflight: bool = False
    round_started: int = 0
    round_acks: set[str] = field(default_factory=set)
    round_reads: list[_Read] = field(default_factory=list)
    next_reads: list[_Read] = field(default_factory=list)
    confirmed_reads: list[_Read] = field(default_factory=list)
    transfer: _Transfer | None = None

    @property
    def ready(self) -> bool:
        return isinstance(self.phase, _Ready)

    def enter(self, phase: _Phase) -> None:
        """Move to `phase`: the one place a phase changes."""
        if type(phase) not in _TRANSITIONS[type(self.phase)]:
            raise AssertionError(
                f"leadership phase {type(self.phase).__name__} -> {type(phase).__name__} is not a transition"
            )
        self.phase = phase


_HANDLERS: dict[type, str] = {
    MetaView: "_on_meta_view",
    ClientWrite: "_on_client_write",
    ClientWriteMany: "_on_client_write_many",
    ClientRead: "_on_client_read",
    Tick: "_on_tick",
    TransferLeader: "_on_transfer_leader",
    ChangeMembership: "_on_change_membership",
    Compact: "_on_compact",
    SnapshotInstalled: "_on_snapshot_installed",
    Begin: "_on_begin",
    BeginOk: "_on_begin_ok",
    StaleTerm: "_on_stale_term",
    Fetch: "_on_fetch",
    FetchReply: "_on_fetch_reply",
    Append: "_on_append",
    AppendReply: "_on_append_reply",
    Heartbeat: "_on_heartbeat",
    HeartbeatReply: "_on_heartbeat_reply",
    SnapshotNeeded: "_on_snapshot_needed",
}


class Replica:
    """One replica of one shard group.  See the module docstring."""

    def __init__(self, node_id: str, group: int, config: ReplicaConfig, stored: StoredState) -> None:
        self._id = node_id
        self._group = group
        self._cfg = config
        self._term = stored.term
        snap = stored.snapshot
        self._snap: SnapshotMeta | None = snap
        self._snap_seq = snap.seq if snap is not None else 0
        self._snap_term = snap.term if snap is not None else 0
        log = [e for e in stored.entries if e.seq > self._snap_seq]
        for i, e in enumerate(log):
            if e.seq != self._snap_seq + 1 + i:
                raise ValueError(f"stored log is not contiguous at seq {e.seq}")
        self._log: list[Entry] = log
        # The stored commit may be stale (or, after a power loss, ahead of the
        # surviving log); clamping it is safe because it only ever grows back
        # from the leader.
        self._commit = max(self._snap_seq, min(stored.commit, self.last_seq))
        self._persisted_commit = stored.commit
        self._resyncing = stored.resync
        self._applied = self._snap_seq
        self._dedup = self._dedup_from(snap)
        self._configs: list[tuple[int, Config]] = [(e.seq, e.data) for e in log if e.kind == "config"]
        self._pending_rids: dict[str, int] = {rid: e.seq for e in log for rid in entry_rids(e)}
        self._view: MetaView | None = None
        self._leader: str | None = None
        self._lead: _Leadership | None = None
        self._follower_reads: list[_Read] = []
        # When this replica last heard from the leader of its term (or, until
        # it does, learned of the term): the silence the shell reports to meta.
        self._heard_leader_at: int | None = None
        self._timer_at: int | None = None
        self._config_cache: Config | None = None
        # A Compact the leader holds back while a follower still needs the
        # entries it would drop (see _on_compact).
        self._compact_meta: SnapshotMeta | None = None
        self._compact_asked = 0
        # The SnapshotMetas of the latest TakeSnapshot points, made while the
        # dedup table was exactly there (rebuilding one later costs a replay).
        self._prepared: dict[int, SnapshotMeta] = {}
        self._since_snapshot = 0  # client writes applied since the last TakeSnapshot
        # A request from a term meta has not shown us yet, handled once a
        # view shows it (see "Terms come from meta"); and our last ask for
        # that view: (term, when).
        self._deferred: Message | None = None
        self._view_asked: tuple[int, int] | None = None
        self._now = 0
        self._out: list[Effect] = []

    # ------------------------------------------------------------------
    # Read-only state

    @property
    def node_id(self) -> str:
        return self._id

    @property
    def group(self) -> int:
        return self._group

    @property
    def term(self) -> int:
        return self._term

    @property
    def leader(self) -> str | None:
        return self._leader

    @property
    def role(self) -> str:
        lead = self._lead
        if lead is not None:
            return "leader" if lead.ready else "candidate"
        if self._id in self._config().learners:
            return "learner"
        return "follower"

    @property
    def ready(self) -> bool:
        return self._lead is not None and self._lead.ready

    @property
    def has_quorum(self) -> bool:
        """False while this replica leads without round trips with a majority
        of its voters within lease_ms (check-quorum); True otherwise."""
        return self._lead is None or self._lead.quorum_ok

    @property
    def unheard_voters(self) -> tuple[str, ...]:
        """The voters a leader has had no answer from within lease_ms (while it
        collects promises: those that have not promised); () when not leading.
        Meta picks a successor among them: they are the far side of a cut."""
        lead = self._lead
        if lead is None:
            return ()
        if isinstance(lead.phase, (_Begin, _Fetch)):
            return tuple(v for v in lead.begin_to if v not in lead.promised)
        now, lease = self._now, self._cfg.lease_ms
        return tuple(v for v in self._config().voters
                     if v != self._id and ((pr := lead.progress.get(v)) is None or now - pr.heard_at >= lease))

    @property
    def quorum_lost_at(self) -> int | None:
        """When (on this replica's clock) a leader lost its quorum, if it has."""
        return self._lead.quorum_lost_at if self._lead is not None else None

    @property
    def leader_heard_at(self) -> int | None:
        """When (on this replica's clock) a non-leader last heard from its
        term's leader, or learned of the term; None while leading or before
        it knows of any."""
        return None if self._lead is not None else self._heard_leader_at

    @property
    def last_seq(self) -> int:
        return self._snap_seq + len(self._log)

    @property
    def last_term(self) -> int:
        return self._log[-1].term if self._log else self._snap_term

    @property
    def commit_seq(self) -> int:
        return self._commit

    @property
    def applied_seq(self) -> int:
        return self._applied

    @property
    def resyncing(self) -> bool:
        """True while this replica re-syncs after losing its log (it neither votes nor leads)."""
        return self._resyncing

    @property
    def config_seq(self) -> int:
        """Seq of the newest config entry in the log or snapshot (0: the
        bootstrap configuration meta assigned).  Committed once
        `config_seq <= commit_seq`; meta records it as the group's conf_ver."""
        lc = self._log_config()
        return lc[0] if lc is not None else 0

    def accepts_snapshot(self, seq: int) -> bool:
        """Would `SnapshotInstalled` at `seq` be taken now?  The shell asks
        before it restores the plugin, so that a snapshot the core would
        ignore never replaces applied state."""
        lead = self._lead
        return seq > self._applied and (lead is None or isinstance(lead.phase, _Fetch))

    @property
    def snapshot_seq(self) -> int:
        return self._snap_seq

    @property
    def voters(self) -> tuple[str, ...]:
        return self._config().voters

    @property
    def learners(self) -> tuple[str, ...]:
        return self._config().learners

    @property
    def transfer_target(self) -> str | None:
        lead = self._lead
        return lead.transfer.target if lead is not None and lead.transfer is not None else None

    def term_at(self, seq: int) -> int | None:
        """Term of the entry at `seq`; None when it is compacted or absent."""
        if seq == self._snap_seq:
            return self._snap_term
        i = seq - self._snap_seq - 1
        if i < 0 or i >= len(self._log):
            return None
        return self._log[i].term

    def entries(self, lo: int, hi: int) -> list[Entry]:
        """Entries with lo <= seq <= hi that are still in the log."""
        base = self._snap_seq + 1
        return self._log[max(lo - base, 0) : max(hi - base + 1, 0)]

    def _writes_in(self, e: Entry) -> int:
        """Client writes in `e` (0 for the core's own entries)."""
        weight = self._cfg.op_weight
        if e.kind == "op":
            return 1 if weight is None else weight(e.data)
        if e.kind == "ops":
            return len(e.data) if weight is None else sum(map(weight, e.data))
        return 0

    def _batch_from(self, lo: int) -> list[Entry]:
        """The entries one Append or FetchReply carries from `lo`: at most
        `max_batch_entries`, at most `max_batch_ops` client writes (an
        "ops" entry counts its ops) and at most `max_batch_bytes` encoded
        (when `entry_bytes` measures them), unless the first entry alone
        is over, so a lagging follower is caught up in bounded messages."""
        batch = self.entries(lo, lo + self._cfg.max_batch_entries - 1)
        budget = self._cfg.max_batch_ops
        # A lone entry goes whatever its size: not measured.
        size_of = self._cfg.entry_bytes if len(batch) > 1 else None
        room = self._cfg.max_batch_bytes
        for i, e in enumerate(batch):
            budget -= self._writes_in(e) or 1
            if budget < 0 and i > 0:
                return batch[:i]
            if size_of is not None:
                room -= size_of(e)
                if room < 0 and i > 0:
                    return batch[:i]
        return batch

    # ------------------------------------------------------------------
    # The single entry point

    def handle(self, msg: Message | Event, now: int) -> list[Effect]:
        name = _HANDLERS.get(type(msg))
        if name is None:
            raise TypeError(f"replica cannot handle {type(msg).__name__}")
        if isinstance(msg, Message) and (msg.dst != self._id or msg.group != self._group):
            return []
        self._now = now
        self._out = []
        getattr(self, name)(msg)
        self._settle()
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------
    # Decisions a test may override (tests/tier1/test_replica_planted_bugs.py)

    def _counts_for_commit(self, seq: int) -> bool:
        """May replica counting commit `seq`?  Only for entries of our own
        term: an older entry held by a majority can still be overwritten by
        a leader that never saw it (Raft Figure 8)."""
        return self.term_at(seq) == self._term

    def _begin_round_required(self) -> bool:
        """Must a new leader collect promises and adopt the best log first?
        Always: meta may have named a stale replica."""
        return True

    def _adopts_message_terms(self) -> bool:
        """May a message's higher term be adopted on its word?  Never: only
        meta publishes terms (see "Terms come from meta")."""
        return False

    def _ack_durable(self, msg: Message) -> None:
        """Send an answer that vouches for state persisted in this call.  It
        must follow the Persist (the shell performs effects in order)."""
        self._send(msg)

    def _next_ts(self) -> int:
        """The log time of an entry this leader appends now: the adopted
        log's last timestamp when the term started, plus our monotonic time
        since then (see "Log time").  A wall clock here would let one fast
        clock expire every request id the group remembers."""
        lead = self._lead
        assert lead is not None
        return lead.ts_base + (self._now - lead.now_base)

    def _quorum_contact(self, lead: _Leadership) -> bool:
        """Has this leader heard from a majority of its voters within lease_ms?"""
        if isinstance(lead.phase, _Begin):
            return self._now - lead.started_at < self._cfg.lease_ms
        if isinstance(lead.phase, _Fetch):
            # A majority promised; the fetch goes to one of them, and a source
            # silent for a lease sends us back to _Begin (_on_tick).
            return True
        return self._contact_majority(lead, self._config().voters)

    def _contact_majority(self, lead: _Leadership, voters: Sequence[str]) -> bool:
        """Did a majority of `voters` (we count if we are one) answer within lease_ms?"""
        now, lease = self._now, self._cfg.lease_ms
        fresh = 0
        for v in voters:
            if v == self._id:
                fresh += 1
            else:
                pr = lead.progress.get(v)
                if pr is not None and now - pr.heard_at < lease:
                    fresh += 1
        return 2 * fresh > len(voters) or not voters

    # ------------------------------------------------------------------
    # Effect helpers

    def _send(self, msg: Message) -> None:
        self._out.append(Send(msg))

    def _persist(
        self,
        *,
        term: int | None = None,
        entries: Sequence[Entry] = (),
        truncate_after: int | None = None,
        snapshot: SnapshotMeta | None = None,
    ) -> None:
        out = self._out
        last = out[-1] if out else None
        # Folding into the previous Persist keeps one call one fsync; it is
        # allowed when the combined Persist, applied in its fixed order
        # (term, snapshot, truncate, entries), equals the two in sequence.
        if type(last) is Persist:
            if truncate_after is None and snapshot is None:
                if term is not None:
                    last.term = term
                if entries:
                    last.entries = last.entries + tuple(entries)
                return
            if not last.entries and last.truncate_after is None and last.snapshot is None:
                if term is not None:
                    last.term = term
                last.snapshot, last.truncate_after, last.entries = snapshot, truncate_after, tuple(entries)
                return
        out.append(Persist(term=term, entries=tuple(entries), truncate_after=truncate_after, snapshot=snapshot))

    def _reply_error(self, req: Any, code: str, leader: str | None) -> None:
        self._out.append(Reply(req, False, 0, self._term, code, leader))

    # ------------------------------------------------------------------
    # Log primitives

    def _log_append(self, entries: Sequence[Entry]) -> None:
        if entries and entries[0].seq != self.last_seq + 1:
            raise AssertionError(f"{self._id}: appending seq {entries[0].seq} after {self.last_seq}")
        self._log.extend(entries)
        for e in entries:
            if e.kind == "config":
                self._configs.append((e.seq, e.data))
                self._config_cache = None
            elif e.rid is not None:
                for rid in entry_rids(e):
                    self._pending_rids[rid] = e.seq

    def _drop_after(self, seq: int) -> None:
        """Drop the suffix after `seq`.  A committed entry is never dropped:
        asked to, we have a bug (or a corrupted peer), and stopping beats
        diverging (papering over split histories loses writes silently)."""
        if seq < self._commit:
            raise AssertionError(
                f"{self._id}: asked to truncate after {seq} but {self._commit} is committed"
            )
        del self._log[seq - self._snap_seq :]
        if self._configs and self._configs[-1][0] > seq:
            self._configs = [c for c in self._configs if c[0] <= seq]
            self._config_cache = None
        if any(s > seq for s in self._pending_rids.values()):
            self._pending_rids = {r: s for r, s in self._pending_rids.items() if s <= seq}

    def _merge(self, entries: Sequence[Entry]) -> None:
        """Log matching (Raft §5.3): keep what agrees, cut at the first
        entry that disagrees by (term, seq), append the rest; persist."""
        last = self.last_seq
        cut: int | None = None
        i, n = 0, len(entries)
        while i < n:
            e = entries[i]
            if e.seq > last:
                break
            if e.seq > self._snap_seq and self.term_at(e.seq) != e.term:
                cut = e.seq - 1
                self._drop_after(cut)
                break
            i += 1
        new = entries[i:]
        if cut is None and not new:
            return
        self._log_append(new)
        self._persist(truncate_after=cut, entries=new)

    def _find_conflict_by_term(self, seq: int, term: int) -> int:
        """The largest s <= seq whose entry has a term <= `term`: nothing
        after it can match a log whose entry at `seq` has term `term`, so a
        whole term is skipped per round trip instead of one entry."""
        s = min(seq, self.last_seq)
        base = self._snap_seq + 1
        log = self._log
        while s > self._snap_seq and log[s - base].term > term:
            s -= 1
        return max(s, self._snap_seq)

    def _mismatch(self, prev_seq: int, prev_term: int) -> tuple[int, int] | None:
        """None when our log has (prev_term, prev_seq); else the (seq, term)
        hint the sender should back up to."""
        if prev_seq > self.last_seq:
            return self.last_seq, self.last_term
        if prev_seq < self._snap_seq:
            # Compacted entries are committed, hence in every leader's log
            # (callers that may hold uncommitted entries there, i.e. Fetch,
            # never get here).  At the snapshot point itself the term is
            # known and is compared like any other.
            return None
        if self.term_at(prev_seq) == prev_term:
            return None
        s = self._find_conflict_by_term(prev_seq, prev_term)
        return s, self.term_at(s) or 0

    def _config(self) -> Config:
        """The configuration in force: the newest config entry in the log (or
        the snapshot), else the bootstrap one meta assigned."""
        cfg = self._config_cache
        if cfg is None:
            lc = self._log_config()
            if lc is not None:
                cfg = lc[1]
            elif self._view is not None:
                cfg = Config(tuple(self._view.voters), tuple(self._view.learners))
            else:
                cfg = Config(())
            self._config_cache = cfg
        return cfg

    def _log_config(self) -> tuple[int, Config] | None:
        if self._configs:
            return self._configs[-1]
        if self._snap is not None and self._snap.config is not None:
            return self._snap.config_seq, self._snap.config
        return None

    def _dedup_from(self, snap: SnapshotMeta | None) -> DedupTable:
        if snap is None:
            return DedupTable(self._cfg.dedup_window_ms, self._cfg.dedup_max)
        return DedupTable(self._cfg.dedup_window_ms, self._cfg.dedup_max, snap.dedup, snap.ts)

    # ------------------------------------------------------------------
    # Terms

    def _adopt_term(self, term: int, leader: str | None) -> None:
        """Move to a newer term, from meta's view, as a follower.  The promise
        to ignore older terms is persisted before anything is answered at `term`."""
        self._step_down(leader)
        self._term = term
        self._leader = leader
        self._heard_leader_at = self._now  # the silence clock starts with the term
        self._persist(term=term)

    def _accept_term(self, msg: Message) -> bool:
        """Gate for requests from a (would-be) leader: answer StaleTerm and
        return False when the sender is behind us."""
        if msg.term < self._term:
            self._send(StaleTerm(src=self._id, dst=msg.src, group=self._group, term=self._term))
            return False
        if msg.term > self._term:
            if not self._adopts_message_terms():
                self._defer(msg)
                return False
            self._adopt_term(msg.term, msg.src)
        elif self._leader is None and self._lead is None:
            self._leader = msg.src
        if msg.src == self._leader:
            self._heard_leader_at = self._now
        return True

    def _defer(self, msg: Message) -> None:
        """Keep a request from a term above ours for when meta's view shows
        that term, and ask for the view.

        One is kept: the one of the lowest such term (the next term meta can
        publish is ours + 1; a forger's higher terms must not push out the
        real next leader's message), the latest of equal terms."""
        kept = self._deferred
        if kept is None or kept.term <= self._term or msg.term <= kept.term:
            self._deferred = msg
        self._need_view(msg.term)

    def _need_view(self, term: int) -> None:
        """Ask the shell for meta's view: at once for a term above any asked
        about, else at most once per retry_ms (the sender retransmits, and
        meta may not have published the term yet when we first ask)."""
        asked = self._view_asked
        if asked is None or term > asked[0] or self._now >= asked[1] + self._cfg.retry_ms:
            self._view_asked = (max(term, asked[0]) if asked is not None else term, self._now)
            self._out.append(NeedMetaView(term))

    def _handle_deferred(self) -> None:
        """After a view: handle the kept request if the view brought its term
        and named its sender leader; drop it once it cannot be."""
        kept = self._deferred
        if kept is None or kept.term > self._term:
            return
        self._deferred = None
        if kept.term == self._term and kept.src == self._leader and self._lead is None:
            getattr(self, _HANDLERS[type(kept)])(kept)

    def _step_down(self, new_leader: str | None) -> None:
        """Leave leadership: every pending write has an unknown outcome now."""
        lead = self._lead
        if lead is None:
            return
        self._lead = None
        for w in lead.waiter_deadlines:
            if not w.done:
                w.done = True
                self._fail_waiter(w, QUORUM_TIMEOUT, new_leader)
        for r in (*lead.round_reads, *lead.next_reads, *lead.confirmed_reads):
            self._reply_error(r.req, NOT_LEADER, new_leader)

    def _on_stale_term(self, m: StaleTerm) -> None:
        if m.term > self._term:
            if self._adopts_message_terms():
                self._adopt_term(m.term, None)
            # Meta has moved on, or this is forged: its view decides, and
            # (adopted from the view) fences us.
            self._need_view(m.term)

    # ------------------------------------------------------------------
    # Meta's view and the start of a term

    def _on_meta_view(self, v: MetaView) -> None:
        cur = self._view
        if cur is not None and (v.term, v.conf_ver) < (cur.term, cur.conf_ver):
            return  # an older view delivered late
        self._view = v
        if self._log_config() is None:
            self._config_cache = None
        if v.term > self._term:
            if v.leader == self._id and self._id in v.voters and not self._resyncing:
                self._start_term(v)
            else:
                # Adopting meta's term fences the old leader sooner.
                self._adopt_term(v.term, v.leader if v.leader != self._id else None)
                self._announce()
        elif v.term == self._term and self._leader is None and v.leader != self._id:
            self._leader = v.leader
            if self._heard_leader_at is None:
                self._heard_leader_at = self._now
            self._announce()
        self._handle_deferred()

    def _announce(self) -> None:
        """Tell the leader meta named what commit we know.

        We may have restarted: the leader believes we know what it told our
        previous incarnation, and in an idle group it would tell us again only
        at the next heartbeat. A leader not leading this term yet ignores it."""
        if self._leader is not None:
            self._send(HeartbeatReply(src=self._id, dst=self._leader, group=self._group, term=self._term,
                                      round=0, commit=self._commit))

    def _start_term(self, view: MetaView) -> None:
        self._adopt_term(view.term, self._id)
        quorums = [tuple(view.voters)]
        lc = self._log_config()
        if lc is not None and lc[0] > view.conf_ver and set(lc[1].voters) != set(view.voters):
            # Our log holds a config meta has not recorded yet; it may
            # already be committed, so its voters must be asked too.
            quorums.append(lc[1].voters)
        ask = tuple(dict.fromkeys(v for q in quorums for v in q if v != self._id))
        lead = _Leadership(quorums=tuple(quorums), begin_to=ask, started_at=self._now)
        lead.promised[self._id] = (self.last_term, self.last_seq)
        self._lead = lead
        if not self._begin_round_required():
            self._start_replicating()
            return
        self._send_begins()
        self._maybe_finish_begin()

    def _send_begins(self) -> None:
        lead = self._lead
        assert lead is not None
        for peer in lead.begin_to:
            if peer not in lead.promised:
                self._send(Begin(src=self._id, dst=peer, group=self._group, term=self._term))
        phase = lead.phase
        assert isinstance(phase, _Begin)
        phase.retry_at = self._now + self._cfg.retry_ms

    def _on_begin(self, m: Begin) -> None:
        if self._lead is not None and m.term == self._term:
            return  # a term has one leader; this cannot be for us
        if not self._accept_term(m):
            return
        if self._resyncing:
            # Our log may lack entries we once acknowledged: a promise from
            # us could let a majority without them elect a leader.
            return
        self._ack_durable(
            BeginOk(
                src=self._id,
                dst=m.src,
                group=self._group,
                term=self._term,
                last_term=self.last_term,
                last_seq=self.last_seq,
                commit=self._commit,
            )
        )

    def _on_begin_ok(self, m: BeginOk) -> None:
        lead = self._lead
        if lead is None or m.term != self._term or not isinstance(lead.phase, _Begin):
            return
        lead.promised[m.src] = (m.last_term, m.last_seq)
        self._maybe_finish_begin()

    @staticmethod
    def _is_majority(voters: Sequence[str], have: set[str] | dict[str, Any]) -> bool:
        return 2 * sum(1 for v in voters if v in have) > len(voters)

    def _maybe_finish_begin(self) -> None:
        lead = self._lead
        assert lead is not None
        if not all(self._is_majority(q, lead.promised) for q in lead.quorums):
            return
        # Ties prefer ourselves: an equal (term, seq) is an identical log.
        best, (bt, bs) = max(lead.promised.items(), key=lambda kv: (kv[1], kv[0] == self._id))
        if (bt, bs) == (self.last_term, self.last_seq):
            self._start_replicating()
            return
        lead.enter(_Fetch(src=best, goal=(bt, bs), prev=self._find_conflict_by_term(bs, bt), heard_at=self._now))
        lead.quorum_until = 0
        self._send_fetch()

    # ------------------------------------------------------------------
    # Adopting the best log (phase _Fetch)

    def _send_fetch(self) -> None:
        lead = self._lead
        assert lead is not None
        phase = lead.phase
        assert isinstance(phase, _Fetch)
        prev = phase.prev
        self._send(
            Fetch(
                src=self._id,
                dst=phase.src,
                group=self._group,
                term=self._term,
                prev_term=self.term_at(prev) or 0,
                prev_seq=prev,
            )
        )
        phase.retry_at = self._now + self._cfg.retry_ms

    def _on_fetch(self, m: Fetch) -> None:
        if self._lead is not None and m.term == self._term:
            return
        if not self._accept_term(m):
            return
        env = dict(src=self._id, dst=m.src, group=self._group, term=self._term)
        if m.prev_seq < self._snap_seq:
            # The entries after prev_seq are gone here: send the snapshot.
            self._send(SnapshotNeeded(**env, snap_term=self._snap_term, snap_seq=self._snap_seq))
            return
        miss = self._mismatch(m.prev_seq, m.prev_term)
        if miss is not None:
            self._send(
                FetchReply(
                    **env, ok=False, prev_seq=m.prev_seq, prev_term=m.prev_term, hint_seq=miss[0], hint_term=miss[1]
                )
            )
            return
        batch = self._batch_from(m.prev_seq + 1)
        self._send(FetchReply(**env, ok=True, prev_seq=m.prev_seq, prev_term=m.prev_term, entries=tuple(batch)))

    def _on_fetch_reply(self, m: FetchReply) -> None:
        lead = self._lead
        phase = lead.phase if lead is not None else None
        if (
            m.term != self._term
            or not isinstance(phase, _Fetch)
            or m.src != phase.src
            or m.prev_seq != phase.prev
            or m.prev_term != (self.term_at(m.prev_seq) or 0)
        ):
            return  # not the answer to our current question
        phase.heard_at = self._now
        if m.ok:
            if not m.entries and m.prev_seq < phase.goal[1]:
                self._restart_begin()  # the source no longer has the log it promised
                return
            self._merge(m.entries)
            phase.prev = m.prev_seq + len(m.entries)
        else:
            back = min(self._find_conflict_by_term(m.hint_seq, m.hint_term), m.prev_seq - 1)
            if back < self._commit:
                # The source disagrees with what we know is committed: it
                # lost its log since it promised (a replaced disk comes back
                # re-syncing). Its promise is void; ask the voters again.
                self._restart_begin()
                return
            phase.prev = back
        self._continue_fetch()

    def _restart_begin(self) -> None:
        """Collect promises again, with this replica's log as it is now.

        What was fetched so far came from the best log of a majority, so it
        stays; a replica that has lost its log is re-syncing and does not
        promise, so the new majority is one whose logs can be trusted."""
        lead = self._lead
        assert lead is not None
        lead.enter(_Begin())
        lead.started_at = self._now
        lead.quorum_until = 0
        lead.promised = {self._id: (self.last_term, self.last_seq)}
        self._send_begins()
        self._maybe_finish_begin()

    def _continue_fetch(self) -> None:
        lead = self._lead
        assert lead is not None
        phase = lead.phase
        assert isinstance(phase, _Fetch)
        goal_term, goal_seq = phase.goal
        if phase.prev < goal_seq:
            self._send_fetch()
            return
        if (self.last_term, self.last_seq) != (goal_term, goal_seq):
            raise AssertionError(
                f"{self._id}: adopted log ends at {(self.last_term, self.last_seq)}, "
                f"expected {(goal_term, goal_seq)}"
            )
        self._start_replicating()

    # ------------------------------------------------------------------
    # Replication (leader side)

    def _start_replicating(self) -> None:
        lead = self._lead
        assert lead is not None
        # Log time continues from the adopted log (see "Log time").
        lead.ts_base = self._log[-1].ts if self._log else self._dedup.newest_ts
        lead.now_base = self._now
        e = Entry(self._term, self.last_seq + 1, "term_start", None, None, self._next_ts())
        lead.enter(_Starting(term_start_seq=e.seq))
        self._log_append([e])
        self._persist(entries=[e])
        self._sync_progress()
        lead.next_heartbeat = self._now + self._cfg.heartbeat_ms
        self._replicate_all()

    def _sync_progress(self) -> None:
        """Track exactly the members of the configuration in force."""
        lead = self._lead
        assert lead is not None
        lead.quorum_until = 0  # the voters may have changed: look again
        cfg = self._config()
        members = [p for p in (*cfg.voters, *cfg.learners) if p != self._id]
        for peer in members:
            if peer not in lead.progress:
                lead.progress[peer] = self._initial_progress(peer)
        for peer in [p for p in lead.progress if p not in members]:
            del lead.progress[peer]
        if lead.transfer is not None and lead.transfer.target not in cfg.voters:
            lead.transfer = None

    def _initial_progress(self, peer: str) -> _Progress:
        lead = self._lead
        assert lead is not None
        # Start with the entry just appended (the term start or the config
        # entry that added the peer), so there is always something to send.
        nxt = self.last_seq
        # A promise counts as a round trip; a voter that never promised has
        # been silent since the term began.
        heard = self._now if peer in lead.promised else lead.started_at
        promised = lead.promised.get(peer)
        if promised is not None:
            # Its BeginOk told us where its log ends; a likely match point.
            t, s = promised
            if s < nxt and self.term_at(s) == t:
                nxt = s + 1
        return _Progress(next=nxt, heard_at=heard)

    def _replicate_all(self) -> None:
        lead = self._lead
        assert lead is not None
        for peer in lead.progress:
            self._replicate(peer)

    def _replicate(self, peer: str) -> None:
        """Send the next batch unless one is already in flight: one Append
        per follower at a time, so entries that arrive meanwhile travel
        together in the next one (natural batching)."""
        lead = self._lead
        assert lead is not None
        pr = lead.progress[peer]
        if pr.inflight is not None or pr.next > self.last_seq:
            return
        if pr.next <= self._snap_seq:
            self._send(
                SnapshotNeeded(
                    src=self._id,
                    dst=peer,
                    group=self._group,
                    term=self._term,
                    snap_term=self._snap_term,
                    snap_seq=self._snap_seq,
                )
            )
            pr.inflight = self._snap_seq
            pr.inflight_prev = -1
            pr.retry_at = self._now + self._cfg.snapshot_retry_ms
            return
        prev = pr.next - 1
        batch = self._batch_from(pr.next)
        self._send(
            Append(
                src=self._id,
                dst=peer,
                group=self._group,
                term=self._term,
                prev_term=self.term_at(prev) or 0,
                prev_seq=prev,
                entries=tuple(batch),
                commit=self._commit,
            )
        )
        pr.inflight = prev + len(batch)
        pr.inflight_prev = prev
        pr.retry_at = self._now + self._cfg.retry_ms
        pr.told_commit = max(pr.told_commit, min(self._commit, pr.inflight))
        pr.told_at = self._now

    def _on_append_reply(self, m: AppendReply) -> None:
        lead = self._lead
        if lead is None or m.term != self._term:
            return
        pr = lead.progress.get(m.src)
        if pr is None:
            return
        pr.heard_at = self._now
        if m.ok:
            if m.match > pr.match:
                pr.match = m.match
            if pr.next <= pr.match:
                pr.next = pr.match + 1
            if pr.inflight is not None and m.match >= pr.inflight:
                pr.inflight = None
        elif pr.inflight is not None and m.prev_seq == pr.inflight_prev:
            pr.inflight = None
            back = self._find_conflict_by_term(m.hint_seq, m.hint_term)
            if m.prev_seq <= pr.match:
                # It lost entries it had acknowledged durably: its disk
                # broke the contract.  Forget what we believed so it can be
                # repaired instead of being stuck rejecting forever.
                pr.match = min(back, m.hint_seq)
            pr.next = max(pr.match + 1, min(m.prev_seq, back + 1))
        self._replicate(m.src)

    def _advance_commit(self) -> None:
        lead = self._lead
        assert lead is not None
        voters = self._config().voters
        if not voters:
            return
        progress = lead.progress
        matches = sorted(
            (self.last_seq if v == self._id else (progress[v].match if v in progress else 0) for v in voters),
            reverse=True,
        )
        n = matches[len(voters) // 2]
        if n > self._commit and self._counts_for_commit(n):
            self._commit = n

    def _all_voters_have(self, seq: int) -> bool:
        lead = self._lead
        assert lead is not None
        for v in self._config().voters:
            if v != self._id and (v not in lead.progress or lead.progress[v].match < seq):
                return False
        return True

    # ------------------------------------------------------------------
    # Replication (follower side)

    def _on_append(self, m: Append) -> None:
        if self._lead is not None and m.term == self._term:
            return
        if not self._accept_term(m):
            return
        env = dict(src=self._id, dst=m.src, group=self._group, term=self._term)
        miss = self._mismatch(m.prev_seq, m.prev_term)
        if miss is not None:
            self._send(AppendReply(**env, ok=False, prev_seq=m.prev_seq, hint_seq=miss[0], hint_term=miss[1]))
            return
        self._merge(m.entries)
        # Only what this Append vouched for is known to equal the leader's
        # log; a stale suffix beyond it may still be cut later.
        match = max(m.prev_seq + len(m.entries), self._snap_seq)
        self._learn_commit(min(m.commit, match))
        if self._resyncing and 0 < m.commit <= match and self.term_at(m.commit) == m.term:
            # The leader's commit reached an entry of its own term, so its
            # term-start entry (and everything committed before it) is
            # committed, and we now hold all of it durably.
            self._resyncing = False
        self._ack_durable(AppendReply(**env, ok=True, prev_seq=m.prev_seq, match=match))

    def _learn_commit(self, seq: int) -> None:
        if seq > self._commit:
            self._commit = seq

    def _on_heartbeat(self, m: Heartbeat) -> None:
        if self._lead is not None and m.term == self._term:
            return
        if not self._accept_term(m):
            return
        # The leader sends min(commit, our match), which our log holds.
        self._learn_commit(min(m.commit, self.last_seq))
        lc = m.leader_commit
        if self._resyncing and lc is not None and 0 < lc <= self.last_seq and self.term_at(lc) == m.term:
            # As in _on_append, but on the leader's own commit, not `commit`: that
            # one is clamped to the match the leader holds for us, which may be
            # far below what we acknowledged before we lost our log (shell
            # simulator seed 1045 ended a re-sync on it and lost committed
            # entries). Our entry at the leader's commit is of its term, so (log
            # matching: a term's entries come from its one leader) our log up to
            # there is the leader's, every committed entry included, persisted in
            # an earlier pass. Without this, a replica whose catch-up ended with
            # an Append that carried an older commit stayed re-syncing (no vote,
            # no lead) until the next write: an idle group kept it out for good
            # (shell simulator seed 1282).
            self._resyncing = False
        self._send(HeartbeatReply(src=self._id, dst=m.src, group=self._group, term=self._term, round=m.round))

    def _on_heartbeat_reply(self, m: HeartbeatReply) -> None:
        lead = self._lead
        if lead is None or m.term != self._term:
            return
        phase = lead.phase
        if isinstance(phase, _Fetch) and m.src == phase.src and m.commit is None:
            phase.heard_at = self._now  # still there (a snapshot download answers nothing else)
        if lead.round_inflight and m.round >= lead.read_round and m.src in self._config().voters:
            lead.round_acks.add(m.src)
            self._check_read_round()
        pr = lead.progress.get(m.src)
        if pr is not None:
            if m.commit is None:
                pr.heard_at = self._now  # an answer to our Heartbeat (an announce proves no round trip)
            if m.commit is not None and m.commit < pr.told_commit:
                pr.told_commit = m.commit  # it forgot (restarted): the commit notice tells it again
            self._replicate(m.src)

    def _lags_commit(self, pr: _Progress) -> bool:
        """It holds entries it does not know are committed, and no Append will tell it.

        With an Append in flight its reply comes first, and the next Append
        (or, with nothing left to send, the notice) carries the commit."""
        return pr.inflight is None and min(self._commit, pr.match) > pr.told_commit

    def _send_heartbeats(self, peers: Sequence[str]) -> None:
        lead = self._lead
        assert lead is not None
        for peer in peers:
            pr = lead.progress.get(peer)
            commit = min(self._commit, pr.match) if pr is not None else 0
            if pr is not None:
                pr.told_commit = max(pr.told_commit, commit)
                pr.told_at = self._now
            self._send(
                Heartbeat(
                    src=self._id, dst=peer, group=self._group, term=self._term, commit=commit, round=lead.read_round,
                    leader_commit=self._commit,
                )
            )

    # ------------------------------------------------------------------
    # Snapshots

    def _snapshot_meta_at(self, seq: int, exact: DedupTable | None = None) -> SnapshotMeta:
        """The SnapshotMeta as of `seq`; `exact` is a dedup table known to be at `seq`."""
        if exact is not None:
            dedup = exact
        elif seq == self._applied:
            dedup = self._dedup
        else:
            # The table as of `seq`: replay from the previous snapshot, so
            # every replica compacting at `seq` derives the same one.
            dedup = self._dedup_from(self._snap)
            for e in self.entries(self._snap_seq + 1, seq):
                dedup.apply(e)
        cfg = None
        cfg_seq = 0
        for s, c in self._configs:
            if s <= seq:
                cfg_seq, cfg = s, c
        if cfg is None and self._snap is not None:
            cfg, cfg_seq = self._snap.config, self._snap.config_seq
        return SnapshotMeta(
            term=self.term_at(seq) or 0,
            seq=seq,
            dedup=dedup.export(),
            config=cfg,
            config_seq=cfg_seq,
            ts=dedup.newest_ts,
        )

    def _on_compact(self, c: Compact) -> None:
        seq = c.seq
        if seq <= self._snap_seq or seq > self._applied:
            return
        if self._compact_meta is None or seq > self._compact_meta.seq:
            if self._compact_meta is None:
                self._compact_asked = self._now
            # Computed now, not when the compaction happens: by then the
            # dedup table would have to be replayed from the old snapshot.
            prepared = self._prepared.pop(seq, None)
            if prepared is None and c.meta is not None and c.meta.seq == seq:
                prepared = c.meta  # this core's own TakeSnapshot meta, kept by the shell
            self._compact_meta = prepared if prepared is not None else self._snapshot_meta_at(seq)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Compact as asked, unless we lead and a follower still lacks entries
        the compaction would drop.  Compacting under a follower that is only
        an Append behind (the normal state under load) would make it download
        the whole snapshot; etcd keeps catch-up entries for the same reason.
        The hold is bounded by `compact_hold_ms`, so a dead follower delays
        compaction, never prevents it."""
        meta = self._compact_meta
        if meta is None:
            return
        if meta.seq <= self._snap_seq:
            self._compact_meta = None  # a snapshot install went past it
            return
        lead = self._lead
        if (lead is not None and self._now < self._compact_asked + self._cfg.compact_hold_ms
                and any(pr.match < meta.seq for pr in lead.progress.values())):
            return
        self._compact_meta = None
        self._prepared = {s: p for s, p in self._prepared.items() if s > meta.seq}
        del self._log[: meta.seq - self._snap_seq]
        self._snap, self._snap_seq, self._snap_term = meta, meta.seq, meta.term
        self._configs = [x for x in self._configs if x[0] > meta.seq]
        self._persist(snapshot=meta)

    def _on_snapshot_needed(self, m: SnapshotNeeded) -> None:
        lead = self._lead
        if lead is not None and m.term == self._term:
            # Our fetch source has compacted what we lack.
            phase = lead.phase
            if isinstance(phase, _Fetch) and m.src == phase.src:
                phase.heard_at = self._now
                self._out.append(DownloadSnapshot(m.src, m.term, m.snap_seq, m.snap_term, m.digest, m.size))
                phase.retry_at = self._now + self._cfg.snapshot_retry_ms
            return
        if not self._accept_term(m):
            return
        if m.snap_seq <= self._commit:
            # We are already past it (a late or repeated request).
            self._send(
                AppendReply(
                    src=self._id,
                    dst=m.src,
                    group=self._group,
                    term=self._term,
                    ok=True,
                    prev_seq=m.snap_seq,
                    match=self._commit,
                )
            )
            return
        self._out.append(DownloadSnapshot(m.src, m.term, m.snap_seq, m.snap_term, m.digest, m.size))

    def _on_snapshot_installed(self, ev: SnapshotInstalled) -> None:
        meta = ev.meta
        lead = self._lead
        phase = lead.phase if lead is not None else None
        if meta.seq <= self._applied or (lead is not None and not isinstance(phase, _Fetch)):
            return
        self._install_snapshot(meta)
        if isinstance(phase, _Fetch):
            # The snapshot point is the one place known to agree with the
            # source (it is committed); whatever we were probing is moot.
            phase.prev = meta.seq
            self._continue_fetch()
        elif self._leader is not None:
            self._ack_durable(
                AppendReply(
                    src=self._id,
                    dst=self._leader,
                    group=self._group,
                    term=self._term,
                    ok=True,
                    prev_seq=meta.seq,
                    match=meta.seq,
                )
            )

    def _install_snapshot(self, meta: SnapshotMeta) -> None:
        """Replace state up to meta.seq with the (committed) snapshot; keep
        the suffix after it only if it continues the snapshot's history."""
        keep = self.term_at(meta.seq) == meta.term
        cut: int | None = None
        if keep:
            del self._log[: meta.seq - self._snap_seq]
            self._configs = [x for x in self._configs if x[0] > meta.seq]
            self._pending_rids = {r: s for r, s in self._pending_rids.items() if s > meta.seq}
        else:
            if self._commit >= meta.seq:
                raise AssertionError(f"{self._id}: snapshot {meta.seq} contradicts committed entries")
            self._log = []
            self._configs = []
            self._pending_rids = {}
            cut = meta.seq
        self._config_cache = None
        self._snap, self._snap_seq, self._snap_term = meta, meta.seq, meta.term
        self._commit = max(self._commit, meta.seq)
        self._applied = meta.seq
        self._dedup = self._dedup_from(meta)
        self._persist(snapshot=meta, truncate_after=cut)

    # ------------------------------------------------------------------
    # Client writes

    def _write_refusal(self) -> tuple[str, str | None] | None:
        """Why this replica cannot append a client entry now, if it cannot."""
        lead = self._lead
        if lead is None:
            return NOT_LEADER, self._leader
        self._check_quorum(lead)
        if not lead.quorum_ok:
            return NO_QUORUM, self._id
        if not lead.ready:
            return NOT_LEADER, self._id  # leading soon: retry here
        if lead.transfer is not None:
            return NOT_LEADER, lead.transfer.target
        return None

    def _refuse_write(self, req: Any, rid: str | None, refusal: tuple[str, str | None]) -> None:
        """Refuse a write.  Without a quorum, a rid the group already knows is
        answered as what it is, never as "nothing applied": applied (its seq;
        committed, whoever leads next) or in the log (QUORUM_TIMEOUT: it may
        still commit).  A client re-sending after a lost answer must not be
        told that an applied write failed."""
        if refusal[0] == NO_QUORUM and rid is not None:
            done = self._dedup.lookup(rid)
            if done is not None:
                self._out.append(Reply(req, True, done, self._term, None, self._id, self._index_of(rid, done)))
                return
            if rid in self._pending_rids:
                self._reply_error(req, QUORUM_TIMEOUT, self._id)
                return
        self._reply_error(req, *refusal)

    def _on_client_write(self, w: ClientWrite) -> None:
        refusal = self._write_refusal()
        if refusal is not None:
            self._refuse_write(w.req, w.rid, refusal)
            return
        if w.rid is not None:
            done = self._dedup.lookup(w.rid)
            if done is not None:
                self._out.append(Reply(w.req, True, done, self._term, None, self._id, self._index_of(w.rid, done)))
                return
            pending = self._pending_rids.get(w.rid)
            if pending is not None:
                self._await(w.req, pending, w.ack, self._index_of(w.rid, pending))
                return
        e = Entry(self._term, self.last_seq + 1, "op", w.op, w.rid, self._next_ts())
        self._leader_append(e)
        self._await(w.req, e.seq, w.ack)

    def _on_client_write_many(self, w: ClientWriteMany) -> None:
        refusal = self._write_refusal()
        if refusal is not None:
            for req, rid in zip(w.reqs, w.rids or (None,) * len(w.reqs)):
                self._refuse_write(req, rid, refusal)
            return
        rids = w.rids or (None,) * len(w.ops)
        fresh: list[tuple[Any, Any, str | None]] = []
        here: dict[str, int] = {}  # rid -> index in the new entry, for a rid repeated in this batch
        later: list[tuple[Any, int]] = []
        for req, op, rid in zip(w.reqs, w.ops, rids):
            if rid is not None:
                done = self._dedup.lookup(rid)
                if done is not None:
                    self._out.append(Reply(req, True, done, self._term, None, self._id, self._index_of(rid, done)))
                    continue
                pending = self._pending_rids.get(rid)
                if pending is not None:
                    self._await(req, pending, w.ack, self._index_of(rid, pending))
                    continue
                if rid in here:
                    later.append((req, here[rid]))
                    continue
                here[rid] = len(fresh)
            fresh.append((req, op, rid))
        if not fresh:
            return
        seq = self.last_seq + 1
        if len(fresh) == 1 and not later:
            # A plain op; with the same rid repeated in the batch, an "ops"
            # entry of one instead, whose result the shell keeps for each.
            req, op, rid = fresh[0]
            self._leader_append(Entry(self._term, seq, "op", op, rid, self._next_ts()))
            self._await(req, seq, w.ack)
            return
        self._leader_append(Entry(self._term, seq, "ops", tuple(f[1] for f in fresh), tuple(f[2] for f in fresh),
                                  self._next_ts()))
        self._await(tuple(f[0] for f in fresh), seq, w.ack, many=True)
        for req, i in later:
            self._await(req, seq, w.ack, i)

    def _index_of(self, rid: str, seq: int) -> int | None:
        """The position of `rid` in the "ops" entry at `seq` (None for a plain op, or once compacted)."""
        found = self.entries(seq, seq)
        if found and found[0].kind == "ops" and rid in found[0].rid:
            return found[0].rid.index(rid)
        return None

    def _leader_append(self, e: Entry) -> None:
        self._log_append([e])
        if e.kind == "config":
            self._sync_progress()
        # The Appends go out before our own Persist, so the followers write
        # while we do (see "Durability contract"): a round costs one fsync
        # of latency instead of two in a row.
        self._replicate_all()
        self._persist(entries=[e])

    def _await(self, req: Any, seq: int, ack: str, idx: int | None = None, many: bool = False) -> None:
        """Answer `req` once the entry at `seq` is durable as `ack` asks; with
        `many`, `req` is the tuple of reqs at positions 0.. of that entry."""
        lead = self._lead
        assert lead is not None
        if ack == "leader":
            # Our copy is durable once the Persist above is performed.
            self._finish_write(_WriteWaiter(req, seq, ack, 0, idx=idx, many=many))
            return
        w = _WriteWaiter(req, seq, ack, self._now + self._cfg.quorum_timeout_ms, idx=idx, many=many)
        if seq in lead.waiters:
            lead.waiters[seq].append(w)
        else:
            lead.waiters[seq] = [w]
            heapq.heappush(lead.waiter_seqs, seq)
        lead.waiter_deadlines.append(w)

    def _complete_writes(self) -> None:
        lead = self._lead
        assert lead is not None
        heap = lead.waiter_seqs
        while heap and heap[0] <= self._commit:
            seq = heapq.heappop(heap)
            for w in lead.waiters.pop(seq, ()):
                if w.done:
                    continue
                if w.ack == "all" and not self._all_voters_have(seq):
                    lead.all_waiters.append(w)
                else:
                    self._finish_write(w)
        if lead.all_waiters:
            still = []
            for w in lead.all_waiters:
                if w.done:
                    continue
                if self._all_voters_have(w.seq):
                    self._finish_write(w)
                else:
                    still.append(w)
            lead.all_waiters = still

    def _finish_write(self, w: _WriteWaiter) -> None:
        w.done = True
        if w.many:
            self._out.append(ReplyMany(w.req, w.seq, self._term, self._id))
        else:
            self._out.append(Reply(w.req, True, w.seq, self._term, None, self._id, w.idx))

    def _fail_waiter(self, w: _WriteWaiter, code: str, leader: str | None) -> None:
        for req in w.req if w.many else (w.req,):
            self._reply_error(req, code, leader)

    def _expire_writes(self) -> None:
        lead = self._lead
        assert lead is not None
        q = lead.waiter_deadlines
        while q and (q[0].done or q[0].deadline <= self._now):
            w = q.popleft()
            if not w.done:
                w.done = True
                self._fail_waiter(w, QUORUM_TIMEOUT, self._id)

    # ------------------------------------------------------------------
    # Reads

    def _on_client_read(self, r: ClientRead) -> None:
        deadline = r.deadline if r.deadline > 0 else self._now + self._cfg.quorum_timeout_ms
        if r.consistency == "follower":
            if self._applied >= r.min_seq:
                self._out.append(ServeRead(r.req, self._applied))
            else:
                self._follower_reads.append(_Read(r.req, r.min_seq, deadline))
            return
        lead = self._lead
        if lead is not None:
            self._check_quorum(lead)
            if not lead.quorum_ok:
                self._reply_error(r.req, NO_QUORUM, self._id)
                return
        if lead is None or not lead.ready:
            self._reply_error(r.req, NOT_LEADER, self._leader if lead is None else self._id)
            return
        # Read index: everything committed when the read arrived.  Ready
        # means our term-start entry committed, so that is everything any
        # earlier leader acknowledged too.
        read = _Read(r.req, max(self._commit, r.min_seq), deadline)
        if lead.round_inflight:
            lead.next_reads.append(read)
        else:
            lead.round_reads.append(read)
            self._start_read_round()

    def _start_read_round(self) -> None:
        """One quorum confirmation for every read waiting at this moment."""
        lead = self._lead
        assert lead is not None
        lead.read_round += 1
        lead.round_inflight = True
        lead.round_started = self._now
        voters = self._config().voters
        lead.round_acks = {self._id} if self._id in voters else set()
        self._send_heartbeats([v for v in voters if v != self._id])
        self._check_read_round()

    def _check_read_round(self) -> None:
        lead = self._lead
        assert lead is not None
        if not self._is_majority(self._config().voters, lead.round_acks):
            return
        lead.round_inflight = False
        lead.confirmed_reads.extend(lead.round_reads)
        lead.round_reads = lead.next_reads
        lead.next_reads = []
        if lead.round_reads:
            self._start_read_round()

    def _serve_reads(self) -> None:
        lead = self._lead
        if lead is not None and lead.confirmed_reads:
            still = []
            for r in lead.confirmed_reads:
                if self._applied >= r.at_seq:
                    self._out.append(ServeRead(r.req, r.at_seq))
                else:
                    still.append(r)
            lead.confirmed_reads = still
        if self._follower_reads:
            still = []
            for r in self._follower_reads:
                if self._applied >= r.at_seq:
                    self._out.append(ServeRead(r.req, self._applied))
                else:
                    still.append(r)
            self._follower_reads = still

    def _expire_reads(self, reads: list[_Read]) -> list[_Read]:
        now = self._now
        still = []
        for r in reads:
            if r.deadline <= now:
                self._reply_error(r.req, DEADLINE_EXCEEDED, self._leader)
            else:
                still.append(r)
        return still

    # ------------------------------------------------------------------
    # Leadership transfer and membership

    def _on_transfer_leader(self, t: TransferLeader) -> None:
        lead = self._lead
        if (
            lead is None
            or not lead.ready
            or not lead.quorum_ok
            or lead.transfer is not None
            or t.target == self._id
            or t.target not in self._config().voters
        ):
            return
        pr = lead.progress.get(t.target)
        if pr is None or self._now - pr.heard_at >= self._cfg.lease_ms:
            return  # it cannot answer us: waiting for it would only hold writes up
        lead.transfer = _Transfer(t.target, self._now + self._cfg.transfer_timeout_ms)
        self._replicate(t.target)

    def _check_transfer(self) -> None:
        lead = self._lead
        assert lead is not None
        tr = lead.transfer
        if tr is None or tr.reported:
            return
        pr = lead.progress.get(tr.target)
        # The target has all of our log, and all of it is committed: with
        # writes refused meanwhile, every write we took has been answered
        # before we hand over (in a group of four or more voters the target
        # and we are no majority, and a step-down would leave pending writes
        # with an unknown outcome).
        if pr is not None and pr.match >= self.last_seq and self._commit >= self.last_seq:
            tr.reported = True
            self._out.append(TransferReady(tr.target, self._term, self.last_seq))

    def _on_change_membership(self, c: ChangeMembership) -> None:
        refusal = self._write_refusal()
        lead = self._lead
        if (refusal is not None and refusal[0] == NO_QUORUM and c.remove is not None and lead is not None
                and lead.ready and lead.transfer is None
                and self._contact_majority(lead, tuple(v for v in self._config().voters if v != c.remove))):
            # Removing the voter we cannot hear is what gives us a quorum
            # back (a config entry takes effect when appended).
            refusal = None
        if refusal is not None:
            self._reply_error(c.req, *refusal)
            return
        lc = self._log_config()
        conf_seq = lc[0] if lc is not None else 0
        view = self._view
        if conf_seq > self._commit or view is None or view.conf_ver != conf_seq:
            # The previous change is uncommitted or meta has not recorded it.
            self._reply_error(c.req, BUSY, self._id)
            return
        new_cfg = self._changed_config(c)
        if isinstance(new_cfg, str):
            self._reply_error(c.req, new_cfg, self._id)
            return
        e = Entry(self._term, self.last_seq + 1, "config", new_cfg, None, self._next_ts())
        self._leader_append(e)
        self._await(c.req, e.seq, "quorum")

    def _changed_config(self, c: ChangeMembership) -> Config | str:
        """The configuration after the single change `c`, or an error code."""
        cfg = self._config()
        asked = [x for x in (c.add_learner, c.promote, c.remove) if x is not None]
        if len(asked) != 1:
            return BAD_REQUEST
        voters, learners = cfg.voters, cfg.learners
        if c.add_learner is not None:
            if c.add_learner in voters or c.add_learner in learners:
                return BAD_REQUEST
            return Config(voters, (*learners, c.add_learner))
        if c.promote is not None:
            if c.promote not in learners:
                return BAD_REQUEST
            lead = self._lead
            assert lead is not None
            pr = lead.progress.get(c.promote)
            if pr is None or self.last_seq - pr.match > self._cfg.promote_max_lag:
                return LAGGING
            return Config((*voters, c.promote), tuple(x for x in learners if x != c.promote))
        gone = c.remove
        if gone == self._id:
            return BAD_REQUEST  # transfer leadership first
        if gone in voters:
            if len(voters) == 1:
                return BAD_REQUEST
            return Config(tuple(x for x in voters if x != gone), learners)
        if gone in learners:
            return Config(voters, tuple(x for x in learners if x != gone))
        return BAD_REQUEST

    # ------------------------------------------------------------------
    # Check-quorum

    def _check_quorum(self, lead: _Leadership) -> None:
        now = self._now
        if lead.quorum_ok and now < lead.quorum_until:
            return
        ok = self._quorum_contact(lead)
        if ok:
            until = self._quorum_deadline(lead)
            lead.quorum_until = until if until is not None else now + self._cfg.lease_ms
        if ok == lead.quorum_ok:
            return
        lead.quorum_ok = ok
        if ok:
            lead.quorum_lost_at = None
        else:
            lead.quorum_lost_at = self._now
            # Whatever we were waiting on may or may not commit later (under
            # us once replies return, or under the next leader): say so now,
            # rather than after quorum_timeout.  Reads not yet confirmed by a
            # round changed nothing; confirmed ones are still served.
            for w in lead.waiter_deadlines:
                if not w.done:
                    w.done = True
                    self._fail_waiter(w, QUORUM_TIMEOUT, self._id)
            lead.waiters.clear()
            lead.waiter_seqs.clear()
            lead.all_waiters.clear()
            lead.waiter_deadlines.clear()
            for r in (*lead.round_reads, *lead.next_reads):
                self._reply_error(r.req, NO_QUORUM, self._id)
            lead.round_reads, lead.next_reads = [], []
            lead.round_inflight = False
        self._out.append(ReportQuorum(self._term, ok))

    def _quorum_deadline(self, lead: _Leadership) -> int | None:
        """When the quorum is lost if no reply arrives meanwhile (None: it cannot be)."""
        lease = self._cfg.lease_ms
        if isinstance(lead.phase, _Begin):
            return lead.started_at + lease
        if isinstance(lead.phase, _Fetch):
            return None
        voters = self._config().voters
        need = len(voters) // 2 + 1 - (1 if self._id in voters else 0)
        if need <= 0:
            return None
        heard = sorted((lead.progress[v].heard_at for v in voters if v in lead.progress), reverse=True)
        if len(heard) < need:
            return None
        return heard[need - 1] + lease

    # ------------------------------------------------------------------
    # Time

    def _on_tick(self, _: Tick) -> None:
        self._timer_at = None  # the shell's timer has fired
        lead = self._lead
        now = self._now
        if lead is not None:
            phase = lead.phase
            if isinstance(phase, (_Begin, _Fetch)) and now >= lead.next_heartbeat:
                # Voters that promised (or have yet to) hear from us while we
                # collect promises or fetch a long log: they must not report
                # us silent to meta.  commit=0 tells them nothing else.
                for peer in lead.begin_to:
                    self._send(Heartbeat(src=self._id, dst=peer, group=self._group, term=self._term, commit=0,
                                         round=0))
                lead.next_heartbeat = now + self._cfg.heartbeat_ms
            if isinstance(phase, _Begin):
                if now >= phase.retry_at:
                    self._send_begins()
            elif isinstance(phase, _Fetch):
                if now - phase.heard_at >= self._cfg.lease_ms:
                    # The source is gone: ask a majority again (any majority's
                    # best log will do; what was fetched so far stays).
                    self._restart_begin()
                elif now >= phase.retry_at:
                    self._send_fetch()
            else:
                self._tick_leader(lead)
        if self._follower_reads:
            self._follower_reads = self._expire_reads(self._follower_reads)

    def _tick_leader(self, lead: _Leadership) -> None:
        now = self._now
        for peer, pr in lead.progress.items():
            if pr.inflight is not None and now >= pr.retry_at:
                pr.inflight = None  # presumed lost
                self._replicate(peer)
        if now >= lead.next_heartbeat:
            self._send_heartbeats(list(lead.progress))
            lead.next_heartbeat = now + self._cfg.heartbeat_ms
        elif lead.round_inflight and now >= lead.round_started + self._cfg.retry_ms:
            lead.round_started = now
            self._send_heartbeats([v for v in self._config().voters if v not in lead.round_acks])
        if lead.notice_at is not None and now >= lead.notice_at:
            notice = self._cfg.commit_notice_ms
            self._send_heartbeats([p for p, pr in lead.progress.items()
                                   if self._lags_commit(pr) and now >= pr.told_at + notice])
        self._expire_writes()
        for name in ("round_reads", "next_reads", "confirmed_reads"):
            reads = getattr(lead, name)
            if reads:
                setattr(lead, name, self._expire_reads(reads))
        if lead.transfer is not None and now >= lead.transfer.deadline:
            lead.transfer = None  # meta did not act in time: admit writes again

    def _next_wakeup(self) -> int | None:
        times: list[int] = []
        lead = self._lead
        if lead is not None:
            if lead.quorum_ok and lead.quorum_until > self._now:  # (never a timer in the past: it would spin)
                times.append(lead.quorum_until)
            phase = lead.phase
            if isinstance(phase, (_Begin, _Fetch)):
                times.append(phase.retry_at)
                times.append(lead.next_heartbeat)
                if isinstance(phase, _Fetch):
                    times.append(phase.heard_at + self._cfg.lease_ms)
            else:
                times.append(lead.next_heartbeat)
                if lead.notice_at is not None:
                    times.append(lead.notice_at)
                times.extend(pr.retry_at for pr in lead.progress.values() if pr.inflight is not None)
                if lead.round_inflight:
                    times.append(lead.round_started + self._cfg.retry_ms)
                if lead.waiter_deadlines:
                    times.append(lead.waiter_deadlines[0].deadline)
                for reads in (lead.round_reads, lead.next_reads, lead.confirmed_reads):
                    times.extend(r.deadline for r in reads)
                if lead.transfer is not None:
                    times.append(lead.transfer.deadline)
                if self._compact_meta is not None:
                    times.append(self._compact_asked + self._cfg.compact_hold_ms)
        times.extend(r.deadline for r in self._follower_reads)
        return min(times) if times else None

    # ------------------------------------------------------------------
    # After every event

    def _settle(self) -> None:
        lead = self._lead
        if lead is not None and isinstance(lead.phase, (_Starting, _Ready)):
            self._advance_commit()
            phase = lead.phase
            if isinstance(phase, _Starting) and self._commit >= phase.term_start_seq:
                lead.enter(_Ready())
                self._out.append(ReportReady(self._term))
        self._apply_committed()
        if lead is not None and lead.ready:
            self._complete_writes()
            self._check_transfer()
            # A follower that has heard nothing from us for commit_notice_ms
            # while our commit is ahead of what it knows: no Append is coming.
            quiet = [pr.told_at for pr in lead.progress.values() if self._lags_commit(pr)]
            lead.notice_at = min(quiet) + self._cfg.commit_notice_ms if quiet else None
        if lead is not None:
            # After the commit moved: what this call committed is answered as done.
            self._check_quorum(lead)
        self._serve_reads()
        self._maybe_compact()
        self._record_commit()
        at = self._next_wakeup()
        if at is not None and at != self._timer_at:
            self._timer_at = at
            self._out.append(SetTimer(at))

    def _apply_committed(self) -> None:
        if self._commit <= self._applied:
            return
        base = self._snap_seq + 1
        batch = tuple(self._log[self._applied + 1 - base : self._commit + 1 - base])
        pending = self._pending_rids
        every = self._cfg.snapshot_every
        start = 0
        for i, e in enumerate(batch):
            self._dedup.apply(e)
            if e.rid is not None:
                for rid in entry_rids(e):
                    if pending.get(rid) == e.seq:
                        del pending[rid]
            if every and (e.kind == "op" or e.kind == "ops"):
                self._since_snapshot += self._writes_in(e)
                if self._since_snapshot >= every:
                    writes, self._since_snapshot = self._since_snapshot, 0
                    self._out.append(Apply(batch[start : i + 1]))
                    start = i + 1
                    # Two kept: the oldest, which the shell may still be
                    # writing (it skips points asked for meanwhile), and this one.
                    if self._prepared:
                        oldest = min(self._prepared)
                        self._prepared = {oldest: self._prepared[oldest]}
                    meta = self._prepared[e.seq] = self._snapshot_meta_at(e.seq, exact=self._dedup)
                    self._out.append(TakeSnapshot(e.seq, meta, writes))
        self._applied = self._commit
        if start < len(batch):
            self._out.append(Apply(batch[start:]))

    def _record_commit(self) -> None:
        """Piggyback the commit index on this call's last Persist, if any;
        it is only a restart hint, never worth an fsync of its own."""
        if self._commit <= self._persisted_commit:
            return
        for eff in reversed(self._out):
            if type(eff) is Persist:
                eff.commit = self._commit
                self._persisted_commit = self._commit
                return
