"""`shardgrid worker`: hosts the shard-group replicas meta places on it.

It registers with meta, watches `/v1/cluster`, opens (or creates) every group
whose voters or learners name it, feeds meta's assignment (term, leader,
members) to each group's core, heartbeats per-group progress to the meta
leader, and reports to meta what the cores ask for (ready, transfer).

A group that failed on a disk error is retried in place (worker/retry.py).
The data of a group meta's view no longer places here (removed, or replaced
while this worker was away) is moved aside under a tombstone name.
"""
from __future__ import annotations

import asyncio
import importlib
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from meta.client import MetaClient, MetaError, MetaUnreachable
from shardgrid.common.gctune import start_gc_policy
from shardgrid.common.httpmetrics import HttpMetrics
from shardgrid.common.identity import SoftwareIdentity, package_version
from shardgrid.common.peerauth import ClusterKeys, Principal
from shardgrid.common.peerauth_http import PeerSigner
from shardgrid.common.log import setup_logging
from shardgrid.common.serving import app_runner, cap_connections
from shardgrid.common.tls import NO_TLS, Tls
from topology.model import Settings, model_groups
from worker.infer import DEFAULT_MAX_ROWS, DEFAULT_MAX_WAIT_MS, InferenceService, infer_warm
from worker import replica_msgs as m
from worker.capacity import Capacity, free_bytes, resident_bytes, tree_bytes
from worker.group import GroupCorrupt, GroupSettings, GroupShell, PassStats
from worker.plugins.base import PluginSettings, load_plugin
from worker.retry import Backoff, RetryPolicy, probe_disk, settle_from_disk
from worker.server import WorkerApi
from worker.throttle import SnapshotServing
from worker.transport import SendStats, Transport
from worker.wal import WalError


# How often the bytes each hosted group holds on disk are measured (a walk of its directory).
SIZE_EVERY_S = 10.0
# Registration retries: meta unreachable or failing is retried at a steady pace;
# a refusal (an operator must act) backs off up to the cap.
REGISTER_RETRY_S = 0.5
REGISTER_REFUSED_MAX_S = 10.0
# How long a fetch of meta's view a core asked for (NeedMetaView) may take:
# the sender retransmits, and the core asks again.
VIEW_FETCH_S = 2.0
# Fetches start at least this far apart: messages from unpublished terms (a
# forger's, say) cost meta at most ten cluster views a second per worker. One
# asked for sooner waits and serves everyone who asks meanwhile.
VIEW_FETCH_GAP_S = 0.1


@dataclass(frozen=True)
class WorkerConfig:
    id: str
    listen: str
    advertise: str
    meta: list[str]
    data: Path
    zone: str | None = None
    # Source address of outgoing connections (peers, meta); None = the OS picks.
    source_addr: str | None = None
    # What it offers the cluster (bytes; 0 = not said), advertised when it registers.
    available_ram: int = 0
    available_disk: int = 0
    # The cluster secret(s) (None: intra-cluster traffic is not authenticated, tests only).
    cluster_keys: ClusterKeys | None = field(default=None, repr=False)
    identity: SoftwareIdentity = SoftwareIdentity("", "")
    tls: Tls = field(default=NO_TLS)
    # Inference batching on `layers` groups (worker/infer_batch.py): rows per
    # forward pass (1 turns batching off) and the longest a request waits for others.
    infer_max_rows: int = DEFAULT_MAX_ROWS
    infer_max_wait_ms: float = DEFAULT_MAX_WAIT_MS


class _BatchingCollector:
    """The group loops' and peer streams' counts, read at scrape time.

    Plain integers bumped on the hot path (a prometheus Counter takes a lock
    per increment): passes and events of the group loops, messages and
    frames of the peer streams. Per acknowledged write they show how much
    each round is shared (`shardgrid bench` prints them).
    """

    def __init__(self, passes: PassStats, sends: SendStats) -> None:
        self.passes = passes
        self.sends = sends

    def collect(self) -> list[Metric]:
        return [CounterMetricFamily("shardgrid_worker_passes", "group loop passes, all groups", self.passes.passes),
                CounterMetricFamily("shardgrid_worker_events", "events the group loops handled (client calls, "
                                    "peer messages, ticks)", self.passes.events),
                CounterMetricFamily("shardgrid_worker_peer_messages", "replication messages sent to peers",
                                    self.sends.messages),
                CounterMetricFamily("shardgrid_worker_peer_frames", "stream frames that carried them",
                                    self.sends.frames),
                CounterMetricFamily("shardgrid_worker_peer_unpackable", "replication messages dropped because "
                                    "msgpack could not pack them (a bug; the log says which peer)",
                                    self.sends.unpackable),
                CounterMetricFamily("shardgrid_worker_overloaded", "client calls refused 503 overloaded because "
                                    "their group held its limit of pending writes and reads", self.passes.overloaded)]


