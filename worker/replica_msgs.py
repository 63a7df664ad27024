"""The vocabulary of the replication core (worker/replica.py).

Plain data only: log entries, what a restart reads back from disk, the
messages replicas exchange, the events the I/O shell feeds in and the effects
it must perform.  Everything is a slotted dataclass; everything except
`Persist` is frozen.  Messages are keyword-only so that call sites stay
readable despite the shared envelope fields.

Every message carries the envelope `src, dst, group, term`: `term` is the
sender's current term, which is what fences stale leaders.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, TypeAlias

EntryKind: TypeAlias = Literal["op", "ops", "term_start", "config"]
AckMode: TypeAlias = Literal["leader", "quorum", "all"]
Consistency: TypeAlias = Literal["strong", "follower"]

# Error codes of `Reply.error_code`.
NOT_LEADER = "not_leader"  # not appended; safe to retry (see `leader` for a hint)
QUORUM_TIMEOUT = "quorum_timeout"  # appended, outcome unknown: retry with the same rid
DEADLINE_EXCEEDED = "deadline_exceeded"  # a read could not be served in time
UNAVAILABLE = "unavailable"
BUSY = "busy"  # a membership change is already in flight
BAD_REQUEST = "bad_request"  # a membership change that makes no sense
LAGGING = "lagging"  # promote refused: the learner has not caught up yet
# Refused: this leader has not had a round trip with a majority of its voters
# for `lease_ms` (check-quorum). Nothing new was appended; writes it took
# earlier were answered QUORUM_TIMEOUT when it noticed.
NO_QUORUM = "no_quorum"


# --------------------------------------------------------------------------
# Durable state


@dataclass(slots=True, frozen=True)
class Config:
    """A group configuration: only voters count towards quorums."""

    voters: tuple[str, ...]
    learners: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class Entry:
    """One log entry.  `data` is opaque for ops (a tuple of them for "ops"), a `Config` for config
    entries and None for term starts.  `ts` is the group's log time when the
    leader appended the entry: ms of leadership, carried from leader to
    leader (see "Log time" in worker/replica.py), never a wall clock.  It is
    what dedup expiry is computed from, so every replica derives the same
    table."""

    term: int
    seq: int
    kind: EntryKind
    data: Any = None
    rid: Any = None  # str | None; for "ops", a tuple with one str | None per op
    ts: int = 0


def entry_rids(e: Entry) -> tuple[str, ...]:
    """The request ids an entry carries: one for an op, one per op of an "ops" entry.

    An "ops" entry is several client writes appended as one entry (`data`
    and `rid` are equal-length tuples): a batch costs one entry's worth of
    log, replication and fsync work, and each write keeps its own rid for
    dedup.
    """
    if e.kind == "op":
        return () if e.rid is None else (e.rid,)
    if e.kind == "ops":
        return tuple(r for r in e.rid if r is not None)
    return ()


@dataclass(slots=True, frozen=True)
class SnapshotMeta:
    """What the log before a snapshot point is replaced with.

    `dedup` is the request-id table as of `seq` (rid, seq, ts in apply order),
    `config`/`config_seq` the latest configuration at or before `seq` (None
    when the group never had a config entry), `ts` the newest entry
    timestamp applied at `seq`."""

    term: int
    seq: int
    dedup: tuple[tuple[str, int, int], ...] = ()
    config: Config | None = None
    config_seq: int = 0
    ts: int = 0


@dataclass(slots=True)
class StoredState:
    """What a restart reads back from disk (empty for a new replica)."""

    term: int = 0
    entries: list[Entry] = field(default_factory=list)  # after the snapshot point
    snapshot: SnapshotMeta | None = None
    commit: int = 0  # may be stale; never ahead of the truth
    # The log was discarded after corruption: entries this replica once
    # acknowledged may be gone, so it must not vote (answer Begin) or lead
    # until a ready leader has brought it up to that leader's commit.
    resync: bool = False


@dataclass(slots=True, frozen=True)
class ReplicaConfig:
    # Followers learn the commit from the next Append; what is left at the
    # end of a burst goes out as a commit notice `commit_notice_ms` later
    # (unless an Append carried it first); a restarted follower announces
    # itself to the leader meta names, which then notices it too. The periodic
    # heartbeat is only a backstop, so it can be rare: each one costs every
    # group a message and a reply per follower, which was most of an idle
    # worker's CPU at 50 ms.
    heartbeat_ms: int = 500
    # Check-quorum: a leader without a round trip with a majority of its
    # voters for this long refuses writes and strong reads (NO_QUORUM) and
    # says so (ReportQuorum); a follower's silence clock is reported against
    # it too.  Must be well above heartbeat_ms (an idle leader's round trips).
    lease_ms: int = 1500
    commit_notice_ms: int = 20
    retry_ms: int = 200
    quorum_timeout_ms: int = 2000
    max_batch_entries: int = 1024
    max_batch_ops: int = 4096  # client writes per Append/FetchReply ("ops" entries count each op)
    # Encoded bytes of the entries one Append/FetchReply carries (an entry
    # alone over it still goes, by itself), measured with `entry_bytes`
    # (None: not measured, the counts above only). A receiver refuses a
    # stream message over 64 MiB (worker/server.py MAX_BODY): a lagging
    # follower's 1024 entries of up to 16 MiB each could never reach it.
    # 8 MiB keeps one Append far below that, and twice the largest
    # coalesced call (16 MiB) still goes alone.
    max_batch_bytes: int = 8 << 20
    entry_bytes: Callable[[Entry], int] | None = None
    dedup_window_ms: int = 10 * 60 * 1000
    dedup_max: int = 100_000
    transfer_timeout_ms: int = 3000
    # A snapshot download takes far longer than an Append round trip.
    snapshot_retry_ms: int = 5000
    # `promote` is refused while the learner is further behind than this.
    promote_max_lag: int = 64
    # How long a leader may hold a compaction back for a follower that still
    # needs the entries (it would otherwise have to download a snapshot).
    compact_hold_ms: int = 5000
    # Client writes between snapshot points (TakeSnapshot); 0: none, the
    # shell sends Compact at seqs of its choosing.
    snapshot_every: int = 0
    # Client writes one op stands for (the plugin's `weight`; None: 1 each).
    # It counts toward snapshot_every and max_batch_ops, so a bulk op of a
    # thousand records is not taken for one write.
    op_weight: Callable[[Any], int] | None = None


# --------------------------------------------------------------------------
# Messages between replicas of one group


@dataclass(slots=True, frozen=True, kw_only=True)
class Message:
    src: str
    dst: str
    group: int
    term: int


@dataclass(slots=True, frozen=True, kw_only=True)
class Begin(Message):
    """Start of term `term`: promise to ignore older terms, tell me your log."""


@dataclass(slots=True, frozen=True, kw_only=True)
class BeginOk(Message):
    last_term: int
    last_seq: int
    commit: int


@dataclass(slots=True, frozen=True, kw_only=True)
class StaleTerm(Message):
    """Answer to any request from an older term; `term` is the newer one."""


@dataclass(slots=True, frozen=True, kw_only=True)
class Fetch(Message):
    """A starting leader asks for the entries after `prev_seq`, provided the
    responder's entry at `prev_seq` has term `prev_term`."""

    prev_term: int
    prev_seq: int


