"""The gateway's inference route runner (gateway/models.py) against stub workers."""
from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest

from gateway.forward import AttemptFailed, Trace, WorkerReply, reply_from
from gateway.models import SUSPECT_S, ModelApi
from gateway.router import RoutingTable, Target
from shardgrid.common.wire import ApiError, error_body
from worker.infer import infer_warm

D = 2


def view(groups: dict[int, tuple[int, int, list[str]]], dead: tuple[str, ...] = ()) -> dict[str, Any]:
    workers = {f"w{i}": {"addr": f"127.0.0.1:{7200 + i}", "live": f"w{i}" not in dead} for i in range(1, 5)}
    return {"revision": 1, "workers": workers,
            "groups": {str(g): {"term": 1, "leader": reps[0], "ready": True, "voters": reps, "learners": []}
                       for g, (_, _, reps) in groups.items()},
            "topology": {"shards": 1, "settings": {}, "models": [{
                "name": "m", "layers": 12, "d_model": D,
                "groups": [{"id": g, "first": a, "last": b} for g, (a, b, _) in groups.items()]}]}}


class Workers:
    """Each hop adds its layer count to every value; `down` workers refuse, `broken` ones drop the call."""

    def __init__(self, down: set[str] = frozenset(), broken: set[str] = frozenset()) -> None:
        self.down, self.broken = set(down), set(broken)
        self.calls: list[tuple[str, int, int, int]] = []

    async def call(self, target: Target, op: str, gid: int, body: dict[str, Any], timeout: float) -> WorkerReply:
        assert op == "infer"
        self.calls.append((target.wid, gid, body["start"], body["end"]))
        if target.wid in self.down:
            raise AttemptFailed("refused", False, f"{target.wid} unreachable")
        if target.wid in self.broken:
            return reply_from(503, {}, error_body("unavailable", "not warm", shard=gid), target, gid)
        n = body["rows"] * D
        vals = struct.unpack(f"<{n}f", body["x"])
        y = struct.pack(f"<{n}f", *(v + body["end"] - body["start"] + 1 for v in vals))
        return reply_from(200, {}, {"y": y, "version": 1, "batch": 1, "compute_ms": 0.1, "queued": 0}, target, gid)


async def run(groups: dict[int, tuple[int, int, list[str]]], workers: Workers, deadline_s: float = 2.0,
              dead: tuple[str, ...] = ()) -> tuple[list[float], list[dict[str, Any]], list[dict[str, Any]]]:
    table = RoutingTable.from_view(view(groups, dead))
    api = ModelApi(None, call=workers.call)
    x = struct.pack(f"<{D}f", 0.0, 1.0)
    loop = asyncio.get_running_loop()
    y, route, tried = await api.run_route(table, table.models["m"], x, 1, loop.time() + deadline_s, Trace())
    return list(struct.unpack(f"<{D}f", y)), route, tried


async def test_each_layer_runs_once_across_overlapping_groups() -> None:
    y, route, _ = await run({1: (0, 5, ["w1", "w2"]), 2: (3, 11, ["w2", "w3"])}, Workers())
    assert y == [12.0, 13.0]  # 12 layers ran, each once
    assert [(r["group"], r["start_layer"], r["end_layer"]) for r in route] == [(1, 0, 5), (2, 6, 11)]


async def test_a_failed_replica_is_followed_by_the_other_and_both_are_in_the_trace() -> None:
    w = Workers(down={"w1"})
    y, route, tried = await run({1: (0, 11, ["w1", "w2"])}, w)
    assert y == [12.0, 13.0] and route[0]["worker"] == "w2"
    assert [(t["worker"], t["ok"]) for t in tried] == [("w1", False), ("w2", True)]


async def test_a_group_whose_replicas_all_fail_is_routed_around_from_where_the_route_stopped() -> None:
    groups = {1: (0, 5, ["w1"]), 2: (3, 11, ["w2"]), 3: (4, 9, ["w3"]), 4: (8, 11, ["w4"])}
    w = Workers(broken={"w2"})
    y, route, tried = await run(groups, w)
    assert y == [12.0, 13.0]
    assert [(r["group"], r["start_layer"], r["end_layer"]) for r in route] == [(1, 0, 5), (3, 6, 9), (4, 10, 11)]
    assert ("w2", False) in [(t["worker"], t["ok"]) for t in tried]


async def test_no_group_left_for_some_layers_is_unavailable_naming_them() -> None:
    with pytest.raises(ApiError) as info:
        await run({1: (0, 5, ["w1"]), 2: (6, 11, ["w2"])}, Workers(down={"w2"}))
    assert info.value.code == "unavailable"
    assert "layers 6-11 of model 'm' are not covered" in info.value.message


