"""The cluster's health verdict: green, yellow or red, and why. Pure functions.

`assess(status)` judges the dict `topoctl status` gathers (`GET /v1/cluster`
from the meta leader, plus `meta_nodes` from `gather_status`); it does no
I/O, reads no clock, and returns the same answer for the same input, so
every rule is tested on hand-built dicts (tests/tier1/test_health.py).

- red: some request cannot be served. Meta has no leader, its leader
  reports no quorum, or its leader does not answer from here; no topology is applied; a group has no leader, a leader that has
  not finished its start-of-term round, a leader that cannot serve (down,
  silent, failed, corrupt, re-syncing, not reporting the group, leading
  without a quorum, or whose own report does not say it leads the group's
  term, ready), or fewer voters able to serve than a quorum needs.
- yellow: everything is served, but with less margin than it should have.
  A group has fewer voters than its replication factor, a learner catching
  up, a placement change (operator) in progress, or a voter that is down,
  failed, corrupt, re-syncing, cut off from its leader, unheard by it or
  lagging; a meta node is down (by the meta leader's own Raft view) or
  unreachable from here; a replica the meta leader has not heard yet in its
  first lease (right after a meta failover: unknown, not down); or the
  replicas' health is unknown (the view did not come from the meta leader,
  which alone holds the workers' heartbeat reports: "unknown" is never
  "healthy").
- green: none of the above.

Mixed software versions are a warning, not a verdict: a rolling upgrade
runs mixed versions by design and waits for `green` after each worker, so
they must not hold the verdict at yellow (see runbook/operations.md).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from topology.model import replication_factors

DEFAULT_LEASE_MS = 1500
# States in which a replica acknowledges writes: it counts toward its group's quorum.
SERVING = ("ok", "lagging")


class Verdict(str, Enum):
    GREEN = "green"
    YELLOW = "yellow"
    RED = "red"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def at_least(self, wanted: "Verdict") -> bool:
        """Is this verdict as good as `wanted` or better (green is at least yellow)?"""
        return self.rank <= wanted.rank


_RANK = {Verdict.GREEN: 0, Verdict.YELLOW: 1, Verdict.RED: 2}


@dataclass(frozen=True)
class HealthPolicy:
    # Entries a replica may trail by before it counts as lagging. Workers
    # report at different moments (every lease/5), so under write load a
    # replica seems a few hundred entries behind while it is in step.
    max_lag: int = 1000


@dataclass(frozen=True)
class Reason:
    verdict: Verdict
    subject: str  # "meta", "topology", "replicas", or "group N"
    kind: str  # a stable name of the rule (no-leader, under-replicated, replica-down, ...): scripts match on it
    why: str
    group: int | None = None
    worker: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict.value}

    def line(self) -> str:
        return f"{self.subject}: {self.why}"


@dataclass(frozen=True)
class ReplicaHealth:
    """One replica as its worker last reported it, judged against its group."""

    group: int
    worker: str
    role: str  # leader, voter, learner
    # ok, lagging, down, unconfirmed, silent, missing, closed, corrupt, failed, resyncing, not-leading, no-quorum,
    # cut-off, unheard, unknown
    state: str
    why: str
    commit: int | None = None
    applied: int | None = None
    apply_lag: int | None = None  # commit - applied on the replica itself (one report: no skew)
    behind: int | None = None  # the leader's last seq - this replica's commit (None: no usable leader report)

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Health:
    verdict: Verdict
    reasons: tuple[Reason, ...]
    warnings: tuple[str, ...]
    replicas: tuple[ReplicaHealth, ...]  # empty when the view carries no reports
    reports: bool  # did the view carry the workers' heartbeat reports?

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "reasons": [r.to_dict() for r in self.reasons],
                "warnings": list(self.warnings), "reports": self.reports,
                "replicas": [r.to_dict() for r in self.replicas]}


def _majority(n: int) -> int:
    return n // 2 + 1


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def lease_ms(st: Mapping[str, Any]) -> int:
    """The topology's lease_ms (the default before one is applied)."""
    settings = (st.get("topology") or {}).get("settings") or {}
    return int(settings.get("lease_ms") or DEFAULT_LEASE_MS)


def _rf(st: Mapping[str, Any], gid: int) -> int | None:
    topo = st.get("topology")
    if not topo:
        return None
    return replication_factors(topo).get(gid, _int(topo.get("replication_factor")))