@dataclass(slots=True, frozen=True, kw_only=True)
class FetchReply(Message):
    ok: bool
    prev_seq: int  # echoed with prev_term: the fetcher's log may change
    prev_term: int  # between two Fetches at the same seq (snapshot install)
    entries: tuple[Entry, ...] = ()
    hint_seq: int = 0  # on mismatch: back up to at most here (see Raft §5.3)
    hint_term: int = 0


@dataclass(slots=True, frozen=True, kw_only=True)
class Append(Message):
    prev_term: int
    prev_seq: int
    entries: tuple[Entry, ...]
    commit: int


@dataclass(slots=True, frozen=True, kw_only=True)
class AppendReply(Message):
    ok: bool
    prev_seq: int  # echoed, to recognise the answer to the in-flight Append
    match: int = 0  # ok: my log equals the leader's up to here, durably
    hint_seq: int = 0  # not ok: my log cannot match beyond hint_seq ...
    hint_term: int = 0  # ... whose term is hint_term


@dataclass(slots=True, frozen=True, kw_only=True)
class Heartbeat(Message):
    commit: int  # min(the leader's commit, the follower's match): what the follower may learn
    round: int  # read-index confirmation round (0 = none yet)
    # The leader's own commit, unclamped: a re-syncing follower that holds it at
    # the leader's term holds every committed entry (None from an older sender).
    leader_commit: int | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class HeartbeatReply(Message):
    round: int
    # Set only when a follower announces itself unasked (after a restart, on
    # learning its term's leader from meta): the commit it knows, which may be
    # below what the leader told its previous incarnation.
    commit: int | None = None


