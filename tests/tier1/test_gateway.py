"""The gateway in-process against fake workers and a fake meta (aiohttp apps on loopback)."""
from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from gateway.forward import (LANE_DEPTH, MAX_CALL_BYTES, MAX_CALL_RECORDS, Attempt, AttemptFailed, Forwarder,
                             GatewayMetrics, GroupCaller, QueuedWrites, WorkerReply, _expire, take_call)
from gateway.router import AttemptBudget, Next, RetryState, Target
from shardgrid.common.gctune import GATEWAY_YOUNG, tune_gc
from tests.tier1.test_gateway_fakes import Answer, Call, RecordingLog, dead_addr, err, make_fakes, start_gateway
from topology.routing import shard_for

# Slack on top of a deadline for "answered before the deadline" (scheduling, loopback).
SLACK_S = 0.08


@pytest.fixture(autouse=True)
def gateway_gc_policy() -> Iterator[None]:
    """The collector as the gateway process runs it (shardgrid/common/gctune.py): young
    collections only. Under pytest's default one, a full collection of the
    test process's heap (hundreds of tests' worth by then) paused the
    in-process gateway for 130 ms in the middle of a 300 ms deadline (CI)."""
    saved = gc.get_threshold()
    tune_gc(GATEWAY_YOUNG)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


async def test_each_id_goes_to_its_shard_leader(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=3)
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    table = gw.rt.cache.table
    assert table is not None and table.shard_for("foobar") == 0x85944171F73967E8 % 3 == shard_for("foobar", 3)
    ids = [f"user-{i}" for i in range(30)] + ["foobar", "a", "é", "a/b"]
    for id_ in ids:
        resp = await client.put(f"/items/{id_}", data=orjson.dumps({"n": id_}))
        assert resp.status == 200, await resp.text()
        gid = shard_for(id_, 3)
        leader = ("w1", "w2", "w3")[gid]
        assert resp.headers["x-shard"] == str(gid) and resp.headers["x-served-by"] == leader
        assert (await resp.json())["created"] is True
        [(wid, call)] = [(w, c) for w, c in f.calls() if c.body["op"]["id"] == id_]
        assert (wid, call.kind, call.gid) == (leader, "write", gid)
        assert call.body["op"] == {"kind": "put_item", "id": id_, "doc": {"n": id_}}
        assert call.body["ack"] == "quorum"
    assert len(f.calls()) == len(ids)
    got = await client.get("/items/a/b")
    assert got.status == 200 and await got.json() == {"n": "a/b"}
    assert got.headers["x-seq"] and got.headers["x-term"] == "1"


async def test_not_leader_is_retried_at_the_named_leader_with_the_same_rid(aiohttp_server: Any,
                                                                            aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))

    async def refuse(call: Call) -> Answer:
        return err("not_leader", call.gid, leader="B", term=1)

    f.workers["A"].on = refuse
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    resp = await client.put("/items/k", data=b'{"x": 1}', headers={"x-request-id": "req-42"})
    assert resp.status == 200 and resp.headers["x-served-by"] == "B"
    assert resp.headers["x-request-id"] == "req-42"
    [a], [b] = f.workers["A"].calls, f.workers["B"].calls
    assert a.body["rid"] == b.body["rid"] == "req-42"
    # The hint sticks: the next write goes straight to B.
    resp = await client.put("/items/k2", data=b"1")
    assert resp.status == 200 and len(f.workers["A"].calls) == 1 and len(f.workers["B"].calls) == 2


async def test_transfer_hint_at_the_same_term_then_meta_catches_up(aiohttp_server: Any, aiohttp_client: Any) -> None:
    """During a graceful transfer the old leader names the target at the current term."""
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))
    b_ready = asyncio.Event()

    async def a_transferring(call: Call) -> Answer:
        return err("not_leader", call.gid, leader="B", term=1)

    async def b_leading_soon(call: Call) -> Answer | None:
        if not b_ready.is_set():
            return err("not_leader", call.gid, leader="B", term=1)  # names itself: retry here soon
        return None

    f.workers["A"].on, f.workers["B"].on = a_transferring, b_leading_soon
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])

    async def meta_sets_term_2() -> None:
        await asyncio.sleep(0.15)
        f.meta.set_leader(0, "B", 2)
        b_ready.set()

    task = asyncio.create_task(meta_sets_term_2())
    resp = await client.put("/items/k", data=b"{}", headers={"x-deadline-ms": "2000"})
    await task
    assert resp.status == 200 and resp.headers["x-served-by"] == "B"
    rids = {c.body["rid"] for c in f.workers["A"].calls + f.workers["B"].calls}
    assert len(rids) == 1 and len(f.workers["B"].calls) >= 2


async def test_dead_leader_until_meta_names_a_new_one(aiohttp_server: Any, aiohttp_client: Any) -> None:
    dead = dead_addr()
    f = await make_fakes(aiohttp_server, shards=1, wids=("B",), extra_addrs={"A": dead})
    f.meta.set_leader(0, "A", 1)  # A leads but nothing listens there
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])

    async def failover() -> None:
        await asyncio.sleep(0.3)
        f.meta.set_leader(0, "B", 2)

    task = asyncio.create_task(failover())
    t0 = time.monotonic()
    resp = await client.put("/items/k", data=b'{"v": 1}', headers={"x-deadline-ms": "3000", "x-request-id": "r1"})
    elapsed = time.monotonic() - t0
    await task
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-served-by"] == "B" and resp.headers["x-term"] == "1"
    assert 0.25 < elapsed < 1.5
    assert [c.body["rid"] for c in f.workers["B"].calls] == ["r1"]


