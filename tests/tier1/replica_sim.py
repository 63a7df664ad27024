"""Deterministic simulation of one shard group around worker/replica.py.

`run_seed(seed)` drives 3-5 replicas, a model of meta and clients with one
`random.Random(seed)`, and checks the replication invariants after every
handle() call; it raises `SimViolation` at the first breach.

What is modelled
----------------
* network: per-message random delay (so reordering) with an optional heavy
  tail, loss, duplication,
  partitions that come and go (checked when a message is sent);
* disk, per replica: `durable` state plus the Persists performed but not yet
  fsynced.  The shell contract is followed literally: pending Persists are
  fsynced before the next non-Persist effect of the list is performed.  A
  crash can hit between any two effects: a process crash (SIGKILL) keeps
  what was written, a power loss drops it.  Restart builds a new Replica
  from the durable state;
* meta: (term, leader, voters, learners, conf_ver); compare-and-sets a new
  term naming ANY voter -- at random, the stalest one or the one with the
  newest (maybe unreplicated) tail -- delivers views late, lost, duplicated
  and occasionally stale; fails over when no leader is ready; handles
  TransferReady and records config entries as they are applied; answers a
  replica's NeedMetaView with its view (now and then a stale one);
* forged messages: a Begin, Append, Heartbeat or StaleTerm from a term meta
  has not published (one above its term up to far above), from a member or
  an outsider;
* a nemesis aimed at leaders: cut off right after appending its term start
  (a failover that dies at birth) or a client write, right after committing
  something, or soon after being named; killed after its Appends of fresh
  entries left but before its own Persist of them;
* clients: writes with unique values and rids (ack quorum / all / leader),
  retried with the same rid elsewhere after not_leader / quorum_timeout /
  silence, and re-sent after they were acknowledged (a lost response) --
  always within the dedup window of their first send, as the API asks;
  strong and follower reads; transfers; membership changes;
  compactions and snapshot downloads (an instant copy of the source's
  durable snapshot);
* clocks: every node's `now` is its own monotonic clock (the sim's time plus
  an offset drawn anew at each start: a reboot may begin anywhere), and each
  node has a wall clock, skewed by up to hours and stepped now and then,
  which nothing in the core may read (a planted bug does: it must be caught);
* meta's isolation failover (check-quorum): the rule of meta/controller.py
  (`isolation_evidence`) over the leader's has_quorum and the followers'
  silence, with its decision window;
* quiet windows (profile "isolation"): no crash, no loss, no meta whim; the
  current leader is cut from its followers (both ways, or one direction)
  while meta still hears everyone, or the link to the current leader flaps.

Invariants (checked incrementally)
----------------------------------
* at most one replica acts as leader (ready or not) per term;
* a replica's term never decreases, including across restarts: the durable
  term is >= every term the previous incarnation sent a message with;
* no replica holds or persists a term above meta's (the term cap);
* log matching: per replica, a rolling hash of its log prefix; an entry with
  the same (term, seq) on two replicas must have the same prefix hash;
* the committed log `C` is what replicas have applied (Apply effects that
  were performed); a replica never applies anything that disagrees with it
  (state machine safety), applies in order, and never truncates an entry of
  it;
* leader completeness: a leader's log holds all of C committed in earlier
  terms when its Begin round adopts a log (it appends its term start) and
  when it reports ready;
* commit survival, i.e. what "committed" means: whenever C grows, every
  majority of meta's voters, if it answered a Begin round now, would make
  the leader adopt a log holding all of C.  This flags an unsafe commit
  (Raft Figure 8, an ack before fsync) before anybody overwrites it;
* every write acknowledged with ack=quorum|all is in C at the seq it was
  acknowledged with, and at the end exactly once; no rid is in C twice;
* a strong read is served at a state that includes every quorum write
  acknowledged before the read was issued; a follower read honours min_seq;
* exactly-once: a write re-sent within the dedup window is answered with the
  seq it was acknowledged at, and no rid is ever committed twice;
* availability: after a cut that leaves the other voters a connected
  majority, one of them is the ready leader (with its quorum) within a bound;
  a flapping link changes the leadership at most once per decision window.
At the end everything heals and the group must converge within a bound.

Seeds draw one of four profiles: "mixed" (every knob varies), "failover"
(a storm of short-lived leaders on three replicas with tiny batches),
"clocks" (a short dedup window, wildly skewed wall clocks, lost responses)
and "isolation" (quiet windows with long, one-way and flapping cuts).
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meta.controller import ISOLATION_HOLD_LEASES, isolation_evidence
from tests.support.sim_checks import CommittedLog, SimViolation
from worker.replica import Replica
from worker.replica_msgs import (
    Append,
    Apply,
    Begin,
    ChangeMembership,
    ClientRead,
    ClientWrite,
    ClientWriteMany,
    Compact,
    Config,
    DownloadSnapshot,
    Entry,
    Heartbeat,
    HeartbeatReply,
    Message,
    MetaView,
    Persist,
    NeedMetaView,
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
    StaleTerm,
    StoredState,
    TakeSnapshot,
    Tick,
    TransferLeader,
    TransferReady,
    entry_rids,
)

GROUP = 0
WALL_EPOCH = 1_796_000_000_000  # what a wall clock reads at the sim's time 0 (Dec 2026, in ms)
RESEND_MARGIN_MS = 10  # a retry is sent this much inside the window: it still has to arrive


def early_append_end(out: list[Any]) -> int | None:
    """The index of the first Persist when an Append is sent before it and
    it holds entries (a leader replicating fresh entries before its own
    fsync), else None."""
    sent = False
    for i, eff in enumerate(out):
        t = type(eff)
        if t is Persist:
            return i if sent and eff.entries else None
        if t is Send and type(eff.msg) is Append:
            sent = True
    return None


def leads(r: Replica) -> bool:
    """Acting as the leader of its term, ready or still starting it."""
    return r.role in ("leader", "candidate")


def entry_hash(prev: int, e: Entry) -> int:
    return hash((prev, e.term, e.seq, e.kind, e.data, e.rid))


@dataclass(slots=True)
class Disk:
    term: int = 0
    entries: list[Entry] = field(default_factory=list)
    snapshot: SnapshotMeta | None = None
    commit: int = 0
    # The log was thrown away after (simulated) corruption; cleared once the
    # replica reports it has re-synced and that state is durable.
    resync: bool = False

    def apply(self, p: Persist) -> None:
        if p.term is not None:
            if p.term < self.term:
                raise SimViolation(f"durable term decreases {self.term} -> {p.term}")
            self.term = p.term
        if p.snapshot is not None:
            s = p.snapshot.seq
            self.snapshot = p.snapshot
            self.entries = [e for e in self.entries if e.seq > s]
        if p.truncate_after is not None:
            t = p.truncate_after
            base = self.snapshot.seq + 1 if self.snapshot else 1
            del self.entries[max(t + 1 - base, 0) :]
        if p.entries:
            self.entries.extend(p.entries)
        if p.commit is not None:
            self.commit = p.commit

    def stored(self) -> StoredState:
        return StoredState(self.term, list(self.entries), self.snapshot, self.commit, self.resync)


@dataclass(slots=True)
class Node:
    name: str
    disk: Disk = field(default_factory=Disk)
    replica: Replica | None = None
    inc: int = 0  # incarnation: stale timers and downloads are ignored
    pending: list[Persist] = field(default_factory=list)
    h: list[int] = field(default_factory=lambda: [0])  # prefix hash per seq
    applied: int = 0
    term_seen: int = 0  # in-memory term of this incarnation
    sent_term: int = 0  # highest term this node ever put on the wire
    timer_at: int = -1
    down_until: int = 0
    mono: int = 0  # this incarnation's clock: its `now` is the sim's time plus this
    wall: int = 0  # its wall clock's offset from the sim's time (only planted bugs read it)


@dataclass(slots=True)
class WriteOp:
    id: int
    rid: str
    value: int
    ack: str
    attempts: int = 0
    done: bool = False
    seq: int = 0
    first_sent: int = 0


@dataclass(slots=True)
class ReadOp:
    id: int
    consistency: str
    min_seq: int  # what it must observe
    done: bool = False


@dataclass(slots=True)
class Params:
    nodes: int
    voters: int
    chaos_ms: int
    step_ms: tuple[int, int]
    delay: tuple[int, int]
    tail: float  # share of messages that are very late (GC pause, retransmit)
    loss: float
    dup: float
    mid_crash: float
    power_share: float
    meta_rate: float  # chance per driver step that meta names a new leader
    nemesis: float  # scales the targeted strikes at leaders (see Sim.perform)
    patience_ms: int  # how long meta waits for a ready leader before failing over
    cfg: ReplicaConfig
    profile: str = "mixed"
    resend: float = 0.0  # share of driver steps that re-send an acknowledged write (a lost response)
    wall_skew_ms: int = 0  # wall clocks are off by up to this much
    quiet_weight: float = 0.0  # driver weight of a quiet window with a cut on the leader
    forge: float = 0.0  # share of driver steps that inject a message from a term meta has not published


PROFILES = ("mixed", "failover", "clocks", "isolation")
HOUR_MS = 3_600_000


def sim_weight(op: Any) -> int:
    """A deterministic weight of 1..4 per simulated op (its value)."""
    return 1 + op % 4 if isinstance(op, int) else 1


def sim_bytes(e: Entry) -> int:
    """A deterministic stand-in for an entry's encoded size."""
    return 8 + len(repr(e.data))