@dataclass(slots=True, frozen=True, kw_only=True)
class SnapshotNeeded(Message):
    """The sender no longer has the entries the receiver needs: download the
    sender's snapshot at `snap_seq` and report `SnapshotInstalled`.

    `digest` (xxh3-128 hex) and `size` (bytes) of the archive are set by
    the sender's shell as it sends (the core knows no files): the
    downloader checks what it fetches against these, never against what
    the HTTP answer claims. None from the core; a receiver downloads
    nothing on a message without them."""

    snap_term: int
    snap_seq: int
    digest: str | None = None
    size: int | None = None


# --------------------------------------------------------------------------
# Events from the I/O shell


@dataclass(slots=True, frozen=True)
class MetaView:
    """Meta's current assignment for the group.  `conf_ver` is the seq of
    the config entry meta last recorded (0: the bootstrap configuration)."""

    term: int
    leader: str | None
    voters: tuple[str, ...]
    learners: tuple[str, ...] = ()
    conf_ver: int = 0


@dataclass(slots=True, frozen=True)
class ClientWrite:
    req: Any
    op: Any
    ack: AckMode = "quorum"
    rid: str | None = None


@dataclass(slots=True, frozen=True)
class ClientWriteMany:
    """Several writes at once: those not already known by rid become ONE
    entry, answered together by one ReplyMany on success (or, with one new
    write and no rid repeated, a plain "op" entry and a Reply); a write whose rid is
    already applied or pending gets its own Reply (with `idx` its position
    in the entry that holds it). Failures are Replies, write by write."""

    reqs: tuple[Any, ...]
    ops: tuple[Any, ...]
    ack: AckMode = "quorum"
    rids: tuple[str | None, ...] = ()


@dataclass(slots=True, frozen=True)
class ClientRead:
    req: Any
    query: Any
    consistency: Consistency = "strong"
    min_seq: int = 0
    deadline: int = 0  # absolute ms on this replica's clock (the one `now` comes from)


@dataclass(slots=True, frozen=True)
class Tick:
    pass


@dataclass(slots=True, frozen=True)
class TransferLeader:
    target: str


@dataclass(slots=True, frozen=True)
class ChangeMembership:
    """Exactly one of add_learner / promote / remove."""

    req: Any = None
    add_learner: str | None = None
    promote: str | None = None
    remove: str | None = None


@dataclass(slots=True, frozen=True)
class Compact:
    """The plugin has durably snapshotted its state at `seq`."""

    seq: int
    # The TakeSnapshot meta the shell wrote beside it, when it had one: the
    # core keeps only two prepared metas, and one it dropped meanwhile (the
    # shell skips or defers points) would cost a replay of the dedup table.
    meta: SnapshotMeta | None = field(default=None, compare=False)


@dataclass(slots=True, frozen=True)
class SnapshotInstalled:
    """The shell downloaded a snapshot and restored the plugin from it."""

    meta: SnapshotMeta


Event: TypeAlias = (
    MetaView | ClientWrite | ClientRead | Tick | TransferLeader | ChangeMembership | Compact | SnapshotInstalled
)


# --------------------------------------------------------------------------
# Effects for the I/O shell


