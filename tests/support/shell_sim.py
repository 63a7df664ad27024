"""Deterministic simulation of whole shard groups of real `GroupShell`s.

The core simulator (tests/tier1/replica_sim.py) proves the replication
algorithm; this one runs the code that keeps its durability promise: the
group loop's effect ordering and group commit (worker/group.py), the WAL
(worker/wal.py), snapshot archives, installs and downloads
(worker/snapshots.py), each replica on its own simulated disk
(tests/support/sim_storage.py), all on one virtual-time event loop
(tests/support/sim_loop.py) driven by one `random.Random(seed)`.

What is modelled
----------------
* disks: unsynced writes lost, torn, or kept block by block (holes) on a
  power loss, names lost without a directory fsync, fsync failures with
  Linux's semantics (the pages are gone), short writes (the disk filling
  in the middle of one: the next fails ENOSPC; or a signal), and bytes
  flipped in a synced WAL record while its replica is down;
* crashes anywhere: a node's disk may kill it at its k-th mutating call
  (in the middle of a WAL append, a segment roll, a hard-state write, a
  snapshot archive or install, a download), or the nemesis kills it
  between two events; either way as a process crash (the page cache
  survives) or a power loss, and now and then the whole room loses power;
* a group that failed on its disk is reopened in place the way the worker
  does it (worker/retry.py: every file synced and its cache dropped);
* network: delay (so reordering), loss, duplication, one-way and two-way
  cuts; every message goes through the wire codec; messages a node sent
  before it died are still delivered;
* snapshot downloads from a peer's archive on its simulated disk, with
  answers cut short, a source that is busy, and one that flips a byte;
* meta: a term and leader changed only by compare-and-set, failover to a
  live voter it has recorded (the most up-to-date one, or any), views
  delayed and lost; leader transfers asked of the leader, handed over by
  the leader's own compare-and-set (delayed, sometimes lost, refused once
  the term moved or to a worker that is no voter);
* membership: spare workers that host no replica at first; meta's staged
  operators one step at a time through the leader's `change_members`
  (answered, refused or timed out like the worker's members route): add a
  learner, promote it once caught up (often by a snapshot download),
  remove a voter (the leader handing over first; a live majority and three
  voters left) or a learner; meta records a membership the leader reports
  committed (voters, learners, conf_ver) and its views carry it; a worker
  opens a replica meta places on it and drops one meta no longer names,
  its data moved aside (added again, it starts empty);
* clients: unique writes with request ids, acknowledged at quorum or all,
  retried with the same rid after a timeout or a not_leader.

Invariants (tests/support/sim_checks.py, plus what only this simulator sees)
---------------------------------------------------------------------------
* state machine safety, in-order application, exactly-once, and no
  acknowledged write lost (at acknowledgement and at the end);
* WAL recovery: a WAL record damaged after it was synced is reported (the
  replica re-syncs), never skipped;
* a replica never stops on anything but its disk (a failed group that did
  not fail on an OSError is a bug);
* at the end, with every fault healed, the group converges and every
  member (voter or learner) holds the same items: each acknowledged write,
  nothing else that was not committed; a replica removed from the group
  holds nothing that was not committed either (checked when its worker
  drops it, or at the end if it has not).

`SHARDGRID_SIM_PLANT=NAME` (or `plant=`) runs a known bug instead (see
PLANTS); the simulator must catch it.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import sys
import tempfile
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import structlog

from meta.controller import CATCH_UP_LAG
from tests.support.sim_checks import CommittedLog, SimViolation
from tests.support.sim_loop import InlineExecutor, VirtualTimeLoop
from tests.support.sim_storage import SimCrash, SimStorage
from worker import replica_msgs as m
from worker.codec import decode_message, encode_message
from worker.group import RESYNC_MARKER, GroupSettings, GroupShell, ShellRuntime
from worker.plugins.base import NotFound, load_plugin
from worker.server import DEFAULT_TIMEOUT_S  # what the members route gives a change
from worker.snapshot_fetch import FetchFailed, RangeBody, SourceBusy
from worker.wal import _HEADER, _SEGMENT_RE, HEADER_BYTES  # the sim walks records to damage one

GROUP = 0
ROOT = Path("/sim")
PLANTS = ("early-ack", "ignore-fsync-error", "skip-corrupt", "unverified-snapshot")
REPLAY_HINT = "{plant}make sim SEED={seed}"


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Params:
    nodes: int
    chaos_ms: int
    writes_per_s: int
    ack_all: float  # share of writes acknowledged only once every voter has them
    delay_ms: tuple[int, int]
    loss: float
    dup: float
    crash_every_ms: int  # mean time between nemesis strikes
    power_share: float  # of crashes, how many lose the machine's power (else: the process dies)
    outage_share: float  # of strikes, how many take the power of every node at once
    midop: float  # chance per incarnation that its disk kills it at a mutating call
    midop_within: int  # ... at one of the next this many calls
    fsync_fail: float  # chance per fsync
    corrupt: float  # chance per restart that a synced WAL record was damaged while down
    partition: float  # of strikes, how many cut links instead
    snapshot_every: int
    segment_bytes: int
    download_cut: float
    download_busy: float
    download_flip: float
    power_modes: tuple[str, ...]
    snapshot_ratio: float  # GroupSettings.snapshot_state_ratio: 0 snapshots at every point
    short_write: float  # chance per write that it is short (then half the time the next one fails ENOSPC)
    transfer: float  # of strikes, how many ask the leader to hand its leadership to another node
    spare: int  # nodes beyond the voters: workers that host no replica until an operator adds one
    members: float  # of strikes, how many take one step of a staged membership change


def draw_params(rng: random.Random) -> Params:
    return Params(
        nodes=rng.choice((3, 3, 3, 5)),
        chaos_ms=rng.randint(2500, 5000),
        writes_per_s=rng.choice((40, 80, 160)),
        ack_all=rng.choice((0.0, 0.2)),
        delay_ms=(1, rng.choice((3, 8, 20))),
        loss=rng.choice((0.0, 0.01, 0.05)),
        dup=rng.choice((0.0, 0.02)),
        crash_every_ms=rng.choice((150, 300, 600)),
        power_share=rng.choice((0.3, 0.6, 0.9)),
        outage_share=rng.choice((0.05, 0.15)),
        midop=rng.choice((0.2, 0.5, 0.8)),
        midop_within=rng.choice((20, 100, 400)),
        fsync_fail=rng.choice((0.0, 0.002, 0.01)),
        corrupt=rng.choice((0.0, 0.1, 0.3)),
        partition=rng.choice((0.1, 0.3)),
        snapshot_every=rng.choice((8, 20, 60)),
        segment_bytes=rng.choice((1024, 4096, 1 << 16)),
        download_cut=rng.choice((0.0, 0.2)),
        download_busy=rng.choice((0.0, 0.2)),
        download_flip=rng.choice((0.0, 0.1, 0.3)),
        power_modes=rng.choice((("lose",), ("prefix",), ("reorder",), ("lose", "prefix", "reorder"))),
        snapshot_ratio=rng.choice((0.0, 0.5)),
        short_write=rng.choice((0.0, 0.0, 0.002, 0.02)),
        transfer=rng.choice((0.0, 0.1, 0.3)),
        spare=rng.choice((0, 1, 1)),
        members=rng.choice((0.0, 0.15, 0.3)),
    )


# ----------------------------------------------------------------------------- the node


@dataclass
class SimNode:
    name: str
    storage: SimStorage
    scratch: Path
    shell: SimShell | None = None
    # The worker holds a replica of the group (open, or to be reopened after
    # a crash); False for a spare, and for a replica dropped once meta's view
    # no longer names it (worker/process.py `_drop_group`).
    hosted: bool = False
    up: bool = False
    inc: int = 0
    applied: int = 0  # the last seq this incarnation applied (or restored)
    damaged: tuple[str, int] | None = None  # (segment, offset) flipped while down: recovery must report it
    # Insertion-ordered (a dict, not a set): cancelling in hash order would not replay.
    tasks: dict[asyncio.Task[Any], None] = field(default_factory=dict)


class SimShell(GroupShell):
    """The real shell; the simulator only watches what it applies."""

    sim: ShellSim
    node: SimNode

    def _apply(self, entries: tuple[m.Entry, ...]) -> None:
        self.sim.on_apply(self.node, entries)
        super()._apply(entries)

    def _restore_downloaded(self, snap: Any, now: int) -> list[m.Effect]:
        effects = super()._restore_downloaded(snap, now)
        r = self.replica
        if r is not None and r.applied_seq > self.node.applied:
            self.sim.stats["snapshot_installed"] += 1
            if self.node.name in self.sim.m_learners:
                self.sim.stats["learner_snapshot_installed"] += 1  # a new replica catching up
            self.sim.log(f"INSTALLED {self.node.name} snapshot {r.applied_seq}")
            self.node.applied = r.applied_seq
        return effects


class _Hooks:
    def __init__(self, sim: ShellSim, node: SimNode) -> None:
        self.sim = sim
        self.node = node

    def peer_addr(self, worker_id: str) -> str | None:
        return worker_id if worker_id in self.sim.nodes else None

    def report_ready(self, group: int, term: int) -> None:
        self.sim.on_ready(self.node, term)

    def transfer_ready(self, group: int, target: str, term: int) -> None:
        # The worker's POST /v1/groups/{g}/leader: in flight a while, sometimes lost.
        if self.sim.calm or self.sim.rng.random() > 0.1:
            self.sim.loop.call_later(self.sim.rng.randint(1, 30) / 1000, self.sim.meta_hand_over, self.node.name,
                                     target, term)

    def report_quorum(self, group: int, term: int, ok: bool) -> None:
        pass

    async def meta_view(self, group: int) -> m.MetaView | None:
        await asyncio.sleep(self.sim.rng.randint(1, 20) / 1000)
        # The worker answers only for a group meta places on it (worker/process.py).
        return self.sim.view() if self.node.up and self.sim.is_member(self.node.name) else None


class _Transport:
    """The shell's only use of its transport: send. The simulator's network carries it."""

    def __init__(self, sim: ShellSim, node: SimNode) -> None:
        self.sim = sim
        self.node = node

    def send(self, msg: m.Message) -> None:
        self.sim.net_send(self.node, msg)


class _Snapshots:
    """Downloads from a peer's archive on its simulated disk, over a network
    that cuts answers short, finds the source busy, or flips a byte."""

    CHUNK = 2048

    def __init__(self, sim: ShellSim, node: SimNode) -> None:
        self.sim = sim
        self.node = node

    async def manifest(self, source: str, seq: int) -> Any:
        src = self.sim.nodes.get(source)
        await asyncio.sleep(self.sim.rng.randint(1, 10) / 1000)
        if src is None or not src.up or src.shell is None or self.sim.cut_between(source, self.node.name):
            raise FetchFailed(f"{source} unreachable")
        snap = src.shell.snapshot(seq)
        if snap is None:
            raise FetchFailed(f"{source} has no snapshot at {seq}")
        return {"seq": snap.seq, "term": snap.term, "size": snap.size, "digest": snap.digest}

    @contextlib.asynccontextmanager
    async def fetch(self, source: str, seq: int, start: int, total: int) -> AsyncIterator[RangeBody]:
        sim, rng = self.sim, self.sim.rng
        src = sim.nodes.get(source)
        await asyncio.sleep(rng.randint(1, 10) / 1000)
        if src is None or not src.up or src.shell is None or sim.cut_between(source, self.node.name):
            raise FetchFailed(f"{source} unreachable")
        if rng.random() < sim.p.download_busy:
            sim.stats["download_busy"] += 1
            raise SourceBusy(source)
        snap = src.shell.snapshot(seq)
        if snap is None:
            raise FetchFailed("that snapshot is gone")
        data = bytearray(src.storage.read_bytes(snap.path)[start:])
        if data and rng.random() < sim.p.download_flip:
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)  # a source (or a link) that lies
            sim.stats["download_flipped"] += 1
        cut = rng.randrange(len(data) + 1) if data and rng.random() < sim.p.download_cut else None
        if not sim.calm and rng.random() < sim.p.midop / 2:
            # Somewhere in writing what arrives, checking it, or installing it.
            sim.arm_crash(self.node, rng.randint(1, 8))
        yield RangeBody(start, self._chunks(bytes(data), cut))

    async def _chunks(self, data: bytes, cut: int | None) -> AsyncIterator[bytes]:
        end = len(data) if cut is None else cut
        for i in range(0, end, self.CHUNK):
            await asyncio.sleep(0.001)
            yield data[i:min(end, i + self.CHUNK)]
        if cut is not None:
            self.sim.stats["download_cut"] += 1
            raise FetchFailed("the answer broke off")

    async def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- plants


def _planted(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Patch in a known bug for the length of a run (the simulator must catch it)."""
    if name is None:
        return contextlib.nullcontext()
    if name not in PLANTS:
        raise ValueError(f"unknown plant {name!r}; known: {', '.join(PLANTS)}")
    return _plant(name)


