"""The metadata service's HTTP API, and the controller loop on the Raft leader.

Reads are served from this node's applied state (each answer carries its
`revision`, so a watcher can tell old from new). Writes go through the Raft
log from any node (PySyncObj forwards a follower's command to the leader).
Heartbeats are soft state and live on the Raft leader only: a follower answers
them with `not_leader` naming the leader's HTTP address, and `MetaClient`
follows it.
"""
from __future__ import annotations

import asyncio
import math
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import Counter, Gauge

from meta.balance import balance_leader_counts
from meta.controller import (ISOLATION_HOLD_LEASES, REBALANCE_AFTER_MS, ChangeMembers, GroupReport, RecordMembers,
                             Refusal, SetLeader, SoftState, StartTransfer, UpdateOperator, advance_operator,
                             best_transfer_target, decide, heard_live, rebalance, report_of, transfer_lag_allowed)
from meta.hotspot import HotSettings, HotState, relieve
from meta.raft import MetaRaft, RaftUnavailable
from meta.reconcile import reconcile
from meta.repair import (REFUSAL_HOLD_MS, CancelAssignment, SetWorkerState, StartOperator, expired_assignments,
                         repair)
from meta.state import GroupRecord, MetaStateMachine, revoked
from shardgrid.common.auth import bearer_ok, check_bearer
from shardgrid.common.httpmetrics import HttpMetrics
from shardgrid.common.identity import SoftwareIdentity, package_version
from shardgrid.common.peerauth import ClusterKeys, Principal, SessionTable
from shardgrid.common.peerauth_http import PeerGuard, PeerSigner, peer_of, refusal, require_sender
from shardgrid.common.tls import connector_ssl, scheme
from shardgrid.common.serving import body_deadline
from shardgrid.common.units import MAX_BYTES
from shardgrid.common.wire import LOGGER_KEY, REFUSAL_REASONS, ApiError, error_middleware, json_response, short_repr
from topology.errors import TopologyError
from topology.loader import load_topology
from topology.model import GroupSpec, Topology, replication_factors
from topology.plan import Action, action_to_dict, other_changes, plan, render_action, render_plan

MAX_TOPOLOGY_BYTES = 1 << 20
MAX_WATCH_S = 60.0
# Long-poll watches one meta node holds at once (each worker and gateway keeps one open).
MAX_WATCHERS = 1024
COMMAND_TIMEOUT_S = 5.0
TRANSFER_TIMEOUT_S = 10.0
WORKER_CALL_TIMEOUT_S = 5.0
CONTROLLER_PERIOD_S = 0.1
# The meta leader's event loop standing still for more than lease_ms // STALL_LEASE_SHARE
# (a paused process, a starved one) makes what it heard old (SoftState.stood_still).
# A 1.3 s pause of the meta leader once failed every group over: on waking, the
# followers' reported silence, grown by their reports' age, read as cut-off leaders.
STALL_LEASE_SHARE = 3
STALL_CHECK_S = 0.05
# A group moved back to its preferred leader is not moved again for this
# long, doubled after each move that did not leave it with its preferred
# leader (up to REBALANCE_BACKOFF_MAX_MS): a move that keeps failing (the
# leader cannot reach the target, say) must not pause the group's writes
# every few seconds.
REBALANCE_COOLDOWN_MS = 15_000
REBALANCE_BACKOFF_MAX_MS = 600_000
# settings.rebalance_window_ms when the applied topology predates it.
DEFAULT_REBALANCE_WINDOW_MS = 30_000
DEFAULT_LEASE_MS = 1500

SERVER_KEY: web.AppKey["MetaServer"] = web.AppKey("meta_server", object)  # type: ignore[arg-type]


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


# Routes only cluster members may call, and which (shardgrid/common/peerauth_http.py);
# the others are reads anyone may make or operator verbs behind the admin token.
PEER_POLICY = {
    "/v1/workers/register": frozenset({"worker"}),
    "/v1/workers/{wid}/heartbeat": frozenset({"worker"}),
    "/v1/groups/{gid}/ready": frozenset({"worker"}),
    "/v1/groups/{gid}/leader": frozenset({"worker"}),
    "/v1/gateways/register": frozenset({"gateway"}),
}
# Admission refusals kept for `topoctl status` (most recent last).
MAX_REFUSALS = 32
MAX_GATEWAYS = 1024


@dataclass
class MetaServerConfig:
    admin_token: str | None = field(default=None, repr=False)  # never in a log line or traceback
    controller: bool = True
    # None: no cluster secret, worker-facing routes are open (tests of the API alone).
    cluster_keys: ClusterKeys | None = field(default=None, repr=False)
    node_id: str = "meta"
    client_tls: ssl.SSLContext | None = field(default=None, repr=False)  # calls to workers: https, verified
    version: str = ""  # this node's software version (empty: the installed package's)


@dataclass
class _BalanceMove:
    """Leader balance's record of one group: the move under way and its backoff."""

    term: int | None = None  # the group's term when the move under way started
    at: int = 0
    attempts: int = 0  # moves since the group last ended with its preferred leader
    retry_at: int = 0

    def started(self, now: int, term: int) -> None:
        self.term, self.at = term, now
        self.attempts += 1
        self.retry_at = now + min(REBALANCE_COOLDOWN_MS << (self.attempts - 1), REBALANCE_BACKOFF_MAX_MS)