async def test_a_dead_replica_is_not_tried_and_a_failed_one_is_tried_last_for_a_while() -> None:
    w = Workers()
    await run({1: (0, 11, ["w3", "w2"])}, w, dead=("w3",))
    assert [c[0] for c in w.calls] == ["w2"]  # meta says w3 is dead: never called
    w = Workers(down={"w1"})
    groups = {1: (0, 11, ["w1", "w2"])}
    table = RoutingTable.from_view(view(groups))
    api = ModelApi(None, call=w.call)
    x = struct.pack(f"<{D}f", 0.0, 1.0)
    loop = asyncio.get_running_loop()
    await api.run_route(table, table.models["m"], x, 1, loop.time() + 2, Trace())
    assert [c[0] for c in w.calls] == ["w1", "w2"]
    w.calls.clear()
    await api.run_route(table, table.models["m"], x, 1, loop.time() + 2, Trace())
    assert [c[0] for c in w.calls] == ["w2"]  # w1 failed just now: w2 first
    loads = api.loads.loads(table, 1, 0, now=10**9)  # long after: w1 is warm again
    assert all(lo.warm for lo in loads)
    assert SUSPECT_S < 10**9


async def test_an_impossible_budget_is_refused_before_any_call() -> None:
    w = Workers()
    with pytest.raises(ApiError) as info:
        await run({1: (0, 11, ["w1"])}, w, deadline_s=0.001)
    assert info.value.code == "over_budget" and w.calls == []


class _Replica:
    def __init__(self, role: str, applied: int = 5, commit: int = 5, heard: int | None = None,
                 ready: bool = True, quorum: bool = True) -> None:
        self.role, self.applied_seq, self.commit_seq = role, applied, commit
        self.leader_heard_at, self.ready, self.has_quorum = heard, ready, quorum


class _Shell:
    def __init__(self, replica: _Replica | None, failed: str | None = None) -> None:
        from worker.group import GroupSettings

        self.replica, self.failed, self.settings = replica, failed, GroupSettings(lease_ms=1500)


def test_a_replica_is_warm_only_while_applied_and_in_touch_with_its_group() -> None:
    from worker.group import now_ms

    now = now_ms()
    assert infer_warm(_Shell(_Replica("leader")))
    assert not infer_warm(_Shell(_Replica("leader", quorum=False)))  # cut from its followers
    assert not infer_warm(_Shell(_Replica("candidate", ready=False)))
    assert infer_warm(_Shell(_Replica("follower", heard=now)))
    assert not infer_warm(_Shell(_Replica("follower", heard=now - 5000)))  # cut from its leader
    assert not infer_warm(_Shell(_Replica("follower", heard=None)))
    assert not infer_warm(_Shell(_Replica("follower", applied=4, heard=now)))  # behind its commit
    assert not infer_warm(_Shell(_Replica("leader"), failed="disk"))
    assert not infer_warm(_Shell(None))


async def test_a_group_without_a_live_replica_is_routed_around_or_named() -> None:
    w = Workers()
    y, route, _ = await run({1: (0, 11, ["w3"]), 2: (0, 11, ["w2"])}, w, dead=("w3",))
    assert y == [12.0, 13.0] and [r["group"] for r in route] == [2]
    with pytest.raises(ApiError) as info:
        await run({1: (0, 11, ["w3"])}, w, dead=("w3",))
    assert info.value.code == "unavailable" and "layers 0-11" in info.value.message


def test_the_load_model_learns_what_each_call_in_hand_adds_and_forgets_when_unmeasured() -> None:
    from gateway.layer_route import DEFAULT_MS_PER_LAYER
    from gateway.models import ESTIMATE_HALF_LIFE_S, _Seen

    seen = _Seen()
    t = 0.0
    for i in range(400):  # 1 ms per layer alone, 0.1 ms more per call in hand
        in_hand = 1 + (i % 20)
        seen.observe(in_hand, 1.0 + 0.1 * (in_hand - 1), t)
    assert seen.predict(1) == pytest.approx(1.0, abs=0.05)
    assert seen.predict(41) == pytest.approx(5.0, abs=0.2)
    assert seen.ms_per_layer(41, t) >= seen.predict(41)  # never below the fit
    later = t + 10 * ESTIMATE_HALF_LIFE_S
    assert seen.ms_per_layer(41, later) == pytest.approx(DEFAULT_MS_PER_LAYER, abs=0.01)
    # Seen at one load only: no slope is assumed, so more load may be admitted and measured.
    flat = _Seen()
    for _ in range(50):
        flat.observe(4, 2.0, 0.0)
    assert flat.predict(40) == pytest.approx(2.0)