@contextlib.contextmanager
def _plant(name: str) -> Iterator[None]:
    import worker.group as group
    import worker.wal as wal

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        saved.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    if name == "early-ack":
        # Every effect of a pass performed before its Persists are durable.
        async def perform(self: GroupShell, effects: list[m.Effect]) -> None:
            self._perform_in_order(effects)
            persists = [e for e in effects if isinstance(e, m.Persist)]
            if persists:
                self._persist_all(persists)
        patch(group.GroupShell, "_perform", perform)
    elif name == "ignore-fsync-error":
        real_sync = wal.Wal.sync

        def sync(self: wal.Wal) -> bool:
            try:
                return real_sync(self)
            except OSError:
                self._dirty = False
                self._failed = None
                return True
        patch(wal.Wal, "sync", sync)
    elif name == "skip-corrupt":
        real_recover = wal.Wal._recover

        def recover(self: wal.Wal) -> None:
            # On a damaged record: drop it and everything after it, as if it were a torn tail.
            while True:
                try:
                    return real_recover(self)
                except wal.WalCorrupt as exc:
                    path = Path(exc.path) if getattr(exc, "path", None) else None
                    offset = getattr(exc, "offset", None)
                    if path is None or offset is None or not self._io.exists(path):
                        raise
                    self._io.truncate(path, offset)
                    for name_ in sorted(self._io.listdir(self._dir)):
                        if _SEGMENT_RE.match(name_) and name_ > path.name:
                            self._io.unlink(self._dir / name_)
                    self._segments, self._run_seq, self._run_term = [], [], []
        patch(wal.Wal, "_recover", recover)
    elif name == "unverified-snapshot":
        class _Matches(str):
            def __eq__(self, other: object) -> bool:
                return True

            def __ne__(self, other: object) -> bool:
                return False

            __hash__ = str.__hash__
        patch(group, "file_digest", lambda *a, **k: _Matches("skipped"))
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


