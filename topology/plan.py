"""The plan: the ordered actions that turn the current groups into the desired ones.

Order: every group creation first (by group id); then, group by group in id
order, replica additions, then the leader move, then replica removals. So a
group never has fewer replicas than it should at any step, and its leader
is moved (to a worker that is a replica by then) before it can be removed.
Groups present in `current` but absent from `desired` are ignored: the
number of shards is fixed on a live cluster (the loader refuses changes).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from topology.model import GroupSpec


@dataclass(frozen=True)
class CreateGroup:
    group: int
    replicas: tuple[str, ...]
    leader: str


@dataclass(frozen=True)
class AddReplica:
    group: int
    worker: str


@dataclass(frozen=True)
class RemoveReplica:
    group: int
    worker: str


@dataclass(frozen=True)
class MoveLeader:
    group: int
    from_worker: str
    to_worker: str


Action = CreateGroup | AddReplica | RemoveReplica | MoveLeader

_KINDS: dict[type, str] = {
    CreateGroup: "create_group",
    AddReplica: "add_replica",
    RemoveReplica: "remove_replica",
    MoveLeader: "move_leader",
}


def _by_id(groups: Sequence[GroupSpec], name: str) -> dict[int, GroupSpec]:
    out: dict[int, GroupSpec] = {}
    for g in groups:
        if g.id in out:
            raise ValueError(f"{name}: group {g.id} appears twice")
        out[g.id] = g
    return out


def plan(current: Sequence[GroupSpec], desired: Sequence[GroupSpec]) -> list[Action]:
    cur = _by_id(current, "current")
    want = _by_id(desired, "desired")
    actions: list[Action] = []
    for gid in sorted(want):
        if gid not in cur:
            g = want[gid]
            actions.append(CreateGroup(group=gid, replicas=tuple(g.replicas), leader=g.leader))
    for gid in sorted(want):
        if gid not in cur:
            continue
        have, goal = cur[gid], want[gid]
        have_set, goal_set = set(have.replicas), set(goal.replicas)
        actions.extend(AddReplica(group=gid, worker=w) for w in sorted(goal_set - have_set))
        if have.leader != goal.leader:
            actions.append(MoveLeader(group=gid, from_worker=have.leader, to_worker=goal.leader))
        actions.extend(RemoveReplica(group=gid, worker=w) for w in sorted(have_set - goal_set))
    return actions


def render_action(a: Action) -> str:
    if isinstance(a, CreateGroup):
        return f"+ create group {a.group}: replicas {','.join(a.replicas)} leader {a.leader}"
    if isinstance(a, AddReplica):
        return f"+ group {a.group}: add replica {a.worker}"
    if isinstance(a, RemoveReplica):
        return f"- group {a.group}: remove replica {a.worker}"
    if isinstance(a, MoveLeader):
        return f"~ group {a.group}: move leader {a.from_worker} -> {a.to_worker}"
    raise TypeError(f"not a plan action: {a!r}")


def render_plan(actions: Sequence[Action]) -> str:
    """One line per action (no trailing newline); "no changes" when empty."""
    if not actions:
        return "no changes"
    return "\n".join(render_action(a) for a in actions)


def other_changes(current: dict[str, Any] | None, desired: dict[str, Any]) -> list[str]:
    """What else the file changes besides groups, one line each: settings,
    workers joining or leaving the file, and any other top-level field (so a
    file that changes something is never shown as "no changes")."""
    if current is None:
        return []
    lines: list[str] = []
    old_s, new_s = current.get("settings") or {}, desired.get("settings") or {}
    for key in sorted(set(old_s) | set(new_s)):
        if old_s.get(key) != new_s.get(key):
            lines.append(f"~ settings.{key}: {old_s.get(key)} -> {new_s.get(key)}")
    old_w = {w["id"]: w for w in current.get("workers") or []}
    new_w = {w["id"]: w for w in desired.get("workers") or []}
    for wid in sorted(set(new_w) - set(old_w)):
        lines.append(f"+ worker {wid} ({new_w[wid]['http']}, zone {new_w[wid]['zone']})")
    for wid in sorted(set(old_w) - set(new_w)):
        lines.append(f"- worker {wid} (leaves the file; its replicas move to the placement above)")
    for wid in sorted(set(old_w) & set(new_w)):
        if old_w[wid] != new_w[wid]:
            lines.append(f"~ worker {wid}: {old_w[wid]['http']}, zone {old_w[wid]['zone']} -> "
                         f"{new_w[wid]['http']}, zone {new_w[wid]['zone']}")
    old_m = {m["name"] for m in current.get("models") or []}
    for m in desired.get("models") or []:
        if m["name"] not in old_m:
            ranges = ", ".join(f"{g['id']}: {g['first']}-{g['last']}" for g in m["groups"])
            lines.append(f"+ model {m['name']} ({m['layers']} layers, d_model {m['d_model']}; groups {ranges})")
    for key in sorted(set(current) | set(desired)):
        if key not in ("settings", "workers", "groups", "groups_explicit", "models") \
                and current.get(key) != desired.get(key):
            lines.append(f"~ {key} changed")
    return lines


def action_to_dict(a: Action) -> dict[str, Any]:
    kind = _KINDS.get(type(a))
    if kind is None:
        raise TypeError(f"not a plan action: {a!r}")
    if isinstance(a, CreateGroup):
        return {"kind": kind, "group": a.group, "replicas": list(a.replicas), "leader": a.leader}
    if isinstance(a, MoveLeader):
        return {"kind": kind, "group": a.group, "from_worker": a.from_worker, "to_worker": a.to_worker}
    return {"kind": kind, "group": a.group, "worker": a.worker}


def action_from_dict(d: dict[str, Any]) -> Action:
    """Inverse of `action_to_dict` (e.g. for topoctl rendering a plan meta sent)."""
    kind = d.get("kind")
    if kind == "create_group":
        return CreateGroup(group=d["group"], replicas=tuple(d["replicas"]), leader=d["leader"])
    if kind == "add_replica":
        return AddReplica(group=d["group"], worker=d["worker"])
    if kind == "remove_replica":
        return RemoveReplica(group=d["group"], worker=d["worker"])
    if kind == "move_leader":
        return MoveLeader(group=d["group"], from_worker=d["from_worker"], to_worker=d["to_worker"])
    raise ValueError(f"unknown plan action kind {kind!r}")
