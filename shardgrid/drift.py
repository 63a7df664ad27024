"""Drift: where a live group differs from the placement a topology file pins. Pure functions.

A file with `groups:` declares each group's replicas and leader, but the
controller may move a group away from them: repair replaces a gone voter,
drain replaces a draining one, `topoctl replicas` and `topoctl transfer`
edit the placement (availability before obedience: a group is kept at its
replication factor even where that means a worker the file does not name).
Each of those edits the group's `desired` placement in meta, so reconcile
keeps the controller's choice until the file is applied again.

`drift(file, view)` compares, group by group, the file's replicas and leader
with meta's view (voters, learners, leader, `desired`, `preferred_leader`,
operators, worker states) and says what differs and, when the view tells,
why. `topoctl status` shows it for the applied file; `topoctl apply
--dry-run` for the file about to be applied, with `move_back` saying what
applying it would move (and what would wait for a worker that cannot take a
replica now). Groups placed automatically (no `groups:`) have no declared
placement and never drift.

Inputs are plain data: `file` is `Topology.to_dict()` (the applied one is the
view's `topology`), `view` is `GET /v1/cluster` (group and operator ids may
be ints or strings).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Worker states that say why a worker is not where the file puts it.
LEAVING = ("removed", "draining", "drained")
# What moved a replica off a worker in each state (repair for a gone one, drain for a leaving one).
_MOVED_BY = {"removed": "repaired onto", "not live": "repaired onto", "unknown to meta": "repaired onto",
             "draining": "drained onto", "drained": "drained onto"}


@dataclass(frozen=True)
class GroupDrift:
    group: int
    file_replicas: tuple[str, ...]
    file_leader: str
    voters: tuple[str, ...]
    learners: tuple[str, ...]
    leader: str | None
    desired: tuple[str, ...]  # the controller's target; () when meta has none recorded
    preferred_leader: str | None
    why: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "line": render_drift(self)}


def pinned_groups(file: Mapping[str, Any] | None) -> dict[int, tuple[tuple[str, ...], str]]:
    """{group id: (replicas, leader)} the file declares; {} when it places groups
    automatically. A stored copy without `groups_explicit` predates the flag:
    its groups are compared as written."""
    if not file or not file.get("groups_explicit", True):
        return {}
    return {int(g["id"]): (tuple(g["replicas"]), str(g["leader"])) for g in file.get("groups") or []}


def worker_note(wid: str, workers: Mapping[str, Any]) -> str | None:
    """Why `wid` may not hold a replica now, from meta's view; None when nothing says so."""
    w = workers.get(wid)
    if w is None:
        return "unknown to meta"
    if w.get("state") in LEAVING:
        return str(w["state"])
    if w.get("live") is False:  # None: a meta follower's view, which cannot tell
        return "not live"
    return None


def _by_id(items: Mapping[Any, Any] | None, gid: int) -> Any:
    items = items or {}
    return items.get(str(gid), items.get(gid))


def _pairs(missing: Sequence[str], extra: Sequence[str]) -> list[tuple[str | None, str | None]]:
    """(file's worker, live worker in its place), in order; None where one side ran out."""
    n = max(len(missing), len(extra))
    return [(missing[i] if i < len(missing) else None, extra[i] if i < len(extra) else None) for i in range(n)]


def _why(pin: tuple[tuple[str, ...], str], g: Mapping[str, Any], op: Mapping[str, Any] | None,
         workers: Mapping[str, Any]) -> list[str]:
    replicas, file_leader = pin
    voters, desired = list(g["voters"]), list(g.get("desired") or [])
    out: list[str] = []
    missing = [w for w in replicas if w not in voters]
    extra = [w for w in voters if w not in replicas]
    for gone, took in _pairs(missing, extra):
        note = worker_note(gone, workers) if gone is not None else None
        if gone is not None and took is not None:
            out.append(f"{gone} {note}: {_MOVED_BY.get(note, 'replaced by')} {took}" if note
                       else f"{gone} replaced by {took}")
        elif gone is not None:
            out.append(f"{gone} {note or 'not a voter'}")
        elif took is not None:
            out.append(f"{took} not in the file")
    if op is not None:
        out.append(f"{op['kind']} {op['worker']} in progress ({op['step']})")
    if desired and sorted(desired) != sorted(replicas):
        out.append(f"the controller keeps {','.join(desired)} until the file is applied again")
    elif desired and op is None:
        waiting = [w for w in missing if worker_note(w, workers)]
        if waiting:
            out.append(f"the controller waits for {','.join(waiting)} to move it back")
    leader, preferred = g.get("leader"), g.get("preferred_leader")
    if preferred and preferred != file_leader:
        # An operator's transfer pins its choice; the balancing rules do not.
        why = "topoctl transfer" if g.get("leader_pinned", True) else "leader balancing"
        out.append(f"preferred leader {preferred} ({why})")
    elif leader != file_leader and file_leader in voters:
        note = worker_note(file_leader, workers)
        out.append(f"{file_leader} {note}" if note else
                   f"leader balance moves it back to {file_leader} once {file_leader} is caught up")
    return out


