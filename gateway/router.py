"""The gateway's routing table and its retry/deadline policy, as pure code.

Nothing here touches a socket or the event loop: `RoutingTable` is built from
the cluster view meta serves at `GET /v1/cluster`, and the policy functions
decide, from numbers and error codes, what the forwarding loop
(`gateway/forward.py`) does next. That keeps every decision unit-testable.

Routing: entity -> shard = `shard_for(id, S)`; group id == shard id; writes and
strong reads go to the group's leader, follower reads to any live replica.

Leader hints. A worker that refuses with `not_leader` names the leader it
believes in, at its term. The hint is kept next to the table (see
`effective_leader`) and wins while its term is at least the table's term for
the group: during a graceful transfer the old leader names the target at the
*current* term, before meta has written the next one, and that is exactly the
worker to try. A view with a newer term for the group makes the hint stale.

Deadline policy. Every request has one budget (`x-deadline-ms`, default the
topology's `settings.deadline_ms`). Each attempt gets the remaining budget
minus `RESPONSE_MARGIN_S` (time kept to write the answer), and the worker is
told a deadline `WORKER_MARGIN_S` shorter still, so that it answers with a
definite code (`quorum_timeout`) before our HTTP timeout cuts the connection.
When less than `MIN_ATTEMPT_S` remains nothing more is tried and the gateway
answers at once (`give_up`):

* a write that may have been applied (an attempt timed out, the connection
  broke after sending, or a worker said `quorum_timeout`) -> 504
  `quorum_timeout`: outcome unknown, retry with the same `x-request-id`;
* a read whose attempt timed out -> 504 `deadline_exceeded`;
* otherwise nothing was applied (no leader, connection refused, `not_leader`,
  `unavailable`) -> 503 `unavailable` with `retry-after`.

A leader that refuses with `unavailable` for `no_quorum` (check-quorum: it
cannot reach a majority of its group) is the one refusal that waiting does
not cure within a request: meta moves the leadership a lease or more later,
or never (a majority lost). So the request goes to the new leader if meta
has named one already, and otherwise gets that answer at once (`give_up`,
with `reason: no_quorum`) instead of a 503 or 504 at its deadline.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable

from gateway.layer_route import RangeGroup
from shardgrid.common.wire import ApiError
from topology.routing import shard_for

# -- deadline arithmetic ---------------------------------------------------------------

RESPONSE_MARGIN_S = 0.010  # kept back from the budget to write the answer to the client
WORKER_MARGIN_S = 0.005  # the worker's deadline ends this much before our HTTP timeout
MIN_ATTEMPT_S = 0.004  # less than this left for an attempt: it cannot succeed, stop
BACKOFF_FIRST_S = 0.005
BACKOFF_MAX_S = 0.100
RETRY_AFTER_S = 1  # the `retry-after` of gateway 503s (whole seconds, as HTTP wants)
DEFAULT_DEADLINE_MS = 5000  # before the first routing table names settings.deadline_ms
NO_QUORUM = "no_quorum"  # the `reason` of a worker's `unavailable` from check-quorum


@dataclass(frozen=True, slots=True)
class AttemptBudget:
    http_timeout_s: float  # the whole HTTP exchange with the worker
    worker_deadline_ms: int  # what the worker is told (`deadline_ms` in the body)


def attempt_budget(remaining_s: float) -> AttemptBudget | None:
    """The budget of the next attempt, or None when there is no time left for one."""
    http = remaining_s - RESPONSE_MARGIN_S
    if http < MIN_ATTEMPT_S:
        return None
    worker_ms = max(1, int((http - WORKER_MARGIN_S) * 1000))
    return AttemptBudget(http, worker_ms)


def backoff_s(retries: int, remaining_s: float) -> float:
    """Pause before retry number `retries` (0-based): exponential, capped, within budget."""
    pause = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * (1 << min(retries, 10)))
    return max(0.0, min(pause, remaining_s - RESPONSE_MARGIN_S - MIN_ATTEMPT_S))


# -- reply policy ---------------------------------------------------------------------------


class Next(enum.Enum):
    DONE = "done"  # hand this answer to the client
    RETRY = "retry"  # retry at once (same request id)
    BACKOFF = "backoff"  # pause (or until the table changes), then retry
    REFRESH = "refresh"  # ask meta for a fresh view, pause, then retry
    GIVE_UP = "give_up"  # stop now with the gateway's own answer (`give_up`)


def after_reply(code: str | None, write: bool, hinted_other: bool, reason: str | None = None,
                moved: bool = False) -> Next:
    """What to do with a worker's answer (`code` None = success).

    `hinted_other`: a `not_leader` named a worker other than the one we asked,
    so retrying at once goes somewhere new; naming itself means "leading soon".
    `reason`: the error's reason; `moved`: the table names another leader (or
    a newer term) than the worker that answered.

    `overloaded` (the group's queue on that worker, or the gateway's stream
    to it, is full; nothing was queued) is the answer, at once: only that
    leader can take the request, and retrying it there within the deadline
    adds load where there is too much already. The client gets the 503 with
    `retry-after`. (A follower read moves on to another replica first:
    `Forwarder._run`.)
    """
    if code is None:
        return Next.DONE
    if code == "not_leader":
        return Next.RETRY if hinted_other else Next.BACKOFF
    if code == "quorum_timeout" and write:
        return Next.RETRY  # same rid: the worker's dedup makes it apply once
    if code == "deadline_exceeded" and not write:
        return Next.RETRY
    if code == "unavailable":
        if reason == NO_QUORUM:
            return Next.RETRY if moved else Next.GIVE_UP
        return Next.REFRESH  # the group failed or is shutting down on that worker
    return Next.DONE  # 4xx and anything else are the answer


@dataclass(slots=True)
class RetryState:
    """What the attempts of one request (or one shard of a batch) have learned."""

    attempts: int = 0
    retries: int = 0
    maybe_applied: bool = False  # some write attempt's outcome is unknown
    timed_out: bool = False  # some read attempt ran out of time
    last_problem: str = "no attempt was possible"
    last_term: int | None = None
    last_leader: str | None = None
    last_reason: str | None = None  # of the last refusal, when it gave one


def give_up(state: RetryState, write: bool, shard: int | None) -> ApiError:
    """The gateway's own answer when the budget is spent (see the module docstring)."""
    ctx: dict[str, Any] = {"shard": shard, "term": state.last_term, "leader": state.last_leader,
                           "attempts": state.attempts, "reason": state.last_reason}
    if write and state.maybe_applied:
        return ApiError("quorum_timeout", "the write was not acknowledged within the deadline; its outcome is "
                        f"unknown: retry with the same x-request-id ({state.last_problem})", **ctx)
    if not write and state.timed_out:
        return ApiError("deadline_exceeded", f"no answer within the deadline ({state.last_problem})", **ctx)
    if state.last_reason == NO_QUORUM:
        return ApiError("unavailable", f"nothing was applied: shard {shard}'s leader {state.last_leader} cannot reach a "
                        "majority of its replicas (no quorum); meta moves the leadership when the other replicas can "
                        "form one: retry later", **ctx)
    return ApiError("unavailable", "nothing was applied: no leader could take the request within the "
                    f"deadline ({state.last_problem}); retry later", **ctx)