async def test_hung_leader_is_abandoned_when_meta_moves_leadership(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))

    async def hang(call: Call) -> Answer:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    f.workers["A"].on = hang
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    asyncio.get_running_loop().call_later(0.3, f.meta.set_leader, 0, "B", 2)
    t0 = time.monotonic()
    resp = await client.put("/items/k", data=b"{}", headers={"x-deadline-ms": "3000"})
    assert resp.status == 200 and resp.headers["x-served-by"] == "B"
    assert time.monotonic() - t0 < 1.5
    assert f.workers["A"].calls[0].body["rid"] == f.workers["B"].calls[0].body["rid"]


@pytest.mark.parametrize("method", ["PUT", "GET"])
@pytest.mark.parametrize("handshake_delay_s", [0.0, 0.2])
async def test_silent_leader_is_refused_before_the_deadline(aiohttp_server: Any, aiohttp_client: Any,
                                                            method: str, handshake_delay_s: float) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    # The first request to a worker opens the gateway's call stream to it: the
    # time that takes is part of the request's budget, not added to it.
    f.workers["A"].handshake_delay_s = handshake_delay_s

    async def hang(call: Call) -> Answer:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    f.workers["A"].on = hang
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    t0 = time.monotonic()
    resp = await client.request(method, "/items/k", data=b"{}" if method == "PUT" else None,
                                headers={"x-deadline-ms": "400"})
    elapsed = time.monotonic() - t0
    body = await resp.json()
    assert 0.3 < elapsed < 0.4 + SLACK_S, elapsed
    assert resp.status == 504
    # A write that may have reached the leader: outcome unknown. A read: deadline.
    assert body["error"]["code"] == ("quorum_timeout" if method == "PUT" else "deadline_exceeded")
    assert body["error"]["shard"] == 0
    # The call went out once, and the worker was told a deadline shorter than the gateway's.
    assert len(f.workers["A"].calls) == 1 and f.workers["A"].calls[0].body["deadline_ms"] < 400


async def test_no_leader_is_503_with_retry_after_before_the_deadline(aiohttp_server: Any,
                                                                     aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    f.meta.set_leader(0, None, 2)
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    t0 = time.monotonic()
    resp = await client.put("/items/k", data=b"{}", headers={"x-deadline-ms": "300"})
    elapsed = time.monotonic() - t0
    assert resp.status == 503 and resp.headers["retry-after"] == "1"
    assert (await resp.json())["error"]["code"] == "unavailable"
    assert elapsed < 0.3 + SLACK_S
    assert f.calls() == []
    metrics = await (await client.get("/metrics")).text()
    assert 'shardgrid_gateway_refusals_total{code="unavailable"} 1.0' in metrics


async def test_quorum_timeout_is_retried_with_the_same_rid(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    refusals = [2]

    async def slow_quorum(call: Call) -> Answer | None:
        if refusals[0] > 0:
            refusals[0] -= 1
            return err("quorum_timeout", call.gid, leader="A", term=1)
        return None

    f.workers["A"].on = slow_quorum
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    resp = await client.post("/signals", data=b'{"entity": "e", "kind": "clicks", "value": 2}')
    assert resp.status == 200
    assert await resp.json() == {"entity": "e", "kind": "clicks", "mode": "incr", "value": 2,
                                 "seq": int(resp.headers["x-seq"])}
    assert len({c.body["rid"] for c in f.workers["A"].calls}) == 1 and len(f.workers["A"].calls) == 3
    assert f.workers["A"].calls[0].body["op"] == {"kind": "signal", "entity": "e", "name": "clicks", "value": 2,
                                                  "mode": "incr"}


async def test_quorum_timeout_until_the_deadline_is_504_outcome_unknown(aiohttp_server: Any,
                                                                        aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))

    async def never(call: Call) -> Answer:
        await asyncio.sleep(0.05)
        return err("quorum_timeout", call.gid, leader="A", term=1)

    f.workers["A"].on = never
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    t0 = time.monotonic()
    resp = await client.delete("/items/k", headers={"x-deadline-ms": "300", "x-request-id": "same"})
    elapsed = time.monotonic() - t0
    assert resp.status == 504 and (await resp.json())["error"]["code"] == "quorum_timeout"
    assert elapsed < 0.3 + SLACK_S
    assert len(f.workers["A"].calls) >= 3 and {c.body["rid"] for c in f.workers["A"].calls} == {"same"}


@pytest.mark.parametrize("maybe_applied", [True, False])
async def test_a_leader_gone_mid_write_is_outcome_unknown_only_when_it_says_so(
        aiohttp_server: Any, aiohttp_client: Any, maybe_applied: bool) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))

    async def failing(call: Call) -> Answer:
        status, body = err("unavailable", call.gid, leader="A", term=1)
        if maybe_applied:  # the group failed after its Appends left (worker/group.py)
            body["error"]["maybe_applied"] = True
        return status, body

    f.workers["A"].on = failing
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    resp = await client.put("/items/k", data=b"{}", headers={"x-deadline-ms": "300"})
    error = (await resp.json())["error"]
    if maybe_applied:
        assert resp.status == 504 and error["code"] == "quorum_timeout" and "outcome is unknown" in error["message"]
    else:
        assert resp.status == 503 and error["code"] == "unavailable" and "nothing was applied" in error["message"]
    assert f.workers["A"].calls