# ----------------------------------------------------------------------------- the simulator


class ShellSim:
    def __init__(self, seed: int, plant: str | None = None, verbose: bool = False) -> None:
        self.seed = seed
        self.plant = plant
        self.rng = random.Random(seed)
        self.p = draw_params(self.rng)
        self.verbose = verbose
        self.loop = VirtualTimeLoop()
        self.loop.set_exception_handler(self._loop_error)
        self.stats: Counter[str] = Counter()
        self.trace: list[str] = []  # its last lines (all of them with verbose)
        self.digest = 0  # of every line and every apply: equal digests, equal runs
        # Every worker, the spares last; the voters meta starts the group with first.
        self.names = [f"n{i}" for i in range(self.p.nodes + self.p.spare)]
        self._scratch = Path(tempfile.mkdtemp(prefix="shellsim-"))
        self.calm = False
        self.nodes = {n: SimNode(n, self.new_disk(n), self._scratch / n) for n in self.names}
        self.commits = CommittedLog(self.fail)
        self.cut: set[tuple[str, str]] = set()
        self.m_term = 0
        self.m_leader: str | None = None
        self.m_changed = 0.0
        # The membership meta has recorded (meta/state.py `set_members`):
        # conf_ver is the seq of its config entry, 0 for the bootstrap one.
        self.m_voters: tuple[str, ...] = tuple(self.names[:self.p.nodes])
        self.m_learners: tuple[str, ...] = ()
        self.m_conf_ver = 0
        self.m_operator: tuple[str, str] | None = None  # the staged operator in progress: (add|remove, worker)
        self.m_call: str | None = None  # the membership change meta has asked of the leader and awaits
        self.ready: dict[int, str] = {}  # term -> the replica that reported itself its ready leader
        self.written: dict[str, int] = {}  # item id -> the n its doc holds
        self.next_id = 0
        self.writers = 0  # client writes not yet answered for good
        self.failure: BaseException | None = None
        self.settings = GroupSettings(fsync="batch", snapshot_every=self.p.snapshot_every, quorum_timeout_ms=1000,
                                      lease_ms=300, segment_bytes=self.p.segment_bytes,
                                      snapshot_state_ratio=self.p.snapshot_ratio)

    # -- plumbing --------------------------------------------------------------------

    @property
    def now(self) -> int:
        return self.loop.ms()

    def log(self, text: str) -> None:
        line = f"{self.now:7d} {text}"
        self.digest = zlib.crc32(line.encode(), self.digest)
        self.trace.append(line)
        if len(self.trace) > 400:
            del self.trace[:100]
        if self.verbose:
            print(line)

    def fail(self, text: str) -> NoReturn:
        exc = SimViolation(f"seed {self.seed}{' plant ' + self.plant if self.plant else ''} t={self.now}: {text}")
        if self.failure is None:
            # Raised inside the shell's loop too, which would only mark its group failed.
            self.failure = exc
            self.loop.stop()
        raise exc

    def spawn(self, coro: Any, node: SimNode | None = None) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        task.add_done_callback(self._task_done)
        if node is not None:
            node.tasks[task] = None
            task.add_done_callback(lambda t: node.tasks.pop(t, None))
        return task

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, SimCrash):
            return  # a dead process's callback
        if self.failure is None:
            self.failure = exc if isinstance(exc, BaseException) else RuntimeError(context.get("message"))
            loop.stop()

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, SimCrash) and self.failure is None:
            self.failure = exc
            self.loop.stop()

    def view(self) -> m.MetaView:
        return m.MetaView(self.m_term, self.m_leader, self.m_voters, self.m_learners, self.m_conf_ver)

    def is_member(self, name: str) -> bool:
        return name in self.m_voters or name in self.m_learners

    def new_disk(self, name: str) -> SimStorage:
        """The disk worker `name` holds the group on when it first opens it
        (at the start, or after the replica it held was moved aside)."""
        io = SimStorage(random.Random(self.rng.random()))
        io.fsync_fail_rate = 0.0 if self.calm else self.p.fsync_fail
        io.short_write_rate = 0.0 if self.calm else self.p.short_write
        # A failed fsync can leave a log damaged (a process that dies
        # before the WAL cuts what the fsync forgot): one damaged log at
        # a time, as for the simulator's own damage (see `restart`).
        io.may_fail = lambda: not self.any_resyncing(besides=self.nodes[name])
        return io

    # -- run ------------------------------------------------------------------------

    def run(self) -> ShellSim:
        # A replay shows the shells' own log lines between the simulator's.
        quiet = contextlib.nullcontext() if self.verbose else structlog.testing.capture_logs()
        with _planted(self.plant), quiet:
            try:
                try:
                    self.loop.run_until_complete(self._main())
                except RuntimeError:
                    if self.failure is None:
                        raise
                if self.failure is not None:
                    raise self.failure
            finally:
                for task in asyncio.all_tasks(self.loop):
                    task.cancel()
                with contextlib.suppress(BaseException):
                    self.loop.run_until_complete(asyncio.sleep(0))
                self.loop.close()
                shutil.rmtree(self._scratch, ignore_errors=True)
        return self

    async def _main(self) -> None:
        self.log(f"PARAMS {self.p}")
        for node in self.nodes.values():
            if self.is_member(node.name):
                self.start(node)
        self.meta_cas(self.names[0])
        self.spawn(self.clients())
        self.spawn(self.nemesis())
        self.spawn(self.meta_loop())
        await asyncio.sleep(self.p.chaos_ms / 1000)
        self.calm = True
        self.log("CONVERGE")
        self.cut.clear()
        for node in self.nodes.values():
            node.storage.fsync_fail_rate = 0.0
            node.storage.short_write_rate = 0.0
            node.storage.crash_hook = None
            if node.hosted and not node.up and self.is_member(node.name):
                self.start(node)
            elif node.hosted and not node.up:
                self.forget(node)
        limit = self.now + 30_000
        # Every client gets its answer (retrying as it would), then the group settles.
        while self.writers or not self.converged():
            if self.now > limit:
                self.fail(f"did not converge in 30 s ({self.writers} writes unanswered): {self.status()}")
            await asyncio.sleep(0.05)
        self.final_checks()

    def status(self) -> str:
        parts = [f"meta term={self.m_term} leader={self.m_leader} voters={self.m_voters} "
                 f"learners={self.m_learners} conf_ver={self.m_conf_ver}"]
        for n in self.names:
            node = self.nodes[n]
            r = node.shell.replica if node.shell is not None else None
            if not node.hosted:
                parts.append(f"{n}:not hosted")
            elif not node.up or r is None:
                parts.append(f"{n}:down")
            else:
                parts.append(f"{n}:{r.role} t{r.term} last=({r.last_term},{r.last_seq}) c{r.commit_seq} "
                             f"a{r.applied_seq} ready={r.ready} resync={r.resyncing} failed={node.shell.failed} "
                             f"cfg@{r.config_seq}={r.voters}/{r.learners}")
        return " | ".join(parts)

    # -- nodes ----------------------------------------------------------------------

    def start(self, node: SimNode) -> None:
        io = node.storage
        io.crash_hook = None
        node.inc += 1
        node.scratch.mkdir(parents=True, exist_ok=True)
        plugin = load_plugin("entities")
        runtime = ShellRuntime(storage=io, clock=self.loop.ms, rng=random.Random(self.rng.random()),
                               executor=lambda _name: InlineExecutor(),
                               snapshots=lambda shell, node=node: _Snapshots(self, node),  # type: ignore[misc]
                               scratch=node.scratch)
        shell = SimShell(node.name, GROUP, ROOT / node.name, plugin, self.settings,
                         _Transport(self, node), _Hooks(self, node), structlog.get_logger(),  # type: ignore[arg-type]
                         runtime=runtime)
        shell.sim, shell.node = self, node
        node.shell = shell
        node.hosted = node.up = True
        damaged = node.damaged  # kept until an open gets through recovery: still on disk till then
        try:
            shell.open()
        except SimCrash:
            self.log(f"CRASH {node.name} while opening")
            self.crashed(node)
            return
        except OSError as exc:
            # The worker retries a group that failed to open on its disk (worker/retry.py).
            self.log(f"OPEN FAILED {node.name}: {exc}")
            self.stats["open_failed_on_disk"] += 1
            node.up = False
            node.storage.kill()
            self.loop.call_later(self.rng.randint(20, 200) / 1000, self.restart, node, False)
            return
        r = shell.replica
        assert r is not None
        node.damaged = None
        node.storage.scarred = False  # this recovery read the disk: it reported any hole (and re-syncs)
        if damaged is not None and not r.resyncing:
            self.fail(f"{node.name}: WAL record damaged at {damaged[0]}:{damaged[1]} after it was synced, "
                      f"and recovery did not report it")
        node.applied = r.applied_seq
        if shell.wal is not None and shell.wal.recovery.torn_bytes:
            self.stats["torn_tail_truncated"] += 1
        self.log(f"START {node.name} term={r.term} last=({r.last_term},{r.last_seq}) applied={r.applied_seq} "
                 f"resync={r.resyncing}")
        if not self.calm and self.rng.random() < self.p.midop:
            self.arm_crash(node, self.rng.randint(1, self.p.midop_within))
        shell.start()
        self.spawn(self.watch(node, node.inc), node)
        self.loop.call_later(self.rng.randint(1, 20) / 1000, self.deliver_view, node)

    def arm_crash(self, node: SimNode, within: int) -> None:
        """`node`'s disk kills it at its `within`-th mutating call from now."""
        left = within

        def hook(op: str) -> bool:
            nonlocal left
            left -= 1
            if left:
                return False
            where = _crash_site()
            self.stats[f"crash_in_{op}"] += 1
            self.stats[f"crash_during_{where}"] += 1
            self.log(f"CRASH {node.name} in {op} during {where}")
            self.loop.call_soon(self.crashed, node)
            return True
        node.storage.crash_hook = hook

    def crashed(self, node: SimNode, power: bool | None = None) -> None:
        """`node` dies now (its disk decides what it keeps when it restarts)."""
        if not node.up:
            return
        node.up = False
        node.storage.die()
        shell = node.shell
        if shell is not None:
            for task in (shell._task, shell._download, shell._meta_check, *node.tasks):
                if task is not None:
                    task.cancel()
            if shell._timer is not None:
                shell._timer.cancel()
        if power is None:
            power = self.rng.random() < self.p.power_share
        self.stats["crash_power" if power else "crash_kill"] += 1
        down = self.rng.randint(20, 400) / 1000
        self.loop.call_later(down, self.restart, node, power)

    def restart(self, node: SimNode, power: bool) -> None:
        if node.up or not node.hosted:
            return  # (not hosted: its worker dropped the replica meanwhile)
        if power:
            node.storage.power_loss(mode=self.rng.choice(self.p.power_modes))  # type: ignore[arg-type]
        else:
            node.storage.kill()
        if not self.is_member(node.name):
            # The restarted worker reads meta's view first: the replica was
            # removed while it was down (worker/process.py `_drop_stale`).
            self.forget(node)
            return
        if not self.calm and self.rng.random() < self.p.corrupt and not self.any_resyncing():
            # One damaged log at a time: a second one before the first has
            # re-synced is a double fault a group of 3 may not survive
            # (neither re-syncing replica votes), safely but for good.
            node.damaged = self.damage(node)
        self.start(node)

    def any_resyncing(self, besides: SimNode | None = None) -> bool:
        """Whether a node (other than `besides`) holds a damaged log or re-syncs one."""
        for node in self.nodes.values():
            if node is besides:
                continue
            if node.damaged is not None or node.storage.forgotten or node.storage.scarred:
                # (A failed fsync's pages read back by a process that died
                # before the WAL cut them, then a power loss: a log damaged
                # as surely as by the simulator's own hand.)
                return True
            r = node.shell.replica if node.shell is not None else None
            if r is not None and r.resyncing:
                return True
            # The marker goes with the first pass that persists after the re-sync.
            if node.storage.holds(ROOT / node.name / RESYNC_MARKER):
                return True
        return False

    def damage(self, node: SimNode) -> tuple[str, int] | None:
        """Flip a byte in a synced WAL record that recovery must read and report:
        in a segment before the last, or in the last one with a whole record after it."""
        io = node.storage
        wal_dir = ROOT / node.name / "wal"
        if not io.exists(wal_dir):
            return None
        segs = sorted(n for n in io.listdir(wal_dir) if _SEGMENT_RE.match(n))
        choices: list[tuple[str, int, int]] = []
        for i, name in enumerate(segs):
            data = io.read_bytes(wal_dir / name)
            records = list(_records(data))
            if i == len(segs) - 1:
                records = records[:-1]  # its last record may be a torn tail: cut, not reported
            choices.extend((name, lo, hi) for lo, hi in records)
        if not choices:
            return None
        name, lo, hi = self.rng.choice(choices)
        offset = io.corrupt(wal_dir / name, self.rng, lo, hi)
        self.stats["wal_damaged"] += 1
        self.log(f"DAMAGE {node.name} {name}@{offset}")
        return name, offset

    async def watch(self, node: SimNode, inc: int) -> None:
        """What the worker does about a failed group (worker/process.py
        `_retry_group`): on a disk error, once the disk answers, close the
        failed shell, sync what is on disk and drop its cache
        (worker/retry.py `settle_from_disk`), and open the group again in
        the same process, backing off while any of that fails. A replica
        that stops on anything else stopped on a bug."""
        while node.up and node.inc == inc:
            await asyncio.sleep(0.02)
            shell = node.shell
            if shell is None or shell.failed is None:
                continue
            if not shell.failed_on_disk:
                self.fail(f"{node.name} stopped on a bug: {shell.failed}")
            self.log(f"FAILED {node.name}: {shell.failed}")
            delay = 0.02
            while True:
                await asyncio.sleep(self.rng.uniform(delay, 2 * delay))
                if not node.up or node.inc != inc:
                    return  # crashed meanwhile: its restart opens the group
                try:
                    await shell.close()
                    node.storage.settle()
                    break
                except OSError as exc:
                    self.log(f"RETRY {node.name} failed: {exc}")
                    self.stats["reopen_retried"] += 1
                    delay = min(delay * 2, 0.5)
            self.stats["reopened_after_disk_error"] += 1
            self.log(f"REOPEN {node.name}")
            node.up = False
            self.start(node)
            return

    def on_apply(self, node: SimNode, entries: tuple[m.Entry, ...]) -> None:
        for e in entries:
            self.commits.in_order(node.name, e.seq, node.applied)
            key = (e.term, e.seq, e.kind, repr(e.data))
            self.digest = zlib.crc32(f"{self.now} {node.name} {e.term} {e.seq}".encode(), self.digest)
            if self.verbose:
                self.log(f"APPLY {node.name} {key}")
            self.commits.applied(node.name, e.seq, key, m.entry_rids(e))
            node.applied = e.seq

    def on_ready(self, node: SimNode, term: int) -> None:
        who = self.ready.setdefault(term, node.name)
        if who != node.name:
            self.fail(f"two ready leaders in term {term}: {who} and {node.name}")
        self.log(f"READY {node.name} term {term}")

    # -- network ---------------------------------------------------------------------

    def cut_between(self, a: str, b: str) -> bool:
        return (a, b) in self.cut

    def net_send(self, node: SimNode, msg: m.Message) -> None:
        if not node.up:
            return  # a dead process sends nothing
        wire = encode_message(msg)
        if self.calm:
            copies = 1
        elif self.rng.random() < self.p.loss or (msg.src, msg.dst) in self.cut:
            return
        else:
            copies = 2 if self.rng.random() < self.p.dup else 1
        for _ in range(copies):
            self.loop.call_later(self.rng.randint(*self.p.delay_ms) / 1000, self.net_arrive, wire)

    def net_arrive(self, wire: Any) -> None:
        msg = decode_message(wire)
        dst = self.nodes.get(msg.dst)
        if dst is not None and dst.up and dst.shell is not None and (msg.src, msg.dst) not in self.cut:
            dst.shell.deliver(msg)

    def deliver_view(self, node: SimNode) -> None:
        """Meta's view reaches `node`'s worker, which does with it what
        worker/process.py `_apply_view` does: opens a replica meta now places
        there, drops one meta no longer names, and hands the view to the rest."""
        member = self.is_member(node.name)
        if member and not node.hosted:
            self.stats["members_opened"] += 1
            self.log(f"OPEN {node.name}: meta places a replica here")
            self.start(node)
        elif not member and node.hosted:
            if node.up:  # (a replica that is down is dropped when its worker restarts)
                self.drop(node)
        elif node.up and node.shell is not None:
            node.shell.deliver(self.view())

    def drop(self, node: SimNode) -> None:
        """worker/process.py `_drop_group`: meta recorded a membership without
        this replica: close it and move its data aside. What it applied so far
        must have been committed (its later applies were checked as they came)."""
        shell = node.shell
        assert shell is not None
        self.check_items(node.name, shell.plugin, complete=False)
        node.up = False
        for task in (shell._task, shell._download, shell._meta_check, *node.tasks):
            if task is not None:
                task.cancel()  # before anything else runs: no apply after this
        node.storage.crash_hook = None
        self.spawn(self._close(node, shell))
        self.forget(node)

    async def _close(self, node: SimNode, shell: SimShell) -> None:
        try:
            await shell.close()
        except OSError as exc:  # the disk failed it: the worker logs that and drops the replica all the same
            self.log(f"CLOSE {node.name} failed: {exc}")

    def forget(self, node: SimNode) -> None:
        """The worker holds no replica of the group any more: its data is
        moved aside, so one added here again starts from an empty directory."""
        self.stats["members_dropped"] += 1
        self.log(f"DROP {node.name}: meta no longer places a replica here")
        node.hosted = node.up = False
        node.shell = None
        node.damaged = None
        node.storage = self.new_disk(node.name)

    # -- meta ------------------------------------------------------------------------

    def meta_cas(self, leader: str) -> None:
        self.m_term += 1
        self.m_leader = leader
        self.m_changed = self.now
        self.stats["meta_cas"] += 1
        self.log(f"META term {self.m_term} leader {leader}")
        self.publish()

    def publish(self) -> None:
        """Meta's new view reaches each worker's watch a little later, or not at all."""
        for node in self.nodes.values():
            if self.calm or self.rng.random() > 0.1:
                self.loop.call_later(self.rng.randint(1, 30) / 1000, self.deliver_view, node)

    def meta_record(self) -> None:
        """meta/controller.py `record_members`: a membership the leader of
        meta's current term reports as committed in its log (its config
        entry's seq past meta's conf_ver, and at most its commit), recorded
        by compare-and-set on conf_ver. Learned from the leader's reports
        (heartbeats, now and then), not from the answer to the change, so a
        change whose answer was lost is recorded too."""
        leader = self.nodes.get(self.m_leader or "")
        r = leader.shell.replica if leader is not None and leader.up and leader.shell is not None else None
        if r is None or r.term != self.m_term or r.role != "leader":
            return
        if r.config_seq > self.m_conf_ver and r.config_seq <= r.commit_seq and r.voters:
            self.m_voters, self.m_learners, self.m_conf_ver = tuple(r.voters), tuple(r.learners), r.config_seq
            self.stats["members_recorded"] += 1
            self.log(f"META members v{self.m_conf_ver} voters={self.m_voters} learners={self.m_learners}")
            self.publish()

    async def meta_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            for node in self.nodes.values():
                if self.rng.random() < 0.3:
                    self.deliver_view(node)
            if self.rng.random() < 0.5:
                self.meta_record()
            if self.m_operator is not None and not self.calm and self.rng.random() < 0.2:
                self.advance_operator()  # meta's controller advances an operator on its own
            leader = self.nodes.get(self.m_leader or "")
            r = leader.shell.replica if leader is not None and leader.up and leader.shell is not None else None
            healthy = r is not None and r.ready and r.term == self.m_term and r.has_quorum
            if healthy or self.now - self.m_changed < 400:
                continue
            # Meta names only a voter it has recorded (meta/controller.py `failover_candidate`).
            live = [n for n in self.m_voters if self.nodes[n].up and self.nodes[n].shell is not None
                    and self.nodes[n].shell.replica is not None and self.nodes[n].shell.failed is None]
            if not live:
                continue
            able = [n for n in live if not self.nodes[n].shell.replica.resyncing] or live  # type: ignore[union-attr]
            if self.calm or self.rng.random() < 0.6:
                best = max(able, key=self.position)
            else:
                best = self.rng.choice(live)
            self.meta_cas(best)

    def meta_hand_over(self, sender: str, target: str, expect_term: int) -> None:
        """meta/server.py's set_leader for a transfer: only the leader of
        `expect_term` may name its successor, by compare-and-set."""
        if self.m_term != expect_term or self.m_leader != sender or target not in self.m_voters:
            self.stats["transfer_refused"] += 1
            self.log(f"HANDOVER {sender} -> {target} at term {expect_term} refused (meta term {self.m_term})")
            return
        self.stats["transfer_done"] += 1
        self.meta_cas(target)

    def ask_transfer(self) -> None:
        """An operator's (or the balancer's) transfer: meta asks the leader it knows."""
        leader = self.nodes.get(self.m_leader or "")
        if leader is None or not leader.up or leader.shell is None:
            return
        others = [n for n in self.m_voters if n != leader.name]  # meta transfers to a voter only
        if not others:
            return
        target = self.rng.choice(others)
        self.stats["transfer_asked"] += 1
        self.log(f"TRANSFER {leader.name} -> {target} asked")
        leader.shell.deliver(m.TransferLeader(target))

    def position(self, name: str) -> tuple[int, int]:
        r = self.nodes[name].shell.replica  # type: ignore[union-attr]
        return (r.last_term, r.last_seq) if r is not None else (0, 0)

    # -- faults ----------------------------------------------------------------------

    async def nemesis(self) -> None:
        rng = self.rng
        while not self.calm:
            await asyncio.sleep(rng.expovariate(1 / self.p.crash_every_ms) / 1000 + 0.001)
            if self.calm:
                return
            roll = rng.random()
            if roll < self.p.outage_share:
                self.stats["outage"] += 1
                self.log("OUTAGE: every node loses power")
                for node in self.nodes.values():
                    self.crashed(node, power=True)
            elif roll < self.p.outage_share + self.p.partition:
                a, b = rng.sample(self.names, 2)
                pairs = {(a, b)} if rng.random() < 0.5 else {(a, b), (b, a)}
                if rng.random() < 0.3:  # a node cut from everyone
                    pairs = {(a, n) for n in self.names if n != a} | {(n, a) for n in self.names if n != a}
                self.cut |= pairs
                self.stats["partition"] += 1
                self.log(f"CUT {sorted(pairs)}")
                self.loop.call_later(rng.randint(100, 800) / 1000, self.heal, pairs)
            elif roll < self.p.outage_share + self.p.partition + self.p.transfer:
                self.ask_transfer()
            elif roll < self.p.outage_share + self.p.partition + self.p.transfer + self.p.members:
                self.membership_step()
            else:
                up = [n for n in self.names if self.nodes[n].up]
                if up:
                    self.crashed(self.nodes[rng.choice(up)])

    def heal(self, pairs: set[tuple[str, str]]) -> None:
        self.cut -= pairs

    # -- membership ------------------------------------------------------------------

    def membership_step(self) -> None:
        """An operator's hand on the group's membership (meta/server.py
        `replicas`, `cancel_operator`): start a staged operator when none is
        in progress -- add a worker that hosts no replica, or remove a
        member -- else take its next step, or now and then cancel it
        (between two steps, which leaves a consistent group, perhaps with a
        learner that a later removal takes out)."""
        rng = self.rng
        if self.m_operator is not None:
            if rng.random() < 0.1:
                self.stats["members_operator_cancelled"] += 1
                self.log(f"OPERATOR {self.m_operator} cancelled")
                self.m_operator = None
            else:
                self.advance_operator()
            return
        outside = [n for n in self.names if not self.is_member(n) and self.worker_live(n)]
        removable = [n for n in (*self.m_voters, *self.m_learners) if self.may_remove(n)]
        if outside and (not removable or rng.random() < 0.5):
            self.m_operator = ("add", rng.choice(outside))
        elif removable:
            # A learner left behind by a cancelled add goes first.
            self.m_operator = ("remove", self.m_learners[0] if self.m_learners else rng.choice(removable))
        else:
            return
        self.stats[f"members_operator_{self.m_operator[0]}"] += 1
        self.log(f"OPERATOR {self.m_operator} started")
        self.advance_operator()

    def advance_operator(self) -> None:
        """The operator's next step, from what meta knows now, as
        meta/controller.py `advance_operator` takes it: an add goes learner,
        catch up, promote; a removal moves the leadership away from the
        worker first. One membership call at a time, and only with a ready
        leader."""
        op = self.m_operator
        leader = self.nodes.get(self.m_leader or "")
        if op is None or self.m_call is not None or leader is None or not leader.up \
                or self.ready.get(self.m_term) != leader.name:
            return
        kind, who = op
        if (kind == "add" and who in self.m_voters) or (kind == "remove" and not self.is_member(who)):
            self.stats[f"members_operator_{kind}_done"] += 1
            self.log(f"OPERATOR {op} done")
            self.m_operator = None
        elif kind == "add" and who not in self.m_learners:
            self.ask_members(leader, "add_learner", who)
        elif kind == "add":
            if self.caught_up(who):
                self.ask_members(leader, "promote", who)
        elif who != leader.name:
            self.ask_members(leader, "remove", who)
        else:
            # The leader cannot remove itself: the `transfer` step moves the
            # leadership to the live, most caught-up voter first.
            others = [v for v in self.m_voters if v != who and self.nodes[v].up and self.nodes[v].shell is not None]
            if others and leader.shell is not None:
                target = max(others, key=self.position)
                self.stats["members_transfer_first"] += 1
                self.log(f"TRANSFER {who} -> {target} asked, to remove {who}")
                leader.shell.deliver(m.TransferLeader(target))

    def worker_live(self, name: str) -> bool:
        """Meta hears the worker's heartbeats (a worker hosting no replica of
        this group is not one the simulator crashes)."""
        node = self.nodes[name]
        return node.up or not node.hosted

    def may_remove(self, member: str) -> bool:
        """meta/server.py `replicas`: the voters that remain must hold a live
        majority. And at least three must remain: the fault model's one
        damaged log at a time needs three voters (two cannot start a term
        while one of them re-syncs, and one alone would lose it all)."""
        remaining = [v for v in self.m_voters if v != member]
        live = [v for v in remaining if self.worker_live(v)]
        return len(remaining) >= 3 and len(live) >= len(remaining) // 2 + 1

    def caught_up(self, learner: str) -> bool:
        """meta/controller.py `caught_up`: the learner has applied up to
        CATCH_UP_LAG short of the leader's commit."""
        lead, node = self.nodes.get(self.m_leader or ""), self.nodes[learner]
        lr = lead.shell.replica if lead is not None and lead.up and lead.shell is not None else None
        r = node.shell.replica if node.up and node.shell is not None else None
        return lr is not None and r is not None and r.applied_seq >= lr.commit_seq - CATCH_UP_LAG

    def ask_members(self, leader: SimNode, step: str, who: str) -> None:
        self.m_call = f"{step} {who}"
        self.stats[f"members_{step}_asked"] += 1
        self.log(f"MEMBERS {step} {who} asked of {leader.name}")
        # The worker's route dies with its process (a task cancelled before
        # it ran never enters its `finally`: the callback ends the call).
        task = self.spawn(self.members_call(leader, step, who), leader)
        task.add_done_callback(self._members_call_done)

    def _members_call_done(self, task: asyncio.Task[Any]) -> None:
        self.m_call = None

    async def members_call(self, node: SimNode, step: str, who: str) -> None:
        """Meta's ChangeMembers: POST /v1/groups/{g}/members to the leader,
        whose route (worker/server.py `members`) waits for the change to
        commit, or answers an error, or `deadline_exceeded` (outcome unknown)."""
        await asyncio.sleep(self.rng.randint(1, 10) / 1000)
        shell = node.shell
        if not node.up or shell is None:
            self.stats[f"members_{step}_unreachable"] += 1
            return
        out = await shell.change_members({step: who}, DEFAULT_TIMEOUT_S)
        if out.ok:
            self.stats[f"members_{step}"] += 1
            self.log(f"MEMBERS {step} {who} committed at {out.seq}")
        else:
            self.stats[f"members_{step}_{out.error_code}"] += 1
            self.log(f"MEMBERS {step} {who} refused: {out.error_code} {out.message or ''}")

    # -- clients ---------------------------------------------------------------------

    async def clients(self) -> None:
        while not self.calm:
            await asyncio.sleep(self.rng.expovariate(self.p.writes_per_s))
            if not self.calm:
                self.writers += 1
                self.spawn(self.client_write())

    async def client_write(self) -> None:
        try:
            await self._write_one()
        finally:
            self.writers -= 1

    async def _write_one(self) -> None:
        self.next_id += 1
        i = self.next_id
        rid, item = f"r{i}", f"k{i}"
        self.written[item] = i
        op = {"kind": "put_item", "id": item, "doc": {"n": i}}
        ack = "all" if self.rng.random() < self.p.ack_all else "quorum"
        target = self.m_leader or self.rng.choice(self.names)
        for _ in range(40):
            node = self.nodes[target]
            shell = node.shell
            if node.up and shell is not None and shell.replica is not None:
                inc = node.inc
                out = await shell.write(op, ack, rid, timeout_s=1.0)
                if out.ok and node.inc == inc:
                    self.commits.acknowledged(node.name, rid, out.seq)
                    self.stats[f"acked_{ack}"] += 1
                    return
                target = out.leader if out.leader in self.nodes and self.rng.random() < 0.8 \
                    else self.rng.choice(self.names)
            else:
                target = self.rng.choice(self.names)
            await asyncio.sleep(self.rng.randint(20, 80) / 1000)

    # -- the end ---------------------------------------------------------------------

    def converged(self) -> bool:
        """The leader meta names leads, has committed its whole log and a
        configuration meta has recorded, and every member (voter or learner)
        of that configuration holds and has applied all of it. A replica
        removed from the group is left out: it may have stopped anywhere."""
        leader = self.nodes.get(self.m_leader or "")
        if leader is None or not leader.up or leader.shell is None:
            return False
        lr = leader.shell.replica
        if lr is None or not lr.ready or lr.term != self.m_term or lr.commit_seq != lr.last_seq \
                or lr.config_seq != self.m_conf_ver:
            return False
        for name in (*lr.voters, *lr.learners):
            node = self.nodes[name]
            r = node.shell.replica if node.up and node.shell is not None else None
            if r is None or r.last_seq != lr.last_seq or r.applied_seq != lr.last_seq or r.term != lr.term \
                    or r.resyncing:
                return False
        return True

    def final_checks(self) -> None:
        for node in self.nodes.values():
            # (A replica dropped from the group was checked when its worker dropped it.)
            if node.hosted and node.shell is not None:
                self.check_items(node.name, node.shell.plugin, complete=self.is_member(node.name))
        self.stats["short_writes"] = sum(n.storage.short_writes for n in self.nodes.values())
        self.stats["acked"] = len(self.commits.acked)
        self.stats["committed"] = self.commits.last

    def check_items(self, name: str, plugin: Any, complete: bool) -> None:
        """What replica `name`'s state machine holds: nothing that was never
        committed, each item as written, and (`complete`: a member of the
        group that converged) every acknowledged write."""
        acked_items = {f"k{rid[1:]}" for rid in self.commits.acked}
        committed = {f"k{rid[1:]}" for rids in self.commits.rids for rid in rids}
        for item, n in self.written.items():
            try:
                doc = plugin.query({"kind": "get_item", "id": item})
            except NotFound:
                doc = None
            except ValueError as exc:  # a stored doc that no longer decodes: damaged state
                self.fail(f"{name}: item {item} is unreadable: {exc}")
            if complete and item in acked_items and doc != {"n": n}:
                self.fail(f"{name}: acknowledged item {item} reads {doc!r}")
            if doc is not None and item not in committed:
                self.fail(f"{name}: item {item} is there but was never committed")
            if doc is not None and doc != {"n": n}:
                self.fail(f"{name}: item {item} reads {doc!r}, written as {{'n': {n}}}")