# -- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """A worker to call: its id, base URL and (for leaders) the term it leads."""

    wid: str
    base: str  # "http://host:port" (https with TLS)
    term: int = 0


@dataclass(frozen=True, slots=True)
class WorkerRoute:
    id: str
    addr: str
    base: str
    zone: str | None
    state: str | None
    live: bool | None  # None: the meta node that served the view does not know (not its leader)


@dataclass(frozen=True, slots=True)
class GroupRoute:
    id: int
    term: int
    leader: str | None
    ready: bool
    voters: tuple[str, ...]
    learners: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Hint:
    """A worker's `not_leader` answer: who it says leads, at which term."""

    term: int
    leader: str


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """A model the topology declares: its shape and the layer ranges of its groups."""

    name: str
    layers: int
    d_model: int
    groups: tuple[RangeGroup, ...]


@dataclass(frozen=True)
class RoutingTable:
    revision: int
    shards: int  # 0 = no topology applied yet
    deadline_ms: int
    embedding_dim: int
    ack: str
    groups: dict[int, GroupRoute]
    workers: dict[str, WorkerRoute]
    view: dict[str, Any] = field(repr=False, compare=False)  # what meta sent, for /cluster/*
    models: dict[str, ModelRoute] = field(default_factory=dict)

    @classmethod
    def from_view(cls, view: dict[str, Any], url_scheme: str = "http") -> "RoutingTable":
        topo = view.get("topology") or {}
        settings = topo.get("settings") or {}
        workers: dict[str, WorkerRoute] = {}
        for wid, w in (view.get("workers") or {}).items():
            addr = str(w.get("addr", ""))
            base = addr if addr.startswith("http") else f"{url_scheme}://{addr}"
            live = w.get("live")
            workers[str(wid)] = WorkerRoute(str(wid), addr, base, w.get("zone"), w.get("state"),
                                            live if isinstance(live, bool) else None)
        groups: dict[int, GroupRoute] = {}
        for key, g in (view.get("groups") or {}).items():
            gid = int(key)  # JSON object keys are strings
            groups[gid] = GroupRoute(gid, int(g.get("term", 0)), g.get("leader"), bool(g.get("ready", False)),
                                     tuple(g.get("voters") or ()), tuple(g.get("learners") or ()))
        return cls(
            revision=int(view.get("revision", 0)),
            shards=int(topo.get("shards", 0) or 0),
            deadline_ms=int(settings.get("deadline_ms", DEFAULT_DEADLINE_MS)),
            embedding_dim=int(settings.get("embedding_dim", 64)),
            ack=str(settings.get("ack", "quorum")),
            groups=groups,
            workers=workers,
            view=view,
            models={str(m["name"]): ModelRoute(str(m["name"]), int(m["layers"]), int(m["d_model"]),
                                               tuple(RangeGroup(int(g["id"]), int(g["first"]), int(g["last"]))
                                                     for g in m["groups"]))
                    for m in topo.get("models") or ()},
        )

    def shard_for(self, entity_id: str) -> int:
        return shard_for(entity_id, self.shards)

    def target(self, wid: str | None, term: int = 0) -> Target | None:
        w = self.workers.get(wid) if wid is not None else None
        return Target(w.id, w.base, term) if w is not None and w.addr else None

    def leader_target(self, gid: int, hint: Hint | None = None) -> Target | None:
        g = self.groups.get(gid)
        if g is None:
            return None
        leader, term = effective_leader(g, hint)
        return self.target(leader, term)

    def replica_targets(self, gid: int) -> tuple[Target, ...]:
        """Every replica of the group a follower read may use: voters then learners,
        skipping workers meta reports dead (unknown liveness counts as live)."""
        g = self.groups.get(gid)
        if g is None:
            return ()
        out = []
        for wid in (*g.voters, *g.learners):
            w = self.workers.get(wid)
            if w is not None and w.addr and w.live is not False:
                out.append(Target(w.id, w.base, g.term))
        return tuple(out)

    def groups_without_ready_leader(self) -> list[int]:
        ids = set(range(self.shards)) | set(self.groups)
        return sorted(gid for gid in ids
                      if gid not in self.groups or not self.groups[gid].ready or self.groups[gid].leader is None)