class MetaServer:
    def __init__(self, raft: MetaRaft, config: MetaServerConfig, log: Any) -> None:
        self.raft = raft
        self.config = config
        self.log = log
        self.soft: SoftState | None = None
        self.heartbeat_raw: dict[str, dict[str, Any]] = {}
        self.version = config.version or package_version()
        self.metrics = HttpMetrics("meta", self.version)
        reg = self.metrics.registry
        self.g_leader = Gauge("shardgrid_meta_is_leader", "1 on the meta Raft leader", registry=reg)
        self.g_revision = Gauge("shardgrid_meta_revision", "applied cluster revision", registry=reg)
        self.g_raft_term = Gauge("shardgrid_meta_raft_term", "PySyncObj term", registry=reg)
        self.c_failovers = Counter("shardgrid_meta_failovers", "leaderships the controller moved, by cause "
                                   "(silent, restarted, unusable, unassigned, isolated)", ["cause"], registry=reg)
        self.c_balance = Counter("shardgrid_meta_leader_balance_moves", "transfers back to a group's preferred "
                                 "leader that leader balance started", registry=reg)
        self.c_placement = Counter("shardgrid_meta_placement_steps", "replica operators the controller started, by "
                                   "rule (repair: a gone voter; reconcile: the desired placement) and kind (add, "
                                   "remove)", ["by", "kind"], registry=reg)
        self.c_decisions = Counter("shardgrid_meta_controller_decisions", "every decision the controller acted on, "
                                   "by kind (failover, leader_balance, leader_count, repair, drain, reconcile, "
                                   "hot_leader, shed, refused) and reason (a failover's cause, an operator's "
                                   "add/remove, hot relief's latency/load/remove, a refusal's reason or timeout)",
                                   ["kind", "reason"], registry=reg)
        self.c_stalls = Counter("shardgrid_meta_leader_stalls", "times this meta leader's event loop stood "
                                "still long enough (paused, starved) to start over as if newly elected",
                                registry=reg)
        self._controller_task: asyncio.Task[None] | None = None
        self._stalled_ms = 0  # the longest the event loop stood still since the last controller pass
        self._session: aiohttp.ClientSession | None = None
        # Groups with a call to their leader in flight (one at a time per group).
        self._busy_groups: set[int] = set()
        self._watchers = 0  # long-poll watches of /v1/cluster in progress
        self._balance: dict[int, _BalanceMove] = {}  # leader balance, per group moved
        # Hot-group relief's own soft state, for the SoftState it was built from
        # (a new meta leadership starts every window over).
        self._hot = HotState()
        self._hot_soft: SoftState | None = None
        self.me = Principal("meta", config.node_id)
        keys = config.cluster_keys
        self.signer = PeerSigner(keys, self.me) if keys is not None else None
        table = SessionTable(keys, self.me, time.monotonic, revoked=self._revoked) if keys is not None else None
        self.guard = PeerGuard(table, PEER_POLICY, log, registry=reg, on_refuse=self._note_refusal)
        # Who was refused admission, and why: shown by `topoctl status`.
        self.refusals: deque[dict[str, Any]] = deque(maxlen=MAX_REFUSALS)
        self.gateways: dict[str, dict[str, Any]] = {}

    def _revoked(self, who: Principal) -> bool:
        return who.role == "worker" and revoked(self.raft.sm.workers.get(who.name))

    def _note_refusal(self, who: str | None, addr: str | None, reason: str) -> None:
        if reason in ("unknown_credentials", "version_mismatch", "revoked"):
            # Without the secret, the principal is only what the request claimed.
            self.refusals.append({"principal": who, "claimed": reason == "unknown_credentials", "addr": addr,
                                  "reason": reason,
                                  "at_unix_ms": int(time.time() * 1000)})

    # -- app ------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.metrics.middleware, error_middleware, self.guard.middleware,
                                           body_deadline],
                              client_max_size=MAX_TOPOLOGY_BYTES)
        app[SERVER_KEY] = self
        app[LOGGER_KEY] = self.log
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get("/v1/status", self.status)
        r.add_get("/v1/cluster", self.cluster)
        r.add_get("/v1/topology", self.get_topology)
        r.add_put("/v1/topology", self.put_topology)
        r.add_post("/v1/groups/{gid}/transfer", self.transfer)
        r.add_post("/v1/groups/{gid}/replicas", self.replicas)
        r.add_delete("/v1/groups/{gid}/operator", self.cancel_operator)
        r.add_get("/v1/operators", self.operators)
        r.add_post("/v1/groups/{gid}/ready", self.group_ready)
        r.add_post("/v1/groups/{gid}/leader", self.group_leader)
        r.add_post("/v1/workers/register", self.register_worker)
        r.add_post("/v1/workers/{wid}/heartbeat", self.heartbeat)
        r.add_post("/v1/workers/{wid}/gone", self.worker_gone)
        r.add_post("/v1/workers/{wid}/drain", self.worker_drain)
        r.add_post("/v1/workers/{wid}/undrain", self.worker_undrain)
        r.add_post("/v1/workers/{wid}/revoke", self.worker_revoke)
        r.add_post("/v1/workers/{wid}/admit", self.worker_admit)
        r.add_post("/v1/gateways/register", self.register_gateway)
        app.on_startup.append(self._start_controller)
        app.on_cleanup.append(self._stop_controller)
        return app

    async def _start_controller(self, app: web.Application) -> None:
        if self.config.controller:
            self._controller_task = asyncio.create_task(self._controller_loop())

    async def _stop_controller(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        if self._controller_task is not None:
            self._controller_task.cancel()
            try:
                await self._controller_task
            except asyncio.CancelledError:
                pass

    # -- helpers ---------------------------------------------------------------

    async def _submit(self, cmd: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.raft.submit(cmd, COMMAND_TIMEOUT_S)
        except RaftUnavailable as exc:
            leader = self.raft.leader()
            raise ApiError("unavailable",
                           f"the metadata log did not commit the change ({exc.reason}); "
                           "the outcome is unknown: re-read and retry",
                           meta_leader=leader.id if leader else None, retry_elsewhere=True) from None

    @staticmethod
    def _raise_failed(result: dict[str, Any]) -> None:
        if not result.get("ok"):
            extra = {k: v for k, v in result.items() if k not in ("ok", "code", "message")}
            raise ApiError(result["code"], result["message"], **extra)

    def _meta_nodes(self) -> list[dict[str, str]]:
        return [{"id": p.id, "raft": p.raft, "http": p.http} for p in [self.raft.me, *self.raft.peers]]

    def _lease_ms(self) -> int:
        topo = self.raft.sm.topology
        if topo is None:
            return DEFAULT_LEASE_MS
        return int(topo["settings"]["lease_ms"])

    # -- handlers -------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        leader = self.raft.leader()
        return json_response({"ok": True, "id": self.raft.me.id, "version": self.version,
                              "leader": leader.id if leader else None,
                              "is_leader": self.raft.is_leader(), "revision": self.raft.sm.revision})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        status = self.raft.status()
        self.g_leader.set(1 if status["role"] == "leader" else 0)
        self.g_revision.set(status["revision"])
        self.g_raft_term.set(status["raft_term"])
        return await self.metrics.handle_metrics(request)

    async def status(self, request: web.Request) -> web.Response:
        # Admission refusals are this node's own: a refused process may have asked any meta node.
        return json_response({**self.raft.status(), "version": self.version, "refusals": list(self.refusals)})

    def cluster_view(self) -> dict[str, Any]:
        view = self.raft.sm.view()
        leader = self.raft.leader()
        view["meta"] = self._meta_nodes()
        view["meta_leader"] = leader.id if leader else None
        view["served_by"] = self.raft.me.id
        now = _now_ms()
        view["gateways"] = [{**{k: v for k, v in g.items() if k != "last_seen_ms"},
                             "last_seen_ms_ago": now - g["last_seen_ms"]}
                            for g in sorted(self.gateways.values(), key=lambda g: g["id"])]
        if self.soft is not None and self.raft.is_leader():
            now, lease = _now_ms(), self._lease_ms()
            # How long this node has led: in its first lease a worker it has not heard
            # yet is unknown, not down (health.py). A new field: older readers ignore it.
            view["meta_leader_for_ms"] = now - self.soft.leader_since_ms
            for wid, w in view["workers"].items():
                seen = self.soft.workers.get(wid)
                w["live"] = heard_live(self.soft, wid, now, lease)
                w["last_seen_ms_ago"] = None if seen is None else now - seen.last_seen_ms
                w["report"] = self.heartbeat_raw.get(wid)
        return view

    async def cluster(self, request: web.Request) -> web.Response:
        wait = request.query.get("wait")
        if wait is not None:
            try:
                after = int(wait)
                timeout = float(request.query.get("timeout", "30"))
            except ValueError:
                raise ApiError("bad_request", "wait must be an integer revision and timeout a number of seconds")
            if not math.isfinite(timeout):
                raise ApiError("bad_request", "timeout must be a finite number of seconds")
            if self._watchers >= MAX_WATCHERS:
                # Every worker and gateway holds one; beyond that it is a flood.
                raise ApiError("overloaded", f"{MAX_WATCHERS} watches are open on this meta node; retry shortly",
                               retry_elsewhere=True)
            deadline = time.monotonic() + min(max(timeout, 0.0), MAX_WATCH_S)
            self._watchers += 1
            try:
                while self.raft.sm.revision <= after:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    await self.raft.wait_changed(remaining)
            finally:
                self._watchers -= 1
        return json_response(self.cluster_view())

    async def get_topology(self, request: web.Request) -> web.Response:
        sm = self.raft.sm
        if sm.topology_text is None:
            raise ApiError("not_found", "no topology has been applied yet (topoctl apply FILE)")
        return web.Response(text=sm.topology_text, content_type="application/yaml",
                            headers={"x-topology-revision": str(sm.topology_revision)})

    async def put_topology(self, request: web.Request) -> web.Response:
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        body = await request.read()
        dry_run = request.query.get("dry_run", "") in ("1", "true", "yes")
        pinned = request.query.get("expect_revision")
        expect = _decimal(pinned) if pinned is not None else None
        if pinned is not None and expect is None:
            raise ApiError("bad_request", "expect_revision must be a non-negative integer (decimal digits)")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:
            sm = self.raft.sm
            revision = sm.topology_revision if expect is None else expect
            live = Topology.from_dict(sm.topology) if sm.topology is not None else None
            try:
                desired = load_topology(body, live=live)
            except TopologyError as err:
                raise ApiError("bad_request", "invalid topology", errors=err.to_list()) from None
            current = [GroupSpec(g.id, g.leader or "", tuple(g.voters)) for g in sm.groups.values()]
            actions = plan(current, desired.groups)
            # The same file again still moves back what the controller moved
            # away from its pinned `groups:` (repair, drain, the verbs).
            stale = sm.stale_placement(desired)
            unchanged = sm.topology == desired.to_dict() and not stale
            others = other_changes(sm.topology, desired.to_dict()) + _retarget_lines(sm, desired, stale, actions)
            text = "\n".join([render_action(a) for a in actions] + others) or render_plan(actions)
            answer = {"dry_run": dry_run, "changed": not unchanged, "plan": [action_to_dict(a) for a in actions],
                      "changes": others, "plan_text": text, "topology_revision": sm.topology_revision}
            if dry_run or unchanged:
                return json_response(answer)
            result = await self._submit({"op": "put_topology", "text": body.decode("utf-8"),
                                         "topology": desired.to_dict(), "expect_revision": revision,
                                         "reassert": True})
            if result.get("ok"):
                answer.update(changed=result.get("changed", True), topology_revision=result["topology_revision"],
                              revision=result["revision"])
                self.log.info("topology_applied", topology_revision=result["topology_revision"],
                              actions=len(actions), reasserted=result.get("reasserted", []))
                return json_response(answer)
            if result["code"] == "conflict" and expect is None and time.monotonic() < deadline:
                # Our applied state was behind the log: wait for it and re-plan.
                await self.raft.wait_changed(0.1)
                continue
            self._raise_failed(result)

    # -- operator verbs ---------------------------------------------------------------

    def _require_leader(self) -> SoftState:
        """Verbs that judge liveness run where the heartbeats are: the Raft leader."""
        if not self.raft.is_leader() or self.soft is None:
            leader = self.raft.leader()
            raise ApiError("not_leader", "operator verbs run on the meta leader",
                           leader=leader.id if leader else None, leader_http=leader.http if leader else None)
        return self.soft

    def _group_record(self, gid: int) -> GroupRecord:
        g = self.raft.sm.groups.get(gid)
        if g is None:
            raise ApiError("not_found", f"no group {gid}")
        return g

    def _worker_addr(self, wid: str) -> str:
        w = self.raft.sm.workers.get(wid)
        if w is None:
            raise ApiError("unavailable", f"worker {wid} is not registered")
        return w.addr

    async def _worker_post(self, wid: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                ssl=connector_ssl(self.config.client_tls)), middlewares=(self.signer,) if self.signer else ())
        url = f"{scheme(self.config.client_tls)}://{self._worker_addr(wid)}{path}"
        async with self._session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"},
                                      timeout=aiohttp.ClientTimeout(total=WORKER_CALL_TIMEOUT_S)) as resp:
            return resp.status, orjson.loads(await resp.read())

    async def transfer(self, request: web.Request) -> web.Response:
        """Graceful leadership transfer: returns once the new leader is ready.

        The target also becomes the group's preferred leader (once the
        transfer succeeded, or at once when it already leads), so the
        controller's leader balance keeps the operator's choice.
        """
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        soft = self._require_leader()
        gid = self._gid(request)
        body = await _json_body(request)
        g = self._group_record(gid)
        now, lease = _now_ms(), self._lease_ms()
        target = body.get("to")
        if target is not None and not isinstance(target, str):
            raise ApiError("bad_request", "\"to\" must be a worker id")
        if not g.ready or g.leader is None:
            raise ApiError("unavailable", f"group {gid} has no ready leader to hand over from", shard=gid)
        gone = frozenset(w.id for w in self.raft.sm.workers.values() if revoked(w))
        if target is None:
            target = best_transfer_target(g, soft, now, lease, exclude=gone)
            if target is None:
                raise ApiError("unavailable", f"group {gid} has no live voter to take over", shard=gid)
        if target == g.leader:
            await self._prefer(gid, target)
            return json_response({"group": gid, "changed": False, "leader": g.leader, "term": g.term})
        if target not in g.voters:
            raise ApiError("bad_request", f"{target} is not a voter of group {gid} (voters: {', '.join(g.voters)})",
                           shard=gid)
        if target in gone:
            raise ApiError("bad_request", f"{target} was revoked: it leads nothing", shard=gid)
        if not heard_live(soft, target, now, lease) or report_of(soft, target, gid) is None:
            raise ApiError("bad_request", f"{target} is not live (no recent heartbeat for group {gid})", shard=gid)
        lead_rep, tgt_rep = report_of(soft, g.leader, gid), report_of(soft, target, gid)
        if lead_rep is not None and tgt_rep is not None and \
                tgt_rep.last_seq < lead_rep.commit - transfer_lag_allowed(lead_rep, lease):
            raise ApiError("bad_request", f"{target} is not caught up: it has seq {tgt_rep.last_seq}, "
                           f"the leader committed {lead_rep.commit}", shard=gid)
        if gid in self._busy_groups:
            raise ApiError("conflict", f"group {gid} has a leader call in progress (an operator step or leader "
                           "balance); retry in a few seconds", shard=gid)
        # Busy for the whole hand-over: the controller neither balances nor
        # steps an operator of this group meanwhile.
        self._busy_groups.add(gid)
        try:
            return await self._hand_over(gid, g.term, g.leader, target)
        finally:
            self._busy_groups.discard(gid)

    async def _hand_over(self, gid: int, old_term: int, old_leader: str, target: str) -> web.Response:
        try:
            status, answer = await self._worker_post(old_leader, f"/v1/groups/{gid}/transfer", {"to": target})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ApiError("unavailable", f"could not reach leader {old_leader}: {type(exc).__name__}") from None
        if status >= 300:
            raise ApiError("unavailable", f"leader {old_leader} refused the transfer: {answer}")
        self.log.info("transfer_started", group=gid, old_leader=old_leader, target=target, term=old_term)
        deadline = time.monotonic() + TRANSFER_TIMEOUT_S
        while time.monotonic() < deadline:
            cur = self.raft.sm.groups[gid]
            if cur.term > old_term and cur.ready:
                if cur.leader != target:
                    raise ApiError("conflict", f"group {gid} moved to {cur.leader} (term {cur.term}), not {target}: "
                                   "another change won", shard=gid, leader=cur.leader, term=cur.term)
                await self._prefer(gid, target)
                return json_response({"group": gid, "changed": True, "old_term": old_term, "old_leader": old_leader,
                                      "new_term": cur.term, "new_leader": cur.leader})
            await self.raft.wait_changed(0.2)
        cur = self.raft.sm.groups[gid]
        raise ApiError("deadline_exceeded", f"group {gid} did not finish the transfer in {TRANSFER_TIMEOUT_S:.0f} s "
                       f"(term {cur.term}, leader {cur.leader}, ready {cur.ready})", shard=gid)

    async def _prefer(self, gid: int, worker: str, pinned: bool = True) -> None:
        self._raise_failed(await self._submit({"op": "set_preferred_leader", "group": gid, "leader": worker,
                                               "pinned": pinned}))

    async def replicas(self, request: web.Request) -> web.Response:
        """Start a staged operator: add a replica (learner, catch up, promote) or remove one."""
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        soft = self._require_leader()
        gid = self._gid(request)
        body = await _json_body(request)
        g = self._group_record(gid)
        add, remove = body.get("add"), body.get("remove")
        if (add is None) == (remove is None) or not isinstance(add or remove, str):
            raise ApiError("bad_request", "replicas needs exactly one of {\"add\": WORKER} or {\"remove\": WORKER}")
        now, lease = _now_ms(), self._lease_ms()
        members = set(g.voters) | set(g.learners)
        if add is not None:
            if add in members:
                raise ApiError("bad_request", f"{add} already hosts group {gid}")
            if add not in self.raft.sm.workers:
                raise ApiError("bad_request", f"{add} is not a registered worker")
            if not heard_live(soft, add, now, lease):
                heard = soft.workers.get(add)
                raise ApiError("bad_request", f"{add} is not live (no heartbeat in the last {lease} ms)" if heard else
                               f"{add} is registered, but this meta leader has not heard its heartbeat yet: "
                               "retry once `topoctl status` shows it live")
            cmd = self._operator_cmd(gid, "add", add)
        else:
            if remove not in members:
                raise ApiError("bad_request", f"{remove} does not host group {gid}")
            remaining = [v for v in g.voters if v != remove]
            # Only voters this meta leader has heard from count: right after a
            # meta failover the controller's grace lease would count a voter
            # that died meanwhile, and the removal would leave no quorum.
            live = [v for v in remaining if heard_live(soft, v, now, lease)]
            if not remaining or len(live) < len(remaining) // 2 + 1:
                raise ApiError("bad_request", f"removing {remove} would leave group {gid} without a quorum of live "
                               f"voters ({len(live)} live of {len(remaining)})")
            cmd = self._operator_cmd(gid, "remove", remove)
        result = await self._submit(cmd)
        self._raise_failed(result)
        self.log.info("operator_started", **result["operator"])
        return json_response(result["operator"], status=202)

    def _operator_cmd(self, gid: int, kind: str, worker: str, message: str = "",
                      replaces: str | None = None, by: str = "operator") -> dict[str, Any]:
        """The command that starts a staged operator (a verb's or the controller's): an add
        starts as a learner, a removal of the leader by handing its leadership over."""
        g = self.raft.sm.groups.get(gid)
        step = "add_learner" if kind == "add" else "transfer" if g is not None and g.leader == worker else "remove"
        return {"op": "put_operator", "group": gid, "kind": kind, "worker": worker, "step": step,
                "message": message, "replaces": replaces, "started_ms": int(time.time() * 1000), "by": by}

    async def cancel_operator(self, request: web.Request) -> web.Response:
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        gid = self._gid(request)
        op = self.raft.sm.operators.get(gid)
        if op is None:
            raise ApiError("not_found", f"group {gid} has no operator in progress")
        result = await self._submit({"op": "update_operator", "group": gid, "kind": op.kind, "worker": op.worker,
                                     "step": op.step, "done": True, "cancelled": True})
        self._raise_failed(result)
        # Every step is a single committed membership change, so stopping
        # between steps leaves the group consistent (perhaps with a learner).
        self.log.info("operator_cancelled", group=gid, kind=op.kind, worker=op.worker, step=op.step)
        return json_response({"cancelled": True, "group": gid, "kind": op.kind, "worker": op.worker,
                              "step": op.step})

    async def operators(self, request: web.Request) -> web.Response:
        return json_response({"operators": self.raft.sm.view()["operators"]})

    @staticmethod
    def _gid(request: web.Request) -> int:
        gid = _decimal(request.match_info["gid"])
        if gid is None:
            raise ApiError("bad_request", "group id must be a non-negative integer (decimal digits)")
        return gid

    async def group_ready(self, request: web.Request) -> web.Response:
        """A leader finished its start-of-term protocol (CAS on term and leader)."""
        body = await _json_body(request)
        term, leader = body.get("term"), body.get("leader")
        if not isinstance(term, int) or isinstance(term, bool) or not isinstance(leader, str):
            raise ApiError("bad_request", "ready needs {\"term\": int, \"leader\": str}")
        require_sender(request, "worker", leader, "a leader's ready")
        result = await self._submit({"op": "set_ready", "group": self._gid(request), "term": term, "leader": leader})
        self._raise_failed(result)
        return json_response(result)

    async def group_leader(self, request: web.Request) -> web.Response:
        """Compare-and-set a group's leader: term becomes expect_term + 1 (the fence)."""
        body = await _json_body(request)
        leader, expect = body.get("leader"), body.get("expect_term")
        if not isinstance(expect, int) or isinstance(expect, bool) or not isinstance(leader, str):
            raise ApiError("bad_request", "leader needs {\"leader\": str, \"expect_term\": int}")
        gid = self._gid(request)
        peer = peer_of(request)
        current = self.raft.sm.groups.get(gid)
        if peer is not None and (current is None or peer.name != current.leader):
            # Only the group's leader hands its leadership over (a transfer);
            # failovers are the controller's own, through the log.
            raise refusal("wrong_sender", f"only group {gid}'s leader may name its successor, not {peer}")
        result = await self._submit({"op": "set_leader", "group": gid, "leader": leader, "expect_term": expect})
        self._raise_failed(result)
        self.log.info("leader_set", group=gid, leader=leader, term=result["term"])
        return json_response(result)

    async def register_worker(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        wid, addr = body.get("id"), body.get("addr")
        if not isinstance(wid, str) or not wid or not isinstance(addr, str) or ":" not in addr:
            raise ApiError("bad_request", "register needs {\"id\": str, \"addr\": \"host:port\", \"zone\": str}")
        require_sender(request, "worker", wid, "a worker's registration")
        identity = self._admit_identity(request, f"worker:{wid}", body)
        zone = body.get("zone")
        if zone is not None and not isinstance(zone, str):
            raise ApiError("bad_request", "zone must be a string")
        capacity = {}
        for key in ("available_ram", "available_disk"):
            value = body.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_BYTES:
                raise ApiError("bad_request", f"{key} must be a whole number of bytes (0 to {MAX_BYTES})")
            capacity[key] = value
        known = self.raft.sm.workers.get(wid)
        allow_repoint = None
        if known is not None and known.addr != addr:
            self._admit_repoint(request, wid, known.addr, addr)
            allow_repoint = known.addr
        # allow_repoint makes the check above a compare-and-set: an address that
        # changed between this read and the commit is refused there, not overwritten.
        result = await self._submit({"op": "register_worker", "id": wid, "addr": addr, "zone": zone,
                                     "ram_bytes": capacity["available_ram"],
                                     "disk_bytes": capacity["available_disk"],
                                     "allow_repoint": allow_repoint, "version": identity.version,
                                     "code_digest": identity.code_digest})
        if not result.get("ok") and result.get("reason") == "revoked":
            self._note_refusal(f"worker:{wid}", request.remote, "revoked")
        self._raise_failed(result)
        return json_response({**result, "admission": "admitted"})

    def _admit_identity(self, request: web.Request, who: str, body: dict[str, Any]) -> SoftwareIdentity:
        """The software a joining process reports; refused (403 version_mismatch)
        unless settings.allowed_versions lists its version (or lists none)."""
        version, digest = body.get("version", ""), body.get("code_digest", "")
        if not isinstance(version, str) or len(version) > 64 or not isinstance(digest, str) or len(digest) > 128:
            raise ApiError("bad_request", "version and code_digest must be strings (at most 64 and 128 characters)")
        allowed = ((self.raft.sm.topology or {}).get("settings") or {}).get("allowed_versions") or []
        if allowed and version not in allowed:
            self._note_refusal(who, request.remote, "version_mismatch")
            self.log.warning("admission_refused", principal=who, peer_addr=request.remote, reason="version_mismatch",
                             version=version, allowed=list(allowed))
            raise ApiError("forbidden", f"{who} runs version {version or '(none)'}; settings.allowed_versions admits "
                           f"{', '.join(allowed)}", reason="version_mismatch", allowed_versions=list(allowed))
        return SoftwareIdentity(version, digest)

    async def register_gateway(self, request: web.Request) -> web.Response:
        """A gateway says who it is (it is not placed on: this is for admission and `topoctl status`)."""
        body = await _json_body(request)
        gid, addr = body.get("id"), body.get("addr")
        if not isinstance(gid, str) or not gid or len(gid) > 128 or not isinstance(addr, str) or len(addr) > 256:
            raise ApiError("bad_request", "register needs {\"id\": str, \"addr\": \"host:port\"}")
        require_sender(request, "gateway", gid, "a gateway's registration")
        if not self.raft.is_leader():
            leader = self.raft.leader()
            raise ApiError("not_leader", "gateways register with the meta leader",
                           leader=leader.id if leader else None, leader_http=leader.http if leader else None)
        identity = self._admit_identity(request, f"gateway:{gid}", body)
        if gid not in self.gateways and len(self.gateways) >= MAX_GATEWAYS:
            oldest = min(self.gateways, key=lambda k: self.gateways[k]["last_seen_ms"])
            del self.gateways[oldest]
        self.gateways[gid] = {"id": gid, "addr": addr, "admission": "admitted", "version": identity.version,
                              "code_digest": identity.code_digest, "last_seen_ms": _now_ms()}
        return json_response({"ok": True, "admission": "admitted"})

    async def worker_revoke(self, request: web.Request) -> web.Response:
        """Take a worker's credentials away: it leaves the eligible set at once,
        its leaderships fail over, its replicas are replaced, and meta and its
        peers refuse its traffic. `admit` undoes it."""
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        wid = self._worker_id(request)
        result = await self._submit({"op": "set_admission", "id": wid, "admission": "revoked"})
        self._raise_failed(result)
        dropped = self.guard.revoke(Principal("worker", wid))
        self.log.warning("worker_revoked", worker=wid, sessions_dropped=dropped)
        return json_response({"worker": wid, "admission": "revoked", "changed": result.get("changed", True)})

    async def worker_admit(self, request: web.Request) -> web.Response:
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        wid = self._worker_id(request)
        result = await self._submit({"op": "set_admission", "id": wid, "admission": "admitted"})
        self._raise_failed(result)
        self.log.info("worker_admitted", worker=wid)
        return json_response({"worker": wid, "admission": "admitted", "changed": result.get("changed", True)})

    def _admit_repoint(self, request: web.Request, wid: str, old: str, new: str) -> None:
        """May this registration move a known worker id from `old` to `new`?

        Client traffic, replication and snapshot downloads follow a worker's
        address, so moving it is an operator's act: it needs the admin token.
        A meta without an admin token is open to anyone anyway; it allows the
        move, as before, with a warning. Either way a worker heard within the
        lease is not moved: two processes claim one id, and the live one keeps it."""
        if not bearer_ok(request.headers.get("Authorization"), self.config.admin_token):
            raise ApiError("unauthorized",
                           f"worker {wid} is registered at {old}: moving it to {new} needs the admin token; "
                           f"if it moved on purpose, put its new address in the topology (topoctl apply)",
                           registered_addr=old)
        soft = self._require_leader()  # liveness is known where the heartbeats are
        now = _now_ms()
        if heard_live(soft, wid, now, self._lease_ms()):
            seen = soft.workers[wid]
            raise ApiError("conflict",
                           f"worker {wid} is live at {old} (heard {now - seen.last_seen_ms} ms ago): "
                           f"another process claims its id from {new}; stop one of them "
                           f"(a stopped worker may move once it is silent for a lease)",
                           registered_addr=old)
        self.log.warning("worker_repointed", worker=wid, old_addr=old, new_addr=new, peer=request.remote,
                         authenticated=self.config.admin_token is not None)

    async def worker_gone(self, request: web.Request) -> web.Response:
        """An operator says the worker will not come back: repair replaces its
        voters now instead of after settings.replace_after_ms."""
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        soft = self._require_leader()
        wid = self._worker_id(request)
        seen = soft.workers.get(wid)
        now = _now_ms()
        if seen is not None and heard_live(soft, wid, now, self._lease_ms()):
            raise ApiError("bad_request", f"{wid} is live (heard {now - seen.last_seen_ms} ms ago): stop it first; "
                           "the replicas of a live worker are not replaced")
        result = await self._submit({"op": "set_worker_state", "id": wid, "state": "removed"})
        self._raise_failed(result)
        self.log.info("worker_gone", worker=wid)
        return json_response({"worker": wid, "state": "removed"})

    async def worker_drain(self, request: web.Request) -> web.Response:
        """Take a worker out of service: the controller hands its leaderships
        over, replaces its replicas, then marks it `drained` (meta/repair.py)."""
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        wid = self._worker_id(request)
        rec = self.raft.sm.workers[wid]
        if rec.state in ("draining", "drained"):
            return json_response({"worker": wid, "state": rec.state, "changed": False})
        if rec.state == "removed":
            raise ApiError("bad_request", f"{wid} was declared gone: its replicas are being replaced already")
        self._raise_failed(await self._submit({"op": "set_worker_state", "id": wid, "state": "draining"}))
        self.log.info("worker_draining", worker=wid)
        return json_response({"worker": wid, "state": "draining", "changed": True})

    async def worker_undrain(self, request: web.Request) -> web.Response:
        """Make a drained (or draining) worker eligible for replicas and leaderships again."""
        check_bearer(request.headers.get("Authorization"), self.config.admin_token)
        wid = self._worker_id(request)
        topo = self.raft.sm.topology or {}
        declared = any(w["id"] == wid for w in topo.get("workers", []))
        state = "active" if declared else "available"
        rec = self.raft.sm.workers[wid]
        if rec.state not in ("draining", "drained"):
            raise ApiError("bad_request", f"{wid} is {rec.state}, not draining or drained")
        self._raise_failed(await self._submit({"op": "set_worker_state", "id": wid, "state": state}))
        self.log.info("worker_undrained", worker=wid, state=state)
        return json_response({"worker": wid, "state": state})

    def _worker_id(self, request: web.Request) -> str:
        wid = request.match_info["wid"]
        if wid not in self.raft.sm.workers:
            raise ApiError("not_found", f"no worker {wid!r}")
        return wid

    async def heartbeat(self, request: web.Request) -> web.Response:
        if not self.raft.is_leader() or self.soft is None:
            leader = self.raft.leader()
            raise ApiError("not_leader", "heartbeats go to the meta leader",
                           leader=leader.id if leader else None, leader_http=leader.http if leader else None)
        wid = request.match_info["wid"]
        require_sender(request, "worker", wid, "a heartbeat")
        if revoked(self.raft.sm.workers.get(wid)):
            raise refusal("revoked", f"worker {wid} was revoked: its heartbeats are not heard")
        body = await _json_body(request)
        raw_groups = body.get("groups", {})
        if not isinstance(raw_groups, dict):
            raise ApiError("bad_request", "groups must be an object keyed by group id")
        reports: dict[int, GroupReport] = {}
        try:
            for gid, rep in raw_groups.items():
                reports[_group_key(gid)] = _group_report(rep)
        except (TypeError, ValueError):
            raise ApiError("bad_request", "each group report (keyed by the group id's digits) needs integer "
                           "term/last_term/last_seq/commit/applied/config_seq/disk_bytes >= 0, quorum true/false/null, "
                           "leader_silence_ms, snapshot_bytes and snapshot_total integers or null, "
                           "persist_p99_ms/persist_ema_ms/write_rate non-negative numbers, resyncing and "
                           "snapshot_waiting booleans, role and failed strings, voters/learners/unheard arrays of "
                           "strings") from None
        boot = body.get("boot")
        if boot is not None and (not isinstance(boot, str) or not 0 < len(boot) <= 64):
            raise ApiError("bad_request", "boot must be a string of 1 to 64 characters")
        # The software the worker runs now (served back in /v1/cluster's report);
        # optional: a worker older than this field sends none.
        version = body.get("version")
        if version is not None and (not isinstance(version, str) or len(version) > 64):
            raise ApiError("bad_request", "version must be a string of at most 64 characters")
        self.soft.heard_from(wid, _now_ms(), reports, self._lease_ms(), boot)
        self.heartbeat_raw[wid] = body
        return json_response({"ok": True, "revision": self.raft.sm.revision})

    # -- controller -------------------------------------------------------------------

    async def _controller_loop(self) -> None:
        loop = asyncio.get_running_loop()
        watchdog = asyncio.create_task(self._watch_stalls())
        try:
            while True:
                start = loop.time()
                await asyncio.sleep(CONTROLLER_PERIOD_S)
                self._note_stall(loop.time() - start - CONTROLLER_PERIOD_S)
                stalled_ms, self._stalled_ms = self._stalled_ms, 0
                if not self.raft.is_leader():
                    self.soft = None
                    continue
                if self.soft is None:
                    self.soft = SoftState(leader_since_ms=_now_ms())
                    self.log.info("meta_leader_elected", waiting_lease_ms=self._lease_ms())
                elif stalled_ms > self._lease_ms() // STALL_LEASE_SHARE:
                    self.soft.stood_still(_now_ms())
                    self.c_stalls.inc()
                    self.log.warning("meta_leader_stalled", stalled_ms=stalled_ms, waiting_lease_ms=self._lease_ms())
                try:
                    await self._controller_pass()
                except ApiError as err:
                    self.log.warning("controller_action_failed", code=err.code, message=err.message)
        finally:
            watchdog.cancel()

    async def _watch_stalls(self) -> None:
        """Measure how long the event loop stands still, also while a controller
        pass awaits a commit (its own sleep measures only the time between passes)."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(STALL_CHECK_S)
            self._note_stall(loop.time() - start - STALL_CHECK_S)

    def _note_stall(self, late_s: float) -> None:
        self._stalled_ms = max(self._stalled_ms, int(late_s * 1000))

    async def _controller_pass(self) -> None:
        assert self.soft is not None
        sm = self.raft.sm
        now, lease = _now_ms(), self._lease_ms()
        for wid in sm.workers:
            self.soft.know(wid, now)
        gone = frozenset(w.id for w in sm.workers.values() if revoked(w))
        actions = decide(list(sm.groups.values()), self.soft, now, lease, revoked=gone)
        for op in list(sm.operators.values()):
            group = sm.groups.get(op.group)
            if group is not None and op.group not in self._busy_groups:
                actions.extend(advance_operator(op, group, self.soft, now, lease))
        topo = sm.topology
        self.soft.note_operators([(op.group, op.kind, op.worker) for op in sm.operators.values()], now)
        if topo is not None:
            # Give up on assignments that do not finish, then repair (a gone
            # voter, a gap), then the applied placement: one operator per group.
            timeout = int(topo["settings"].get("assignment_timeout_ms", 300_000))
            actions.extend(expired_assignments(sm.operators, self.soft, now, timeout))
            replace_after = int(topo["settings"].get("replace_after_ms", 60_000))
            groups = list(sm.groups.values())
            moves = repair(groups, sm.operators, sm.workers, self.soft, now, lease, replace_after,
                           int(topo["replication_factor"]), replication_factors(topo))
            moved = {s.group for s in moves if not isinstance(s, SetWorkerState)}
            moves += [s for s in reconcile(groups, sm.operators, sm.workers, self.soft, now, lease)
                      if s.group not in moved]
            actions.extend(s for s in moves if isinstance(s, SetWorkerState) or s.group not in self._busy_groups)
        if not actions and not self._busy_groups and self._balance_idle(now):
            # Balance only a quiet cluster: no failover, operator or leader
            # call in flight, and no earlier move still under way.
            held = {g for g, b in self._balance.items() if now < b.retry_at} | self._hot.held_groups(now)
            unwanted = frozenset(w.id for w in sm.workers.values()
                                 if w.state in ("draining", "drained", "removed") or revoked(w))
            for move in rebalance(list(sm.groups.values()), self.soft, now, lease, frozenset(held | set(sm.operators)),
                                  unwanted):
                b = self._balance.setdefault(move.group, _BalanceMove())
                b.started(now, sm.groups[move.group].term)
                self.log.info("leader_rebalance", group=move.group, leader=move.leader, preferred=move.target,
                              attempt=b.attempts)
                self.c_balance.inc()
                self.c_decisions.labels("leader_balance", "preferred").inc()
                actions.append(move)
            if not any(isinstance(a, StartTransfer) for a in actions) and topo is not None:
                actions.extend(await self._balance_counts(now, lease, held | set(sm.operators)))
        quiet = not actions and not self._busy_groups and self._balance_idle(now)
        actions.extend(await self._hot_relief(now, lease, quiet))
        for action in actions:
            await self._execute(action)

    async def _balance_counts(self, now: int, lease: int, busy: set[int]) -> list[StartTransfer]:
        """Leader-count balance (meta/balance.py): the target becomes the preferred leader first."""
        assert self.soft is not None and self.raft.sm.topology is not None
        sm = self.raft.sm
        window = int(sm.topology["settings"].get("rebalance_window_ms", DEFAULT_REBALANCE_WINDOW_MS))
        isolated = {g for g, t in self.soft.isolation_moved_ms.items()
                    if now - t < max(ISOLATION_HOLD_LEASES * lease, REBALANCE_AFTER_MS)}
        out = []
        for move in balance_leader_counts(list(sm.groups.values()), sm.workers, self.soft, now, lease,
                                          busy | isolated, self.soft.balance_moved_ms, window):
            try:
                await self._prefer(move.group, move.target, pinned=False)
            except ApiError as err:
                self.log.warning("leader_count_move_failed", group=move.group, code=err.code, message=err.message)
                continue
            self.soft.balance_moved_ms[move.group] = now
            self._balance.setdefault(move.group, _BalanceMove()).started(now, sm.groups[move.group].term)
            self.c_decisions.labels("leader_count", "spread").inc()
            self.log.info("leader_count_move", group=move.group, leader=move.leader, target=move.target,
                          reason=move.reason)
            out.append(StartTransfer(move.group, move.leader, move.target))
        return out

    async def _hot_relief(self, now: int, lease: int, quiet: bool) -> list[StartTransfer | StartOperator]:
        """Hot-group relief (meta/hotspot.py): its clocks run every pass, its
        decisions come only in a quiet one. A leadership move names the target
        preferred leader first, so that leader balance keeps it there."""
        sm, soft = self.raft.sm, self.soft
        if sm.topology is None or soft is None:
            return []
        if self._hot_soft is not soft:
            self._hot, self._hot_soft = HotState(), soft
        window = int(sm.topology["settings"].get("rebalance_window_ms", DEFAULT_REBALANCE_WINDOW_MS))
        counted = {g for g, t in soft.balance_moved_ms.items() if now - t < window}
        busy = frozenset(set(sm.operators) | self._busy_groups | counted)
        actions: list[StartTransfer | StartOperator] = []
        for d in relieve(self._hot, list(sm.groups.values()), sm.workers, soft, now, lease,
                         HotSettings.of(sm.topology["settings"]), busy, quiet):
            self.c_decisions.labels(d.kind, d.reason).inc()
            self.log.info("controller_decision", kind=d.kind, reason=d.reason, group=d.action.group,
                          detail=d.detail, window_ms=self._hot.window_ms)
            if isinstance(d.action, StartTransfer):
                await self._prefer(d.action.group, d.action.target, pinned=False)
                # Leader balance's record: the next quiet pass waits for this transfer.
                self._balance.setdefault(d.action.group, _BalanceMove()).started(now, sm.groups[d.action.group].term)
            actions.append(d.action)
        return actions

    def _balance_idle(self, now: int) -> bool:
        """No balancing move under way: each ended (its group moved on) or timed out."""
        for gid, b in self._balance.items():
            if b.term is None:
                continue
            g = self.raft.sm.groups.get(gid)
            if g is not None and g.term > b.term and g.ready:
                b.term = None
                if g.leader == g.preferred_leader:
                    b.attempts = 0  # it worked: no backoff next time
            elif now - b.at >= TRANSFER_TIMEOUT_S * 1000:
                b.term = None  # given up on; the backoff in retry_at holds the group
            else:
                return False
        return True

    async def _execute(self, action: Any) -> None:
        if isinstance(action, SetLeader):
            result = await self._submit({"op": "set_leader", "group": action.group, "leader": action.leader,
                                         "expect_term": action.expect_term})
            self.log.info("failover", group=action.group, new_leader=action.leader,
                          expect_term=action.expect_term, reason=action.reason, cause=action.cause,
                          ok=result.get("ok"), code=result.get("code"))
            if result.get("ok"):
                self.c_failovers.labels(action.cause).inc()
                self.c_decisions.labels("failover", action.cause).inc()
                if action.cause == "isolated" and self.soft is not None:
                    self.soft.isolation_moved_ms[action.group] = _now_ms()
        elif isinstance(action, RecordMembers):
            result = await self._submit({"op": "set_members", "group": action.group, "voters": list(action.voters),
                                         "learners": list(action.learners), "conf_ver": action.conf_ver,
                                         "expect_conf_ver": action.expect_conf_ver})
            self.log.info("members_recorded", group=action.group, voters=action.voters, learners=action.learners,
                          conf_ver=action.conf_ver, ok=result.get("ok"))
        elif isinstance(action, UpdateOperator):
            current = self.raft.sm.operators.get(action.group)
            if current is not None and not action.done and (current.step, current.message) == \
                    (action.step, action.message):
                return
            result = await self._submit({"op": "update_operator", "group": action.group, "kind": action.kind,
                                         "worker": action.worker, "step": action.step, "message": action.message,
                                         "done": action.done})
            self.log.info("operator_step", group=action.group, kind=action.kind, worker=action.worker,
                          step=action.step, message=action.message, done=action.done, ok=result.get("ok"))
        elif isinstance(action, SetWorkerState):
            result = await self._submit({"op": "set_worker_state", "id": action.worker, "state": action.state})
            self.log.info("worker_state_set", worker=action.worker, state=action.state, reason=action.reason,
                          ok=result.get("ok"))
        elif isinstance(action, CancelAssignment):
            op = self.raft.sm.operators.get(action.group)
            if op is None or (op.kind, op.worker) != ("add", action.worker):
                return
            result = await self._submit({"op": "update_operator", "group": action.group, "kind": "add",
                                         "worker": action.worker, "step": op.step, "done": True, "cancelled": True})
            self.log.warning("assignment_timed_out", group=action.group, worker=action.worker, reason=action.reason,
                             ok=result.get("ok"))
            if result.get("ok"):
                self._refuse(action.group, action.worker, "timeout")
        elif isinstance(action, StartOperator):
            if action.kind == "add":
                # Asking the worker first may take up to a call timeout: off
                # the pass, which must go on failing groups over meanwhile.
                self._busy_groups.add(action.group)
                task = asyncio.create_task(self._assign(action))
                task.add_done_callback(lambda _t, g=action.group: self._busy_groups.discard(g))
            else:
                await self._start_operator(action)
        elif isinstance(action, (ChangeMembers, StartTransfer)):
            self._busy_groups.add(action.group)
            task = asyncio.create_task(self._call_leader(action))
            task.add_done_callback(lambda _t, g=action.group: self._busy_groups.discard(g))

    def _refuse(self, group: int, worker: str, reason: str) -> None:
        assert self.soft is not None
        self.soft.refused[(group, worker)] = Refusal(reason, _now_ms() + REFUSAL_HOLD_MS)
        self.c_decisions.labels("refused", reason).inc()

    async def _assign(self, action: StartOperator) -> None:
        if await self._assignment_accepted(action):
            await self._start_operator(action)

    async def _start_operator(self, action: StartOperator) -> None:
        result = await self._submit(self._operator_cmd(action.group, action.kind, action.worker,
                                                       action.reason, action.replaces, action.by))
        self.log.info("placement_step_started", by=action.by, group=action.group, kind=action.kind,
                      worker=action.worker, reason=action.reason, ok=result.get("ok"), code=result.get("code"))
        if result.get("ok"):
            self.c_placement.labels(action.by, action.kind).inc()
            if action.by != "shed":  # hot relief counted its own when it decided
                self.c_decisions.labels(action.by, action.kind).inc()

    async def _assignment_accepted(self, action: StartOperator) -> bool:
        """Ask the chosen worker whether it can take the replica (worker/capacity.py);
        a refusal, or no answer, skips it for this group for REFUSAL_HOLD_MS."""
        g = self.raft.sm.groups.get(action.group)
        need = 0
        if g is not None and self.soft is not None:
            need = max((rep.disk_bytes for v in g.voters if (rep := report_of(self.soft, v, g.id)) is not None),
                       default=0)
        try:
            status, answer = await self._worker_post(action.worker, "/v1/assignments",
                                                     {"group": action.group, "bytes": need})
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ApiError) as exc:
            status, answer = 0, {"error": {"reason": "unreachable", "message": type(exc).__name__}}
        if status == 200:
            return True
        err = answer.get("error", {}) if isinstance(answer, dict) else {}
        reason = err.get("reason") if err.get("reason") in REFUSAL_REASONS else "unreachable"
        self.log.warning("assignment_refused", by=action.by, group=action.group, worker=action.worker,
                         reason=reason, status=status, message=err.get("message"))
        self._refuse(action.group, action.worker, reason)
        return False

    async def _call_leader(self, action: ChangeMembers | StartTransfer) -> None:
        if isinstance(action, StartTransfer):
            path, body = f"/v1/groups/{action.group}/transfer", {"to": action.target}
        else:
            path = f"/v1/groups/{action.group}/members"
            body = {k: v for k, v in (("add_learner", action.add_learner), ("promote", action.promote),
                                      ("remove", action.remove)) if v is not None}
        try:
            status, answer = await self._worker_post(action.leader, path, body)
            self.log.info("operator_call", group=action.group, leader=action.leader, path=path, status=status,
                          answer=answer)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ApiError) as exc:
            self.log.warning("operator_call_failed", group=action.group, leader=action.leader, path=path,
                             error=type(exc).__name__)
        # Give the change time to show up in heartbeats before the next attempt.
        await asyncio.sleep(0.3)


def _retarget_lines(sm: MetaStateMachine, topo: Topology, stale: list[int], actions: list[Action]) -> list[str]:
    """A plan line for each group the file steers back that no move shows (its
    voters and leader already are the file's; only where the controller steers
    it changes), so the plan never says "no changes" for a file that changes it."""
    moved = {a.group for a in actions}
    out: list[str] = []
    for g in topo.groups:
        if g.id not in stale or g.id in moved:
            continue
        rec = sm.groups[g.id]
        if sorted(rec.desired) != sorted(g.replicas):
            out.append(f"~ group {g.id}: desired {','.join(rec.desired) or '-'} -> {','.join(g.replicas)} "
                       "(the file's placement again)")
        if rec.preferred_leader != g.leader:
            out.append(f"~ group {g.id}: preferred leader {rec.preferred_leader or '-'} -> {g.leader}")
    return out


def _decimal(raw: str) -> int | None:
    """The int that `raw` spells in ASCII digits (at most 19), else None.

    Not int(): it also reads " 1", "+1", "1_0" and other scripts' digits
    ("١" is 1), so a path naming no group in any way a client meant could
    compare-and-set one."""
    if raw.isascii() and raw.isdigit() and len(raw) <= 19:
        return int(raw)
    return None


# The deepest nesting orjson encodes (it reads up to 1024 levels).
MAX_BODY_DEPTH = 254


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise ApiError("bad_request", f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("bad_request", "the body must be a JSON object")
    # Meta serves some of what it is sent (a heartbeat's report, in every
    # /v1/cluster answer): a body nested deeper than orjson writes would make
    # each of those a 500. Only a body with brackets enough can be; counting
    # them is a C loop, far cheaper than the encode that decides.
    if raw.count(b"[") + raw.count(b"{") > MAX_BODY_DEPTH:
        try:
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise ApiError("bad_request", f"the body is nested deeper than {MAX_BODY_DEPTH} levels") from None
    return body


# A heartbeat's report is read strictly: a field of the wrong type is a 400,
# never coerced (int("12"), float([] or 0), bool("no") all "worked" and let a
# malformed report into the controller's decisions). Absent numbers read as
# 0 (older workers leave later fields out), and so do a null disk_bytes and
# latency, as they always have.
_INT64_MAX = (1 << 63) - 1


def _group_key(gid: Any) -> int:
    if not (isinstance(gid, str) and gid.isascii() and gid.isdigit() and len(gid) <= 19):
        raise ValueError("a group id key must be its decimal digits")
    return int(gid)


def _int_field(rep: dict[str, Any], key: str, null_ok: bool = False) -> int:
    value = rep.get(key, 0)
    if value is None and null_ok:
        return 0
    if type(value) is not int or not 0 <= value <= _INT64_MAX:
        raise TypeError(f"{key} must be a non-negative integer")
    return value


def _opt_int(rep: dict[str, Any], key: str) -> int | None:
    return None if rep.get(key) is None else _int_field(rep, key)


def _opt_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise TypeError("quorum must be true, false or null")


def _bool_field(rep: dict[str, Any], key: str) -> bool:
    value = rep.get(key, False)
    if type(value) is not bool:
        raise TypeError(f"{key} must be true or false")
    return value


def _opt_ms(value: Any) -> float:
    """A reported latency (ms) or rate: absent (an older worker) reads as 0, "not measured"."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError("a latency must be a finite, non-negative number of ms")
    return float(value)


def _names(rep: dict[str, Any], key: str) -> tuple[str, ...]:
    value = rep.get(key) or []
    if type(value) is not list or not all(type(v) is str for v in value):
        raise TypeError(f"{key} must be an array of worker ids")
    return tuple(value)


def _group_report(rep: Any) -> GroupReport:
    if type(rep) is not dict:
        raise TypeError("a group report must be an object")
    role = rep.get("role", "")
    if type(role) is not str:
        raise TypeError("role must be a string")
    return GroupReport(
        term=_int_field(rep, "term"), role=role, last_term=_int_field(rep, "last_term"),
        last_seq=_int_field(rep, "last_seq"), commit=_int_field(rep, "commit"), applied=_int_field(rep, "applied"),
        voters=_names(rep, "voters"), learners=_names(rep, "learners"), config_seq=_int_field(rep, "config_seq"),
        resyncing=_bool_field(rep, "resyncing"), failed=_failed_of(rep), write_rate=_opt_ms(rep.get("write_rate")),
        quorum=_opt_bool(rep.get("quorum")), unheard=_names(rep, "unheard"),
        leader_silence_ms=_opt_int(rep, "leader_silence_ms"), disk_bytes=_int_field(rep, "disk_bytes", null_ok=True),
        snapshot_bytes=_opt_int(rep, "snapshot_bytes"), snapshot_total=_opt_int(rep, "snapshot_total"),
        snapshot_waiting=_bool_field(rep, "snapshot_waiting"),
        persist_p99_ms=_opt_ms(rep.get("persist_p99_ms")), persist_ema_ms=_opt_ms(rep.get("persist_ema_ms")))


def _failed_of(rep: dict[str, Any]) -> str | None:
    """Why a worker's replica of a group cannot serve, if it said so.

    A group the worker found corrupt at start-up is reported as
    `{"state": "corrupt", "error": ...}`: it must not lead either."""
    failed = rep.get("failed")
    if failed is not None:
        if type(failed) is not str:
            raise TypeError("failed must be a string or null")
        return failed[:200]
    if rep.get("state") == "corrupt":
        error = rep.get("error")
        return f"corrupt: {error if type(error) is str else short_repr(error)}"[:200]
    return None