def no_quorum(gid: int, leader: str, term: int = 1) -> Answer:
    status, body = err("unavailable", gid, leader=leader, term=term, message="no quorum")
    body["error"]["reason"] = "no_quorum"
    return status, body


async def test_a_leader_without_quorum_is_a_prompt_503(aiohttp_server: Any, aiohttp_client: Any) -> None:
    """Waiting does not cure it within a request (meta moves the leader a lease
    later, or never): the client hears at once, with the reason."""
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))

    async def refuse(call: Call) -> Answer:
        return no_quorum(call.gid, "A")

    f.workers["A"].on = refuse
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    for method, path in (("PUT", "/items/k"), ("GET", "/items/k")):
        t0 = time.monotonic()
        resp = await client.request(method, path, data=b"{}" if method == "PUT" else None,
                                    headers={"x-deadline-ms": "3000"})
        elapsed = time.monotonic() - t0
        error = (await resp.json())["error"]
        assert resp.status == 503 and resp.headers["retry-after"] == "1", error
        assert error["code"] == "unavailable" and error["reason"] == "no_quorum" and error["leader"] == "A"
        assert "nothing was applied" in error["message"] and "no quorum" in error["message"]
        assert elapsed < 1.0, elapsed  # not at the 3 s deadline
    assert len(f.workers["A"].calls) == 2
    resp = await client.post("/batch", data=orjson.dumps({"writes": [{"op": "put_item", "id": "k", "doc": 1}]}),
                             headers={"x-deadline-ms": "3000"})
    item = (await resp.json())["results"][0]
    assert item["error"]["code"] == "unavailable" and item["error"]["reason"] == "no_quorum"


async def test_a_write_that_may_have_applied_is_504_when_the_leader_then_lacks_quorum(
        aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    answers = [err("quorum_timeout", 0, leader="A", term=1), no_quorum(0, "A")]

    async def script(call: Call) -> Answer:
        return answers.pop(0) if answers else no_quorum(call.gid, "A")

    f.workers["A"].on = script
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    resp = await client.put("/items/k", data=b"{}", headers={"x-deadline-ms": "3000", "x-request-id": "r"})
    error = (await resp.json())["error"]
    assert resp.status == 504 and error["code"] == "quorum_timeout" and "outcome is unknown" in error["message"]
    assert [c.body["rid"] for c in f.workers["A"].calls] == ["r", "r"]


async def test_a_leader_without_quorum_is_left_for_the_one_meta_names(aiohttp_server: Any,
                                                                        aiohttp_client: Any) -> None:
    """The old leader still answers (no_quorum) after meta moved the group:
    the gateway goes to the new one at once, with the same request id
    (whether meta's watch or the answer reaches it first)."""
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])

    async def refuse_after_move(call: Call) -> Answer:
        f.meta.set_leader(0, "B", 2)  # meta moves it while A answers
        await asyncio.sleep(0.05)  # (the gateway's watch hears of it meanwhile)
        return no_quorum(call.gid, "A")

    f.workers["A"].on = refuse_after_move
    resp = await client.put("/items/k", data=b'{"v": 1}', headers={"x-deadline-ms": "3000", "x-request-id": "r1"})
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-served-by"] == "B"
    assert [c.body["rid"] for c in f.workers["A"].calls + f.workers["B"].calls] == ["r1", "r1"]


class _Cache:
    """What Forwarder._after_error asks of the route cache."""

    def __init__(self, leader: Target) -> None:
        self.leader = leader
        self.nudges = 0

    def leader_target(self, gid: int) -> Target:
        return self.leader

    def nudge(self) -> None:
        self.nudges += 1

    def apply_hint(self, gid: int, leader: Any, term: Any) -> None:
        raise AssertionError("a no_quorum refusal carries no hint")


@pytest.mark.parametrize("table, expect", [
    (Target("B", "http://b", 2), Next.RETRY),     # meta named another worker: go there
    (Target("A", "http://a", 2), Next.RETRY),     # the same worker at a newer term
    (Target("A", "http://a", 1), Next.GIVE_UP),   # still the one that refused: answer now
])
def test_a_no_quorum_refusal_goes_where_the_table_points(table: Target, expect: Next) -> None:
    cache = _Cache(table)
    fwd = Forwarder(cache, None, GatewayMetrics())  # type: ignore[arg-type]
    status, body = no_quorum(0, "A")
    reply = WorkerReply(status, "unavailable", body, "A", 0, 1, None)
    st = RetryState()
    assert fwd._after_error(st, reply, 0, Target("A", "http://a", 1), write=True) is expect
    assert st.last_reason == "no_quorum" and st.last_leader == "A" and not st.maybe_applied
    assert cache.nudges == (1 if expect is Next.GIVE_UP else 0)