# What a crash interrupted, innermost first: the shell's and the WAL's steps
# whose every crash point recovery must survive.
_SITES = ("_roll", "_recover", "_install_snapshot_point", "_restore_downloaded", "_write_hard_state_file", "truncate_after", "compact_through", "reset", "append",
          "install_downloaded", "_fetch", "write_snapshot", "prune_snapshots", "_write_marker", "_open")


def _crash_site() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _SITES:
            return frame.f_code.co_name.lstrip("_")
        frame = frame.f_back  # type: ignore[assignment]
    return "other"


def _records(data: bytes) -> Iterator[tuple[int, int]]:
    """[start, end) of each whole record of a WAL segment's bytes (see worker/wal.py)."""
    pos = 0
    while pos + HEADER_BYTES <= len(data):
        length, _digest = _HEADER.unpack_from(data, pos)
        end = pos + HEADER_BYTES + length
        if length == 0 or end > len(data):
            return
        yield pos, end
        pos = end


def run_seed(seed: int, plant: str | None = None, verbose: bool = False) -> ShellSim:
    return ShellSim(seed, plant, verbose).run()


def replay_hint(seed: int, plant: str | None = None) -> str:
    return REPLAY_HINT.format(seed=seed, plant=f"SHARDGRID_SIM_PLANT={plant} " if plant else "")