def draw_params(rng: random.Random, profile: str | None = None) -> Params:
    """Everything about a run that is not the schedule itself.

    "mixed" varies every knob.  "failover" is a storm of leader changes on a
    small group with tiny batches, where new leaders are often lost right
    after being named: the shape Raft's Figure 8 needs (an old-term tail
    replicated separately from the term-start entry, higher-term leftovers
    on a minority)."""
    if profile is None:
        x = rng.random()
        profile = "failover" if x < 0.25 else "clocks" if x < 0.4 else "isolation" if x < 0.55 else "mixed"
    if profile == "clocks":
        # A dedup window short enough to expire within a run, clients that
        # re-send acknowledged writes, wall clocks hours apart, many leaders.
        return Params(
            nodes=3,
            voters=3,
            chaos_ms=rng.randint(1500, 3000),
            step_ms=(4, 16),
            delay=(1, rng.choice((5, 15))),
            tail=0.0,
            loss=rng.choice((0.0, 0.02)),
            dup=0.0,
            mid_crash=0.004,
            power_share=0.5,
            meta_rate=rng.choice((0.05, 0.1)),
            nemesis=0.0,
            patience_ms=200,
            cfg=ReplicaConfig(
                heartbeat_ms=50,
                lease_ms=rng.choice((200, 400)),
                retry_ms=100,
                quorum_timeout_ms=600,
                max_batch_entries=rng.choice((2, 64)),
                transfer_timeout_ms=500,
                snapshot_retry_ms=400,
                snapshot_every=rng.choice((0, 5)),
                dedup_window_ms=rng.choice((250, 500, 1000)),
            ),
            profile=profile,
            resend=0.15,
            wall_skew_ms=rng.choice((15 * 60_000, 2 * HOUR_MS, 48 * HOUR_MS)),
        )
    if profile == "isolation":
        hb = rng.choice((20, 50))
        nodes = rng.choice((3, 3, 5))
        return Params(
            nodes=nodes,
            voters=nodes if rng.random() < 0.5 else 3,
            chaos_ms=rng.randint(5000, 8000),
            step_ms=(4, 16),
            delay=(1, rng.choice((5, 15))),
            tail=rng.choice((0.0, 0.05)),
            loss=rng.choice((0.0, 0.02)),
            dup=rng.choice((0.0, 0.02)),
            mid_crash=0.002,
            power_share=0.5,
            meta_rate=0.02,
            nemesis=rng.choice((0.0, 0.3)),
            patience_ms=300,
            cfg=ReplicaConfig(
                heartbeat_ms=hb,
                lease_ms=hb * rng.choice((4, 6)),
                retry_ms=rng.choice((50, 100)),
                quorum_timeout_ms=600,
                max_batch_entries=rng.choice((2, 64)),
                transfer_timeout_ms=500,
                snapshot_retry_ms=400,
                snapshot_every=rng.choice((0, 10)),
            ),
            profile=profile,
            resend=0.05,
            quiet_weight=6.0,
        )
    if profile == "failover":
        return Params(
            nodes=3,
            voters=3,
            chaos_ms=rng.randint(1500, 2500),
            step_ms=(4, 16),
            delay=(1, rng.choice((5, 15))),
            tail=rng.choice((0.0, 0.1)),
            loss=rng.choice((0.02, 0.05)),
            dup=0.0,
            mid_crash=0.01,
            power_share=0.5,
            meta_rate=rng.choice((0.03, 0.06)),
            nemesis=rng.choice((0.3, 0.6)),
            patience_ms=rng.choice((100, 200)),
            cfg=ReplicaConfig(
                heartbeat_ms=50,
                lease_ms=rng.choice((150, 300)),
                retry_ms=rng.choice((100, 200)),
                quorum_timeout_ms=600,
                max_batch_entries=rng.choice((1, 2)),
                max_batch_ops=rng.choice((2, 4096)),
                transfer_timeout_ms=500,
                snapshot_retry_ms=400,
            ),
            profile=profile,
            forge=rng.choice((0.0, 0.02)),
        )
    nodes = rng.choice((3, 3, 4, 5))
    voters = 3 if nodes > 3 and rng.random() < 0.7 else nodes
    heat = rng.choice((0.5, 1.0, 1.0, 2.0, 4.0))
    heartbeat = rng.choice((50, 100, 500))
    return Params(
        nodes=nodes,
        voters=voters,
        chaos_ms=rng.randint(1500, 3000),
        step_ms=(4, 16),
        delay=(1, rng.choice((5, 15, 30))),
        tail=rng.choice((0.0, 0.05)),
        loss=min(rng.choice((0.0, 0.02, 0.05)) * heat, 0.25),
        dup=rng.choice((0.0, 0.02)),
        mid_crash=0.004 * heat,
        power_share=0.5,
        meta_rate=rng.choice((0.02, 0.05, 0.1)) * min(heat, 2.0),
        nemesis=rng.choice((0.0, 0.3)),
        patience_ms=600,
        cfg=ReplicaConfig(
            # 500: followers learn the last commit of a burst only from the commit notice.
            heartbeat_ms=heartbeat,
            lease_ms=heartbeat * rng.choice((3, 5)),
            commit_notice_ms=rng.choice((5, 20)),
            retry_ms=rng.choice((100, 200)),
            quorum_timeout_ms=600,
            max_batch_entries=rng.choice((1, 2, 3, 8, 64)),
            max_batch_ops=rng.choice((3, 4096)),
            transfer_timeout_ms=500,
            snapshot_retry_ms=400,
            promote_max_lag=rng.choice((2, 64)),
            snapshot_every=rng.choice((0, 3, 10)),
            # Some ops stand for several client writes (a plugin's bulk op):
            # snapshot points and catch-up messages count by weight.
            op_weight=rng.choice((None, sim_weight)),
            # A third of the runs bound Appends by bytes too, a few entries
            # each (from a value already drawn: no draw of its own, so every
            # seed keeps the rest of its scenario).
            max_batch_bytes=40 if heartbeat == 100 else 8 << 20,
            entry_bytes=sim_bytes if heartbeat == 100 else None,
        ),
        resend=rng.choice((0.0, 0.02)),
        forge=rng.choice((0.0, 0.01, 0.03)),
    )