def _report(w: Mapping[str, Any] | None, gid: int) -> dict[str, Any] | None:
    rep = (((w or {}).get("report") or {}).get("groups") or {}).get(str(gid))
    return rep if isinstance(rep, dict) else None


def _not_heard_yet(st: Mapping[str, Any], w: Mapping[str, Any]) -> bool:
    """A worker the meta leader has not heard since it took over, within that leader's
    first lease: right after a meta failover every worker reads so for up to one report
    period while the cluster serves on. A view without `meta_leader_for_ms` (an older
    meta) cannot say how long ago that was: unknown too."""
    if _int(w.get("last_seen_ms_ago")) is not None:
        return False
    led = _int(st.get("meta_leader_for_ms"))
    return led is None or led < lease_ms(st)


def _leads(rep: Mapping[str, Any], g: Mapping[str, Any]) -> bool:
    """Does a replica's own report say it leads group record `g`'s term, ready?"""
    return rep.get("role") == "leader" and rep.get("term") == g.get("term") and bool(rep.get("ready"))


def _not_leading_why(rep: Mapping[str, Any], g: Mapping[str, Any]) -> str:
    term, role = rep.get("term"), rep.get("role")
    if role != "leader":
        return f"meta names it leader of term {g.get('term')}, but it reports role {role} in term {term}"
    if term != g.get("term"):
        return f"its last report is of term {term}, not the group's term {g.get('term')}"
    return f"leads term {term} but reports it has not finished its start-of-term round"


def has_reports(st: Mapping[str, Any]) -> bool:
    """Only the meta leader's view carries heartbeat reports (and `live`)."""
    return any("report" in w for w in (st.get("workers") or {}).values())


def replica_health(st: Mapping[str, Any], gid: int, g: Mapping[str, Any],
                   policy: HealthPolicy = HealthPolicy()) -> list[ReplicaHealth]:
    """Every voter and learner of group `gid` (record `g` of the view), leader first."""
    workers = st.get("workers") or {}
    lease = lease_ms(st)
    leader = g.get("leader")
    lrep = _report(workers.get(leader), gid) if leader else None
    # A leader's report speaks for the group only while it still leads this term.
    if lrep is not None and (lrep.get("role") != "leader" or lrep.get("term") != g.get("term")):
        lrep = None
    lead_seq = _int((lrep or {}).get("last_seq"))
    unheard = set((lrep or {}).get("unheard") or ())
    members = [(w, "voter") for w in g.get("voters") or ()] + [(w, "learner") for w in g.get("learners") or ()]
    members.sort(key=lambda m: m[0] != leader)
    out = []
    for wid, role in members:
        if wid == leader:
            role = "leader"
        w = workers.get(wid)
        rep = _report(w, gid)
        commit, applied = _int((rep or {}).get("commit")), _int((rep or {}).get("applied"))
        apply_lag = max(0, commit - applied) if commit is not None and applied is not None else None
        behind = max(0, lead_seq - commit) if lead_seq is not None and commit is not None else None
        silence = _int((rep or {}).get("leader_silence_ms"))
        state, why = "ok", ""
        if w is None:
            state, why = "unknown", "not a worker meta knows"
        elif w.get("live") is False and _not_heard_yet(st, w):
            led = _int(st.get("meta_leader_for_ms"))
            state, why = "unconfirmed", ("no heartbeat heard yet by the meta leader, which took over "
                                         + (f"{led} ms ago (within its first {lease} ms lease)" if led is not None
                                            else "recently (this meta does not say when)")
                                         + ": unknown, not down")
        elif w.get("live") is False:
            ago = _int(w.get("last_seen_ms_ago"))
            state, why = "down", (f"no heartbeat within the {lease} ms lease"
                                  + (f" (last {ago} ms ago)" if ago is not None
                                     else " (none since meta's leader started)"))
        elif w.get("report") is None:
            state, why = "silent", "live, but has sent no report of its groups yet"
        elif rep is None:
            state, why = "missing", "its worker does not report this group (not opened yet)"
        elif rep.get("state") == "corrupt":
            state, why = "corrupt", str(rep.get("error") or "corrupt at start-up")
        elif rep.get("failed") is not None:
            state, why = "failed", str(rep["failed"])
        elif rep.get("state") == "closed":
            state, why = "closed", "not opened"
        elif rep.get("resyncing"):
            state, why = "resyncing", "lost its log; catching up from a peer, neither votes nor leads"
        elif role == "leader" and not _leads(rep, g):
            # Meta names it, but its own report does not say it leads this term ready: a
            # leader that restarted holds the term as a follower (meta/controller.py
            # restarted_leader) and will never lead it; writes to the group fail meanwhile.
            state, why = "not-leading", _not_leading_why(rep, g)
        elif role == "leader" and rep.get("quorum") is False:
            state, why = "no-quorum", (f"no round trip with a majority of its voters for "
                                       f"{rep.get('no_quorum_ms') or 0} ms: refuses writes")
        elif role != "leader" and silence is not None and silence >= lease:
            state, why = "cut-off", f"has not heard from its leader for {silence} ms"
        elif role != "leader" and wid in unheard:
            state, why = "unheard", f"its leader {leader} has had no answer from it within the {lease} ms lease"
        elif (apply_lag or 0) > policy.max_lag or (role != "leader" and (behind or 0) > policy.max_lag):
            state, why = "lagging", f"applied {applied}, commit {commit}, leader's last seq {lead_seq}"
        out.append(ReplicaHealth(gid, wid, role, state, why, commit, applied, apply_lag, behind))
    return out