def effective_leader(group: GroupRoute, hint: Hint | None) -> tuple[str | None, int]:
    """(leader, term) to use: the hint while it is not older than the table's term."""
    if hint is not None and hint.term >= group.term:
        return hint.leader, hint.term
    return group.leader, group.term


def accept_hint(group: GroupRoute | None, current: Hint | None, leader: Any, term: Any) -> Hint | None:
    """The hint to keep after a `not_leader` naming `leader` at `term` (None: keep `current`).

    A hint without a term (a worker that does not host the group answers from
    its own meta view) counts as the table's term. Hints older than what we
    know are dropped: a stale replica must not send us backwards.
    """
    if group is None or not isinstance(leader, str) or not leader:
        return None
    t = term if isinstance(term, int) and not isinstance(term, bool) else group.term
    if t < group.term or (current is not None and t < current.term):
        return None
    return Hint(t, leader)


def prune_hints(hints: dict[int, Hint], table: RoutingTable) -> dict[int, Hint]:
    """Hints still worth keeping under a new table (a newer term makes them stale)."""
    return {gid: h for gid, h in hints.items() if gid in table.groups and h.term >= table.groups[gid].term}


# -- search merge ---------------------------------------------------------------------------------------


def merge_top_k(per_group: Iterable[list[dict[str, Any]]], k: int) -> list[dict[str, Any]]:
    """The k best hits over all groups: score descending, then id ascending.

    Each group already answered its own top k with the same order, so the
    global top k is among them; a plain sort of at most S*k hits is enough.
    """
    hits = [h for hits in per_group for h in hits]
    hits.sort(key=lambda h: (-h["score"], h["id"]))
    return hits[:k]