class Sim:
    def __init__(
        self, seed: int, replica_cls: type[Replica] = Replica, verbose: bool = False, profile: str | None = None
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.p = draw_params(self.rng, profile)
        self.replica_cls = replica_cls
        self.verbose = verbose
        self.now = 0
        self.queue: list[tuple[int, int, Callable[[Any], None], Any]] = []
        self.counter = 0
        self.steps = 0
        self.names = [f"n{i}" for i in range(self.p.nodes)]
        self.nodes = {n: Node(n) for n in self.names}
        skew = self.p.wall_skew_ms
        for node in self.nodes.values():
            node.wall = self.rng.randint(-skew, skew) if skew else 0
        self.cut: set[tuple[str, str]] = set()
        self.cut_id = 0  # heal(id) heals only the cut it was scheduled for
        self.converging = False
        # Quiet windows: no crash, loss or meta whim while a cut on the leader
        # is judged for availability (or a flapping link for stability).
        self.quiet: str | None = None
        self.quiet_until = 0
        self.quiet_term = 0
        self.quiet_started = 0
        self.m_isolation_at: int | None = None  # meta's decision window (see meta/controller.py)
        # meta
        self.m_term = 0
        self.m_leader: str | None = None
        self.m_voters: tuple[str, ...] = tuple(self.names[: self.p.voters])
        self.m_learners: tuple[str, ...] = ()
        self.m_conf_ver = 0
        self.m_changed_at = 0
        self.m_views: list[MetaView] = []
        # checker state
        # The committed log (keys: prefix hashes, C[seq]) and the clients'
        # acknowledgements, checked as the shell simulator checks them.
        self.commits = CommittedLog(self.fail, origin=0)
        self.answered: set[tuple[str, Any]] = set()  # (node, req) of every write reply
        self.C_term: list[int] = [0]
        # An upper bound on the term each committed entry was committed in: the
        # term of the replica that applied it first (it learned the commit from
        # a leader of that term or an earlier one).
        self.C_by: list[int] = [0]
        self.known: dict[tuple[int, int], int] = {}
        self.leader_of: dict[int, str] = {}
        self.max_acked = 0
        # clients
        self.writes: dict[int, WriteOp] = {}
        self.reads: dict[int, ReadOp] = {}
        self.next_id = 0
        self.acked_ops: list[WriteOp] = []  # quorum/all writes in the order they were acknowledged
        self.resends: set[tuple[int, int]] = set()  # (write, attempt) of each lost-response re-send
        self.stats: Counter[str] = Counter()  # what a run exercised

    # ------------------------------------------------------------------
    # plumbing

    def at(self, t: int, fn: Callable[[Any], None], arg: Any = None) -> None:
        self.counter += 1
        heapq.heappush(self.queue, (max(t, self.now), self.counter, fn, arg))

    def log(self, text: str) -> None:
        if self.verbose:
            print(f"{self.now:6d} {text}")

    def fail(self, text: str) -> None:
        raise SimViolation(f"seed {self.seed} t={self.now}: {text}")

    @property
    def calm(self) -> bool:
        """No faults now: converging, or in a quiet window."""
        return self.converging or self.quiet is not None

    def clock(self, node: Node) -> int:
        """The node's monotonic clock: what its replica gets as `now`."""
        return self.now + node.mono

    def wall_clock(self, node: Node) -> int:
        return WALL_EPOCH + self.now + node.wall

    def run(self) -> None:
        self.log(f"PARAMS {self.p}")
        for n in self.names:
            self.start(self.nodes[n])
        self.meta_cas(self.m_voters[0])
        self.at(1, self.drive)
        self.at(50, self.meta_watch)
        if self.p.wall_skew_ms:
            self.at(self.rng.randint(100, 600), self.step_wall)
        self.at(self.p.chaos_ms, self.begin_convergence)
        limit = self.p.chaos_ms + 15_000
        while self.queue:
            t, _, fn, arg = heapq.heappop(self.queue)
            self.now = t
            if t > limit:
                self.fail(f"did not converge by {limit} ms: {self.status()}")
            fn(arg)
            if self.converged:
                break
        else:
            self.fail("event queue ran dry")
        self.final_checks()

    def status(self) -> str:
        parts = [f"meta term={self.m_term} leader={self.m_leader} voters={self.m_voters} learners={self.m_learners}"]
        for n in self.names:
            r = self.nodes[n].replica
            if r is None:
                parts.append(f"{n}:down")
            else:
                parts.append(
                    f"{n}:{r.role} t{r.term} last=({r.last_term},{r.last_seq}) c{r.commit_seq} a{r.applied_seq} "
                    f"cfg={r.voters}/{r.learners}"
                )
        return " | ".join(parts)

    # ------------------------------------------------------------------
    # replicas and the shell contract

    def start(self, node: Node) -> None:
        d = node.disk
        if d.term < node.sent_term:
            self.fail(f"{node.name} restarted at term {d.term} after sending at {node.sent_term}")
        node.replica = self.replica_cls(node.name, GROUP, self.p.cfg, d.stored())
        if hasattr(node.replica, "wall_clock"):
            # Only a planted bug reads a wall clock; give it this node's.
            node.replica.wall_clock = lambda node=node: self.wall_clock(node)
        # A new incarnation's clock may start anywhere (a reboot resets it).
        node.mono = self.rng.randint(0, 10**9)
        node.inc += 1
        node.pending = []
        node.term_seen = d.term
        node.timer_at = -1
        self.rebuild_shadow(node)
        node.applied = d.snapshot.seq if d.snapshot else 0
        self.log(f"START {node.name} term={d.term} snap={node.applied} last={len(node.h) - 1}")
        self.deliver(node, Tick())
        self.send_view(node, self.rng.randint(1, 20))

    def deliver(self, node: Node, ev: Any) -> None:
        r = node.replica
        if r is None:
            return
        self.steps += 1
        if self.verbose:
            self.log(f"-> {node.name} {ev}")
        if type(ev) is Heartbeat and ev.commit > r.commit_seq and ev.term == r.term:
            self.stats["commit_from_heartbeat"] += 1  # a notice, or the periodic backstop
        if type(ev) is HeartbeatReply and ev.commit is not None and ev.commit < r.commit_seq and r.role == "leader":
            self.stats["announce_behind"] += 1  # a restarted follower tells the leader what it forgot
        try:
            out = r.handle(ev, self.clock(node))
        except AssertionError as exc:
            self.fail(f"{node.name} raised on {ev}: {exc}")
        crash_at = None
        if not self.calm and out and self.rng.random() < self.p.mid_crash:
            crash_at = self.rng.randint(0, len(out))
        elif (early := early_append_end(out)) is not None and self.nemesis_roll(0.3):
            # A leader dies after its Appends left but before its own copy
            # of their entries is durable: the followers may hold what it
            # lost (half of these crashes are power losses).
            crash_at = early
        self.perform(node, r, out, crash_at)
        if node.replica is r:
            self.check_replica(node, r)

    def perform(self, node: Node, r: Replica, out: list[Any], crash_at: int | None) -> None:
        early = early_append_end(out) if crash_at is not None else None
        for i, eff in enumerate(out):
            if i == crash_at:
                self.stats["crash_mid_list"] += 1
                if early is not None and i <= early:
                    self.stats["crash_after_early_append"] += 1
                self.crash(node)
                return
            t = type(eff)
            self.stats[t.__name__] += 1
            if t is Persist:
                if eff.term is not None and eff.term > self.m_term:
                    self.fail(f"{node.name} persists term {eff.term}, above meta's {self.m_term}")
                self.shadow_persist(node, eff)
                node.pending.append(eff)
                if eff.entries and leads(r) and self.strike_after_append(r, eff):
                    self.isolate(node.name)
                continue
            if node.pending:
                self.fsync(node)
            if self.verbose:
                self.log(f"   {node.name} {eff}")
            if t is Send:
                self.net_send(node, eff.msg)
            elif t is Apply:
                self.on_apply(node, eff.entries)
                if leads(r) and self.nemesis_roll(0.2):
                    # ... or dies right after committing something.
                    self.isolate(node.name)
            elif t is Reply:
                self.on_reply(node, eff)
            elif t is ReplyMany:
                # One effect for a batch: checked as the Replies it stands for.
                for i, req in enumerate(eff.reqs):
                    self.on_reply(node, Reply(req, True, eff.seq, eff.term, None, eff.leader, i))
            elif t is ServeRead:
                self.on_serve(node, r, eff)
            elif t is SetTimer:
                node.timer_at = eff.at
                self.at(eff.at - node.mono, self.fire_timer, (node, node.inc, eff.at))
            elif t is ReportQuorum:
                if eff.term != r.term or not leads(r) or eff.ok != r.has_quorum:
                    self.fail(f"{node.name} reports quorum {eff} as {r.role} t{r.term} has_quorum={r.has_quorum}")
                self.stats["quorum_regained" if eff.ok else "quorum_lost"] += 1
            elif t is ReportReady:
                self.on_ready(node, r, eff.term)
            elif t is TransferReady:
                if eff.term == self.m_term:
                    self.at(self.now + self.rng.randint(1, 20), self.meta_transfer, (eff.term, eff.target))
            elif t is NeedMetaView:
                # The shell fetches meta's view; now and then from a meta node
                # that lags (an older view): the core must ask again.
                stale = self.m_views and not self.calm and self.rng.random() < 0.1
                self.send_view(node, self.rng.randint(1, 20), self.rng.choice(self.m_views) if stale else None)
            elif t is DownloadSnapshot:
                self.at(self.now + self.rng.randint(2, 40), self.snapshot_done, (node, node.inc, eff.source))
            elif t is TakeSnapshot:
                if eff.seq != node.applied:
                    self.fail(f"{node.name} asked for a snapshot at {eff.seq} with the plugin at {node.applied}")
                # The plugin's snapshot is written off the loop: Compact comes later.
                self.at(self.now + self.rng.randint(1, 30), self.snapshot_written, (node, node.inc, eff.seq))
            else:
                self.fail(f"unknown effect {eff}")
        if crash_at == len(out):
            self.stats["crash_before_fsync"] += 1
            self.crash(node)
            return
        # With nothing pending, every earlier Persist is durable: the resync marker may go.
        self.fsync(node)

    def fsync(self, node: Node) -> None:
        for p in node.pending:
            node.disk.apply(p)
        node.pending = []
        if node.disk.resync and node.replica is not None and not node.replica.resyncing:
            node.disk.resync = False

    def fire_timer(self, arg: tuple[Node, int, int]) -> None:
        node, inc, at = arg
        if node.inc == inc and node.timer_at == at:
            self.deliver(node, Tick())

    def crash(self, node: Node, power: bool | None = None) -> None:
        if node.replica is None:
            return
        if power is None:
            power = self.rng.random() < self.p.power_share
        if not power:
            self.fsync(node)  # written to the page cache: survives SIGKILL
        node.pending = []
        settled = all(
            (n.replica is None or set(n.replica.voters) == set(self.m_voters))
            and all(set(e.data.voters) == set(self.m_voters) for e in n.disk.entries if e.kind == "config")
            for n in self.nodes.values()
        )
        # One lost disk at a time, in a group of 3+ voters with no membership
        # change in flight: more than that is beyond the fault model (no
        # majority of intact voters could remain).
        if self.rng.random() < 0.08 and len(self.m_voters) >= 3 and settled and \
                not any(n.disk.resync for n in self.nodes.values()):
            # The WAL came back corrupt: the shell discards the log, keeps
            # the term and its last snapshot (worker/group.py), and the replica
            # re-syncs without voting. With the snapshot it may hold a prefix of
            # the leader's log at the leader's term and still lack entries it
            # acknowledged.
            d = node.disk
            snap = d.snapshot if self.rng.random() < 0.5 else None
            node.disk = Disk(term=d.term, snapshot=snap, commit=snap.seq if snap else 0, resync=True)
            self.stats["crash_disk_lost"] += 1
        node.replica = None
        node.inc += 1
        self.rebuild_shadow(node)
        self.log(f"CRASH {node.name} ({'power' if power else 'kill'})")
        self.stats["crash_power" if power else "crash_kill"] += 1
        delay = self.rng.randint(20, 400)
        node.down_until = self.now + delay
        self.at(self.now + delay, self.restart, node)

    def rebuild_shadow(self, node: Node) -> None:
        """The shadow log of a replica that is down is its durable log."""
        d = node.disk
        snap = d.snapshot.seq if d.snapshot else 0
        if snap >= len(self.commits.keys):
            self.fail(f"{node.name} has an uncommitted snapshot at {snap}")
        h = self.commits.keys[: snap + 1]
        for e in d.entries:
            h.append(entry_hash(h[-1], e))
        node.h = h

    def restart(self, node: Node) -> None:
        if node.replica is None and self.now >= node.down_until:
            self.start(node)

    # ------------------------------------------------------------------
    # checks

    def shadow_persist(self, node: Node, p: Persist) -> None:
        h = node.h
        if p.snapshot is not None:
            s = p.snapshot.seq
            if s >= len(self.commits.keys) or p.snapshot.term != self.C_term[s]:
                self.fail(f"{node.name} installs snapshot {s} that is not committed")
            if not (s < len(h) and h[s] == self.commits.keys[s]):
                if p.truncate_after != s:
                    self.fail(f"{node.name} keeps a log that contradicts snapshot {s}")
                h[:] = self.commits.keys[: s + 1]
        if p.truncate_after is not None:
            t = p.truncate_after
            if t + 1 < len(h):
                if t + 1 < len(self.commits.keys) and h[t + 1] == self.commits.keys[t + 1]:
                    self.fail(f"{node.name} truncates committed seq {t + 1}")
                del h[t + 1 :]
        known = self.known
        for e in p.entries:
            if e.seq != len(h):
                self.fail(f"{node.name} appends seq {e.seq} after {len(h) - 1}")
            if e.kind == "term_start":
                r = node.replica
                if r is not None and leads(r) and e.term == r.term:
                    # Our own term start: the log adopted by the Begin round
                    # must already hold everything committed (leader
                    # completeness, checked before the leader is even ready).
                    top = self.committed_before(e.term)
                    if top >= len(h) or h[top] != self.commits.keys[top]:
                        self.fail(f"leader completeness: {node.name} adopted a log without committed seq {top}")
            x = entry_hash(h[-1], e)
            k = (e.term, e.seq)
            was = known.setdefault(k, x)
            if was != x:
                self.fail(f"log matching: {node.name} has {k} with a different prefix")
            h.append(x)

    def check_replica(self, node: Node, r: Replica) -> None:
        if r.term < node.term_seen:
            self.fail(f"{node.name} term went back {node.term_seen} -> {r.term}")
        if r.term > self.m_term:
            self.fail(f"{node.name} is at term {r.term}, above meta's {self.m_term} (the term cap)")
        node.term_seen = r.term
        if leads(r):
            who = self.leader_of.setdefault(r.term, node.name)
            if who != node.name:
                self.fail(f"two leaders in term {r.term}: {who} and {node.name}")
        if r.last_seq != len(node.h) - 1:
            self.fail(f"{node.name} log ends at {r.last_seq} but its Persists say {len(node.h) - 1}")
        if r.applied_seq != node.applied:
            # only a snapshot install may move applied without Apply
            snap = r.snapshot_seq
            if r.applied_seq != snap or snap < node.applied:
                self.fail(f"{node.name} applied_seq {r.applied_seq} but Apply effects say {node.applied}")
            node.applied = snap
        c = r.commit_seq
        if c < len(self.commits.keys) and c < len(node.h) and node.h[c] != self.commits.keys[c]:
            self.fail(f"{node.name} believes seq {c} committed but it differs from the committed log")

    def on_apply(self, node: Node, entries: tuple[Entry, ...]) -> None:
        h = node.h
        C = self.commits.keys
        grew = len(C)
        for e in entries:
            s = e.seq
            self.commits.in_order(node.name, s, node.applied)
            if s >= len(h) or entry_hash(h[s - 1], e) != h[s]:
                self.fail(f"{node.name} applies an entry that is not in its log at {s}")
            if self.commits.applied(node.name, s, h[s], entry_rids(e)):
                self.C_term.append(e.term)
                self.C_by.append(node.replica.term if node.replica is not None else e.term)
                if e.kind == "ops":
                    self.stats["ops_entries_committed"] += 1
                if e.kind == "config":
                    self.meta_record_config(e)
            node.applied = s
        if len(C) > grew:
            self.check_commit_survives(node.name)

    def position(self, name: str) -> tuple[int, int]:
        """(last term, last seq) a replica would report in BeginOk now."""
        node = self.nodes[name]
        r = node.replica
        if r is not None:
            return r.last_term, r.last_seq
        d = node.disk
        if d.entries:
            return d.entries[-1].term, d.entries[-1].seq
        return (d.snapshot.term, d.snapshot.seq) if d.snapshot else (0, 0)

    def resyncing(self, name: str) -> bool:
        node = self.nodes[name]
        return node.replica.resyncing if node.replica is not None else node.disk.resync

    def check_commit_survives(self, by: str) -> None:
        """What "committed" means: whichever majority of voters answers the
        next Begin round, the log it adopts (greatest last (term, seq))
        holds everything committed.  Checked when the committed log grows,
        so an unsafe commit is caught before anybody overwrites it."""
        top = len(self.commits.keys) - 1
        want = self.commits.keys[top]
        voters = self.m_voters
        # A re-syncing replica answers no Begin, so it is in no promising majority.
        able = [v for v in voters if not self.resyncing(v)]
        pos = {v: self.position(v) for v in able}
        for k in range(len(voters) // 2 + 1, len(able) + 1):
            for group in itertools.combinations(able, k):
                best = max(group, key=pos.__getitem__)
                h = self.nodes[best].h
                if top >= len(h) or h[top] != want:
                    self.fail(
                        f"commit of seq {top} (applied by {by}) would not survive a Begin round "
                        f"answered by {group}: {best} would be adopted at {pos[best]} without it"
                    )

    def committed_before(self, term: int) -> int:
        """The last seq of C surely committed in a term before `term`: what
        Raft's leader completeness says a leader of `term` holds. (A leader
        of a term meta has superseded may become ready after a later term
        committed more: a replica never adopts a term from a message, only
        from meta's view, so a deposed leader may finish its Begin round on
        late answers. It can commit and read nothing: the replicas of the
        later term refuse its term.)"""
        top = len(self.commits.keys) - 1
        while top > 0 and self.C_by[top] >= term:
            top -= 1
        return top

    def on_ready(self, node: Node, r: Replica, term: int) -> None:
        top = self.committed_before(term)
        if top >= len(node.h) or node.h[top] != self.commits.keys[top]:
            self.fail(f"leader completeness: {node.name} ready in term {term} without committed seq {top}")
        self.log(f"READY {node.name} term {term}")

    def final_checks(self) -> None:
        for w in self.writes.values():
            if w.done and w.ack != "leader" and w.rid not in self.commits.acked:
                self.fail(f"write {w.rid} done but not recorded")

    # ------------------------------------------------------------------
    # network

    def net_send(self, node: Node, m: Message) -> None:
        if m.term > node.sent_term:
            node.sent_term = m.term
        if (m.src, m.dst) in self.cut:
            return
        rng = self.rng
        if not self.calm and rng.random() < self.p.loss:
            return
        lo, hi = self.p.delay
        delay = rng.randint(lo, hi)
        if not self.calm and rng.random() < self.p.tail:
            delay += rng.randint(30, 150)
        self.at(self.now + delay, self.net_arrive, m)
        if not self.calm and rng.random() < self.p.dup:
            self.at(self.now + rng.randint(lo, 3 * hi), self.net_arrive, m)

    def net_arrive(self, m: Message) -> None:
        if (m.src, m.dst) in self.cut:
            return  # a partition also drops what was in flight
        node = self.nodes.get(m.dst)
        if node is not None:
            self.deliver(node, m)

    def partition(self) -> None:
        if self.cut:
            return
        names = list(self.names)
        self.rng.shuffle(names)
        k = self.rng.randint(1, len(names) // 2)
        side = set(names[:k])
        self.set_cut({(a, b) for a in names for b in names if (a in side) != (b in side)}, f"PARTITION {sorted(side)}")
        self.at(self.now + self.rng.randint(50, 600), self.heal, self.cut_id)

    def isolate(self, name: str) -> None:
        if self.calm:
            return
        self.set_cut(self.cut_off(name, "both"), f"ISOLATE {name}")
        self.at(self.now + self.rng.randint(30, 300), self.heal, self.cut_id)

    def cut_off(self, name: str, way: str) -> set[tuple[str, str]]:
        """The directed links to cut between `name` and everyone else: "both"
        ways, "out" (it cannot send) or "in" (it cannot receive)."""
        out = {(name, b) for b in self.names if b != name}
        inn = {(a, name) for a in self.names if a != name}
        return out | inn if way == "both" else out if way == "out" else inn

    def set_cut(self, cut: set[tuple[str, str]], what: str) -> None:
        self.cut = cut
        self.cut_id += 1
        self.log(what)

    def heal(self, cut_id: int | None = None) -> None:
        """Heal the cut `cut_id` (if it is still the current one), or any cut."""
        if cut_id is not None and cut_id != self.cut_id:
            return
        if self.cut:
            self.log("HEAL")
        self.cut = set()

    # ------------------------------------------------------------------
    # meta

    def view(self) -> MetaView:
        return MetaView(self.m_term, self.m_leader, self.m_voters, self.m_learners, self.m_conf_ver)

    def send_view(self, node: Node, delay: int, view: MetaView | None = None) -> None:
        self.at(self.now + delay, self.view_arrive, (node, view or self.view()))

    def view_arrive(self, arg: tuple[Node, MetaView]) -> None:
        node, v = arg
        self.deliver(node, v)

    def broadcast_view(self) -> None:
        v = self.view()
        self.m_views.append(v)
        for n in self.names:
            if self.calm or self.rng.random() > 0.15:
                self.send_view(self.nodes[n], self.rng.randint(1, 40), v)

    def meta_cas(self, leader: str) -> None:
        self.m_term += 1
        self.m_leader = leader
        self.m_changed_at = self.now
        self.log(f"META term {self.m_term} leader {leader}")
        self.stats["meta_cas"] += 1
        self.broadcast_view()
        if not self.calm and self.rng.random() < self.p.nemesis:
            # Failovers fail half-way in real life: the new leader is lost
            # while its adopted tail and term start are partly replicated.
            self.at(self.now + self.rng.randint(5, 80), self.strike, leader)

    def nemesis_roll(self, share: float) -> bool:
        return bool(self.p.nemesis) and not self.calm and self.rng.random() < self.p.nemesis * share

    def strike_after_append(self, r: Replica, p: Persist) -> bool:
        """Cut a leader off right after it appended, before it replicates:
        a failover that dies at birth leaves its term start on itself
        alone, a leader that dies mid-write leaves a local-only tail."""
        kind = p.entries[-1].kind
        if kind == "term_start" and p.entries[-1].term == r.term:
            return self.nemesis_roll(1.0)
        return kind == "op" and self.nemesis_roll(0.1)

    def strike(self, name: str) -> None:
        if self.calm:
            return
        node = self.nodes[name]
        if self.rng.random() < 0.5:
            if sum(1 for n in self.nodes.values() if n.replica is None) < 2:
                self.crash(node)
        else:
            self.isolate(name)

    def meta_transfer(self, arg: tuple[int, str]) -> None:
        term, target = arg
        if term == self.m_term and target in self.m_voters:
            self.stats["transfer_done"] += 1
            self.meta_cas(target)

    def meta_record_config(self, e: Entry) -> None:
        if e.seq <= self.m_conf_ver:
            return
        cfg: Config = e.data
        self.m_voters, self.m_learners, self.m_conf_ver = cfg.voters, cfg.learners, e.seq
        self.log(f"META config v{e.seq} {cfg}")
        self.at(self.now + self.rng.randint(1, 30), lambda _: self.broadcast_view())

    def meta_watch(self, _: Any) -> None:
        """Long-poll re-reads: every replica sees the current view again,
        now and then a stale one."""
        rng = self.rng
        for n in self.names:
            if rng.random() < 0.5:
                self.send_view(self.nodes[n], rng.randint(1, 30))
        if self.m_views and rng.random() < 0.2 and not self.calm:
            self.send_view(self.nodes[rng.choice(self.names)], rng.randint(1, 30), rng.choice(self.m_views))
        self.at(self.now + rng.randint(80, 200), self.meta_watch)

    def meta_isolation(self) -> None:
        """What meta's controller does about a live leader cut off from its
        voters: the same rule (`isolation_evidence`), from what the replicas
        would report now, with the same decision window."""
        leader = self.m_leader
        lease = self.p.cfg.lease_ms
        if leader is None or (self.m_isolation_at is not None
                              and self.now - self.m_isolation_at < ISOLATION_HOLD_LEASES * lease):
            return
        r = self.nodes[leader].replica
        if r is None:
            return  # silent: meta_failover's business
        quorum = r.has_quorum if r.term == self.m_term and leads(r) else None
        silence: dict[str, int | None] = {}
        others = []
        for v in self.m_voters:
            node = self.nodes[v]
            rv = node.replica
            if v == leader or rv is None or rv.resyncing:
                continue
            others.append(v)
            heard = rv.leader_heard_at
            if rv.term == self.m_term and heard is not None:
                silence[v] = self.clock(node) - heard
        if len(others) < len(self.m_voters) // 2 + 1:
            return
        why = isolation_evidence(self.m_voters, leader, quorum, silence, lease,
                                 r.unheard_voters if quorum is not None else ())
        if why is None:
            return
        self.log(f"META isolation: {why}")
        self.stats["meta_isolation_failover"] += 1
        self.m_isolation_at = self.now
        among = [v for v in others if why.among is None or v in why.among]
        self.meta_cas(max(among, key=self.log_position))

    def meta_failover(self) -> None:
        """What meta's controller does when the leader does not report."""
        if self.quiet is not None:
            return  # nobody is silent in a quiet window: only the isolation rule may act
        node = self.nodes.get(self.m_leader or "")
        r = node.replica if node else None
        healthy = r is not None and r.ready and r.term == self.m_term
        if healthy or self.now - self.m_changed_at < self.p.patience_ms:
            return
        live = [n for n in self.m_voters if self.nodes[n].replica is not None]
        if not live:
            return
        if self.converging:
            # Like meta's controller: never a replica that reports it re-syncs.
            able = [n for n in live if not self.resyncing(n)] or live
            best = max(able, key=self.log_position)
        else:
            best = self.adversarial_pick(live)
        self.meta_cas(best)

    def log_position(self, name: str) -> tuple[int, int]:
        r = self.nodes[name].replica
        return (r.last_term, r.last_seq) if r is not None else (-1, -1)

    def adversarial_pick(self, names: tuple[str, ...] | list[str]) -> str:
        """Safety must not depend on meta's pick: sometimes the stalest
        voter, sometimes the one with the newest (maybe unreplicated) tail."""
        x = self.rng.random()
        if x < 0.25:
            return min(names, key=self.log_position)
        if x < 0.5:
            return max(names, key=self.log_position)
        return self.rng.choice(names)

    # ------------------------------------------------------------------
    # clients

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def pick_target(self) -> Node:
        if self.m_leader is not None and self.rng.random() < 0.8:
            return self.nodes[self.m_leader]
        return self.nodes[self.rng.choice(self.names)]

    def client_write(self) -> None:
        ack = self.rng.choice(("quorum", "quorum", "quorum", "all", "leader"))
        batch = []
        for _ in range(self.rng.choice((1, 1, 1, 2, 3, 5))):
            i = self.new_id()
            w = WriteOp(i, f"r{i}", i, ack, first_sent=self.now)
            self.writes[i] = w
            batch.append(w)
        if len(batch) == 1:
            self.send_write(batch[0], self.pick_target())
            return
        # Several writes in one ClientWriteMany (one "ops" entry); a retry
        # goes alone, so a rid can meet its batch again through dedup.
        if self.rng.random() < 0.2:
            batch.append(batch[0])  # the same write twice in one batch
        node = self.pick_target()
        reqs = []
        for w in batch:
            w.attempts += 1
            reqs.append(("w", w.id, w.attempts))
            self.at(self.now + 1500, self.write_silence, (w, w.attempts))
        msg = ClientWriteMany(tuple(reqs), tuple(w.value for w in batch), ack, tuple(w.rid for w in batch))
        self.at(self.now + self.rng.randint(1, 5), lambda _: self.deliver(node, msg))
        self.stats["write_batches"] += 1

    def send_write(self, w: WriteOp, node: Node) -> None:
        if w.attempts and not self.within_window(w):
            return  # a retry is sent only within the window (decided when it leaves, not when planned)
        w.attempts += 1
        req = ("w", w.id, w.attempts)
        self.at(self.now + self.rng.randint(1, 5), lambda _: self.deliver(node, ClientWrite(req, w.value, w.ack, w.rid)))
        self.at(self.now + 1500, self.write_silence, (w, w.attempts))

    def within_window(self, w: WriteOp) -> bool:
        """May the client still retry `w` with its rid?  Only within the
        dedup window of its first send (runbook/operations.md)."""
        return self.now - w.first_sent < self.p.cfg.dedup_window_ms - RESEND_MARGIN_MS

    def write_silence(self, arg: tuple[WriteOp, int]) -> None:
        w, attempt = arg
        if not w.done and w.attempts == attempt and attempt < 12 and self.within_window(w):
            self.send_write(w, self.pick_target())

    def resend_acked(self) -> None:
        """A client lost the response to an acknowledged write and re-sends
        it with the same rid: it must be answered with the same seq and not
        be applied again (the exactly-once checks in on_write_reply and
        on_apply), whoever leads and whatever the clocks say."""
        recent = [w for w in self.acked_ops[-50:] if self.within_window(w)]
        if not recent:
            return
        w = self.rng.choice(recent)
        self.resends.add((w.id, w.attempts + 1))
        self.stats["resent_acked"] += 1
        self.send_write(w, self.pick_target())

    def on_reply(self, node: Node, rep: Reply) -> None:
        kind, i, *_ = rep.req
        if kind == "w":
            self.on_write_reply(node, self.writes[i], rep)
        elif kind == "r":
            self.reads[i].done = True
            self.stats[f"read_{rep.error_code}"] += 1
        elif kind == "m":
            self.stats[f"membership_{rep.error_code or 'ok'}"] += 1  # no bookkeeping needed
        else:
            self.fail(f"{node.name} answered a request the simulation never made: {rep.req!r}")

    def on_write_reply(self, node: Node, w: WriteOp, rep: Reply) -> None:
        self.stats[f"write_{rep.error_code or 'ok_' + w.ack}"] += 1
        if (node.name, rep.req) in self.answered:
            self.fail(f"{node.name} answered {rep.req!r} twice")
        self.answered.add((node.name, rep.req))
        if rep.ok:
            if w.ack != "leader":
                s = rep.seq
                self.commits.acknowledged(node.name, w.rid, s, rep.idx)
                if not w.done:
                    self.acked_ops.append(w)
                if (w.id, rep.req[2]) in self.resends:
                    self.stats["resent_answered_from_log"] += 1
                if s > self.max_acked:
                    self.max_acked = s
            w.done = True
            w.seq = rep.seq
            return
        if w.done or rep.req[2] != w.attempts or w.attempts >= 12 or not self.within_window(w):
            return
        if rep.error_code == "not_leader" and rep.leader in self.nodes and self.rng.random() < 0.8:
            target = self.nodes[rep.leader]
        else:
            target = self.pick_target()
        self.at(self.now + self.rng.randint(20, 80), lambda _: self.send_write(w, target) if not w.done else None)

    def client_read(self, strong: bool) -> None:
        i = self.new_id()
        # Deadlines are on the serving node's clock (the shell computes them there).
        if strong:
            op = ReadOp(i, "strong", self.max_acked)
            node = self.pick_target()
            ev = ClientRead(("r", i), "q", "strong", 0, self.clock(node) + 400)
        else:
            want = self.rng.randint(0, self.max_acked)
            op = ReadOp(i, "follower", want)
            node = self.nodes[self.rng.choice(self.names)]
            ev = ClientRead(("r", i), "q", "follower", want, self.clock(node) + 400)
        self.reads[i] = op
        self.at(self.now + self.rng.randint(1, 5), lambda _: self.deliver(node, ev))

    def on_serve(self, node: Node, r: Replica, s: ServeRead) -> None:
        op = self.reads[s.req[1]]
        if op.done:
            self.fail(f"read {op.id} served twice")
        op.done = True
        self.stats[f"served_{op.consistency}"] += 1
        if r.applied_seq < s.at_seq:
            self.fail(f"{node.name} serves read at {s.at_seq} with applied {r.applied_seq}")
        if s.at_seq < op.min_seq:
            kind = "stale strong read" if op.consistency == "strong" else "follower read below min_seq"
            self.fail(f"{kind}: {node.name} served at {s.at_seq}, needed {op.min_seq}")

    def snapshot_written(self, arg: tuple[Node, int, int]) -> None:
        node, inc, seq = arg
        if node.inc == inc and node.replica is not None:
            self.stats["snapshot_taken"] += 1
            self.deliver(node, Compact(seq))

    def snapshot_done(self, arg: tuple[Node, int, str]) -> None:
        node, inc, source = arg
        src = self.nodes[source]
        if node.inc != inc or src.replica is None or (source, node.name) in self.cut or src.disk.snapshot is None:
            return
        self.stats["snapshot_installed"] += 1
        self.deliver(node, SnapshotInstalled(src.disk.snapshot))

    # ------------------------------------------------------------------
    # the chaos driver

    # What the driver does each step, by weight; the rest of the time nothing.
    ACTIONS: tuple[tuple[float, str], ...] = (
        (45, "client_write"),
        (15, "strong_read"),
        (5, "follower_read"),
        (3, "crash_one"),
        (2.5, "partition"),
        (2, "transfer"),
        (6, "membership"),
        (2, "compact"),
    )

    # What may still happen in a quiet window.
    QUIET_ACTIONS = frozenset({"client_write", "strong_read", "follower_read", "compact"})

    def drive(self, _: Any) -> None:
        if self.converging:
            return
        rng = self.rng
        x = rng.random() * (100 + self.p.quiet_weight)
        for weight, action in (*self.ACTIONS, (self.p.quiet_weight, "quiet_cut")):
            if x < weight:
                if self.quiet is None or action in self.QUIET_ACTIONS:
                    getattr(self, action)()
                break
            x -= weight
        if rng.random() < self.p.resend:
            self.resend_acked()
        if not self.calm and rng.random() < self.p.forge:
            self.forge()
        if self.quiet is None and rng.random() < self.p.meta_rate:
            self.meta_cas(self.adversarial_pick(self.m_voters))
        self.meta_isolation()
        self.meta_failover()
        lo, hi = self.p.step_ms
        self.at(self.now + rng.randint(lo, hi), self.drive)

    def forge(self) -> None:
        """A message from a term meta has not published: a forger's, or a
        peer's bug. No replica may adopt the term (the term cap); the group
        carries on. The sender may be a member or an outsider; the content
        is harmless should meta later publish the term with that sender as
        leader (then it is no forgery: what it asks is what that leader would)."""
        rng = self.rng
        dst = rng.choice(self.names)
        src = rng.choice([*self.names, "intruder"])
        if src == dst:
            src = "intruder"
        env = dict(src=src, dst=dst, group=GROUP, term=self.m_term + rng.choice((1, 1, 2, 50, 10**6)))
        kind = rng.choice(("begin", "append", "heartbeat", "stale"))
        msg: Message
        if kind == "begin":
            msg = Begin(**env)
        elif kind == "append":
            msg = Append(**env, prev_term=0, prev_seq=0, entries=(), commit=0)
        elif kind == "heartbeat":
            msg = Heartbeat(**env, commit=0, round=0)
        else:
            msg = StaleTerm(**env)
        self.stats["forged"] += 1
        self.log(f"FORGE {msg}")
        self.at(self.now + rng.randint(1, 10), self.net_arrive, msg)

    def step_wall(self, _: Any) -> None:
        """Somebody's wall clock steps (NTP, an operator): by minutes to the skew."""
        node = self.nodes[self.rng.choice(self.names)]
        jump = self.rng.randint(60_000, max(60_000, self.p.wall_skew_ms))
        node.wall += jump if self.rng.random() < 0.5 else -jump
        self.stats["wall_clock_stepped"] += 1
        if not self.converging:
            self.at(self.now + self.rng.randint(100, 600), self.step_wall)

    # -- quiet windows: cuts on the leader, judged for availability --------

    def availability_bound(self) -> int:
        """How soon after a cut on the leader the other voters must have a
        ready leader: check-quorum or the followers' silence (one lease, plus
        a heartbeat for the evidence to form), meta's reaction (a driver
        step), the new leader's Begin round and its term start committing
        (a few message delays, retries), on a network without loss."""
        c = self.p.cfg
        return c.lease_ms + 2 * c.heartbeat_ms + 3 * c.retry_ms + 20 * self.p.delay[1] + 100

    def quiet_cut(self) -> None:
        leader = self.m_leader
        r = self.nodes[leader].replica if leader else None
        hold = ISOLATION_HOLD_LEASES * self.p.cfg.lease_ms
        # Three voters at least (then the others are a majority on their own),
        # each within one Append of the leader's commit (the bound has no room
        # for a long catch-up).
        if (leader is None or r is None or not r.ready or r.term != self.m_term or not r.has_quorum
                or len(self.m_voters) < 3
                or any((rv := self.nodes[v].replica) is None or rv.last_seq < r.commit_seq - self.p.cfg.max_batch_entries
                       for v in self.m_voters)
                or r.transfer_target is not None or set(r.voters) != set(self.m_voters)
                or any(self.nodes[v].replica is None or self.resyncing(v) for v in self.m_voters)
                or (self.m_isolation_at is not None and self.now - self.m_isolation_at < hold)):
            return
        modes = ("both", "out", "in", "flap") + (("split", "split") if len(self.m_voters) >= 5 else ())
        mode = self.rng.choice(modes)
        self.quiet, self.quiet_term, self.quiet_started = mode, self.m_term, self.now
        self.stats[f"quiet_{mode}"] += 1
        if mode == "flap":
            # The link to whoever leads is cut and healed again and again.
            duration = self.rng.randint(2, 3) * hold
            self.quiet_until = self.now + duration
            lease = self.p.cfg.lease_ms
            self.flap((self.rng.randint(lease // 2, 2 * lease), True))
        elif mode == "split":
            # The leader keeps one voter, the one with the newest log (it may
            # hold the leader's unreplicated tail): the rest are a majority.
            ally = max((v for v in self.m_voters if v != leader), key=self.log_position)
            side = {leader, ally}
            bound = self.availability_bound()
            self.set_cut({(a, b) for a in self.names for b in self.names if (a in side) != (b in side)},
                         f"QUIET split {sorted(side)} | rest")
            self.quiet_until = self.now + bound + self.rng.randint(50, 500)
            self.at(self.now + bound, self.check_available, (leader, mode, bound))
        else:
            bound = self.availability_bound()
            self.set_cut(self.cut_off(leader, mode), f"QUIET cut {leader} ({mode})")
            self.quiet_until = self.now + bound + self.rng.randint(50, 500)
            self.at(self.now + bound, self.check_available, (leader, mode, bound))
        self.at(self.quiet_until, self.end_quiet)

    def flap(self, arg: tuple[int, bool]) -> None:
        period, cut = arg
        if self.quiet != "flap" or self.converging:
            return
        if cut and self.m_leader is not None:
            self.set_cut(self.cut_off(self.m_leader, "both"), f"FLAP cut {self.m_leader}")
        else:
            self.heal()
        self.at(self.now + period, self.flap, (period, not cut))

    def check_available(self, arg: tuple[str, str, int]) -> None:
        old, mode, bound = arg
        if self.quiet != mode or self.converging:
            return
        ml = self.m_leader
        r = self.nodes[ml].replica if ml is not None else None
        if ml == old or r is None or not (r.ready and r.term == self.m_term and r.has_quorum) \
                or not self.connected_majority(ml):
            self.fail(f"availability: {bound} ms after leader {old} was cut off ({mode}), the other voters "
                      f"have no ready leader with a quorum: {self.status()}")
        self.stats["availability_checked"] += 1

    def connected_majority(self, name: str) -> bool:
        """Do a majority of meta's voters (`name` included) reach `name` both ways?"""
        ok = [v for v in self.m_voters if v == name or ((name, v) not in self.cut and (v, name) not in self.cut)]
        return 2 * len(ok) > len(self.m_voters)

    def end_quiet(self, _: Any) -> None:
        if self.quiet is None:
            return
        if self.quiet == "flap" and not self.converging:
            # A flapping link moves the leadership at most once per decision window.
            window = ISOLATION_HOLD_LEASES * self.p.cfg.lease_ms
            changes = self.m_term - self.quiet_term
            allowed = (self.now - self.quiet_started) // window + 1
            if changes > allowed:
                self.fail(f"leadership flapped: {changes} changes in a flapping window (at most {allowed})")
            self.stats["flap_checked"] += 1
        self.quiet = None
        self.heal()

    def strong_read(self) -> None:
        self.client_read(strong=True)

    def follower_read(self) -> None:
        self.client_read(strong=False)

    def crash_one(self) -> None:
        if sum(1 for n in self.nodes.values() if n.replica is None) < 2:
            self.crash(self.nodes[self.rng.choice(self.names)])

    def compact(self) -> None:
        """The plugin snapshotted at some applied seq (not always the
        latest: the replica must then rebuild the dedup table as of it)."""
        node = self.nodes[self.rng.choice(self.names)]
        r = node.replica
        if r is not None and r.applied_seq > r.snapshot_seq:
            before = r.snapshot_seq
            self.deliver(node, Compact(self.rng.randint(r.snapshot_seq + 1, r.applied_seq)))
            if node.replica is r and r.snapshot_seq == before and leads(r):
                self.stats["compact_held"] += 1  # a follower still needs those entries

    def transfer(self) -> None:
        if self.m_leader is None:
            return
        node = self.nodes[self.m_leader]
        others = [v for v in self.m_voters if v != self.m_leader]
        if others:
            self.deliver(node, TransferLeader(self.rng.choice(others)))

    def membership(self) -> None:
        if self.m_leader is None:
            return
        rng = self.rng
        node = self.nodes[self.m_leader]
        outside = [n for n in self.names if n not in self.m_voters and n not in self.m_learners]
        choices: list[ChangeMembership] = []
        req = ("m", self.new_id())
        if outside:
            choices.append(ChangeMembership(req, add_learner=rng.choice(outside)))
        if self.m_learners:
            choices.append(ChangeMembership(req, promote=rng.choice(self.m_learners)))
            choices.append(ChangeMembership(req, remove=rng.choice(self.m_learners)))
        if len(self.m_voters) > 2 and not any(n.disk.resync for n in self.nodes.values()):
            # (An operator does not shrink a group while a voter re-syncs:
            # that could leave no majority of intact voters.)
            choices.append(ChangeMembership(req, remove=rng.choice(self.m_voters)))
        if choices:
            self.deliver(node, rng.choice(choices))

    # ------------------------------------------------------------------
    # the end

    def begin_convergence(self, _: Any) -> None:
        self.converging = True
        self.quiet = None
        self.log("CONVERGE")
        self.heal()
        for n in self.names:
            node = self.nodes[n]
            if node.replica is None:
                node.down_until = self.now
                self.at(self.now + 1, self.restart, node)
        self.at(self.now + 50, self.converge_tick)

    def converge_tick(self, _: Any) -> None:
        self.meta_isolation()
        self.meta_failover()
        self.at(self.now + 50, self.converge_tick)

    @property
    def converged(self) -> bool:
        if not self.converging or self.m_leader is None:
            return False
        lr = self.nodes[self.m_leader].replica
        if lr is None or not lr.ready or lr.term != self.m_term or lr.commit_seq != lr.last_seq:
            return False
        if lr.transfer_target is not None:
            return False
        for n in (*lr.voters, *lr.learners):
            r = self.nodes[n].replica
            if r is None or r.last_seq != lr.last_seq or r.applied_seq != lr.last_seq or r.term != lr.term:
                return False
        return True


def run_seed(
    seed: int, replica_cls: type[Replica] = Replica, verbose: bool = False, profile: str | None = None
) -> Sim:
    sim = Sim(seed, replica_cls, verbose, profile)
    sim.run()
    return sim
