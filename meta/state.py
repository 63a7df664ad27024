"""The replicated state of the metadata service, as a pure state machine.

`MetaStateMachine.apply(cmd)` is deterministic and does no I/O: PySyncObj
calls it on every meta node in log order (see `meta/raft.py`), so every node
computes the same state. Every change is a compare-and-set against what the
caller read: the topology against its revision, a group's leader against its
term, a group's membership against its `conf_ver`. `set_leader` writes
`term = expect_term + 1`, so each term of a group has exactly one leader:
that is the fence the workers rely on.

Commands and results are plain dicts (they are pickled into PySyncObj's log
and must stay readable across versions).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from topology.model import Topology

WORKER_STATES = ("active", "available", "draining", "drained", "removed")
# Who is in the cluster (admission), apart from what a worker is doing: a
# revoked worker keeps its state (an operator may admit it back) but is never
# placed, named leader or routed to, and its peers refuse its traffic.
ADMISSIONS = ("admitted", "revoked")
PLACEABLE = ("active", "available")


@dataclass
class WorkerRecord:
    id: str
    addr: str
    zone: str = "default"
    state: str = "available"
    # What the worker advertised when it registered (bytes; 0: not said). Plain
    # defaults, not factories: a record pickled before they existed reads them.
    ram_bytes: int = 0
    disk_bytes: int = 0
    admission: str = "admitted"
    # The software it reported when it registered: package version and a
    # digest of its installed code (settings.allowed_versions checks the first).
    version: str = ""
    code_digest: str = ""


def placeable(rec: WorkerRecord | None) -> bool:
    """May the controller put replicas and leaderships on this worker?"""
    return rec is not None and rec.state in PLACEABLE and getattr(rec, "admission", "admitted") == "admitted"


def revoked(rec: WorkerRecord | None) -> bool:
    return rec is not None and getattr(rec, "admission", "admitted") == "revoked"


@dataclass
class GroupRecord:
    id: int
    term: int
    leader: str | None
    voters: list[str]
    learners: list[str] = field(default_factory=list)
    # Seq of the group-log config entry these members came from (0: the
    # bootstrap membership meta assigned at creation).
    conf_ver: int = 0
    preferred_leader: str | None = None
    # The term whose leader finished the start-of-term protocol (0 = none yet).
    ready_term: int = 0
    # Where the group should live: the applied topology's placement, as the
    # replica verbs and repair have edited it since (meta/reconcile.py drives
    # the voters there). A plain default, not a factory: a record pickled
    # before it existed reads () -- nothing to reconcile until the next apply.
    desired: tuple[str, ...] = ()
    # The preferred leader was chosen explicitly (an operator's transfer, or a
    # file that pins `groups:`): leader-count balance (meta/balance.py) leaves
    # such a group alone.
    leader_pinned: bool = False

    @property
    def ready(self) -> bool:
        return self.leader is not None and self.ready_term == self.term


def ok(**fields: Any) -> dict[str, Any]:
    return {"ok": True, **fields}


def fail(code: str, message: str, **fields: Any) -> dict[str, Any]:
    return {"ok": False, "code": code, "message": message, **fields}


@dataclass
class OperatorRecord:
    """A staged placement change of one group (at most one per group).

    kind: "add" (learner -> catch up -> promote) or "remove" (transfer the
    leadership away if needed -> remove). `step` and `message` say where it
    is and why it waits; the meta leader's executor advances it.
    """

    group: int
    kind: str
    worker: str
    step: str
    message: str = ""
    started_ms: int = 0
    # Who started it: "operator" (a verb), or the controller rule (repair,
    # fill, drain, reconcile, shed). Only the controller's own assignments
    # time out (meta/repair.py).
    by: str = "operator"


class MetaStateMachine:
    """Topology, workers and groups; `revision` bumps on every change."""

    def __init__(self) -> None:
        self.revision = 0
        self.topology_revision = 0
        self.topology_text: str | None = None
        self.topology: dict[str, Any] | None = None
        self.workers: dict[str, WorkerRecord] = {}
        self.groups: dict[int, GroupRecord] = {}
        self.operators: dict[int, OperatorRecord] = {}

    # -- dispatch -----------------------------------------------------------

    def apply(self, cmd: dict[str, Any]) -> dict[str, Any]:
        handler = getattr(self, "_cmd_" + str(cmd.get("op")), None)
        if handler is None:
            return fail("bad_request", f"unknown command {cmd.get('op')!r}")
        result: dict[str, Any] = handler(cmd)
        if result.get("ok") and result.get("changed", True):
            self.revision += 1
        result["revision"] = self.revision
        return result

    # -- commands -----------------------------------------------------------

    def _cmd_put_topology(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["expect_revision"] != self.topology_revision:
            return fail("conflict", f"topology revision is {self.topology_revision}, "
                        f"expected {cmd['expect_revision']}: re-read and re-plan",
                        topology_revision=self.topology_revision)
        topo = Topology.from_dict(cmd["topology"])
        if self.topology is not None and self.topology["shards"] != topo.shards:
            # The caller validated against this revision; this guards the log itself.
            return fail("bad_request", "shards cannot change on a live cluster")
        if self.topology == cmd["topology"]:
            # Same model (perhaps other comments or spacing): nothing to do,
            # unless the caller re-asserts a pinned placement the controller
            # moved since (repair, drain, the replica verbs, a transfer). The
            # flag keeps entries logged before it meaning what they meant.
            stale = self.stale_placement(topo) if cmd.get("reassert") else []
            if not stale:
                return ok(changed=False, topology_revision=self.topology_revision)
            self._declare_workers(topo)
            for g in topo.groups:
                if g.id in stale:
                    self.groups[g.id].preferred_leader = g.leader
                    self.groups[g.id].leader_pinned = True
                    self.groups[g.id].desired = tuple(g.replicas)
            return ok(topology_revision=self.topology_revision, created_groups=[], reasserted=stale)
        self.topology_text = cmd["text"]
        self.topology = cmd["topology"]
        self.topology_revision += 1
        self._declare_workers(topo)
        created = []
        for g in topo.groups:
            current = self.groups.get(g.id)
            if current is None:
                self.groups[g.id] = GroupRecord(id=g.id, term=1, leader=g.leader, voters=list(g.replicas),
                                                preferred_leader=g.leader, desired=tuple(g.replicas),
                                                leader_pinned=topo.pinned(g.id))
                created.append(g.id)
            else:
                # Replica and leader moves of a live group are staged by the
                # controller (reconcile, leader balance) toward these.
                current.preferred_leader = g.leader
                current.leader_pinned = topo.pinned(g.id)
                current.desired = tuple(g.replicas)
        return ok(topology_revision=self.topology_revision, created_groups=created)

    def stale_placement(self, topo: Topology) -> list[int]:
        """The groups a file with `groups:` pins other than where meta now steers
        them (desired placement or preferred leader): the controller or an
        operator moved them since it was applied. Automatic placement pins nothing."""
        return [g.id for g in topo.groups if topo.pinned(g.id) and g.id in self.groups and (
            sorted(self.groups[g.id].desired) != sorted(g.replicas) or self.groups[g.id].preferred_leader != g.leader)]

    def _declare_workers(self, topo: Topology) -> None:
        """The file's workers are active (a `removed` one too: the file names it
        again); an active worker the file no longer declares is only available."""
        declared = {w.id for w in topo.workers}
        for spec in topo.workers:
            rec = self.workers.get(spec.id)
            if rec is None:
                self.workers[spec.id] = WorkerRecord(spec.id, spec.http, spec.zone, "active")
            else:
                rec.addr, rec.zone = spec.http, spec.zone
                if rec.state in ("available", "removed"):
                    rec.state = "active"
        for rec in self.workers.values():
            if rec.id not in declared and rec.state == "active":
                rec.state = "available"

    def _cmd_register_worker(self, cmd: dict[str, Any]) -> dict[str, Any]:
        wid, addr = cmd["id"], cmd["addr"]
        ram, disk = int(cmd.get("ram_bytes", 0)), int(cmd.get("disk_bytes", 0))
        version, digest = str(cmd.get("version", "")), str(cmd.get("code_digest", ""))
        rec = self.workers.get(wid)
        # A worker started without --zone keeps the zone the topology gave it.
        zone = cmd.get("zone") or (rec.zone if rec is not None else "default")
        if rec is None:
            self.workers[wid] = WorkerRecord(wid, addr, zone, "available", ram, disk, version=version,
                                             code_digest=digest)
            return ok(state="available")
        if revoked(rec):
            return fail("forbidden", f"worker {wid} was revoked (topoctl worker admit {wid} lets it back in)",
                        reason="revoked")
        same = (rec.addr, rec.zone, rec.ram_bytes, rec.disk_bytes, getattr(rec, "version", ""),
                getattr(rec, "code_digest", ""))
        if same == (addr, zone, ram, disk, version, digest):
            return ok(changed=False, state=rec.state)
        # The server admitted a move from one address only ("allow_repoint":
        # that address; None: none). A command without the key predates the
        # rule and is replayed as it was applied then: any move.
        allowed = cmd.get("allow_repoint", rec.addr)
        if rec.addr != addr and allowed != rec.addr:
            return fail("conflict", f"worker {wid} is registered at {rec.addr}: moving it to {addr} "
                                    "was not admitted (re-register to have it checked)", registered_addr=rec.addr)
        rec.addr, rec.zone, rec.ram_bytes, rec.disk_bytes = addr, zone, ram, disk
        rec.version, rec.code_digest = version, digest
        return ok(state=rec.state)

    def _cmd_set_admission(self, cmd: dict[str, Any]) -> dict[str, Any]:
        rec = self.workers.get(cmd["id"])
        if rec is None:
            return fail("not_found", f"no worker {cmd['id']!r}")
        if cmd["admission"] not in ADMISSIONS:
            return fail("bad_request", f"admission must be one of {', '.join(ADMISSIONS)}")
        if getattr(rec, "admission", "admitted") == cmd["admission"]:
            return ok(changed=False, admission=rec.admission)
        rec.admission = cmd["admission"]
        return ok(admission=rec.admission)

    def _cmd_set_worker_state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        rec = self.workers.get(cmd["id"])
        if rec is None:
            return fail("not_found", f"no worker {cmd['id']!r}")
        if cmd["state"] not in WORKER_STATES:
            return fail("bad_request", f"worker state must be one of {', '.join(WORKER_STATES)}")
        if rec.state == cmd["state"]:
            return ok(changed=False)
        rec.state = cmd["state"]
        return ok()

    def _cmd_set_leader(self, cmd: dict[str, Any]) -> dict[str, Any]:
        g = self.groups.get(cmd["group"])
        if g is None:
            return fail("not_found", f"no group {cmd['group']}")
        if g.term != cmd["expect_term"]:
            return fail("conflict", f"group {g.id} is at term {g.term}, expected {cmd['expect_term']}",
                        term=g.term, leader=g.leader)
        if cmd["leader"] not in g.voters:
            return fail("bad_request", f"{cmd['leader']!r} is not a voter of group {g.id}",
                        voters=list(g.voters))
        if revoked(self.workers.get(cmd["leader"])):
            # Whatever path proposed it (a failover, a transfer): its peers refuse it.
            return fail("bad_request", f"{cmd['leader']} was revoked: it leads nothing")
        g.term += 1
        g.leader = cmd["leader"]
        return ok(group=g.id, term=g.term, leader=g.leader)

    def _cmd_set_preferred_leader(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Where the operator wants a group's leadership (the controller moves it back there)."""
        g = self.groups.get(cmd["group"])
        if g is None:
            return fail("not_found", f"no group {cmd['group']}")
        if cmd["leader"] not in g.voters:
            return fail("bad_request", f"{cmd['leader']!r} is not a voter of group {g.id}", voters=list(g.voters))
        pinned = bool(cmd.get("pinned", True))
        if (g.preferred_leader, g.leader_pinned) == (cmd["leader"], pinned):
            return ok(changed=False)
        g.preferred_leader, g.leader_pinned = cmd["leader"], pinned
        return ok(group=g.id, preferred_leader=g.preferred_leader)

    def _cmd_set_ready(self, cmd: dict[str, Any]) -> dict[str, Any]:
        g = self.groups.get(cmd["group"])
        if g is None:
            return fail("not_found", f"no group {cmd['group']}")
        if g.term != cmd["term"] or g.leader != cmd["leader"]:
            return fail("conflict", f"group {g.id} is at term {g.term} led by {g.leader}",
                        term=g.term, leader=g.leader)
        if g.ready_term == g.term:
            return ok(changed=False)
        g.ready_term = g.term
        return ok()

    def _cmd_set_members(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Record a membership the group's own log committed (conf_ver = its seq)."""
        g = self.groups.get(cmd["group"])
        if g is None:
            return fail("not_found", f"no group {cmd['group']}")
        if g.conf_ver != cmd["expect_conf_ver"]:
            return fail("conflict", f"group {g.id} is at conf_ver {g.conf_ver}, expected {cmd['expect_conf_ver']}",
                        conf_ver=g.conf_ver)
        if cmd["conf_ver"] <= g.conf_ver:
            return fail("conflict", f"conf_ver must grow past {g.conf_ver}", conf_ver=g.conf_ver)
        voters, learners = list(cmd["voters"]), list(cmd["learners"])
        if not voters or set(voters) & set(learners):
            return fail("bad_request", "voters must be non-empty and disjoint from learners")
        g.voters, g.learners = voters, learners
        g.conf_ver = cmd["conf_ver"]
        return ok(conf_ver=g.conf_ver)

    def _cmd_put_operator(self, cmd: dict[str, Any]) -> dict[str, Any]:
        gid = cmd["group"]
        if gid not in self.groups:
            return fail("not_found", f"no group {gid}")
        current = self.operators.get(gid)
        if current is not None:
            return fail("conflict", f"group {gid} already has an operator in progress: {current.kind} "
                        f"{current.worker} at step {current.step}", operator=asdict(current))
        self.operators[gid] = OperatorRecord(gid, cmd["kind"], cmd["worker"], cmd["step"], cmd.get("message", ""),
                                             cmd.get("started_ms", 0), str(cmd.get("by", "operator")))
        # The placement the group should converge to changes with the
        # operator (a verb, or repair replacing a gone voter): otherwise
        # reconcile would undo it once it is done.
        self._edit_desired(self.groups[gid], cmd["kind"], cmd["worker"], cmd.get("replaces"))
        return ok(operator=asdict(self.operators[gid]))

    @staticmethod
    def _edit_desired(g: GroupRecord, kind: str, worker: str, replaces: str | None = None) -> None:
        if not g.desired:
            return  # nothing applied since this record was made: no placement to edit
        want = [w for w in g.desired if w != worker and w != replaces]
        if kind == "add":
            want.append(worker)
        g.desired = tuple(want)

    def _cmd_update_operator(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = self.operators.get(cmd["group"])
        if op is None or op.kind != cmd["kind"] or op.worker != cmd["worker"]:
            return fail("conflict", "that operator is no longer in progress")
        if cmd.get("done"):
            del self.operators[cmd["group"]]
            if cmd.get("cancelled"):
                # Undo what starting it did to the placement: a cancelled
                # add must not be started again by reconcile (nor a removal).
                self._edit_desired(self.groups[cmd["group"]], "remove" if op.kind == "add" else "add", op.worker)
            return ok(done=True)
        if op.step == cmd["step"] and op.message == cmd.get("message", ""):
            return ok(changed=False)
        op.step, op.message = cmd["step"], cmd.get("message", "")
        return ok(operator=asdict(op))

    # -- reads --------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """The routing state every gateway and worker watches (plain data)."""
        groups = {}
        for gid, g in sorted(self.groups.items()):
            d = asdict(g)
            d["ready"] = g.ready
            groups[gid] = d
        return {
            "revision": self.revision,
            "topology_revision": self.topology_revision,
            "topology": copy.deepcopy(self.topology),
            "workers": {wid: asdict(w) for wid, w in sorted(self.workers.items())},
            "groups": groups,
            "operators": {gid: asdict(op) for gid, op in sorted(self.operators.items())},
        }
