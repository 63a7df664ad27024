"""Automatic placement of shard groups on workers (used when `groups:` is absent).

Goals, in priority order:
1. every group has `rf` replicas on distinct workers;
2. zone spread: a group's replicas span min(rf, zones) zones, and its
   replicas are split as evenly over those zones as zone sizes allow (with
   rf=5 over 3 zones: 2+2+1, so losing any one zone keeps a quorum);
3. replica balance: per-worker replica counts differ by at most one. This is
   guaranteed when all zones have the same number of workers (or there is a
   single zone); with lopsided zones, spread wins over balance (a lone
   worker in its own zone carries more) and the balance is best effort;
4. leader balance: each worker leads floor or ceil(shards / workers) groups
   whenever the replica sets allow it (found by augmenting paths, so it is
   exact, not a heuristic).

The result is a pure function of the *set* of workers (order in the file does
not matter), `shards` and `rf`. It does not minimise movement relative to an
existing placement: adding a worker to an auto-placed cluster can re-place
many groups. Operators who want controlled moves write `groups:` explicitly.
"""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from fractions import Fraction

from topology.model import GroupSpec, WorkerSpec


def natural_key(s: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders "w2" before "w10"."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", s) if part)


def place_groups(workers: Sequence[WorkerSpec], shards: int, rf: int) -> tuple[GroupSpec, ...]:
    ids = [w.id for w in workers]
    if len(set(ids)) != len(ids):
        raise ValueError("worker ids must be unique")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if not 1 <= rf <= len(workers):
        raise ValueError(f"rf must be in 1..{len(workers)} (the number of workers), got {rf}")

    ordered = sorted(workers, key=lambda w: natural_key(w.id))
    rank = {w.id: i for i, w in enumerate(ordered)}
    zones: dict[str, list[str]] = {}
    for w in ordered:
        zones.setdefault(w.zone, []).append(w.id)
    zone_names = sorted(zones, key=natural_key)
    zone_total = {z: 0 for z in zone_names}
    load = {w.id: 0 for w in ordered}
    leads = {w.id: 0 for w in ordered}

    members_of: list[list[str]] = []
    leader_of: list[str] = []
    for _ in range(shards):
        # Decide how many replicas each zone gets (water filling): the zone
        # with the fewest replicas of this group first, so spread is maximal
        # and even; among equals, the zone whose workers carry the least.
        count = {z: 0 for z in zone_names}
        for _slot in range(rf):
            z = min(
                (z for z in zone_names if count[z] < len(zones[z])),
                key=lambda z: (count[z], Fraction(zone_total[z] + 1, len(zones[z]))),
            )
            count[z] += 1
            zone_total[z] += 1
        members: list[str] = []
        for z in zone_names:
            # Least-loaded first keeps loads inside a zone within one of each other.
            picked = sorted(zones[z], key=lambda wid: (load[wid], leads[wid], rank[wid]))[: count[z]]
            members.extend(picked)
        for wid in members:
            load[wid] += 1
        leader = min(members, key=lambda wid: (leads[wid], load[wid], rank[wid]))
        leads[leader] += 1
        members_of.append(members)
        leader_of.append(leader)

    _balance_leaders(members_of, leader_of, leads, [w.id for w in ordered], rank)
    return tuple(
        GroupSpec(id=g, leader=leader_of[g], replicas=tuple(sorted(members_of[g]))) for g in range(shards)
    )


def _balance_leaders(
    members_of: list[list[str]],
    leader_of: list[str],
    leads: dict[str, int],
    order: list[str],
    rank: dict[str, int],
) -> None:
    """Move leaderships (in place) until every worker leads floor..ceil(S/N) groups.

    A leadership moves along a path w0 -> w1 -> ... -> wk where w(i+1) is a
    replica of a group led by w(i): each hop hands that group to the next
    worker, so only the two ends change their count. This is the augmenting
    path of bipartite b-matching: when no path exists, no choice of leaders
    within these replica sets does better for that worker.
    """
    shards, n = len(leader_of), len(order)
    lo, hi = shards // n, -(-shards // n)
    for w in order:
        while leads[w] > hi:
            hops = _find_hops(w, lambda x: leads[x] < hi, members_of, leader_of, rank, push=True)
            if hops is None:
                break
            _apply_hops(hops, leader_of, leads)
    for w in order:
        while leads[w] < lo:
            hops = _find_hops(w, lambda x: leads[x] > lo, members_of, leader_of, rank, push=False)
            if hops is None:
                break
            _apply_hops(hops, leader_of, leads)


def _find_hops(
    start: str,
    is_end: Callable[[str], bool],
    members_of: list[list[str]],
    leader_of: list[str],
    rank: dict[str, int],
    *,
    push: bool,
) -> list[tuple[int, str]] | None:
    """Breadth-first search for a shortest path; returns (group, new leader) hops.

    push: `start` gives one leadership away and the end worker receives one;
    otherwise (pull) `start` receives one and the end worker gives one away.
    """
    led: dict[str, list[int]] = {}
    hosts: dict[str, list[int]] = {}
    for gid, members in enumerate(members_of):
        led.setdefault(leader_of[gid], []).append(gid)
        for m in members:
            hosts.setdefault(m, []).append(gid)
    # prev[x] = (y, gid): the hop between x and y goes through group gid.
    prev: dict[str, tuple[str, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        x = queue.popleft()
        if x != start and is_end(x):
            hops: list[tuple[int, str]] = []
            cur = x
            while (step := prev[cur]) is not None:
                y, gid = step
                # push: y led gid and hands it to cur; pull: cur led gid and hands it to y.
                hops.append((gid, cur if push else y))
                cur = y
            return hops
        if push:
            nexts = [(y, gid) for gid in led.get(x, ()) for y in members_of[gid] if y != x]
        else:
            nexts = [(leader_of[gid], gid) for gid in hosts.get(x, ()) if leader_of[gid] != x]
        for y, gid in sorted(nexts, key=lambda t: (rank[t[0]], t[1])):
            if y not in prev:
                prev[y] = (x, gid)
                queue.append(y)
    return None


def _apply_hops(hops: list[tuple[int, str]], leader_of: list[str], leads: dict[str, int]) -> None:
    for gid, new_leader in hops:
        leads[leader_of[gid]] -= 1
        leads[new_leader] += 1
        leader_of[gid] = new_leader