@dataclass(slots=True)
class Persist:
    """Make durable: `term`, `snapshot` (drop entries up to its seq), drop
    entries after `truncate_after`, append `entries`, `commit` (each None or
    empty when unchanged). The order, and what may and may not be performed
    before it is durable, is the durability contract in worker/replica.py
    ("Durability contract with the I/O shell"), stated there once."""

    term: int | None = None
    entries: tuple[Entry, ...] = ()
    truncate_after: int | None = None
    commit: int | None = None
    snapshot: SnapshotMeta | None = None


@dataclass(slots=True, frozen=True)
class Send:
    msg: Message


@dataclass(slots=True, frozen=True)
class Apply:
    """Committed entries, in order, each exactly once per incarnation.  All
    kinds are included: the shell hands ops to the plugin and reports config
    entries to meta."""

    entries: tuple[Entry, ...]


@dataclass(slots=True, frozen=True)
class Reply:
    req: Any
    ok: bool
    seq: int = 0
    term: int = 0
    error_code: str | None = None
    leader: str | None = None
    idx: int | None = None  # the write's position in an "ops" entry


@dataclass(slots=True, frozen=True)
class ReplyMany:
    """The success of the fresh writes of one ClientWriteMany, all in the "ops"
    entry at `seq`: the same as `Reply(reqs[i], True, seq, term, None, leader, i)`
    for each i, as one effect (a batch costs one waiter and one reply, not one
    per write)."""

    reqs: tuple[Any, ...]
    seq: int
    term: int
    leader: str | None


@dataclass(slots=True, frozen=True)
class ServeRead:
    """Run the query now: applied_seq >= at_seq already holds."""

    req: Any
    at_seq: int


@dataclass(slots=True, frozen=True)
class ReportReady:
    term: int


@dataclass(slots=True, frozen=True)
class ReportQuorum:
    """The leader of `term` lost (ok=False) or regained (ok=True) round trips
    with a majority of its voters within `lease_ms`: tell meta now."""

    term: int
    ok: bool


@dataclass(slots=True, frozen=True)
class TransferReady:
    """Ask meta to CAS the leadership to `target` (expect_term=`term`)."""

    target: str
    term: int
    last_seq: int


@dataclass(slots=True, frozen=True)
class NeedMetaView:
    """A peer spoke at `term`, above every term meta has shown this replica:
    fetch the group's assignment from meta now and deliver it as a MetaView.
    The core adopts terms only from meta's views (the term cap: no term meta has not published), so until the
    view comes the message is not acted on.  The core asks at most once per
    `retry_ms` for a term it already asked about; the shell should also keep
    at most one fetch in flight."""

    term: int


@dataclass(slots=True, frozen=True)
class SetTimer:
    """Deliver Tick() at or before `at`; replaces any earlier request."""

    at: int


@dataclass(slots=True, frozen=True)
class TakeSnapshot:
    """The Apply just before this effect ends at `seq`: snapshot the plugin
    now, before applying anything else, and deliver Compact(seq) once the
    snapshot is written.  The core has kept its own state as of `seq`, so
    that Compact costs it nothing."""

    seq: int
    # What Compact(seq) will most likely install (the core's state as of
    # `seq`): with it the shell writes the whole archive beside the plugin's
    # files, off the group's path, and the install only moves the WAL.
    meta: SnapshotMeta | None = field(default=None, compare=False)
    # Client writes applied since the previous TakeSnapshot (at least
    # snapshot_every): the shell spaces snapshots by state size with it.
    writes: int = field(default=0, compare=False)


@dataclass(slots=True, frozen=True)
class DownloadSnapshot:
    """Fetch `source`'s current snapshot (seq >= `seq`), restore the plugin
    from it and deliver SnapshotInstalled.  The shell should drop duplicate
    requests while one download is running."""

    source: str
    term: int
    seq: int
    # What the source published for its archive (SnapshotNeeded): the
    # download must be exactly this snapshot, of this size and digest.
    snap_term: int | None = None
    digest: str | None = None
    size: int | None = None


Effect: TypeAlias = (
    Persist | Send | Apply | Reply | ReplyMany | ServeRead | ReportReady | ReportQuorum | TransferReady | NeedMetaView
    | SetTimer | DownloadSnapshot | TakeSnapshot
)