class WorkerNode:
    def __init__(self, cfg: WorkerConfig, log: Any) -> None:
        self.cfg = cfg
        self.id = cfg.id
        # Names this run of the process in heartbeats: meta tells a restart
        # from a steady worker even when the restart was quicker than a lease.
        self.boot = uuid.uuid4().hex
        self.log = log
        self.principal = Principal("worker", cfg.id)
        signer: tuple[Any, ...] = (PeerSigner(cfg.cluster_keys, self.principal),) if cfg.cluster_keys else ()
        self.meta = MetaClient(cfg.meta, deadline_s=5.0, local_addr=cfg.source_addr, tls=cfg.tls.client,
                               middlewares=signer)
        self.version = cfg.identity.version or package_version()
        self.metrics = HttpMetrics("worker", self.version)
        reg = self.metrics.registry
        self.infer = InferenceService(cfg.id, log, reg, cfg.infer_max_rows, cfg.infer_max_wait_ms)
        self._torch_ready = "worker.plugins.layers_model" in sys.modules
        self._torch_loading = False
        labels = ["group"]
        # Per group: removed when the group leaves this worker (_forget_group_series).
        self._gauges = {
            name: Gauge(f"shardgrid_group_{name}", doc, labels, registry=reg)
            for name, doc in (("term", "current term"), ("last_seq", "last log seq"), ("commit", "commit seq"),
                              ("applied", "applied seq"), ("lag", "commit - applied"),
                              ("is_leader", "1 when this replica is the ready leader"),
                              ("in_flight", "client requests waiting"),
                              ("has_quorum", "0 while this replica leads without a round trip with a majority of its "
                                             "voters within lease_ms (check-quorum), else 1"),
                              ("leader_silence_seconds", "seconds since this non-leader last heard from its term's "
                                                         "leader (0 while leading)"))
        }
        # One observation per acknowledged write call (a write, or a write_batch
        # of any size): a Histogram takes a lock per observe, so not per record.
        self._write_latency = Histogram("shardgrid_group_write_latency_seconds", "from a write call's arrival in "
                                        "its group to its acknowledgement, per call that acknowledged any write "
                                        "(leader)", labels,
                                        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                                 2.0, 5.0),
                                        registry=reg)
        # Disk stalls show here first: every write of every group waits on these.
        self._wal_sync = Histogram("shardgrid_wal_sync_seconds", "WAL fdatasync duration, all groups of this worker",
                                   buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
                                   registry=reg)
        # Replication messages of the wrong shape, dropped before any core saw them (worker/codec.py).
        self.peer_malformed = Counter("shardgrid_worker_peer_malformed", "replication messages from peers "
                                      "dropped as malformed, by message type (frame: not msgpack; batch: not a "
                                      "list; unknown: no known type); the log names the peer", ["kind"],
                                      registry=reg)
        self._retries_total = Counter("shardgrid_group_retries", "retries in place of groups failed on a disk "
                                      "error, by outcome (reopened, probe_failed, open_failed)", ["outcome"],
                                      registry=reg)
        self.groups: dict[int, GroupShell] = {}
        self.corrupt: dict[int, str] = {}
        self.retry_policy = RetryPolicy()
        self._retries: dict[int, Backoff] = {}
        # Groups whose shell is being closed and their directory renamed: no one
        # else may move that directory meanwhile.
        self._closing: set[int] = set()
        self.view: dict[str, Any] | None = None
        self.registered = False
        self.default_ack = "quorum"
        self.transport = Transport(self.peer_addr, log, local_addr=cfg.source_addr, tls=cfg.tls.client,
                                   middlewares=signer)
        # The snapshot downloads this worker serves to learners; the topology's settings set the limits.
        self.snapshot_serving = SnapshotServing.create(Settings.snapshot_concurrency, Settings.snapshot_rate_mb_s,
                                                       time.monotonic())
        self.pass_stats = PassStats()
        reg.register(_BatchingCollector(self.pass_stats, self.transport.stats))
        self._tasks: list[asyncio.Task[None]] = []
        self._view_fetch: asyncio.Future[dict[str, Any] | None] | None = None  # see meta_view
        self._view_fetched_at = float("-inf")  # when the last one started (monotonic)
        self._beat_now = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        # Bytes on disk per hosted group, measured every SIZE_EVERY_S off the
        # loop: meta sizes a new replica from the leader's figure.
        self.group_bytes: dict[int, int] = {}

    # -- hooks for groups --------------------------------------------------------

    def peer_addr(self, worker_id: str) -> str | None:
        """Where a peer listens; None for one meta revoked (nothing more is sent to it)."""
        if self.view is None:
            return None
        w = self.view["workers"].get(worker_id)
        return w["addr"] if w and not self._revoked_worker(worker_id) else None

    def revoked(self, who: Principal) -> bool:
        """Has meta revoked this peer? (Its requests are refused from the view that says so.)"""
        return who.role == "worker" and self._revoked_worker(who.name)

    def _revoked_worker(self, wid: str) -> bool:
        w = self.view["workers"].get(wid) if self.view is not None else None
        return w is not None and w.get("admission", "admitted") == "revoked"

    def leader_of(self, gid: int) -> str | None:
        g = self._view_group(gid)
        return g["leader"] if g else None

    def report_ready(self, group: int, term: int) -> None:
        self._spawn(self._meta_call("POST", f"/v1/groups/{group}/ready", {"term": term, "leader": self.id},
                                    what="report_ready"))

    def transfer_ready(self, group: int, target: str, term: int) -> None:
        self._spawn(self._meta_call("POST", f"/v1/groups/{group}/leader", {"leader": target, "expect_term": term},
                                    what="transfer_handover"))

    def report_quorum(self, group: int, term: int, ok: bool) -> None:
        # The next heartbeat carries it (group reports); send that one now
        # rather than up to a report interval later: meta fails the group over.
        self._beat_now.set()

    async def meta_view(self, group: int) -> m.MetaView | None:
        """Meta's view of `group` now, for a core that heard of a term meta
        had not shown it (NeedMetaView). One fetch of the cluster view at a
        time serves every group that asks meanwhile; a newer view than the
        watch's is applied as if the watch had brought it."""
        fetch = self._view_fetch
        if fetch is None or fetch.done():
            fetch = self._view_fetch = asyncio.ensure_future(self._fetch_view())
            self._background.add(fetch)  # cancelled by close()
            fetch.add_done_callback(self._background.discard)
        view = await asyncio.shield(fetch)
        if view is None:
            return None
        g = view["groups"].get(str(group)) or view["groups"].get(group)
        return _meta_view(g) if g is not None and self.id in set(g["voters"]) | set(g["learners"]) else None

    async def _fetch_view(self) -> dict[str, Any] | None:
        wait = self._view_fetched_at + VIEW_FETCH_GAP_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._view_fetched_at = time.monotonic()
        try:
            view = await self.meta.call("GET", "/v1/cluster", deadline_s=VIEW_FETCH_S)
        except (MetaError, MetaUnreachable) as exc:
            self.log.warning("meta_view_fetch_failed", error=str(exc))
            return None
        if self.view is None or view["revision"] > self.view["revision"]:
            self._apply_view(view)
        return view  # type: ignore[no-any-return]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _meta_call(self, method: str, path: str, body: dict[str, Any], what: str) -> None:
        try:
            result = await self.meta.call(method, path, json=body)
            self.log.info(what, path=path, result=result)
        except (MetaError, MetaUnreachable) as exc:
            self.log.warning(f"{what}_failed", path=path, error=str(exc))

    # -- meta --------------------------------------------------------------------

    async def _register(self) -> None:
        refused_backoff = REGISTER_RETRY_S
        while not self.registered:
            try:
                await self.meta.register(self.id, self.cfg.advertise, self.cfg.zone,
                                         ram=self.cfg.available_ram, disk=self.cfg.available_disk,
                                         version=self.cfg.identity.version, code_digest=self.cfg.identity.code_digest)
                self.registered = True
                self.log.info("registered", advertise=self.cfg.advertise, available_ram=self.cfg.available_ram,
                              available_disk=self.cfg.available_disk)
            except MetaError as exc:
                if exc.status >= 500:
                    self.log.warning("register_failed", error=str(exc))
                    await asyncio.sleep(REGISTER_RETRY_S)
                    continue
                # Meta said no (e.g. this id is registered at another address):
                # an operator has to act, so say why and keep asking, ever more
                # slowly, rather than exit and lose the answer in a restart loop.
                self.log.error("register_refused", code=exc.code, reason=exc.message, advertise=self.cfg.advertise,
                               registered_addr=exc.body.get("registered_addr"),
                               retry_in_s=refused_backoff)
                await asyncio.sleep(refused_backoff)
                refused_backoff = min(refused_backoff * 2, REGISTER_REFUSED_MAX_S)
            except MetaUnreachable as exc:
                self.log.warning("register_failed", error=str(exc))
                await asyncio.sleep(REGISTER_RETRY_S)
        # Heartbeat before any group opens. Otherwise a slow starter reported
        # its first group ready before meta leader had heard from it, looked
        # silent (known since the topology was applied) and lost that group
        # at once: seen on cold starts of `shardgrid dev`.
        await self._beat()

    async def _watch(self) -> None:
        await self._register()
        after = -1
        while True:
            try:
                view = await self.meta.call("GET", "/v1/cluster", params={"wait": str(after), "timeout": "10"},
                                            deadline_s=20, attempt_timeout_s=15)
            except (MetaError, MetaUnreachable) as exc:
                self.log.warning("watch_failed", error=str(exc))
                await asyncio.sleep(0.2)
                continue
            # A fetch for a core (meta_view) may have applied a newer view than
            # this poll brings (another meta node, a moment later): never go back.
            current = self.view["revision"] if self.view is not None else -1
            if view["revision"] > max(after, current):
                self._apply_view(view)
            after = max(after, view["revision"], current)

    def _apply_view(self, view: dict[str, Any]) -> None:
        self.view = view
        topo = view.get("topology")
        if topo is None:
            return
        settings = topo["settings"]
        self.default_ack = settings.get("ack", "quorum")
        # A topology stored before these settings existed has none: the defaults.
        self.snapshot_serving.configure(int(settings.get("snapshot_concurrency", Settings.snapshot_concurrency)),
                                        int(settings.get("snapshot_rate_mb_s", Settings.snapshot_rate_mb_s)),
                                        time.monotonic())
        for key, g in view["groups"].items():
            gid = int(key)
            members = set(g["voters"]) | set(g["learners"])
            shell = self.groups.get(gid)
            if self.id not in members:
                if shell is not None:
                    # Meta records only committed memberships: this replica was removed.
                    self._spawn(self._drop_group(gid))
                else:
                    self._drop_stale(gid)
                continue
            if shell is None and gid not in self.corrupt:
                if not self._torch_ready and gid in model_groups(topo):
                    # Its plugin needs torch, whose import takes a second or more:
                    # on a thread, then this view again (the loop serves meanwhile).
                    self._load_torch()
                    continue
                shell = self._open_group(gid, topo)
            if shell is not None:
                shell.deliver(_meta_view(g))

    def _load_torch(self) -> None:
        if self._torch_loading:
            return
        self._torch_loading = True

        async def load() -> None:
            try:
                await asyncio.to_thread(importlib.import_module, "worker.plugins.layers_model")
            finally:
                self._torch_loading = False
            self._torch_ready = True
            if self.view is not None:
                self._apply_view(self.view)
        self._spawn(load())

    async def _prebuild(self, gid: int, plugin: Any) -> None:
        """A model group's weights, built before its first request (warm)."""
        try:
            await self.infer.ensure_built(plugin)
        except Exception as exc:  # noqa: BLE001 - the first request builds them again, and says why
            self.log.warning("infer_prebuild_failed", group=gid, error=f"{type(exc).__name__}: {exc}")

    def _open_group(self, gid: int, topo: dict[str, Any]) -> GroupShell | None:
        s = topo["settings"]
        name, plugin_settings = plugin_for(topo, gid)
        plugin = load_plugin(name, plugin_settings)
        # A topology stored before the setting existed has no ratio: the default.
        ratio = float(s.get("snapshot_state_ratio", GroupSettings.snapshot_state_ratio))
        shell = GroupShell(self.id, gid, self.cfg.data / "groups" / str(gid), plugin,
                           GroupSettings(fsync=s["fsync"], snapshot_every=int(s["snapshot_every"]),
                                         snapshot_state_ratio=ratio,
                                         quorum_timeout_ms=int(s["quorum_timeout_ms"]),
                                         lease_ms=int(s["lease_ms"])),
                           self.transport, self, self.log, self.pass_stats)
        shell.on_sync = self._wal_sync.observe
        try:
            shell.open()
        except GroupCorrupt as exc:
            # Do not serve (or vote) with damaged state: an operator replaces this replica.
            self.corrupt[gid] = str(exc)
            self.log.error("group_corrupt", group=gid, error=str(exc))
            return None
        except OSError as exc:
            # The disk, not the data: a failed replica, retried in place like one
            # whose disk failed while it ran.
            shell.mark_failed(exc)
            self.log.error("group_open_failed", group=gid, error=shell.failed)
        else:
            shell.start()
            if name == "layers":
                self._spawn(self._prebuild(gid, plugin))
        # Bound only for a shell this worker keeps (a failed one is retried in place and
        # serves again): labels() creates the series, and a replica found corrupt above
        # would otherwise export an empty one forever (nothing removes it).
        shell.on_write_latency = self._write_latency.labels(str(gid)).observe
        self.groups[gid] = shell
        return shell

    async def _drop_group(self, gid: int) -> None:
        shell = self.groups.pop(gid, None)
        if shell is None:
            return
        self._closing.add(gid)
        try:
            await shell.close()
            # Keep the data under a tombstone name: an operator may still want it.
            gone = _tombstone(shell.root)
            shell.root.rename(gone)
        finally:
            self._closing.discard(gid)
            self._forget_group_series(gid)
        self.log.info("group_removed", group=gid, kept_at=str(gone))

    def _drop_stale(self, gid: int) -> None:
        """Move aside the data of a group meta places elsewhere that no shell
        here holds: this worker was replaced in it while it was down (or its
        replica was found corrupt here). Like `_drop_group`, it keeps the data."""
        if gid in self._closing:
            return  # `_drop_group` is at it
        if self.corrupt.pop(gid, None) is not None:
            self.log.info("group_corrupt_forgotten", group=gid, reason="no longer a member")
        root = self._group_dir(gid)
        if not root.is_dir() or root.is_symlink():
            return
        gone = _tombstone(root)
        try:
            root.rename(gone)
        except OSError as exc:
            # Leave it for the next view: the worker runs on without it.
            self.log.warning("group_stale_drop_failed", group=gid, error=f"{type(exc).__name__}: {exc}")
            return
        self.log.info("group_stale_dropped", group=gid, kept_at=str(gone))

    def _group_dir(self, gid: int) -> Path:
        return self.cfg.data / "groups" / str(gid)

    def _hosts(self, gid: int, shell: GroupShell) -> bool:
        """`shell` is still this worker's replica of `gid`, and meta's view still places one here."""
        if self.groups.get(gid) is not shell or gid in self._closing:
            return False
        g = self._view_group(gid)
        return g is not None and self.id in set(g["voters"]) | set(g["learners"])

    def _view_group(self, gid: int) -> dict[str, Any] | None:
        if self.view is None:
            return None
        groups = self.view["groups"]
        g: dict[str, Any] | None = groups.get(str(gid)) or groups.get(gid)
        return g

    # -- retry in place (worker/retry.py) ------------------------------------------------

    async def _retry_failed(self) -> None:
        while True:
            await asyncio.sleep(self.retry_policy.tick_s)
            for gid, shell, backoff in self._retries_due(time.monotonic()):
                try:
                    await self._retry_group(gid, shell, backoff)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a bug in one group's retry must not stop the others'
                    backoff.wait_longer(time.monotonic())
                    self.log.exception("group_retry_error", group=gid, error=f"{type(exc).__name__}: {exc}")

    def _retries_due(self, now: float) -> list[tuple[int, GroupShell, Backoff]]:
        """The failed groups whose next try is due; keeps every failed group's backoff."""
        for gid in [g for g in self._retries if g not in self.groups]:
            del self._retries[gid]
        due: list[tuple[int, GroupShell, Backoff]] = []
        for gid, shell in self.groups.items():
            backoff = self._retries.get(gid)
            if shell.failed is None:
                if backoff is not None and backoff.settled(now):
                    del self._retries[gid]
            elif not shell.failed_on_disk:
                continue  # a bug, not a cause that clears: it waits for an operator (or repair)
            elif backoff is None:
                self._retries[gid] = Backoff.first(self.retry_policy, now)
            elif backoff.reopened_at is not None:
                backoff.wait_longer(now)  # reopened, and failed again
            elif backoff.due(now):
                due.append((gid, shell, backoff))
        return due

    async def _retry_group(self, gid: int, shell: GroupShell, backoff: Backoff) -> None:
        """Probe the group's disk; when it works, close the group and open it
        from disk as a process restart would (nothing of the failed shell
        carries over: a new plugin, core and WAL)."""
        if not self._hosts(gid, shell):
            return
        try:
            # In a thread: a sick disk can block for long.
            await asyncio.to_thread(probe_disk, shell.root)
            if not self._hosts(gid, shell):
                return
            await shell.close()
            await asyncio.to_thread(settle_from_disk, shell.root)
        except OSError as exc:
            backoff.wait_longer(time.monotonic())
            self._retries_total.labels("probe_failed").inc()
            self.log.warning("group_retry_probe_failed", group=gid, error=f"{type(exc).__name__}: {exc}",
                             attempt=backoff.attempts, next_in_s=backoff.delay)
            return
        if not self._hosts(gid, shell) or self.view is None or self.view.get("topology") is None:
            return
        try:
            fresh = self._open_group(gid, self.view["topology"])
        except WalError as exc:
            # Not the disk (the directory still held, say): the failed shell stays; try again later.
            backoff.wait_longer(time.monotonic())
            self.log.error("group_retry_open_error", group=gid, error=f"{type(exc).__name__}: {exc}")
            return
        if fresh is None:
            # Found corrupt (recorded in self.corrupt): an operator's, or repair's, now.
            self.groups.pop(gid, None)
            self._forget_group_series(gid)
            return
        if fresh.failed is not None:
            backoff.wait_longer(time.monotonic())
            self._retries_total.labels("open_failed").inc()
            self.log.warning("group_retry_open_failed", group=gid, error=fresh.failed, attempt=backoff.attempts,
                             next_in_s=backoff.delay)
            return
        now = time.monotonic()
        backoff.reopened(now)
        self._retries_total.labels("reopened").inc()
        self.log.info("group_reopened", group=gid, was=shell.failed, attempt=backoff.attempts,
                      failed_for_s=round(now - backoff.failed_at, 1))
        view = self._view_group(gid)
        if view is not None:
            fresh.deliver(_meta_view(view))

    def update_gauges(self) -> None:
        for gid, shell in self.groups.items():
            rep = shell.report()
            if "term" not in rep:
                continue
            g = str(gid)
            for key in ("term", "last_seq", "commit", "applied", "lag", "in_flight"):
                self._gauges[key].labels(g).set(rep[key])
            self._gauges["is_leader"].labels(g).set(1 if rep["ready"] else 0)
            self._gauges["has_quorum"].labels(g).set(1 if rep["quorum"] else 0)
            self._gauges["leader_silence_seconds"].labels(g).set((rep["leader_silence_ms"] or 0) / 1000)

    def _forget_group_series(self, gid: int) -> None:
        """Stop exporting a group that left this worker: its last values would
        otherwise stay until a restart and count in every sum by group."""
        if gid in self.groups:
            return  # opened here again meanwhile: its shell observes into these series
        # prometheus_client (0.26, pinned) ignores a label set it never exported.
        for metric in (*self._gauges.values(), self._write_latency):
            metric.remove(str(gid))

    def group_reports(self) -> dict[str, dict[str, Any]]:
        reports = {str(gid): {**shell.report(), "disk_bytes": self.group_bytes.get(gid, 0)}
                   for gid, shell in self.groups.items()}
        for gid, shell in self.groups.items():
            if shell.plugin.name == "layers":
                if not shell.plugin.loaded and shell.replica is not None:
                    # A version set by seed since: built now, before a request needs it.
                    self._spawn(self._prebuild(gid, shell.plugin))
                reports[str(gid)]["infer"] = {**self.infer.report(gid),
                                              "warm": infer_warm(shell) and shell.plugin.loaded,
                                              "version": shell.plugin.stats().get("version")}
        for gid, why in self.corrupt.items():
            reports[str(gid)] = {"state": "corrupt", "error": why}
        return reports

    def _lease_ms(self) -> int:
        if self.view and self.view.get("topology"):
            return int(self.view["topology"]["settings"]["lease_ms"])
        return 1500

    async def _beat(self) -> None:
        try:
            await self.meta.heartbeat(self.id, {"groups": self.group_reports(), "boot": self.boot,
                                                "version": self.version},
                                      deadline_s=self._lease_ms() / 2000)
        except (MetaError, MetaUnreachable) as exc:
            self.log.debug("heartbeat_failed", error=str(exc))

    async def _heartbeat(self) -> None:
        while True:
            self._beat_now.clear()
            if self.registered:
                await self._beat()
            try:
                await asyncio.wait_for(self._beat_now.wait(), max(0.05, self._lease_ms() / 5000))
            except asyncio.TimeoutError:
                pass

    async def _measure(self) -> None:
        while True:
            for gid, shell in list(self.groups.items()):
                self.group_bytes[gid] = await asyncio.to_thread(tree_bytes, shell.root)
            for gid in [g for g in self.group_bytes if g not in self.groups]:
                del self.group_bytes[gid]
            await asyncio.sleep(SIZE_EVERY_S)

    async def capacity(self) -> Capacity:
        """What this worker has left for one more replica (worker/capacity.py)."""
        groups = self.cfg.data / "groups"
        used = await asyncio.to_thread(tree_bytes, groups)
        free = free_bytes(self.cfg.data)
        state = ""
        if self.view is not None:
            state = str(self.view.get("workers", {}).get(self.id, {}).get("state", ""))
        return Capacity(state, self.cfg.available_disk, used, free, self.cfg.available_ram, resident_bytes())

    # -- lifecycle --------------------------------------------------------------------

    def start_background(self) -> None:
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._heartbeat()),
                       asyncio.create_task(self._measure()), asyncio.create_task(self._retry_failed())]

    async def close(self) -> None:
        for task in [*self._tasks, *self._background]:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down: nothing left to report to
                pass
        await self.infer.close()
        for shell in self.groups.values():
            await shell.close()
        await self.transport.close()
        await self.meta.close()