async def test_batch_items_refused_for_no_quorum_keep_what_each_learned(aiohttp_server: Any,
                                                                         aiohttp_client: Any) -> None:
    """Per item of one call: applied, refused for no quorum, or timed out first
    (then no quorum: outcome unknown, never "nothing applied")."""
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    calls = [0]

    async def script(call: Call) -> Answer:
        calls[0] += 1
        nq = no_quorum(0, "A")[1]
        if calls[0] == 1:
            timeout = err("quorum_timeout", 0, leader="A", term=1)[1]
            return 200, {"results": [{"seq": 5, "term": 1, "result": {"id": "k0", "deleted": True}}, nq, timeout]}
        return 200, {"results": [nq] * len(call.body["writes"])}

    f.workers["A"].on = script
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    # (Deletes: a shard's puts would travel as one put_items write.)
    writes = [{"op": "delete_item", "id": f"k{i}"} for i in range(3)]
    resp = await client.post("/batch", data=orjson.dumps({"writes": writes}), headers={"x-deadline-ms": "3000"})
    results = (await resp.json())["results"]
    assert "error" not in results[0] and results[0]["seq"] == 5, results
    assert results[1]["error"]["code"] == "unavailable" and results[1]["error"]["reason"] == "no_quorum"
    assert results[2]["error"]["code"] == "quorum_timeout"
    assert calls[0] == 2  # the timed-out one went again (same rid), then got no_quorum


async def test_search_merges_top_k_across_groups(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=3)
    f.workers["w1"].search_hits[0] = [{"id": "a", "score": 0.9}, {"id": "d", "score": 0.5}, {"id": "g", "score": 0.1}]
    f.workers["w2"].search_hits[1] = [{"id": "b", "score": 0.9}, {"id": "c", "score": 0.7}, {"id": "h", "score": 0.5}]
    f.workers["w3"].search_hits[2] = [{"id": "e", "score": 0.95}, {"id": "ab", "score": 0.5}]
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    resp = await client.post("/search", data=orjson.dumps({"vector": [1, 0, 0, 0.5], "k": 5}))
    assert resp.status == 200
    body = await resp.json()
    assert body == {"results": [{"id": "e", "score": 0.95}, {"id": "a", "score": 0.9}, {"id": "b", "score": 0.9},
                                {"id": "c", "score": 0.7}, {"id": "ab", "score": 0.5}],
                    "degraded": False, "unavailable_shards": []}
    # One strong read per group, at its leader.
    reads = sorted((wid, c.gid, c.body["consistency"], c.body["query"]["k"]) for wid, c in f.calls())
    assert reads == [("w1", 0, "strong", 5), ("w2", 1, "strong", 5), ("w3", 2, "strong", 5)]


async def test_follower_search_and_reads_use_any_replica(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))
    f.workers["B"].search_hits[0] = [{"id": "x", "score": 1.0}]
    f.workers["B"].items[(0, "k")] = {"v": 1}

    async def down(call: Call) -> Answer:
        return err("unavailable", call.gid)

    f.workers["A"].on = down  # the leader refuses: a follower read moves on to B at once
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    headers = {"x-consistency": "follower", "x-min-seq": "7"}
    resp = await client.post("/search", data=orjson.dumps({"vector": [1, 0, 0, 0], "k": 3}), headers=headers)
    assert (await resp.json())["results"] == [{"id": "x", "score": 1.0}]
    resp = await client.get("/items/k", headers=headers)
    assert resp.status == 200 and resp.headers["x-served-by"] == "B" and await resp.json() == {"v": 1}
    point = [c for c in f.workers["B"].calls if c.body["query"]["kind"] == "get_item"]
    assert point[0].body["consistency"] == "follower" and point[0].body["min_seq"] == 7


