"""The I/O shell around one shard-group replica: WAL, plugin, network, timers.

`GroupShell` owns a `Replica` (the sans-I/O core), its `Wal`, its plugin and
its snapshot directory. One task runs the group loop: it takes every event
queued since the last pass (client writes and reads, peer messages, meta
views, timer ticks), feeds them to the core, then performs the effects:

0. the effects before the pass's first `Persist` (the leader's Appends of
   fresh entries), then one yield to the loop so that the peer streams
   write them: the followers fsync while the leader does;
1. every `Persist` of the pass, in order, followed by ONE fsync (group
   commit) — on the loop itself, since it is short (a pass that installs
   a snapshot archive goes to a thread); the requests that arrive
   meanwhile form the next pass;
2. then everything else in order: sends, applies (the plugin), replies,
   reads, reports to meta.

That honours the core's durability contract (worker/replica.py, "Durability
contract with the I/O shell": no effect is performed before every earlier
Persist is durable, and a Persist's parts go to the WAL in the contract's
order, `_persist_all`): effects are only ever delayed, never reordered ahead
of a Persist.

Snapshots: the core asks for one (TakeSnapshot(S)) after the entry S that
completes (a per-replica 3/4 to all of) `snapshot_every` client writes; the
plugin captures its state at exactly S and a thread of its own writes it into
a temp dir, then (given the core's meta for S, carried by TakeSnapshot) the
archive of plugin files + meta, durably (one capture at a time); then
`Compact(S)` goes to the core; the core answers with `Persist(snapshot=meta)`,
and only then does the WAL's snapshot point move and the log get compacted
(the archive is written there instead if the core installs another meta). An
archive may thus exist ahead of the WAL's snapshot point (until Compact, or
after a crash): it holds committed state, recovery ignores it (it restores the
snapshot the WAL names), and the next install prunes it. A follower told to download a
snapshot fetches it by HTTP range requests (resumable), checks it against what
its source published in the replication message (term, seq, size and xxh3-128:
SnapshotNeeded, filled in by the sender's shell), renames it into place,
restores the plugin and reports `SnapshotInstalled`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import random
import shutil
import tempfile
import time
from collections import OrderedDict, deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, cast

import xxhash

from shardgrid.common.wire import PACK_ERRORS, packb
from worker import replica_msgs as m
from worker.codec import decode_entry, encode_entry
from worker.plugins.base import ApplyContext, BadOp, NotFound, Plugin, PluginError
from worker.replica import Replica
from worker.snapshot_fetch import FetchFailed, HttpSnapshotSource, SnapshotSource, SourceBusy, SourceOverran
from worker.snapshots import (SnapshotCorrupt, SnapshotFile, file_digest, install_downloaded, latest_snapshot,
                              prune_snapshots, remove_snapshot, restore_snapshot, snapshot_at, valid_count,
                              valid_digest, write_snapshot)
from worker.storage import OS_STORAGE, Storage, make_dirs, write_all
from worker.transport import Transport
from worker.wal import Recovered, Wal, WalFailed

MAX_PASS_EVENTS = 4096
RESYNC_MARKER = "RESYNC"
RESULT_CACHE = 65_536  # plugin results held for replies, counted in writes
SNAPSHOT_MAX_SPACING = 10  # times snapshot_every: the longest log a large state keeps (snapshot_due)
DOWNLOAD_ATTEMPTS = 8  # in a row without a byte received, before a download gives up (and resumes later)
# A source that serves its limit of snapshot downloads answers busy
# (worker/throttle.py): ask again after this pause, doubled each time up to
# the maximum, each drawn in its upper half so that waiting learners spread
# out. After BUSY_WAIT_S the download ends and the core's next request
# starts it over, from the manifest, which may name a newer snapshot.
BUSY_PAUSE_S = 0.25
BUSY_PAUSE_MAX_S = 4.0
BUSY_WAIT_S = 60.0
# A new learner is told to fetch a snapshot as soon as it is added, which can
# be before its worker has opened the group (the message is then dropped).
# Resending after a second instead of the core's 5 s keeps that from stalling
# the catch-up; a replica already downloading ignores the repeats.
SNAPSHOT_RETRY_MS = 1000
# A message from a term meta has not published is logged at most this often per group.
UNPUBLISHED_LOG_S = 10.0
_CORE_DEFAULTS = m.ReplicaConfig()
MIN_HEARTBEAT_MS = 20  # however short a lease the topology sets: an idle group must not spin
# The latency p99s a group reports are over this many recent samples (issue
# 24's "p99 over the last 100 writes"): recent enough that meta's hot-group
# relief (meta/hotspot.py) sees a change within seconds under load.
P99_SAMPLES = 100
# Client writes and reads one group holds at once, from admission to answer
# (queued for the loop, in the core waiting for a quorum or a read index):
# each write of a write_batch counts one. Past either bound a new call is
# refused at once with `overloaded` (503, nothing queued) instead of growing
# the queue without limit behind a slow disk or a lost quorum. The count
# leaves room for several full write_batches (worker/server.py
# MAX_BATCH_WRITES, 10,000), the bytes (the calls' encoded size) for four
# of the largest (MAX_WRITE_BYTES, 16 MiB). A call alone is always admitted
# into an empty group, so no valid call can be refused forever.
MAX_PENDING = 32_768
MAX_PENDING_BYTES = 64 << 20


def now_ms() -> int:
    # The core's clock, for every timer, deadline and lease: monotonic, so a
    # stepped or skewed wall clock moves none of them. The core never compares
    # it with another process's (entries carry log time: see worker/replica.py).
    return time.monotonic_ns() // 1_000_000


class PeerSender(Protocol):
    """Where a shell's messages to its peers go: fire and forget (the core
    retransmits what is lost). The worker's `Transport` (peer streams) or the
    simulator's network."""

    def send(self, msg: m.Message) -> None: ...


class GroupHooks(Protocol):
    """What a group needs from its worker process."""

    def peer_addr(self, worker_id: str) -> str | None: ...

    def report_ready(self, group: int, term: int) -> None: ...

    def transfer_ready(self, group: int, target: str, term: int) -> None: ...

    def report_quorum(self, group: int, term: int, ok: bool) -> None: ...

    async def meta_view(self, group: int) -> m.MetaView | None:
        """Meta's current assignment of `group`, fetched now (None: meta
        unreachable, or the group is not placed here). The worker also
        delivers it to every group it hosts, as a watched view."""
        ...


@dataclass(frozen=True)
class GroupSettings:
    fsync: str = "batch"
    snapshot_every: int = 100_000
    snapshot_state_ratio: float = 0.5  # see snapshot_due; 0 takes one every snapshot_every writes
    quorum_timeout_ms: int = 2000
    lease_ms: int = 1500
    segment_bytes: int = 64 * 1024 * 1024
    max_pending: int = MAX_PENDING
    max_pending_bytes: int = MAX_PENDING_BYTES


def _thread_pool(name: str) -> Executor:
    return ThreadPoolExecutor(1, thread_name_prefix=name)