def _group_reasons(st: Mapping[str, Any], gid: int, g: Mapping[str, Any], op: Mapping[str, Any] | None,
                   reports: bool, policy: HealthPolicy) -> tuple[list[Reason], list[ReplicaHealth]]:
    subject = f"group {gid}"
    out: list[Reason] = []

    def add(v: Verdict, kind: str, why: str, worker: str | None = None) -> None:
        out.append(Reason(v, subject, kind, why, gid, worker))

    voters, learners, leader = list(g.get("voters") or ()), list(g.get("learners") or ()), g.get("leader")
    if leader is None:
        add(Verdict.RED, "no-leader", "no leader (the controller elects one once a voter is live)")
    elif not g.get("ready"):
        add(Verdict.RED, "not-ready",
            f"leader {leader} (term {g.get('term')}) has not finished its start-of-term round: writes wait", leader)
    rows = replica_health(st, gid, g, policy) if reports else []
    if rows:
        serving = [r for r in rows if r.role != "learner" and r.serving]
        need = _majority(len(voters))
        lead = next((r for r in rows if r.role == "leader"), None)
        # The group serves only through its leader: a leader that cannot serve (any state
        # but ok/lagging, including one whose own report does not say it leads) is red,
        # however many voters are fine.
        # Unconfirmed (not heard yet by a new meta leader) is unknown: neither red nor serving.
        lead_red = lead is not None and not lead.serving and lead.state != "unconfirmed"
        unknown = [r for r in rows if r.role != "learner" and r.state == "unconfirmed"]
        if lead is not None and lead_red:
            add(Verdict.RED, f"leader-{lead.state}", f"leader {lead.worker} {lead.state}: {lead.why}", lead.worker)
        elif len(serving) + len(unknown) < need:
            add(Verdict.RED, "no-quorum", f"{len(serving)} of {len(voters)} voters can serve; a quorum needs {need}")
        for r in rows:
            if r is lead and lead_red:
                continue
            if r.role == "learner":
                add(Verdict.YELLOW, "learner", f"learner {r.worker} catching up"
                                    + (f" ({r.state}: {r.why})" if r.state != "ok" else ""), r.worker)
            elif r.state != "ok":
                kind = "leader-unconfirmed" if r is lead and r.state == "unconfirmed" else f"replica-{r.state}"
                add(Verdict.YELLOW, kind, f"{r.role} {r.worker} {r.state}: {r.why}", r.worker)
    else:
        for wid in learners:
            add(Verdict.YELLOW, "learner", f"learner {wid} catching up", wid)
    rf = _rf(st, gid)
    if rf is not None and len(voters) < rf:
        add(Verdict.YELLOW, "under-replicated",
            f"under-replicated: {len(voters)} of {rf} voters ({','.join(voters) or '-'})")
    if op:
        msg = op.get("message") or ""
        add(Verdict.YELLOW, "operator", f"operator {op.get('kind')} {op.get('worker')} in progress: {op.get('step')}"
                            + (f": {msg}" if msg else ""), op.get("worker"))
    return out, rows