async def test_an_overloaded_leader_is_a_prompt_503_and_a_follower_read_moves_on(aiohttp_server: Any,
                                                                                   aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))
    f.workers["B"].items[(0, "k")] = {"v": 1}

    async def full(call: Call) -> Answer:
        status, body = err("overloaded", call.gid, leader="A", term=1)
        if call.body.get("consistency") == "follower":
            body["error"]["retry_elsewhere"] = True
        return status, body

    f.workers["A"].on = full
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    t0 = time.monotonic()
    resp = await client.put("/items/k", data=b"{}", headers={"x-deadline-ms": "2000"})
    assert resp.status == 503 and resp.headers["retry-after"] == "1"
    assert (await resp.json())["error"]["code"] == "overloaded"
    assert time.monotonic() - t0 < 0.5  # not retried until the deadline
    assert len(f.workers["A"].calls) == 1
    resp = await client.get("/items/k", headers={"x-consistency": "follower"})
    assert resp.status == 200 and resp.headers["x-served-by"] == "B"
    f.workers["B"].on = full  # every replica full: the answer at once, not at the deadline
    t0 = time.monotonic()
    resp = await client.get("/items/k", headers={"x-consistency": "follower", "x-deadline-ms": "2000"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "overloaded"
    assert time.monotonic() - t0 < 0.5


async def test_search_with_a_silent_group_is_degraded_before_the_deadline(aiohttp_server: Any,
                                                                          aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=3)
    f.workers["w1"].search_hits[0] = [{"id": "a", "score": 0.5}]
    f.workers["w3"].search_hits[2] = [{"id": "c", "score": 0.7}]

    async def hang(call: Call) -> Answer:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    f.workers["w2"].on = hang
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    t0 = time.monotonic()
    resp = await client.post("/search", data=orjson.dumps({"vector": [1, 1, 1, 1], "k": 10}),
                             headers={"x-deadline-ms": "400"})
    elapsed = time.monotonic() - t0
    assert resp.status == 200 and elapsed < 0.4 + SLACK_S
    assert await resp.json() == {"results": [{"id": "c", "score": 0.7}, {"id": "a", "score": 0.5}],
                                 "degraded": True, "unavailable_shards": [1]}


async def test_batch_is_one_write_batch_per_shard_with_results_in_order(aiohttp_server: Any,
                                                                       aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=3)
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    writes: list[dict[str, Any]] = []
    for i in range(12):
        writes.append({"op": "put_item", "id": f"i{i}", "doc": {"i": i}})
    writes.append({"op": "signal", "entity": "i1", "kind": "views", "value": 3})
    writes.append({"op": "signal", "entity": "i1", "kind": "color", "value": 7, "mode": "set"})
    writes.append({"op": "put_embedding", "id": "i2", "vector": [0.1, 0.2, 0.3, 0.4]})
    writes.append({"op": "delete_embedding", "id": "i2"})
    writes.append({"op": "delete_item", "id": "i3"})
    resp = await client.post("/batch", data=orjson.dumps({"writes": writes}), headers={"x-request-id": "B1"})
    assert resp.status == 200
    results = (await resp.json())["results"]
    assert len(results) == len(writes)
    keys = [str(w.get("id") or w.get("entity")) for w in writes]
    for w, key, r in zip(writes, keys, results):
        assert r["shard"] == shard_for(key, 3) and r["served_by"] == ("w1", "w2", "w3")[r["shard"]]
    assert [r["result"] for r in results[:12]] == [{"id": f"i{i}", "created": True} for i in range(12)]
    assert [r["result"] for r in results[12:]] == [3, 7, {"id": "i2", "created": True},
                                                  {"id": "i2", "deleted": True}, {"id": "i3", "deleted": True}]
    batches = [(wid, c) for wid, c in f.calls()]
    assert all(c.kind == "write_batch" for _, c in batches)
    assert sorted(c.gid for _, c in batches) == sorted({shard_for(k, 3) for k in keys})  # one call per shard
    # Each shard's puts went as one put_items (id B1#s<shard>, docs as JSON);
    # every other write, and a shard's lone put, kept its own op and id B1#<i>.
    sent = {c.gid: c.body["writes"] for _, c in batches}
    expect: dict[str, Any] = {}
    for gid in sent:
        puts = [i for i in range(12) if shard_for(f"i{i}", 3) == gid]
        if len(puts) > 1:
            expect[f"B1#s{gid}"] = {"kind": "put_items", "ids": [f"i{i}" for i in puts],
                                    "docs": [orjson.dumps({"i": i}) for i in puts]}
            others = [i for i in range(len(writes)) if i >= 12 and shard_for(keys[i], 3) == gid]
        else:
            others = [i for i in range(len(writes)) if shard_for(keys[i], 3) == gid]
        expect.update({f"B1#{i}": None for i in others})
    got = {w["rid"]: (w["op"] if w["op"]["kind"] == "put_items" else None) for ws in sent.values() for w in ws}
    assert got == expect and any(op is not None for op in got.values())


async def test_batch_items_refused_by_a_moving_leader_are_retried(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))

    async def moved(call: Call) -> Answer:
        return err("not_leader", call.gid, leader="B", term=2)

    f.workers["A"].on = moved
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    writes = [{"op": "put_item", "id": f"k{i}", "doc": i} for i in range(5)]
    resp = await client.post("/batch", data=orjson.dumps({"writes": writes}), headers={"x-request-id": "R"})
    results = (await resp.json())["results"]
    assert [r["served_by"] for r in results] == ["B"] * 5
    [moved_puts] = f.workers["B"].calls[0].body["writes"]
    assert moved_puts["rid"] == "R#s0" and moved_puts["op"]["ids"] == [f"k{i}" for i in range(5)]
    assert [r["result"] for r in results] == [{"id": f"k{i}", "created": True} for i in range(5)]


async def test_concurrent_writes_to_a_busy_group_are_coalesced(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    inflight = _slow(f.workers["A"])
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    resps = await asyncio.gather(*(client.put(f"/items/k{i}", data=orjson.dumps(i)) for i in range(30)))
    assert [r.status for r in resps] == [200] * 30
    kinds = [c.kind for c in f.workers["A"].calls]
    assert "write_batch" in kinds and len(kinds) < 30
    assert inflight["max"] <= LANE_DEPTH  # the lane's bound on calls in flight to one leader
    sent = sum(len(c.body["writes"]) if c.kind == "write_batch" else 1 for c in f.workers["A"].calls)
    assert sent == 30 and {f.workers["A"].items[(0, f"k{i}")] for i in range(30)} == set(range(30))


async def test_a_call_takes_the_oldest_writes_within_its_bounds_and_one_ack() -> None:
    loop = asyncio.get_running_loop()

    def q(records: int, size: int = 0, ack: str = "quorum") -> QueuedWrites:
        return QueuedWrites([{"op": {}, "rid": "r"}], records > 1, records, size, ack, 0.0, loop.create_future(), Attempt())

    big, small, leader_ack = q(MAX_CALL_RECORDS - 10), q(20), q(1, ack="leader")
    assert take_call([big, leader_ack, small, q(5)]) == [big]  # 20 more records would pass the bound: wait, in order
    first, second, third = q(1), q(30), q(1)
    assert take_call([first, leader_ack, second, third]) == [first, second, third]  # one ack per call
    assert take_call([leader_ack, first]) == [leader_ack]
    huge = q(MAX_CALL_RECORDS + 500)
    assert take_call([huge, first]) == [huge]  # a part over the bound still goes, alone
    heavy = [q(1, size=MAX_CALL_BYTES // 3) for _ in range(4)]
    assert take_call(heavy) == heavy[:3]


class _GatedCalls:
    """WorkerCalls that record each call and answer it once `gate` is set."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.gate = asyncio.Event()

    async def call(self, target: Target, op: str, gid: int, body: dict[str, Any], timeout: float) -> WorkerReply:
        self.sent.append((op, body))
        await self.gate.wait()
        writes = body["writes"] if op == "write_batch" else [body]
        results = [{"seq": n, "term": 1, "result": w["rid"]} for n, w in enumerate(writes)]
        return WorkerReply(200, None, {"results": results} if op == "write_batch" else results[0], target.wid, gid, 1,
                           None)


@pytest.mark.parametrize("settled_before", ["flush", "send"])
async def test_writes_whose_owner_was_answered_meanwhile_never_leave(settled_before: str) -> None:
    # An owner told "timed out, not sent" (or cancelled) in the same loop
    # iteration as the flush must not have its writes sent after all: the
    # gateway would then answer "nothing was applied" for writes that commit.
    calls = _GatedCalls()
    caller = GroupCaller(0, calls, GatewayMetrics())  # type: ignore[arg-type]
    target, budget = Target("A", "http://a", 1), AttemptBudget(5.0, 4000)
    first = asyncio.create_task(caller.write(target, {"kind": "put_item"}, "first", "quorum", budget, Attempt()))
    while not calls.sent:
        await asyncio.sleep(0)
    late, on_time = Attempt(), Attempt()
    tasks = [asyncio.create_task(caller.write_many(target, [{"op": {}, "rid": rid}], "quorum", budget, attempt))
             for rid, attempt in (("late", late), ("on-time", on_time))]
    await asyncio.sleep(0)
    lane = caller._lanes[target.base]
    doomed = lane.queue[0]
    assert doomed.writes[0]["rid"] == "late" and lane.inflight == 1
    lane.inflight = 0  # the first call's slot frees, as its answer arrives...
    if settled_before == "flush":
        _expire(doomed, "A", 0.0)  # ...and in the same iteration the timer answers the late owner
        caller._flush(target, lane)
    else:
        caller._flush(target, lane)
        _expire(doomed, "A", 0.0)  # ...or just after the flush took it, before the call left
    calls.gate.set()
    with pytest.raises(AttemptFailed) as failed:
        await tasks[0]
    assert failed.value.kind == "timeout" and not failed.value.sent and not late.sent
    reply = await tasks[1]
    assert reply.body == {"results": [{"seq": 0, "term": 1, "result": "on-time"}]} and on_time.sent
    assert [[w["rid"] for w in body["writes"]] for op, body in calls.sent if op == "write_batch"] == [["on-time"]]
    await first
    await caller.close()


async def test_a_call_counts_a_put_items_by_its_records() -> None:
    calls = _GatedCalls()
    caller = GroupCaller(0, calls, GatewayMetrics())  # type: ignore[arg-type]
    target, budget = Target("A", "http://a", 1), AttemptBudget(5.0, 4000)

    def part(rid: str, n: int) -> list[dict[str, Any]]:
        return [{"op": {"kind": "put_items", "ids": [f"{rid}{i}" for i in range(n)], "docs": [b"1"] * n},
                 "rid": rid}]

    first = asyncio.create_task(caller.write(target, {"kind": "put_item"}, "first", "quorum", budget, Attempt()))
    while not calls.sent:
        await asyncio.sleep(0)
    # Queued behind the call in flight: one write each, but 6,000 records together.
    tasks = [asyncio.create_task(caller.write_many(target, part(rid, 3000), "quorum", budget, Attempt()))
             for rid in ("a", "b")] + [asyncio.create_task(caller.write_many(target, part("c", 10), "quorum", budget,
                                                                            Attempt()))]
    await asyncio.sleep(0)
    calls.gate.set()
    await asyncio.gather(first, *tasks)
    assert [[w["rid"] for w in body["writes"]] for op, body in calls.sent[1:]] == [["a"], ["b", "c"]]
    await caller.close()


def _slow(worker: Any, delay_s: float = 0.1) -> dict[str, int]:
    """Make a fake worker answer every call after `delay_s`; returns its calls-in-flight gauge."""
    inflight = {"now": 0, "max": 0}

    async def slow(call: Call) -> Answer | None:
        inflight["now"] += 1
        inflight["max"] = max(inflight["max"], inflight["now"])
        try:
            await asyncio.sleep(delay_s)
        finally:
            inflight["now"] -= 1
        return None

    worker.on = slow
    return inflight


async def test_concurrent_batches_and_single_writes_to_a_busy_group_share_calls(aiohttp_server: Any,
                                                                                 aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    inflight = _slow(f.workers["A"])
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])

    async def batch(n: int) -> Any:
        writes = [{"op": "put_item", "id": f"b{n}-{i}", "doc": {"n": n, "i": i}} for i in range(5)]
        writes.append({"op": "signal", "entity": f"u{n}", "kind": "hits", "value": n})
        resp = await client.post("/batch", data=orjson.dumps({"writes": writes}), headers={"x-request-id": f"R{n}"})
        assert resp.status == 200
        return (await resp.json())["results"]

    async def single(n: int) -> Any:
        resp = await client.put(f"/items/s{n}", data=orjson.dumps(n))
        assert resp.status == 200
        return await resp.json()

    out = await asyncio.gather(*(batch(n) for n in range(12)), *(single(n) for n in range(6)))
    # Every request got its own answers, in its own order.
    for n, results in enumerate(out[:12]):
        assert [r["result"] for r in results] == [{"id": f"b{n}-{i}", "created": True} for i in range(5)] + [n]
        assert {r["served_by"] for r in results} == {"A"}
    assert [r["id"] for r in out[12:]] == [f"s{n}" for n in range(6)] and all(r["created"] for r in out[12:])
    calls = f.workers["A"].calls
    assert inflight["max"] <= LANE_DEPTH
    assert len(calls) < 12 and any(len({w["rid"].split("#")[0] for w in c.body["writes"]}) > 1
                                   for c in calls if c.kind == "write_batch")  # several requests in one call
    assert any({w["rid"][0] == "R" for w in c.body["writes"]} == {True, False}
               for c in calls if c.kind == "write_batch")  # batch parts and single writes in one call
    # Each part still goes as its own writes under its own request ids (the worker's dedup keys), once.
    rids = [w["rid"] for c in calls for w in (c.body["writes"] if c.kind == "write_batch" else [c.body])]
    assert sorted(r for r in rids if r.startswith("R")) == sorted(f"R{n}#{t}" for n in range(12) for t in ("s0", "5"))
    assert len(rids) == len(set(rids)) == 12 * 2 + 6
    assert {k for (_, k) in f.workers["A"].items} == {f"b{n}-{i}" for n in range(12) for i in range(5)} | {
        f"s{n}" for n in range(6)}


async def test_a_coalesced_call_refused_by_a_moving_leader_is_retried_for_each_caller(aiohttp_server: Any,
                                                                                      aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))

    async def moved(call: Call) -> Answer:
        await asyncio.sleep(0.05)
        return err("not_leader", call.gid, leader="B", term=2)

    f.workers["A"].on = moved
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])

    async def batch(n: int) -> Any:
        writes = [{"op": "put_item", "id": f"b{n}-{i}", "doc": i} for i in range(3)]
        resp = await client.post("/batch", data=orjson.dumps({"writes": writes}), headers={"x-request-id": f"R{n}"})
        return (await resp.json())["results"]

    out = await asyncio.gather(*(batch(n) for n in range(6)), client.put("/items/k", data=b"1"))
    for n, results in enumerate(out[:6]):
        assert [(r["served_by"], r["result"]) for r in results] == [("B", {"id": f"b{n}-{i}", "created": True})
                                                                    for i in range(3)]
    assert out[6].status == 200 and out[6].headers["x-served-by"] == "B"
    assert any(c.kind == "write_batch" and len(c.body["writes"]) > 1 for c in f.workers["A"].calls)
    at_b = [w["rid"] for c in f.workers["B"].calls for w in (c.body["writes"] if c.kind == "write_batch" else [c.body])]
    assert sorted(r for r in at_b if r.startswith("R")) == sorted(f"R{n}#s0" for n in range(6))


async def test_a_coalesced_answer_of_the_wrong_length_is_an_error_for_each_caller(aiohttp_server: Any,
                                                                                  aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))

    async def short(call: Call) -> Answer | None:
        await asyncio.sleep(0.05)
        if call.kind == "write_batch" and len(call.body["writes"]) > 1:
            return 200, {"results": [{"seq": 1, "term": 1, "result": None}]}  # one result for several writes
        return None

    f.workers["A"].on = short
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])

    async def batch(n: int) -> Any:
        writes = [{"op": "put_item", "id": f"b{n}-{i}", "doc": i} for i in range(3)]
        resp = await client.post("/batch", data=orjson.dumps({"writes": writes}), headers={"x-request-id": f"R{n}"})
        assert resp.status == 200
        return (await resp.json())["results"]

    out = await asyncio.gather(*(batch(n) for n in range(6)))
    coalesced = {int(w["rid"][1:].split("#")[0]) for c in f.workers["A"].calls
                 if c.kind == "write_batch" and len(c.body["writes"]) > 1 for w in c.body["writes"]}
    assert coalesced, "no call carried more than one request's writes"
    for n, results in enumerate(out):
        if n in coalesced:  # the short answer fits none of them: each gets an error, none a stranger's result
            assert [r["error"]["code"] for r in results] == ["internal"] * 3
        else:
            assert [r["result"] for r in results] == [{"id": f"b{n}-{i}", "created": True} for i in range(3)]


async def test_single_entity_answers_and_worker_errors(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=2, wids=("w1", "w2"), dim=3)
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    missing = await client.get("/items/nope")
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "not_found"
    assert missing.headers["x-served-by"] in ("w1", "w2") and "x-request-id" in missing.headers
    assert (await client.delete("/items/nope")).status == 404
    assert (await client.put("/embeddings/e1", data=b'{"vector": [1, 2.5, -3]}')).status == 200
    got = await client.get("/embeddings/e1")
    assert await got.json() == {"id": "e1", "vector": [1, 2.5, -3]}
    deleted = await client.delete("/embeddings/e1")
    assert await deleted.json() == {"id": "e1", "deleted": True, "seq": int(deleted.headers["x-seq"])}
    await client.post("/signals", data=b'{"entity": "u", "kind": "n", "value": 1.5}')
    await client.post("/signals", data=b'{"entity": "u", "kind": "last", "value": -1, "mode": "set"}')
    sig = await client.get("/signals/u")
    assert await sig.json() == {"entity": "u", "counters": {"n": 1.5}, "last": {"last": -1}}
    health = await (await client.get("/healthz")).json()
    assert health == {"ok": True, "version": gw.version, "revision": 1, "shards": 2,
                      "groups_without_ready_leader": []}
    assert gw.version and f'shardgrid_build_info{{role="gateway",version="{gw.version}"}} 1.0' in \
        await (await client.get("/metrics")).text()


async def test_keeps_working_when_the_first_meta_address_is_down(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A", "B"))
    client, gw = await start_gateway(aiohttp_client, [dead_addr(), f.meta_addr])
    assert (await client.put("/items/k", data=b"1")).status == 200
    # Watch updates still flow through the live meta node.
    f.meta.set_leader(0, "B", 2)
    for _ in range(100):
        target = gw.rt.cache.leader_target(0)
        if target is not None and target.wid == "B":
            break
        await asyncio.sleep(0.01)
    resp = await client.put("/items/k", data=b"2")
    assert resp.status == 200 and resp.headers["x-served-by"] == "B"


async def test_operator_verbs_are_proxied_to_meta(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=2, wids=("w1", "w2"))
    f.meta.view["workers"]["w1"].update(live=True, report={"groups": {"0": {"commit": 10, "applied": 10},
                                                                      "1": {"commit": 9, "applied": 7}}})
    f.meta.view["workers"]["w2"].update(live=False, report={"groups": {"1": {"commit": 12, "applied": 12,
                                                                             "last_seq": 12}}})
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr], admin_token="tok")
    auth = {"Authorization": "Bearer tok"}
    assert (await client.post("/cluster/shards/1/transfer", data=b'{"to": "w1"}')).status == 401
    assert f.meta.verbs == []
    resp = await client.post("/cluster/shards/1/transfer", data=b'{"to": "w1"}', headers=auth)
    assert resp.status == 501 and (await resp.json())["error"]["code"] == "not_implemented"
    f.meta.verb_answer = (202, {"accepted": True})
    resp = await client.post("/cluster/shards/0/replicas", data=b'{"add": "w4"}', headers=auth)
    assert resp.status == 202 and await resp.json() == {"accepted": True}
    assert f.meta.verbs == [("POST", "/v1/groups/1/transfer", b'{"to": "w1"}', "Bearer tok"),
                            ("POST", "/v1/groups/0/replicas", b'{"add": "w4"}', "Bearer tok")]
    assert (await client.post("/cluster/shards/x/transfer", headers=auth)).status == 400
    status = await (await client.get("/cluster/status", headers=auth)).json()
    assert status["workers"]["w1"]["live"] is True and status["workers"]["w2"]["live"] is False
    assert status["liveness_known"] is True and status["gateway"] == {"routing_revision": 1}
    shards = (await (await client.get("/cluster/shards", headers=auth)).json())["shards"]
    g1 = shards[1]
    assert (g1["id"], g1["leader"], g1["term"], g1["ready"], g1["preferred_leader"]) == (1, "w2", 1, True, "w2")
    assert [(r["worker"], r["role"], r["live"], r["lag"]) for r in g1["replicas"]] == \
        [("w1", "voter", True, 5), ("w2", "voter", False, 0)]
    assert [r["lag"] for r in shards[0]["replicas"]] == [0, None]


async def test_access_log_line(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    log = RecordingLog()
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr], log=log, access_log=True)
    await client.put("/items/k", data=b"1", headers={"x-request-id": "log-me"})
    await client.put("/items/", data=b"1")
    access = [fields for level, event, fields in log.lines if event == "access"]
    assert access[0] == {"method": "PUT", "route": "/items/{id}", "status": 200, "shard": 0, "leader": "A",
                         "attempts": 1, "outcome": "ok", "ms": access[0]["ms"], "rid": "log-me"}
    assert access[1]["status"] == 400 and access[1]["outcome"] == "bad_request" and access[1]["attempts"] == 0


async def test_no_access_log_means_no_per_request_info_lines(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1, wids=("A",))
    log = RecordingLog()
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr], log=log, access_log=False)
    before = len(log.lines)
    for i in range(5):
        assert (await client.put(f"/items/k{i}", data=b"1")).status == 200
        assert (await client.get(f"/items/k{i}")).status == 200
    assert [ln for ln in log.lines[before:] if ln[0] != "debug"] == []


async def test_a_malformed_authorization_header_is_401_never_500(aiohttp_server: Any, aiohttp_client: Any) -> None:
    from tests.support.rawhttp import raw_status

    f = await make_fakes(aiohttp_server, shards=2, wids=("w1", "w2"))
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr], admin_token="tok")
    for header in (b"Authorization: Bearer \xff\xfe", b"Authorization: Bearer tok\xff", b"Authorization: ",
                   b"Authorization: tok", b"Authorization: Bearer  tok", b"Authorization: Bearer \xc3\xa9"):
        for method, path in (("GET", "/cluster/status"), ("POST", "/cluster/shards/0/transfer")):
            status, body = await raw_status(client.host, client.port, method, path, [header], b'{"to": "w1"}')
            assert status == 401 and b'"unauthorized"' in body, (header, path, status, body)
    assert f.meta.verbs == []
    # A gateway without a token checks nothing and forwards no malformed token: meta decides.
    open_client, _ = await start_gateway(aiohttp_client, [f.meta_addr])
    f.meta.verb_answer = (202, {"accepted": True})
    status, _ = await raw_status(open_client.host, open_client.port, "POST", "/cluster/shards/0/transfer",
                                 [b"Authorization: Bearer \xff\xfe"], b'{"to": "w1"}')
    assert status == 202 and f.meta.verbs == [("POST", "/v1/groups/0/transfer", b'{"to": "w1"}', None)]