def drift(file: Mapping[str, Any] | None, view: Mapping[str, Any]) -> list[GroupDrift]:
    """Every group the file pins whose live placement, leader or controller
    target differs from the file, in group order."""
    workers = view.get("workers") or {}
    out: list[GroupDrift] = []
    for gid, pin in sorted(pinned_groups(file).items()):
        g = _by_id(view.get("groups"), gid)
        if g is None:
            continue  # not created yet: the plan creates it as the file says
        replicas, file_leader = pin
        desired = tuple(g.get("desired") or ())
        differs = (sorted(g["voters"]) != sorted(replicas) or bool(g["learners"]) or g.get("leader") != file_leader
                   or (bool(desired) and sorted(desired) != sorted(replicas))
                   or (g.get("preferred_leader") or file_leader) != file_leader)
        if not differs:
            continue
        op = _by_id(view.get("operators"), gid)
        out.append(GroupDrift(group=gid, file_replicas=replicas, file_leader=file_leader,
                              voters=tuple(g["voters"]), learners=tuple(g["learners"]), leader=g.get("leader"),
                              desired=desired, preferred_leader=g.get("preferred_leader"),
                              why=tuple(_why(pin, g, op, workers))))
    return out


def render_drift(d: GroupDrift) -> str:
    """`group 1: file w1,w2,w3; live w1,w2,w4 (w3 removed: repaired onto w4; ...)`: the
    leaders are shown when they differ, the learners when there are any."""
    leader_differs = d.leader != d.file_leader
    file = ",".join(d.file_replicas) + (f" leader {d.file_leader}" if leader_differs else "")
    live = ",".join(d.voters) + (f" learners {','.join(d.learners)}" if d.learners else "") + \
        (f" leader {d.leader or '-'}" if leader_differs else "")
    why = f" ({'; '.join(d.why)})" if d.why else ""
    return f"group {d.group}: file {file}; live {live}{why}"


def move_back(d: GroupDrift, workers: Mapping[str, Any]) -> list[str]:
    """What applying the file would move for group `d`, one line each in the
    plan's style: `~ group 1: replica w4 -> w3`, or `... waits for w3 (not live)`
    when reconcile cannot add w3 now (then it removes nothing either, and the
    group keeps its replicas)."""
    def blocked(wid: str) -> str | None:
        note = worker_note(wid, workers)
        if note == "removed":
            # Applying the file makes a worker it declares (every replica it
            # names) active again: only liveness holds a removed one back.
            return "not live" if (workers.get(wid) or {}).get("live") is False else None
        return note

    lines: list[str] = []
    missing = [w for w in d.file_replicas if w not in d.voters]
    extra = [w for w in d.voters if w not in d.file_replicas]
    for want, have in _pairs(missing, extra):
        if want is None:
            lines.append(f"- group {d.group}: remove replica {have}")
            continue
        move = f"replica {have} -> {want}" if have is not None else f"add replica {want}"
        note = blocked(want)
        lines.append(f"~ group {d.group}: {move}" + (f" waits for {want} ({note}); the group keeps "
                                                      f"{','.join(d.voters)} meanwhile" if note else ""))
    if not lines and d.desired and sorted(d.desired) != sorted(d.file_replicas):
        lines.append(f"~ group {d.group}: desired {','.join(d.desired)} -> {','.join(d.file_replicas)} "
                     "(the controller's target back to the file)")
    if d.leader != d.file_leader:
        note = blocked(d.file_leader)
        then = f" waits for {d.file_leader} ({note})" if note else \
            f" once {d.file_leader} is a caught-up voter (leader balance)"
        lines.append(f"~ group {d.group}: leader {d.leader or '-'} -> {d.file_leader}{then}")
    return lines


def render_apply_drift(file: Mapping[str, Any], view: Mapping[str, Any]) -> list[str]:
    """`topoctl apply --dry-run`'s drift section: each group of `file` that the
    live cluster has elsewhere, and what applying the file would move back
    (or wait for). Empty when nothing drifts."""
    drifted = drift(file, view)
    if not drifted:
        return []
    lines = ["drift: the live cluster differs from this file's groups (applying it steers them back):"]
    for d in drifted:
        lines.append(f"  {render_drift(d)}")
        lines.extend(f"    {line}" for line in move_back(d, view.get("workers") or {}))
    return lines