def plugin_for(topo: dict[str, Any], gid: int) -> tuple[str, PluginSettings]:
    """The plugin group `gid` runs: `layers` for a model's group, the topology's plugin otherwise."""
    s = topo["settings"]
    mg = model_groups(topo).get(gid)
    if mg is not None:
        model, group = mg
        return "layers", PluginSettings(model=model, layer_range=(int(group["first"]), int(group["last"])))
    return topo["plugin"], PluginSettings(embedding_dim=int(s["embedding_dim"]))


def _meta_view(g: dict[str, Any]) -> m.MetaView:
    return m.MetaView(g["term"], g["leader"], tuple(g["voters"]), tuple(g["learners"]), int(g.get("conf_ver", 0)))


def _tombstone(root: Path) -> Path:
    """A free name beside `root` to keep a removed replica's data under."""
    gone = root.with_name(f"{root.name}.removed-{int(time.time())}")
    base, n = gone, 1
    while gone.exists():  # removed twice within a second
        gone = base.with_name(f"{base.name}-{n}")
        n += 1
    return gone


def _preload_torch(log: Any) -> None:
    started = time.monotonic()
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        log.warning("torch_unavailable", error=str(exc))
        return
    log.info("torch_loaded", seconds=round(time.monotonic() - started, 2))


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def serve(cfg: WorkerConfig) -> None:
    log = setup_logging("worker", cfg.id)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The entities plugin imports torch on its first search. That import
    # takes seconds of CPU and, done later, would stall this event loop and
    # its heartbeats long enough to lose leaderships; even in a thread it
    # starves the loop of the GIL. Pay it before joining the cluster.
    _preload_torch(log)
    node = WorkerNode(cfg, log)
    runner = app_runner(WorkerApi(node).app(), shutdown_timeout=2.0)
    await runner.setup()
    cap_connections(runner.server, log)
    host, port = _split(cfg.listen)
    await web.TCPSite(runner, host, port, reuse_address=True, ssl_context=cfg.tls.server).start()
    node.start_background()
    gc_policy = start_gc_policy(log)
    log.info("worker_started", listen=cfg.listen, advertise=cfg.advertise, data=str(cfg.data),
             https=cfg.tls.server is not None, peers_tls=cfg.tls.client is not None)
    await stop.wait()
    log.info("worker_stopping")
    gc_policy.cancel()
    await runner.shutdown()
    await node.close()
    await runner.cleanup()
    log.info("worker_stopped")


def main(cfg: WorkerConfig) -> int:
    uvloop.run(serve(cfg))
    return 0