@dataclass(frozen=True)
class ShellRuntime:
    """What a shell takes from its surroundings besides its peers' messages.

    A worker uses the defaults: the OS's disk, the monotonic clock, a
    thread per pool, snapshots downloaded over HTTP from peer workers. The
    deterministic simulator (tests/support/shell_sim.py) runs the same
    shell on a simulated disk, a virtual clock, executors that run a job at
    once, and its own network: every decision the shell makes goes through
    these, so that a seed replays exactly.
    """

    storage: Storage = OS_STORAGE  # the WAL, the snapshot archives, the RESYNC marker
    clock: Callable[[], int] = field(default=lambda: now_ms())  # ms, monotonic: timers, deadlines, leases
    rng: random.Random = field(default_factory=random.Random)  # jitter only
    executor: Callable[[str], Executor] = _thread_pool  # a one-worker pool, given its name
    # The source of snapshot downloads for a shell (None: HTTP from peer workers).
    snapshots: Callable[["GroupShell"], SnapshotSource] | None = None
    # Where plugin captures and restores unpack (real files: plugins read and
    # write directories); None: the group's snapshot directory.
    scratch: Path | None = None


class GroupOverloaded(Exception):
    """A client call refused because the group holds its limit of pending
    calls (`GroupSettings.max_pending`/`max_pending_bytes`); nothing was queued."""

    def __init__(self, gid: int, pending: int, pending_bytes: int, limit: int, limit_bytes: int) -> None:
        super().__init__(f"group {gid} holds {pending} pending client writes and reads ({pending_bytes} bytes; "
                         f"limits {limit} and {limit_bytes}): nothing was queued, retry shortly")
        self.gid = gid
        self.limit = limit
        self.limit_bytes = limit_bytes


_GONE_MID_WRITE = "%s; a write may still commit under the next leader"


def snapshot_due(every: int, records: int, ratio: float) -> int:
    """Client writes since the last snapshot after which the next one is taken.

    A snapshot writes the whole state, so taking one every `every` writes
    costs each write `records / every` records' packing: with unique keys
    the state grows with the writes, and the cost per write with it (at
    10 M items, about a hundred records per write). Waiting for `ratio`
    times the state's records bounds that cost by `1 / ratio` records per
    write when the state stays the same size; while it only grows (every
    write a new key), the spacing grows geometrically (ratio 0.5: each
    snapshot when the state has doubled since the last), which bounds the
    total by a few times the final state. The log, and a restart's replay,
    grow with the state instead, up to SNAPSHOT_MAX_SPACING times `every`.
    """
    if ratio <= 0:
        return every
    return min(max(every, int(records * ratio)), every * SNAPSHOT_MAX_SPACING)


def _snapshot_interval(every: int, node_id: str, gid: int) -> int:
    """This replica's snapshot interval: between 3/4 of `every` and `every`.

    Under even load every replica of every group reaches the same count at
    the same moment; their snapshots (tens of MB written and fsynced each)
    would then all hit the disk together and stall every WAL fsync behind
    them. A fixed per-replica spread keeps them apart.
    """
    spread = xxhash.xxh64_intdigest(f"{node_id}/{gid}".encode()) / 2.0**64
    return max(1, round(every * (1 - spread / 4)))


@dataclass
class Outcome:
    """The answer to one client write or read."""

    ok: bool
    seq: int = 0
    term: int = 0
    error_code: str | None = None
    leader: str | None = None
    result: Any = None
    message: str | None = None
    # Refused after the core took it: the write may be in followers' logs
    # already and commit under the next leader, so the client must not be
    # told that nothing was applied.
    maybe_applied: bool = False


@dataclass
class _Restore:
    """Internal event: a downloaded snapshot is in place; restore from it."""

    snap: SnapshotFile


@dataclass
class DownloadProgress:
    """A snapshot download in flight: what has arrived of how much."""

    received: int
    total: int
    waiting: bool = False  # the source said busy (it serves its limit of downloads): waiting for a turn
    busy_waits: int = 0


@dataclass
class PassStats:
    """How the group loops of one worker batch their work (shared by its groups).

    `events / passes` is the natural batching of the write path at the group
    loop: each pass costs a wake-up, one core call per event, and at most
    one fsync, whatever it carries.
    """

    passes: int = 0
    events: int = 0
    overloaded: int = 0  # client calls refused because their group held its limit (GroupOverloaded)