def _meta_reasons(st: Mapping[str, Any]) -> list[Reason]:
    """Meta's verdict, from meta's own Raft view where it has one: this host failing to
    reach a meta node says little about meta (a firewall, a route), while the meta
    leader's `has_quorum` and `peers` say whether meta itself holds a majority."""
    out: list[Reason] = []
    nodes = list(st.get("meta_nodes") or ())
    n = len(nodes)
    up = [x for x in nodes if x.get("up")]
    down = sorted(str(x.get("id")) for x in nodes if not x.get("up"))
    leader_id = st.get("meta_leader")
    lnode = next((x for x in nodes if x.get("id") == leader_id), None)
    if not leader_id:
        out.append(Reason(Verdict.RED, "meta", "meta-no-leader",
                          "no leader: no failover, placement change or registration can happen"))
        if down:
            out.append(_down_from_here(down, up, n))
        return out
    if lnode is not None and not lnode.get("up"):
        # The one node whose word on meta counts cannot be asked: nothing here says meta works.
        out.append(Reason(Verdict.RED, "meta", "meta-leader-unreachable",
                          f"the meta leader {leader_id} does not answer from here ({lnode.get('error') or 'no answer'});"
                          f" {len(up)} of {n} nodes answer"))
        others = [d for d in down if d != leader_id]
        if others:
            out.append(Reason(Verdict.YELLOW, "meta", "meta-node-unreachable",
                              f"{','.join(others)} unreachable from here too"))
        return out
    quorum = (lnode or {}).get("has_quorum")
    if not isinstance(quorum, bool):
        # No Raft view of the leader's to go by: what this host reaches is all there is.
        if down:
            out.append(_down_from_here(down, up, n))
        return out
    peers = (lnode or {}).get("peers") or {}
    connected = 1 + sum(1 for x in nodes if x.get("id") != leader_id and (peers.get(x.get("id")) or {}).get("connected"))
    if not quorum:
        out.append(Reason(Verdict.RED, "meta", "meta-no-majority",
                          f"the meta leader {leader_id} reports no quorum: connected to {connected} of {n} nodes "
                          "(itself included): a majority is needed"))
    lost = sorted(d for d in down if not (peers.get(d) or {}).get("connected"))
    hidden = sorted(d for d in down if (peers.get(d) or {}).get("connected"))
    if lost and quorum:
        spare = connected - _majority(n)
        out.append(Reason(Verdict.YELLOW, "meta", "meta-node-down",
                          f"{','.join(lost)} not answering, nor connected to the meta leader {leader_id}; {connected} "
                          f"of {n} connected (losing {spare + 1} more stops meta)"))
    if hidden:
        out.append(Reason(Verdict.YELLOW, "meta", "meta-node-unreachable",
                          f"{','.join(hidden)} unreachable from here, though connected to the meta leader {leader_id}"))
    return out


def _down_from_here(down: list[str], up: list[Mapping[str, Any]], n: int) -> Reason:
    spare = len(up) - _majority(n)
    tail = f" (losing {spare + 1} more stops meta)" if spare >= 0 else " (meta's own view of them is not known here)"
    return Reason(Verdict.YELLOW, "meta", "meta-node-unreachable",
                  f"{','.join(down)} unreachable from here; {len(up)} of {n} answer{tail}")


def software(rec: Mapping[str, Any]) -> str:
    """`version (digest prefix)` of a worker or gateway record: two processes that claim one
    version but run other code differ here. `?` for a version not said, `-` when neither is."""
    version, digest = rec.get("version") or "", rec.get("code_digest") or ""
    return f"{version or '?'} ({digest[:8]})" if digest else (version or "-")


def _in_service(w: Mapping[str, Any]) -> bool:
    """A worker whose build counts: not removed, not revoked."""
    return w.get("state") != "removed" and w.get("admission", "admitted") == "admitted"