@dataclass
class _LatencyStats:
    """A latency EMA (alpha 0.1) and the p99 over the last P99_SAMPLES samples;
    `writes` and the rate count what the samples stood for."""

    ema_ms: float = 0.0
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=P99_SAMPLES))
    writes: int = 0
    # (monotonic s, writes) marks at least a second apart, for the write rate;
    # any number of readers (heartbeat, /v1/status, /metrics) see the same rate.
    _mark: tuple[float, int] = (0.0, 0)
    _rate: float = 0.0

    def rate(self) -> float:
        """Acknowledged writes/s over the last second or more."""
        now = time.monotonic()
        then, count = self._mark
        if now - then >= 1.0:
            self._rate = (self.writes - count) / (now - then) if then else 0.0
            self._mark = (now, self.writes)
        return self._rate

    def observe(self, ms: float, writes: int = 1) -> None:
        self.writes += writes
        self.ema_ms = ms if self.ema_ms == 0 else 0.9 * self.ema_ms + 0.1 * ms
        self.samples.append(ms)

    def p99(self) -> float:
        """Nearest rank: of 100 samples the 99th, so one outlier alone is not the p99."""
        if not self.samples:
            return 0.0
        s = sorted(self.samples)
        return s[max(0, -(-len(s) * 99 // 100) - 1)]


class EntrySizes:
    """The encoded size of log entries, for the core's byte bound on an Append
    (`ReplicaConfig.max_batch_bytes`), each measured once: an entry goes in
    an Append to every follower, and again on every retransmission.

    Keyed by (term, seq): only the leader of a term makes an entry at that
    term, once per seq, so the key names the same entry on every replica
    and for good (Raft's log matching). The newest `capacity` are kept; an
    entry measured again after that is only a repeated encode.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self._sizes: dict[tuple[int, int], int] = {}

    def __call__(self, e: m.Entry) -> int:
        key = (e.term, e.seq)
        n = self._sizes.get(key)
        if n is None:
            try:
                n = len(packb(encode_entry(e)))
            except PACK_ERRORS:
                # The WAL refuses it before it could be sent; counted as nothing here.
                n = 0
            if len(self._sizes) >= self.capacity:
                del self._sizes[next(iter(self._sizes))]  # the oldest measured
            self._sizes[key] = n
        return n


class GroupCorrupt(Exception):
    """This replica's durable state is damaged; it must not serve the group."""


class GroupShell:
    def __init__(self, node_id: str, gid: int, root: Path, plugin: Plugin, settings: GroupSettings,
                 transport: PeerSender, hooks: GroupHooks, log: Any, stats: PassStats | None = None,
                 runtime: ShellRuntime | None = None) -> None:
        rt = runtime if runtime is not None else ShellRuntime()
        self.runtime = rt
        self.storage = rt.storage
        self.now_ms = rt.clock
        self.rng = rt.rng
        self.node_id = node_id
        self.stats = stats if stats is not None else PassStats()
        self.gid = gid
        self.root = root
        self.plugin = plugin
        self.settings = settings
        self.transport = transport
        self.hooks = hooks
        self.log = log.bind(group=gid)
        self.snap_dir = root / "snapshots"
        self.scratch = rt.scratch if rt.scratch is not None else self.snap_dir
        self.snapshots: SnapshotSource = (
            rt.snapshots(self) if rt.snapshots is not None
            # Without a source of its own the shell downloads over the worker's peer connections.
            else HttpSnapshotSource(gid, cast(Transport, transport), lambda worker: self.hooks.peer_addr(worker)))
        # Told how long each WAL fdatasync took (the worker's histogram).
        self.on_sync: Callable[[float], None] | None = None
        # Told the seconds of each write call that acknowledged any write (the worker's per-group histogram).
        self.on_write_latency: Callable[[float], None] | None = None
        self.wal: Wal | None = None
        self.replica: Replica | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending: dict[int, tuple[asyncio.Future[Outcome], float, Any]] = {}
        self._batched: dict[int, tuple[_BatchWait, int]] = {}  # write_many's writes: req -> (batch, index)
        self._req_ids = itertools.count(1)
        # Admitted client writes and reads not yet answered, and their bytes (see MAX_PENDING).
        self.pending_calls = 0
        self.pending_bytes = 0
        self.overloaded = 0  # calls refused for it, this group
        self.snapshot_refused = 0  # snapshot downloads refused: not what their source published
        self._results: OrderedDict[int, Any] = OrderedDict()
        self._results_held = 0  # writes whose results are in _results
        self._plugin_snaps: dict[int, Path] = {}
        # seq -> its writer (the meta it archived, if any), until installed or failed
        self._plugin_writes: dict[int, Future[m.SnapshotMeta | None]] = {}
        self._last_snapshot_seq = 0
        # The core counts client writes and asks for snapshots (TakeSnapshot).
        self._snapshot_after = _snapshot_interval(settings.snapshot_every, node_id, gid)
        # Client writes applied since the last snapshot this replica took
        # (after a restart the core applies the log again and counts them).
        self._writes_unsnapped = 0
        self._writes_capturing = 0
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._download: asyncio.Task[None] | None = None
        self.download: DownloadProgress | None = None  # the snapshot download in flight
        # The thread that writes snapshot passes. Cancelling the loop does not
        # stop a pass it is running, and the WAL must not be closed under it.
        self._persist_pool: Executor | None = None
        self._writer_pool: Executor | None = None  # plugin snapshot writers
        self.failed: str | None = None
        # Failed on an error from the disk (the WAL's, a snapshot's): a cause
        # that may clear, so the worker retries the group in place
        # (worker/retry.py). Anything else is a bug and stays failed.
        self.failed_on_disk = False
        self.latency = _LatencyStats()
        # Every replica's (leader's and follower's alike) time from entries
        # reaching this group's queue to their being durable here: comparable
        # across the replicas of a group, so a leader slowed by its worker's
        # load stands out against its followers (meta/hotspot.py). `_arrived`
        # is when the oldest event still queued came in (None: queue empty).
        self.persist = _LatencyStats()
        self._arrived: float | None = None
        self._pass_arrived = 0.0
        self._resync_marker: Path | None = None
        # The fetch of meta's view the core asked for (NeedMetaView): one at a time.
        self._meta_check: asyncio.Task[None] | None = None
        self._unpublished_logged_at: float | None = None

    # -- lifecycle ------------------------------------------------------------

    def open(self) -> None:
        """Recover from disk and build the core. Raises GroupCorrupt, or OSError from the disk.

        A WAL damaged before its tail is discarded (the term is kept) and
        the replica re-syncs from the leader: a RESYNC marker, written
        before anything is deleted, keeps it from voting or leading until
        a ready leader has brought it up to date, across restarts too.
        """
        try:
            self._open()
        except BaseException:
            # Release the directory (the WAL's lock): the next open of this
            # group, a retry in place (worker/retry.py), must not find it held.
            if self.wal is not None:
                with contextlib.suppress(OSError):
                    self.wal.close()
                self.wal = None
            raise

    def _open(self) -> None:
        from worker.wal import HardState, WalCorrupt

        io = self.storage
        make_dirs(io, self.root)
        wal_dir = self.root / "wal"
        marker = self.root / RESYNC_MARKER
        try:
            wal, rec = self._recover_wal(wal_dir)
        except WalCorrupt as exc:
            self.log.error("wal_corrupt_resyncing", error=str(exc))
            _write_marker(io, marker, str(exc))
            Wal.discard(wal_dir, storage=io)
            try:
                wal, rec = self._recover_wal(wal_dir)
            except WalCorrupt as again:
                raise GroupCorrupt(f"WAL hard state unreadable: {again}") from again
        hs = rec.hard_state
        snapshot = None
        if hs.snap_seq > 0:
            snap = snapshot_at(self.snap_dir, hs.snap_seq, storage=io)
            try:
                if snap is None:
                    raise SnapshotCorrupt(f"snapshot {hs.snap_seq} is missing")
                snapshot = restore_snapshot(snap.path, self.plugin, expect_digest=snap.digest, storage=io,
                                            scratch=self._scratch())
            except (SnapshotCorrupt, PluginError) as exc:
                # Start over from nothing but the term; the leader sends a snapshot.
                self.log.error("snapshot_unusable_resyncing", error=str(exc))
                wal.close()
                _write_marker(io, marker, str(exc))
                Wal.discard(wal_dir, HardState(term=hs.term), storage=io)
                wal, rec = self._recover_wal(wal_dir)
                hs = rec.hard_state
        self._last_snapshot_seq = hs.snap_seq
        if io.exists(self.snap_dir):
            prune_snapshots(self.snap_dir, hs.snap_seq, storage=io)
            # Unfinished downloads of a previous run (prune leaves those
            # alone: a running download must not lose its file; none runs
            # before open).
            for name in io.listdir(self.snap_dir):
                if name.startswith(".download-") and name.endswith(".partial"):
                    io.unlink(self.snap_dir / name, missing_ok=True)
        if self.scratch.exists():
            # Captures a previous run made and never installed (it died first).
            for stray in self.scratch.glob(".plugin-*"):
                shutil.rmtree(stray, ignore_errors=True)
        resync = io.exists(marker)
        stored = m.StoredState(term=hs.term, entries=[decode_entry(e.payload) for e in rec.entries],
                               snapshot=snapshot, commit=hs.commit, resync=resync)
        self.wal = wal
        self._resync_marker = marker if resync else None
        self.replica = Replica(self.node_id, self.gid,
                               m.ReplicaConfig(quorum_timeout_ms=self.settings.quorum_timeout_ms,
                                               lease_ms=self.settings.lease_ms,
                                               # Several round trips per lease, so one lost
                                               # heartbeat does not cost the quorum.
                                               heartbeat_ms=max(MIN_HEARTBEAT_MS,
                                                                min(_CORE_DEFAULTS.heartbeat_ms,
                                                                    self.settings.lease_ms // 3)),
                                               snapshot_retry_ms=SNAPSHOT_RETRY_MS,
                                               snapshot_every=self._snapshot_after,
                                               op_weight=self.plugin.weight,
                                               entry_bytes=EntrySizes()), stored)
        self.log.info("group_opened", term=hs.term, snap_seq=hs.snap_seq, last_seq=self.replica.last_seq,
                      torn_bytes=rec.recovery.torn_bytes, resync=resync)

    def _recover_wal(self, wal_dir: Path) -> tuple[Wal, Recovered]:
        wal, rec = Wal.recover(wal_dir, fsync=self.settings.fsync,  # type: ignore[arg-type]
                               segment_bytes=self.settings.segment_bytes, storage=self.storage)
        self.wal = wal  # at once: a failed open releases it
        return wal, rec

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"group-{self.gid}")

    async def close(self) -> None:
        for task in (self._task, self._download, self._meta_check):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for pool in (self._persist_pool, self._writer_pool):
            if pool is not None:
                # Drops a job still queued, waits for one that is running.
                await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
        if self._timer is not None:
            self._timer.cancel()
        self._fail_all("worker shutting down")
        await self.snapshots.close()
        if self.wal is not None:
            self.wal.close()
        for tmp in self._plugin_snaps.values():
            shutil.rmtree(tmp, ignore_errors=True)

    # -- inputs ------------------------------------------------------------------------

    def deliver(self, event: Any) -> None:
        if self.failed is not None:
            return  # no loop takes events from a failed group
        if self._arrived is None:
            self._arrived = time.perf_counter()  # one clock read per pass, not per event
        self._queue.put_nowait(event)

    def _admit(self, n: int, size: int) -> None:
        """Count `n` client writes or reads of `size` bytes in, or raise GroupOverloaded.
        The caller gives them back with `_release` once they are answered."""
        calls, held = self.pending_calls, self.pending_bytes
        if calls and (calls + n > self.settings.max_pending or held + size > self.settings.max_pending_bytes):
            self.overloaded += 1
            self.stats.overloaded += 1
            if self.overloaded in (1, 10) or self.overloaded % 1000 == 0:
                self.log.warning("group_overloaded", pending=calls, pending_bytes=held, refused=self.overloaded,
                                 limit=self.settings.max_pending, limit_bytes=self.settings.max_pending_bytes)
            raise GroupOverloaded(self.gid, calls, held, self.settings.max_pending, self.settings.max_pending_bytes)
        self.pending_calls = calls + n
        self.pending_bytes = held + size

    def _release(self, n: int, size: int) -> None:
        self.pending_calls -= n
        self.pending_bytes -= size

    async def write(self, op: Any, ack: str, rid: str | None, timeout_s: float, size: int = 0) -> Outcome:
        """One write; raises BadOp for an invalid op, GroupOverloaded when the group is full."""
        [out] = await self.write_many([(op, rid)], ack, timeout_s, size)
        if isinstance(out, BadOp):
            raise out  # never enters the log
        return out

    async def write_many(self, writes: list[tuple[Any, str | None]], ack: str,
                         timeout_s: float, size: int = 0) -> list[Outcome | BadOp]:
        """Several writes submitted together: one result each, in order (a BadOp for an invalid op).
        `size`: their encoded bytes as sent. Raises GroupOverloaded (nothing
        queued) when the group holds its limit of pending calls.

        They reach the core as one event (so they can share one "ops"
        entry) and are waited for as one: the replies fill a `_BatchWait`,
        which wakes this call once, instead of a future per write.
        """
        if self.failed is not None:
            failed = Outcome(False, error_code="unavailable", message=f"group {self.gid} failed here: {self.failed}")
            return [failed for _ in writes]
        batch = _BatchWait(asyncio.get_running_loop().create_future(), [None] * len(writes), time.perf_counter())
        reqs: list[int] = []
        ops: list[Any] = []
        rids: list[str | None] = []
        for i, (op, rid) in enumerate(writes):
            try:
                self.plugin.validate(op)
            except BadOp as exc:
                batch.results[i] = exc
                continue
            req = next(self._req_ids)
            self._batched[req] = (batch, i)
            reqs.append(req)
            ops.append(op)
            rids.append(rid)
        if not reqs:
            return batch.results  # type: ignore[return-value]
        try:
            self._admit(len(reqs), size)
        except GroupOverloaded:
            for req in reqs:
                del self._batched[req]
            raise
        batch.left = len(reqs)
        self.deliver(m.ClientWriteMany(tuple(reqs), tuple(ops), ack, tuple(rids)))  # type: ignore[arg-type]
        # A timer that wakes the batch, not wait_for + shield (two more futures
        # and their callbacks per call); replies check fut.done() first.
        timer = asyncio.get_running_loop().call_later(timeout_s, _wake, batch.fut)
        try:
            await batch.fut
        finally:
            timer.cancel()
            self._release(len(reqs), size)
            timed_out = None
            for req in reqs:
                slot = self._batched.pop(req, None)
                if slot is not None:
                    # The write may still commit: outcome unknown, retry with the same rid.
                    timed_out = timed_out or Outcome(False, error_code="quorum_timeout",
                                                     message="no answer within the deadline; outcome unknown",
                                                     leader=self.replica.leader if self.replica else None)
                    batch.results[slot[1]] = timed_out
        return batch.results  # type: ignore[return-value]

    async def read(self, query: Any, consistency: str, min_seq: int, timeout_s: float, size: int = 0) -> Outcome:
        """One read; raises GroupOverloaded (nothing queued) when the group holds its limit of pending calls."""
        deadline = self.now_ms() + int(timeout_s * 1000)
        self._admit(1, size)
        try:
            return await self._request(lambda req: m.ClientRead(req, query, consistency, min_seq, deadline),  # type: ignore[arg-type]
                                       timeout_s, kind=query)
        finally:
            self._release(1, size)

    async def change_members(self, change: dict[str, str], timeout_s: float) -> Outcome:
        # Not admitted against max_pending: meta's operators send one at a
        # time per group, and refusing them would stall a repair under load.
        return await self._request(lambda req: m.ChangeMembership(req=req, **change), timeout_s, kind="members")

    async def _request(self, make: Any, timeout_s: float, kind: Any) -> Outcome:
        if self.failed is not None:
            return Outcome(False, error_code="unavailable", message=f"group {self.gid} failed here: {self.failed}")
        req = next(self._req_ids)
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending[req] = (fut, time.perf_counter(), kind)
        self.deliver(make(req))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            # A membership change may still commit: outcome unknown. (Writes go through write_many.)
            return Outcome(False, error_code="deadline_exceeded",
                           message="no answer within the deadline; outcome unknown",
                           leader=self.replica.leader if self.replica else None)
        finally:
            self._pending.pop(req, None)

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self.replica is not None
        self.deliver(m.Tick())
        try:
            while True:
                batch = [await self._queue.get()]
                while len(batch) < MAX_PASS_EVENTS and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                await self.run_pass(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a replica bug or a disk failure: stop this group, loudly
            self.mark_failed(exc)
            self.log.critical("group_failed", error=self.failed, on_disk=self.failed_on_disk, exc_info=True)
            self._fail_all("group failed on this worker")

    async def run_pass(self, batch: list[Any]) -> None:
        """One pass of the group loop: `batch` (the events queued since the
        last pass) through the core, then its effects performed in the
        durability contract's order (`_perform`). The loop awaits only what
        the contract needs: the early sends' yield and a snapshot pass's
        thread."""
        assert self.replica is not None
        # What stays queued (past MAX_PASS_EVENTS) is timed from now.
        self._pass_arrived = self._arrived if self._arrived is not None else time.perf_counter()
        self._arrived = None if self._queue.empty() else time.perf_counter()
        stats = self.stats
        stats.passes += 1
        stats.events += len(batch)
        now = self.now_ms()
        effects: list[m.Effect] = []
        for ev in batch:
            if isinstance(ev, _Restore):
                # The plugin must be where the core thinks it is when it is
                # replaced: an Apply of an earlier event in this pass,
                # performed after the restore, would land on top of the
                # snapshot's state (a divergence).
                await self._perform(effects)
                effects = self._restore_downloaded(ev.snap, now)
            else:
                effects.extend(self.replica.handle(ev, now))
        await self._perform(effects)

    def mark_failed(self, exc: BaseException) -> None:
        """Stop serving: this group answers `unavailable` and reports `failed` from now on."""
        self.failed = f"{type(exc).__name__}: {exc}"
        # WalFailed: an earlier OSError failed the WAL (it says so once).
        self.failed_on_disk = isinstance(exc, (OSError, WalFailed))

    async def _perform(self, effects: list[m.Effect]) -> None:
        first = next((i for i, e in enumerate(effects) if type(e) is m.Persist), None)
        if first is None:
            # Every earlier pass's Persists are durable: passes are performed in turn.
            self._end_resync()
            self._perform_in_order(effects)
            return
        if first:
            # What comes before the first Persist does not wait for it: the
            # leader's Appends of fresh entries.  Let the peer streams write
            # them now, so that the followers fsync while we do.
            early = effects[:first]
            self._perform_in_order(early)
            if any(type(e) is m.Send for e in early):
                await asyncio.sleep(0)
        persists = [e for e in effects[first:] if isinstance(e, m.Persist)]
        if any(p.snapshot is not None for p in persists):
            # Writing a snapshot archive can take long: off the loop.
            await asyncio.wrap_future(self._pool().submit(self._persist_all, persists))
        else:
            # Appends and one fsync (~0.2 ms) inline: a hop to a thread
            # costs more CPU than that (futex hand-offs, GIL contention
            # with the loop) and adds up to a GIL switch interval (5 ms)
            # of latency to every pass.
            self._persist_all(persists)
        if any(p.entries for p in persists):
            self.persist.observe((time.perf_counter() - self._pass_arrived) * 1000)
        self._end_resync()  # what the core re-synced on is durable now (persisted above)
        self._perform_in_order(effects[first:])

    def _end_resync(self) -> None:
        """Remove the RESYNC marker once the core no longer re-syncs."""
        if self._resync_marker is not None and self.replica is not None and not self.replica.resyncing:
            self.storage.unlink(self._resync_marker, missing_ok=True)
            # Durably: a removal a power loss undoes makes the replica
            # re-sync again and withhold its vote meanwhile, and with one
            # more replica re-syncing that stalls a group of three for good.
            self.storage.fsync_dir(self._resync_marker.parent)
            self._resync_marker = None
            self.log.info("resync_complete", last_seq=self.replica.last_seq)

    def _pool(self) -> Executor:
        if self._persist_pool is None:
            self._persist_pool = self.runtime.executor(f"group-{self.gid}-persist")
        return self._persist_pool

    def _perform_in_order(self, effects: list[m.Effect]) -> None:
        """Every effect but Persists (the caller made those durable first)."""
        for eff in effects:
            if isinstance(eff, m.Persist):
                continue
            if isinstance(eff, m.Send):
                msg = eff.msg
                if type(msg) is m.SnapshotNeeded:
                    msg = self._publish_snapshot(msg)
                self.transport.send(msg)
            elif isinstance(eff, m.Apply):
                self._apply(eff.entries)
            elif isinstance(eff, m.Reply):
                self._reply(eff)
            elif isinstance(eff, m.ReplyMany):
                self._reply_many(eff)
            elif isinstance(eff, m.ServeRead):
                self._serve_read(eff)
            elif isinstance(eff, m.SetTimer):
                self._set_timer(eff.at)
            elif isinstance(eff, m.ReportReady):
                self.hooks.report_ready(self.gid, eff.term)
            elif isinstance(eff, m.ReportQuorum):
                if eff.ok:
                    self.log.info("quorum_regained", term=eff.term)
                else:
                    self.log.warning("quorum_lost", term=eff.term, lease_ms=self.settings.lease_ms,
                                     voters=list(self.replica.voters) if self.replica else None)
                self.hooks.report_quorum(self.gid, eff.term, eff.ok)
            elif isinstance(eff, m.TransferReady):
                self.hooks.transfer_ready(self.gid, eff.target, eff.term)
            elif isinstance(eff, m.NeedMetaView):
                self._check_meta(eff.term)
            elif isinstance(eff, m.DownloadSnapshot):
                self._start_download(eff)
            elif isinstance(eff, m.TakeSnapshot):
                self._snapshot_plugin(eff.seq, eff.meta, eff.writes)

    # -- persistence ------------------------------------------------

    def _persist_all(self, persists: list[m.Persist]) -> None:
        wal = self.wal
        assert wal is not None
        for p in persists:
            if p.term is not None:
                wal.set_hard_state(term=p.term)
            if p.snapshot is not None:
                self._install_snapshot_point(p.snapshot)
            if p.truncate_after is not None:
                wal.truncate_after(p.truncate_after)
            if p.entries:
                wal.append([(e.term, e.seq, encode_entry(e)) for e in p.entries])
            if p.commit is not None:
                wal.set_hard_state(commit=p.commit)
        t0 = time.perf_counter()
        if wal.sync() and self.on_sync is not None:
            self.on_sync(time.perf_counter() - t0)

    def _install_snapshot_point(self, meta: m.SnapshotMeta) -> None:
        """Make the archive for `meta` durable, then move the WAL's start to it."""
        wal = self.wal
        assert wal is not None
        tmp = self._plugin_snaps.pop(meta.seq, None)
        if tmp is not None:
            # Written (and without error) before the core heard of it, with
            # the archive too if the core's meta then is this one.
            archived = self._plugin_writes.pop(meta.seq).result()
            if archived is None or (archived is not meta and archived != meta):
                write_snapshot(self.snap_dir, meta, tmp, storage=self.storage)
            shutil.rmtree(tmp, ignore_errors=True)
        elif snapshot_at(self.snap_dir, meta.seq, storage=self.storage) is None:
            raise RuntimeError(f"core installed snapshot {meta.seq} but no archive exists for it")
        # Captures below a snapshot installed from the leader are superseded.
        # This runs on the persist thread while the loop may drop a failed
        # capture: only atomic pops, each tolerating the other side's. A
        # writer may still be writing into its directory: removed when done.
        for seq in [s for s in list(self._plugin_snaps) if s < meta.seq]:
            old = self._plugin_snaps.pop(seq, None)
            writer = self._plugin_writes.pop(seq, None)
            if old is not None:
                if writer is None:
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    writer.add_done_callback(lambda _f, d=old: shutil.rmtree(d, ignore_errors=True))
        if meta.seq <= wal.last_seq and wal.term_at(meta.seq) == meta.term:
            wal.compact_through(meta.seq)
        else:
            wal.reset(meta.term, meta.seq)
        prune_snapshots(self.snap_dir, meta.seq, storage=self.storage)
        self._last_snapshot_seq = max(self._last_snapshot_seq, meta.seq)

    # -- applying ------------------------------------------------------------------------------

    def _apply(self, entries: tuple[m.Entry, ...]) -> None:
        keep_results = bool(self._pending) or bool(self._batched)
        for e in entries:
            if e.kind == "op" or e.kind == "ops":
                ctx = ApplyContext(e.seq, e.term, e.ts)
                if e.kind == "op":
                    result: Any = self._apply_one(e.data, ctx)
                else:
                    result = _Results([self._apply_one(op, ctx) for op in e.data])
                if keep_results:
                    self._results[e.seq] = result
                    self._results_held += _weight(result)
                    while self._results_held > RESULT_CACHE and self._results:
                        self._results_held -= _weight(self._results.popitem(last=False)[1])

    def _apply_one(self, op: Any, ctx: ApplyContext) -> Any:
        try:
            return self.plugin.apply(op, ctx)
        except BadOp as exc:
            return _ApplyError(exc.code, exc.message)

    def _snapshot_plugin(self, seq: int, meta: m.SnapshotMeta | None = None, writes: int = 0) -> None:
        # The plugin is exactly at `seq` now: entries after it are applied
        # later in this same effect stream. Only the capture runs here: the
        # packing and fsyncs of a large state (~0.2 s per 100k items) would
        # stall every group of this worker, so a thread of its own writes it,
        # and the group keeps applying meanwhile (a writer on the persist
        # thread would hold up the passes queued behind it). Given the core's
        # meta, that thread also writes the archive (the copy and fsyncs of
        # the whole state): installed from the group's pass, it held the
        # group for a hundred milliseconds at 100k items. One
        # capture at a time: each holds a copy of the state, and a point asked
        # for while one is being written is skipped (the next comes
        # snapshot_every later).
        self._writes_unsnapped += writes
        if self._plugin_writes:
            self.log.info("snapshot_skipped", seq=seq, writing=sorted(self._plugin_writes))
            return
        records = self.plugin.snapshot_records()
        due = snapshot_due(self._snapshot_after, records, self.settings.snapshot_state_ratio)
        if self._writes_unsnapped < due:
            self.log.info("snapshot_deferred", seq=seq, writes=self._writes_unsnapped, due=due, records=records)
            return
        # Counted again if the write fails (one capture at a time: one count).
        self._writes_capturing, self._writes_unsnapped = self._writes_unsnapped, 0
        tmp = Path(tempfile.mkdtemp(dir=self._scratch(), prefix=f".plugin-{seq}-"))
        writer = self.plugin.capture()
        self._plugin_snaps[seq] = tmp
        if self._writer_pool is None:
            self._writer_pool = self.runtime.executor(f"group-{self.gid}-snapshot")
        written = self._writer_pool.submit(_write_capture, writer, tmp, self.snap_dir, meta, self.storage)
        self._plugin_writes[seq] = written
        loop = asyncio.get_running_loop()
        written.add_done_callback(lambda f: loop.call_soon_threadsafe(self._plugin_written, seq, f))

    def _plugin_written(self, seq: int, written: "Future[m.SnapshotMeta | None]") -> None:
        """On the loop, once the writer of `seq` has finished: tell the core, or
        drop the capture if it failed (the log still holds everything; the
        next point tries again)."""
        if written.cancelled() or self._plugin_writes.get(seq) is not written:
            return  # closing
        exc = written.exception()
        if exc is None:
            self.deliver(m.Compact(seq, written.result()))
            return
        self.log.error("snapshot_write_failed", seq=seq, error=f"{type(exc).__name__}: {exc}")
        self._writes_unsnapped += self._writes_capturing
        # pop(..., None): an installed snapshot past seq may have dropped it already.
        self._plugin_writes.pop(seq, None)
        tmp = self._plugin_snaps.pop(seq, None)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def _reply(self, r: m.Reply) -> None:
        slot = self._batched.pop(r.req, None)
        if slot is not None:
            self._reply_batched(r, *slot)
            return
        pending = self._pending.get(r.req)
        if pending is None:
            return
        fut = pending[0]
        if fut.done():
            return
        fut.set_result(self._outcome_of(r))

    def _reply_batched(self, r: m.Reply, batch: "_BatchWait", i: int) -> None:
        batch.results[i] = self._outcome_of(r)
        batch.left -= 1
        if batch.left == 0:
            self._batch_done(batch)

    def _reply_many(self, r: m.ReplyMany) -> None:
        """Each write's outcome from its place in the "ops" entry (what
        `_outcome_of` makes of the equivalent Replies, one lookup for all)."""
        held = self._results.get(r.seq)
        items = held.items if isinstance(held, _Results) else ()
        n = len(items)
        batched = self._batched
        for i, req in enumerate(r.reqs):
            slot = batched.pop(req, None)
            if slot is None:
                continue  # its caller has given up
            batch, j = slot
            batch.results[j] = _applied(r.seq, r.term, items[i] if i < n else None)
            batch.left -= 1
            if batch.left == 0:
                self._batch_done(batch)

    def _batch_done(self, batch: "_BatchWait") -> None:
        if batch.fut.done():
            return
        acked = sum(1 for o in batch.results if isinstance(o, Outcome) and o.ok)
        if acked:
            seconds = time.perf_counter() - batch.started
            self.latency.observe(seconds * 1000, acked)
            if self.on_write_latency is not None:
                self.on_write_latency(seconds)
        batch.fut.set_result(None)

    def _outcome_of(self, r: m.Reply) -> Outcome:
        if not r.ok:
            return Outcome(False, r.seq, r.term, r.error_code, r.leader)
        return _applied(r.seq, r.term, self._result_for(r))

    def _fail_all(self, why: str) -> None:
        """Answer everything the core took and will not answer now. Writes and
        membership changes may still commit under the next leader; reads
        changed nothing."""
        for fut, _, kind in self._pending.values():
            if not fut.done():
                changes = kind == "members"
                fut.set_result(Outcome(False, error_code="unavailable", maybe_applied=changes,
                                       message=_GONE_MID_WRITE % why if changes else why))
        for batch, i in self._batched.values():
            batch.results[i] = Outcome(False, error_code="unavailable", message=_GONE_MID_WRITE % why,
                                       maybe_applied=True)
            batch.left -= 1
            if batch.left == 0 and not batch.fut.done():
                batch.fut.set_result(None)
        self._batched.clear()

    def _result_for(self, r: m.Reply) -> Any:
        """The plugin's result for an acknowledged write.

        A plain op's result is handed out once. An "ops" entry's results
        stay until the cache bound pushes them out, since how many replies
        will come for it (retries, a rid repeated in a batch) is not known
        here."""
        held = self._results.get(r.seq)
        if not isinstance(held, _Results):
            if r.idx is not None or r.seq not in self._results:
                return None
            self._results_held -= 1
            return self._results.pop(r.seq)
        return held.items[r.idx] if r.idx is not None and r.idx < len(held.items) else None

    def _serve_read(self, s: m.ServeRead) -> None:
        pending = self._pending.get(s.req)
        if pending is None or pending[0].done():
            return
        fut, _, query = pending
        assert self.replica is not None
        try:
            fut.set_result(Outcome(True, self.replica.applied_seq, self.replica.term, result=self.plugin.query(query)))
        except NotFound as exc:
            fut.set_result(Outcome(False, self.replica.applied_seq, self.replica.term, "not_found",
                                   message=exc.message))
        except BadOp as exc:
            fut.set_result(Outcome(False, error_code="bad_request", message=exc.message))

    def _check_meta(self, term: int) -> None:
        """A peer spoke at `term`, above what meta has shown this replica:
        fetch meta's view now rather than wait for the watch to bring it
        (a new leader's first messages often beat it; the follower must not
        answer them before it has the view)."""
        if self._meta_check is not None and not self._meta_check.done():
            return  # its view covers this too, or the core asks again on the sender's retransmit
        self._meta_check = asyncio.create_task(self._fetch_meta_view(term), name=f"group-{self.gid}-meta-check")

    async def _fetch_meta_view(self, term: int) -> None:
        view = await self.hooks.meta_view(self.gid)
        if view is None:
            return
        self.deliver(view)
        now = self.now_ms() / 1000
        last = self._unpublished_logged_at
        if view.term < term and (last is None or now - last >= UNPUBLISHED_LOG_S):
            # Meta (or the meta node asked) is behind the sender, or the
            # message was forged: either way it is not acted on until meta
            # publishes the term.
            self._unpublished_logged_at = now
            self.log.warning("peer_term_unpublished", term=term, meta_term=view.term,
                             replica_term=self.replica.term if self.replica else None)

    def _set_timer(self, at: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, (at - self.now_ms()) / 1000)
        self._timer = asyncio.get_running_loop().call_later(delay, self.deliver, m.Tick())

    # -- snapshot download ---------------------------------------------------------------------------

    def _start_download(self, d: m.DownloadSnapshot) -> None:
        if self._download is not None and not self._download.done():
            return
        self._download = asyncio.create_task(self._download_snapshot(d))

    async def _download_snapshot(self, d: m.DownloadSnapshot) -> None:
        """Fetch the snapshot `d` names, exactly: the (term, seq), size and
        digest its source published in the replication message
        (SnapshotNeeded). The manifest and the source's answers are only
        transport; what they claim is checked against that, never trusted.
        Any refusal ends this try, nothing installed: the core asks again
        (snapshot_retry_ms), from whichever replica then sends the request."""
        published = _published(d)
        if published is None:
            self.snapshot_refused += 1
            self.log.warning("snapshot_unpublished", source=d.source, seq=d.seq,
                             why="the request carries no valid (term, seq, size, digest) to check a download against")
            return
        term, seq, size, digest = published
        partial = self.snap_dir / f".download-{seq}-{term}.partial"
        try:
            man = await self.snapshots.manifest(d.source, seq)
            if man is None:
                return
            if not isinstance(man, dict) or (man.get("term"), man.get("seq"), man.get("size"),
                                             man.get("digest")) != published:
                # Another snapshot by now (the source took a newer one; the
                # next request names it), or a source that lies.
                self.snapshot_refused += 1
                self.log.warning("snapshot_manifest_mismatch", source=d.source, published=list(published),
                                 manifest=str(man)[:200])
                return
            io = self.storage
            make_dirs(io, self.snap_dir)
            for name in io.listdir(self.snap_dir):
                if name.startswith(".download-") and name.endswith(".partial") and name != partial.name:
                    # An earlier snapshot's, broken off: this one supersedes it.
                    io.unlink(self.snap_dir / name, missing_ok=True)
            started = self.now_ms()
            have = io.size(partial) if io.exists(partial) else 0
            if have > size:
                io.unlink(partial)  # not this snapshot's bytes, whatever they are
                have = 0
            progress = self.download = DownloadProgress(have, size)
            if not await self._fetch(d.source, seq, partial, progress):
                return  # the partial stays: the core asks again, and the next download resumes it
            got = await asyncio.to_thread(file_digest, partial, storage=io)
            if got != digest:
                io.unlink(partial, missing_ok=True)
                self.snapshot_refused += 1
                self.log.warning("snapshot_digest_mismatch", source=d.source, seq=seq, published=digest, got=got)
                return
            # Off the loop: its fsync writes the whole download out.
            snap = await asyncio.to_thread(install_downloaded, self.snap_dir, partial, term, seq, digest, storage=io)
            self.log.info("snapshot_downloaded", source=d.source, seq=seq, bytes=size,
                          seconds=round((self.now_ms() - started) / 1000, 3), busy_waits=progress.busy_waits)
            self.deliver(_Restore(snap))
        except (FetchFailed, OSError) as exc:
            self.log.warning("snapshot_download_failed", source=d.source, error=f"{type(exc).__name__}: {exc}")
        except ValueError as exc:  # orjson.JSONDecodeError too: a manifest too large or not JSON
            self.snapshot_refused += 1
            self.log.warning("snapshot_manifest_unusable", source=d.source, error=f"{type(exc).__name__}: {exc}")
        except SourceOverran as exc:
            # Not the published bytes, whatever they are: start over next time.
            self.storage.unlink(partial, missing_ok=True)
            self.snapshot_refused += 1
            self.log.warning("snapshot_download_refused", source=d.source, seq=seq, error=str(exc))
        finally:
            self.download = None

    async def _fetch(self, source: str, seq: int, partial: Path, progress: DownloadProgress) -> bool:
        """Bring `partial` up to `progress.total` bytes with range requests; True once it has them all.

        A failed attempt resumes from what arrived (DOWNLOAD_ATTEMPTS in a
        row without a byte, then it gives up). A source serving as many
        downloads as it allows answers busy: that is no failure, and it is
        asked again with a growing, jittered pause, for up to BUSY_WAIT_S in
        a row.
        """
        io = self.storage
        failures = 0
        busy_pause = BUSY_PAUSE_S
        busy_until = self.now_ms() / 1000 + BUSY_WAIT_S
        while progress.received < progress.total:
            have = progress.received
            try:
                async with self.snapshots.fetch(source, seq, have, progress.total) as body:
                    progress.waiting = False
                    busy_pause, busy_until = BUSY_PAUSE_S, self.now_ms() / 1000 + BUSY_WAIT_S
                    if body.start == 0:
                        progress.received = 0  # the whole file, from its start
                    fd = io.open(partial, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if body.start else os.O_TRUNC))
                    try:
                        async for chunk in body.chunks:
                            # Never past the published size: a source that
                            # sends more is refused, not written to disk.
                            if progress.received + len(chunk) > progress.total:
                                raise SourceOverran(f"sent more than the published {progress.total} bytes")
                            write_all(io, fd, chunk)
                            progress.received += len(chunk)
                    finally:
                        io.close(fd)
                    if progress.received < progress.total:
                        # An answer that ends short without an error is an
                        # interruption too: asked again at once, it would
                        # spin for as long as the source keeps doing it.
                        raise FetchFailed(f"the answer ended at byte {progress.received} of {progress.total}")
            except SourceBusy:
                progress.waiting = True
                progress.busy_waits += 1
                if self.now_ms() / 1000 + busy_pause > busy_until:
                    self.log.info("snapshot_source_busy_giving_up", source=source, have=have,
                                  waits=progress.busy_waits)
                    return False
                await asyncio.sleep(busy_pause * self.rng.uniform(0.5, 1.0))
                busy_pause = min(busy_pause * 2, BUSY_PAUSE_MAX_S)
            except (FetchFailed, OSError) as exc:
                failures = 0 if progress.received > have else failures + 1
                self.log.warning("snapshot_download_interrupted", source=source, attempt=failures, have=have,
                                 error=f"{type(exc).__name__}: {exc}"[:200])
                if failures >= DOWNLOAD_ATTEMPTS:
                    return False
                await asyncio.sleep(0.2 * failures)
        return progress.received == progress.total

    def _publish_snapshot(self, msg: m.SnapshotNeeded) -> m.SnapshotNeeded:
        """`msg` with the size and digest of our archive at its (term, seq):
        what the receiver checks its download against. Without an archive
        there (none can be: the core installs a snapshot point only once its
        archive is durable) it goes as it is, and the receiver downloads nothing."""
        snap = snapshot_at(self.snap_dir, msg.snap_seq, storage=self.storage)
        if snap is None or snap.term != msg.snap_term or not valid_digest(snap.digest):
            self.log.warning("snapshot_not_published", seq=msg.snap_seq, term=msg.snap_term, to=msg.dst)
            return msg
        return dataclasses.replace(msg, digest=snap.digest, size=snap.size)

    def _restore_downloaded(self, snap: SnapshotFile, now: int) -> list[m.Effect]:
        assert self.replica is not None
        if not self.replica.accepts_snapshot(snap.seq):
            return []
        try:
            meta = restore_snapshot(snap.path, self.plugin, expect_point=(snap.term, snap.seq), storage=self.storage,
                                    scratch=self._scratch())
        except SnapshotCorrupt as exc:
            # Checked before the plugin is touched: this replica is as it was.
            # Only the archive goes; the core asks for a snapshot again.
            self.snapshot_refused += 1
            self.log.error("snapshot_download_unusable", seq=snap.seq, error=str(exc))
            remove_snapshot(snap, storage=self.storage)
            return []
        self._last_snapshot_seq = meta.seq
        self._writes_unsnapped = 0  # the log starts at the installed snapshot
        return self.replica.handle(m.SnapshotInstalled(meta), now)

    def latest_snapshot(self) -> SnapshotFile | None:
        return latest_snapshot(self.snap_dir, storage=self.storage)

    def snapshot(self, seq: int | None = None) -> SnapshotFile | None:
        """The archive at `seq` (the latest without one), if this replica holds it.

        A download asks for the seq its source published, which is the
        source's WAL snapshot point: a newer archive may exist beside it (a
        capture whose Compact never reached the core, before a crash), and
        serving only the latest would refuse that download until the next
        snapshot, which an idle group never takes."""
        if seq is None:
            return self.latest_snapshot()
        return snapshot_at(self.snap_dir, seq, storage=self.storage)

    def _scratch(self) -> Path:
        self.scratch.mkdir(parents=True, exist_ok=True)
        return self.scratch

    # -- reporting ---------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        r = self.replica
        if r is None:
            # Not opened: a failure to open it (the disk) is a failed replica to meta too.
            return {"state": "closed"} if self.failed is None else {"state": "failed", "failed": self.failed}
        now = self.now_ms()
        heard, lost = r.leader_heard_at, r.quorum_lost_at
        dl = self.download
        return {
            "term": r.term, "role": r.role, "leader": r.leader, "ready": r.ready,
            # Check-quorum, for meta's controller and operators: a leader's
            # quorum (and for how long it has lacked one), a follower's silence.
            "quorum": r.has_quorum, "no_quorum_ms": now - lost if lost is not None else None,
            "unheard": list(r.unheard_voters),
            "leader_silence_ms": now - heard if heard is not None else None,
            "last_term": r.last_term, "last_seq": r.last_seq, "commit": r.commit_seq, "applied": r.applied_seq,
            "lag": max(0, r.commit_seq - r.applied_seq), "writes": self.latency.writes,
            "write_rate": round(self.latency.rate(), 1),
            "latency_ema_ms": round(self.latency.ema_ms, 3), "latency_p99_ms": round(self.latency.p99(), 3),
            "persist_ema_ms": round(self.persist.ema_ms, 3), "persist_p99_ms": round(self.persist.p99(), 3),
            "in_flight": len(self._pending) + len(self._batched), "pending_bytes": self.pending_bytes,
            "overloaded": self.overloaded, "voters": list(r.voters), "learners": list(r.learners),
            "config_seq": r.config_seq,
            "snapshot_seq": self._last_snapshot_seq, "failed": self.failed, "resyncing": r.resyncing,
            # The snapshot download in flight, if any: meta's operators show its progress.
            "snapshot_bytes": dl.received if dl is not None else None,
            "snapshot_total": dl.total if dl is not None else None,
            "snapshot_waiting": dl.waiting if dl is not None else False,
            "snapshot_refused": self.snapshot_refused,
        }


def _published(d: m.DownloadSnapshot) -> tuple[int, int, int, str] | None:
    """(term, seq, size, digest) of the snapshot `d` asks for, as its
    source published them, if every one is there and well-formed."""
    if not (valid_count(d.snap_term) and valid_count(d.seq) and d.seq > 0 and valid_count(d.size)
            and valid_digest(d.digest)):
        return None
    return d.snap_term, d.seq, d.size, d.digest  # type: ignore[return-value]


def _write_capture(writer: Callable[[Path], None], tmp: Path, snap_dir: Path,
                   meta: m.SnapshotMeta | None, storage: Storage) -> m.SnapshotMeta | None:
    """On the snapshot thread: the plugin's files into `tmp`, then, given the
    core's meta, the archive of both (durable, not yet the WAL's snapshot
    point); the meta archived, if any. `tmp` stays until the install, which
    archives again should the core install another meta at that seq."""
    writer(tmp)
    if meta is None:
        return None
    write_snapshot(snap_dir, meta, tmp, storage=storage)
    return meta


def _write_marker(io: Storage, path: Path, why: str) -> None:
    # Before anything is deleted, and durable: its name too (the directory's
    # fsync), or a power loss could leave the log discarded and no marker.
    fd = io.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        write_all(io, fd, (why + "\n").encode())
        io.fsync(fd)
    finally:
        io.close(fd)
    io.fsync_dir(path.parent)


@dataclass(frozen=True)
class _ApplyError:
    code: str
    message: str


@dataclass(slots=True, eq=False)
class _BatchWait:
    """The writes of one write_many: a result slot each, one future for all."""

    fut: asyncio.Future[None]
    results: list[Any]
    started: float
    left: int = 0


def _applied(seq: int, term: int, result: Any) -> Outcome:
    """The outcome of a committed write, from what the plugin's apply gave."""
    if isinstance(result, _ApplyError):
        return Outcome(False, seq, term, result.code, message=result.message)
    return Outcome(True, seq, term, result=result)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Results:
    """The plugin's results for the ops of one "ops" entry, by position."""

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items


def _weight(result: Any) -> int:
    return len(result.items) if isinstance(result, _Results) else 1