def software_warnings(st: Mapping[str, Any]) -> list[str]:
    """One line when the workers and gateways in service do not all run the same build."""
    builds: dict[str, list[str]] = {}
    workers = {wid: w for wid, w in sorted((st.get("workers") or {}).items()) if _in_service(w)}
    for wid, w in workers.items():
        if w.get("version") or w.get("code_digest"):
            builds.setdefault(software(w), []).append(wid)
    for gw in st.get("gateways") or ():
        if gw.get("version") or gw.get("code_digest"):
            builds.setdefault(software(gw), []).append(str(gw.get("id")))
    out = []
    if len(builds) > 1:
        parts = "; ".join(f"{b} on {','.join(who)}" for b, who in sorted(builds.items(), key=lambda kv: -len(kv[1])))
        out.append(f"mixed software: {parts} (expected during a rolling upgrade; finish it)")
    # Meta nodes report a version but no code digest: they are compared by version alone.
    # The same workers as above: a removed or revoked one's old version is not what is served.
    served = {w.get("version") for w in workers.values() if w.get("version")}
    served |= {gw.get("version") for gw in st.get("gateways") or () if gw.get("version")}
    metas: dict[str, list[str]] = {}
    for node in st.get("meta_nodes") or ():
        if node.get("up") and node.get("version"):
            metas.setdefault(str(node["version"]), []).append(str(node.get("id")))
    if len(metas) > 1 or (metas and served and set(metas) != served):
        parts = "; ".join(f"{v} on {','.join(who)}" for v, who in sorted(metas.items()))
        out.append(f"mixed meta versions: {parts}; workers and gateways run {', '.join(sorted(served)) or '?'}")
    return out


def _idle_down_warnings(st: Mapping[str, Any]) -> list[str]:
    hosted = {w for g in (st.get("groups") or {}).values() for w in (*(g.get("voters") or ()),
                                                                        *(g.get("learners") or ()))}
    return [f"worker {wid} is not live (it hosts no replica)"
            for wid, w in sorted((st.get("workers") or {}).items())
            if w.get("live") is False and wid not in hosted and w.get("state") != "removed"
            and not _not_heard_yet(st, w)]


def assess(st: Mapping[str, Any], policy: HealthPolicy = HealthPolicy()) -> Health:
    """The verdict on a gathered status (see the module's docstring for the rules)."""
    reasons = _meta_reasons(st)
    groups: Mapping[Any, Mapping[str, Any]] = st.get("groups") or {}
    ops: Mapping[Any, Mapping[str, Any]] = st.get("operators") or {}
    reports = has_reports(st)
    if not groups:
        reasons.append(Reason(Verdict.RED, "topology", "no-groups",
                              "no groups: no topology applied, nothing is served" if not st.get("topology")
                              else "no groups placed"))
    elif not reports:
        reasons.append(Reason(Verdict.YELLOW, "replicas", "reports-unknown",
                              "health unknown: this view did not come from the meta leader, which alone holds "
                              "the workers' reports"))
    replicas: list[ReplicaHealth] = []
    for key, g in sorted(groups.items(), key=lambda kv: int(kv[0])):
        gid = int(key)
        op = ops.get(str(gid)) or ops.get(gid)  # type: ignore[call-overload]
        rs, rows = _group_reasons(st, gid, g, op, reports, policy)
        reasons.extend(rs)
        replicas.extend(rows)
    verdict = max((r.verdict for r in reasons), key=lambda v: v.rank, default=Verdict.GREEN)
    return Health(verdict, tuple(reasons), tuple(software_warnings(st) + _idle_down_warnings(st)), tuple(replicas),
                  reports)


def render_health(h: Health) -> list[str]:
    """The verdict line, then why: red reasons before yellow ones, then warnings."""
    if h.verdict is Verdict.GREEN:
        lines = ["green: every group has a ready leader and its voters in sync"]
    else:
        n = {v: sum(1 for r in h.reasons if r.verdict is v) for v in (Verdict.RED, Verdict.YELLOW)}
        lines = [f"{h.verdict.value}: " + ", ".join(f"{k} {v.value}" for v, k in n.items() if k)
                 + f" reason{'s' if len(h.reasons) != 1 else ''}"]
    for r in sorted(h.reasons, key=lambda r: -r.verdict.rank):
        lines.append(f"  {r.verdict.value:<7} {r.line()}")
    lines.extend(f"  warning {w}" for w in h.warnings)
    return lines


def progress_key(h: Health) -> tuple[str, tuple[tuple[str, str, str, str], ...]]:
    """What `--wait-for` prints again only when it changes: the verdict and which rules hold for what,
    not the numbers in their text (a lag or a snapshot's bytes would print a line every poll)."""
    return h.verdict.value, tuple(sorted((r.verdict.value, r.subject, r.kind, r.worker or "") for r in h.reasons))

