"""shardgrid.client: the retry and idempotency rules, pure and against fake gateways.

The policy (shardgrid/client/policy.py) is driven with a fake clock: what each
attempt carries (request id, x-deadline-ms) and where it goes are asserted
exactly, with no sleeping. The clients are then run against fake gateways
(aiohttp servers on loopback answering from a script) and a port nobody
listens on; the sync client gets a fake clock and sleep too.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
from aiohttp import web

from shardgrid.client import (AsyncClient, BadRequest, Client, ClientError, DeadlineExceeded, GatewayUnreachable,
                              NotFound, NotLeader, OverBudget, ProxyError, QuorumTimeout, RetryPolicy,
                              ShardgridError, Unavailable)
from shardgrid.client import errors
from shardgrid.client.policy import Call, CallPlan, GatewayPool, Outcome, Send, Stop
from shardgrid.common.wire import STATUS_FOR_CODE
from topology.routing import shard_for


# -- the policy, pure ----------------------------------------------------------------------------


def plan(call: Call, gateways: int = 2, deadline: float = 5.0, **policy: Any) -> CallPlan:
    return CallPlan(call, GatewayPool(gateways), RetryPolicy(**policy), deadline, random.Random(1))


WRITE = Call("PUT", "/items/a", b"{}", "write", "rid-1")
READ = Call("GET", "/items/a", None, "read")
UNAVAILABLE = Outcome(status=503, code="unavailable", retry_after_s=1.0)


def test_every_attempt_of_a_write_carries_its_one_request_id() -> None:
    p = plan(WRITE, gateways=3)
    step = p.start(0.0)
    seen = []
    for t, outcome in enumerate([Outcome(status=504, code="quorum_timeout"), Outcome(failure="broken"),
                                 Outcome(failure="timeout"), UNAVAILABLE]):
        assert isinstance(step, Send)
        seen.append(step.headers["x-request-id"])
        step = p.next(outcome, float(t) * 0.01)
    assert isinstance(step, Send)
    seen.append(step.headers["x-request-id"])
    assert seen == ["rid-1"] * 5


def test_a_bad_request_is_final() -> None:
    p = plan(WRITE)
    assert isinstance(p.start(0.0), Send)
    stop = p.next(Outcome(status=400, code="bad_request"), 0.01)
    assert isinstance(stop, Stop) and stop.error is None and stop.applied is False
    assert p.attempts == 1


@pytest.mark.parametrize("code", ["not_found", "payload_too_large", "over_budget", "not_implemented", "conflict"])
def test_final_codes_are_not_resent(code: str) -> None:
    p = plan(READ)
    p.start(0.0)
    assert isinstance(p.next(Outcome(status=STATUS_FOR_CODE[code], code=code), 0.0), Stop)


def test_not_leader_moves_to_another_gateway_at_once() -> None:
    p = plan(WRITE, gateways=2, deadline=20.0)
    first = p.start(10.0)
    assert isinstance(first, Send) and first.gateway == 0
    second = p.next(Outcome(status=503, code="not_leader"), 10.1)
    assert isinstance(second, Send) and second.gateway == 1 and second.at == 10.1


def test_a_refused_connection_moves_on_and_marks_the_gateway_down_for_later_calls() -> None:
    pool = GatewayPool(2)
    p = CallPlan(READ, pool, RetryPolicy(gateway_down_s=2.0), 5.0, random.Random(1))
    assert p.start(0.0).gateway == 0  # type: ignore[union-attr]
    step = p.next(Outcome(failure="refused"), 0.0)
    assert isinstance(step, Send) and step.gateway == 1
    p.next(Outcome(status=200), 0.1)
    later = CallPlan(READ, pool, RetryPolicy(), 5.0, random.Random(1))
    assert later.start(0.2).gateway == 1  # type: ignore[union-attr]


def test_a_write_without_a_request_id_is_resent_only_when_nothing_was_applied() -> None:
    bare = Call("POST", "/signals", b"{}", "write", None)
    p = plan(bare)
    p.start(0.0)
    assert isinstance(p.next(Outcome(failure="refused"), 0.0), Send)  # nothing sent
    assert isinstance(p.next(Outcome(status=503, code="not_leader"), 0.0), Send)  # nothing applied
    stop = p.next(Outcome(failure="broken"), 0.0)  # sent; maybe applied
    assert isinstance(stop, Stop) and stop.error is not None and stop.applied is None
    p2 = plan(bare)
    p2.start(0.0)
    assert isinstance(p2.next(Outcome(status=504, code="quorum_timeout"), 0.0), Stop)
    # The same outcomes with a request id are resent.
    p3 = plan(WRITE)
    p3.start(0.0)
    assert isinstance(p3.next(Outcome(failure="broken"), 0.0), Send)
    assert isinstance(p3.next(Outcome(status=504, code="quorum_timeout"), 0.0), Send)


def test_the_deadline_bounds_the_attempts_and_each_carries_what_is_left() -> None:
    p = plan(READ, gateways=2, deadline=1.0, max_attempts=100, backoff_base_s=0.05, backoff_cap_s=0.2)
    not_leader = Outcome(status=503, code="not_leader")
    step = p.start(0.0)
    budgets, ats = [], []
    now = 0.0
    while isinstance(step, Send):
        assert step.at >= now
        now = step.at + 0.005  # the gateway answers 5 ms after the attempt is sent
        budgets.append(int(step.headers["x-deadline-ms"]))
        ats.append(step.at)
        assert budgets[-1] == int((1.0 - step.at) * 1000)
        assert step.timeout_s == pytest.approx(1.0 - step.at + RetryPolicy().response_margin_s)
        step = p.next(not_leader, now)
    assert budgets[0] == 1000 and budgets == sorted(budgets, reverse=True)
    assert all(at <= 1.0 - RetryPolicy().min_attempt_s for at in ats)
    assert len(budgets) > 5  # backoff, capped at 0.2 s, no retry-after
    assert isinstance(step, Stop) and step.error is None  # the last answer (503) is what the caller gets
    # `unavailable` asks for a retry-after of 1 s, on whichever gateway is next: no second attempt fits in 1 s,
    # and the call ends at once rather than sleeping past its deadline.
    p = plan(READ, gateways=2, deadline=1.0)
    assert isinstance(p.start(0.0), Send)
    stop = p.next(UNAVAILABLE, 0.01)
    assert isinstance(stop, Stop) and stop.error is None and p.attempts == 1


def test_the_deadline_bounds_attempts_when_gateways_do_not_answer() -> None:
    p = plan(WRITE, gateways=2, deadline=2.0, max_attempts=1000, backoff_cap_s=0.1)
    step = p.start(0.0)
    n = 0
    while isinstance(step, Send):
        n += 1
        step = p.next(Outcome(failure="broken"), step.at + 0.05)
    assert isinstance(step, Stop) and isinstance(step.error, ShardgridError)
    assert step.applied is None and step.error.applied is None and "retry with the same request_id" in str(step.error)
    # Every attempt costs at least 50 ms: at most 2.0 / 0.05 of them fit.
    assert 2 < n <= 40 and p.attempts == n


def test_a_deadline_too_short_for_any_attempt() -> None:
    p = plan(READ, deadline=0.01)
    stop = p.start(0.0)
    assert isinstance(stop, Stop) and isinstance(stop.error, DeadlineExceeded)


def test_max_attempts() -> None:
    p = plan(READ, gateways=1, deadline=100.0, max_attempts=3)
    step = p.start(0.0)
    n = 0
    while isinstance(step, Send):
        n += 1
        step = p.next(Outcome(status=503, code="overloaded", retry_after_s=0.0), step.at)
    assert n == 3


def test_a_write_is_not_resent_past_the_dedup_window() -> None:
    p = plan(WRITE, gateways=2, deadline=100.0, write_retry_window_s=3.0)
    p.start(0.0)
    assert isinstance(p.next(Outcome(status=504, code="quorum_timeout"), 2.9), Send)
    assert isinstance(p.next(Outcome(status=504, code="quorum_timeout"), 3.1), Stop)


def test_internal_is_resent_once() -> None:
    p = plan(WRITE)
    p.start(0.0)
    assert isinstance(p.next(Outcome(status=500, code="internal"), 0.0), Send)
    stop = p.next(Outcome(status=500, code="internal"), 0.0)
    assert isinstance(stop, Stop) and stop.applied is None


def test_a_bare_proxy_503_is_an_unknown_outcome() -> None:
    # A 502/503 without the gateway's error body says nothing about what was applied.
    bare = Call("POST", "/signals", b"{}", "write", None)
    p = plan(bare)
    p.start(0.0)
    assert isinstance(p.next(Outcome(status=503, code="unavailable", shaped=False), 0.0), Stop)


def test_every_error_code_has_its_class() -> None:
    assert errors.STATUS_FOR_CODE == STATUS_FOR_CODE  # the client's table mirrors the gateway's
    families = {400: ClientError, 401: ClientError, 403: ClientError, 404: ClientError, 405: ClientError,
                408: ClientError, 409: ClientError, 413: ClientError, 503: Unavailable, 504: DeadlineExceeded}
    for code, status in STATUS_FOR_CODE.items():
        exc = errors.error_from(status, {"error": {"code": code, "message": "m", "shard": 2, "term": 7}})
        assert type(exc) is errors.CLASS_FOR_CODE[code] and exc.code == code and exc.status == status
        assert exc.context == {"shard": 2, "term": 7} and exc.message == "m"
        if status in families:
            assert isinstance(exc, families[status]), code
    # Without the gateway's error body, something in front of it answered: a bare 404 is not "no such item".
    for status in (404, 418, 502, 503):
        bare = errors.error_from(status, "<html>not json</html>")
        assert type(bare) is ProxyError and bare.status == status and bare.code == "proxy_error"
        assert not isinstance(bare, (NotFound, ClientError, Unavailable))
    assert isinstance(errors.error_from(408, ""), errors.RequestTimeout)
    assert isinstance(errors.error_from(429, ""), errors.Overloaded)
    assert isinstance(errors.error_from(504, ""), DeadlineExceeded)
    assert isinstance(errors.error_from(503, {"error": {"code": "not_leader", "message": ""}}), NotLeader)
    assert isinstance(errors.error_from(504, {"error": {"code": "quorum_timeout", "message": ""}}), QuorumTimeout)


# -- fake gateways -------------------------------------------------------------------------------

Answer = tuple[int, Any, dict[str, str]]


@dataclass
class Seen:
    gateway: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Fakes:
    """Gateways on loopback answering from `script(gateway, seen)`; all of them in one thread."""

    names: list[str]
    script: Callable[[str, Seen], Answer]
    seen: list[Seen] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        for name in self.names:
            self.urls.append(asyncio.run_coroutine_threadsafe(self._serve(name), self._loop).result(10))

    async def _serve(self, name: str) -> str:
        async def handle(request: web.Request) -> web.Response:
            raw = await request.read()
            s = Seen(name, request.method, request.path_qs, {k.lower(): v for k, v in request.headers.items()},
                     json.loads(raw) if raw else None)
            self.seen.append(s)
            status, body, headers = self.script(name, s)
            return web.json_response(body, status=status, headers=headers)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        async def stop() -> None:
            for r in self._runners:
                await r.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def fakes() -> Iterator[Callable[..., Fakes]]:
    made: list[Fakes] = []

    def make(script: Callable[[str, Seen], Answer], names: tuple[str, ...] = ("gw1", "gw2")) -> Fakes:
        f = Fakes(list(names), script)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def refused_url() -> str:
    """An address nobody listens on (bound, never listening: refused at once)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def err(code: str, **context: Any) -> Answer:
    headers = {"retry-after": "1"} if STATUS_FOR_CODE[code] == 503 else {}
    return STATUS_FOR_CODE[code], {"error": {"code": code, "message": f"fake {code}", **context}}, headers


def ok(body: Any, shard: int = 1, term: int = 3, seq: int = 17, by: str = "w2", rid: str = "") -> Answer:
    return 200, body, {"x-shard": str(shard), "x-term": str(term), "x-seq": str(seq), "x-served-by": by,
                       "x-request-id": rid}


class FakeTime:
    """A clock the sync client sleeps on without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def sync_client(urls: list[str], **kw: Any) -> Client:
    t = FakeTime()
    return Client(urls, clock=t.clock, sleep=t.sleep, seed=1, **kw)


def run_both(urls: list[str], call: Callable[[Any], Any], **kw: Any) -> list[Any]:
    """`call(client)` with a sync Client, then with an AsyncClient (its calls awaited)."""
    out: list[Any] = []
    with sync_client(urls, **kw) as c:
        out.append(_catch(lambda: call(c)))

    t = FakeTime()

    async def fake_sleep(s: float) -> None:
        t.sleep(s)

    async def with_async() -> Any:
        async with AsyncClient(urls, seed=1, clock=t.clock, sleep=fake_sleep, **kw) as ac:
            try:
                return await call(ac)
            except ShardgridError as exc:
                return exc

    out.append(asyncio.run(with_async()))
    return out


def _catch(f: Callable[[], Any]) -> Any:
    try:
        return f()
    except ShardgridError as exc:
        return exc


# -- the clients against fakes -------------------------------------------------------------------


def test_a_write_retried_through_failures_keeps_its_request_id_and_result_carries_where_it_was_served(
        fakes: Callable[..., Fakes]) -> None:
    def script(gw: str, s: Seen) -> Answer:
        n = sum(1 for x in f.seen if x.headers.get("x-request-id") == s.headers.get("x-request-id"))
        if n == 1:
            return err("quorum_timeout", shard=1)
        if n == 2:
            return err("unavailable")
        return ok({"entity": "u1", "kind": "n", "mode": "incr", "value": None, "seq": 17},
                  rid=s.headers["x-request-id"])

    f = fakes(script)
    sync_res, async_res = run_both(f.urls, lambda c: c.incr("u1", "n", 2))
    for res in (sync_res, async_res):
        assert res.shard == 1 and res.term == 3 and res.seq == 17 and res.served_by == "w2"
        assert res.attempts == 3 and res.entity == "u1" and res.value is None
    posts = [s for s in f.seen if s.path == "/signals"]
    assert len(posts) == 6
    rids = [s.headers["x-request-id"] for s in posts]
    assert rids[0] == rids[1] == rids[2] and rids[3] == rids[4] == rids[5] and rids[0] != rids[3]
    assert sync_res.request_id == rids[0] and async_res.request_id == rids[3]
    assert all(s.body == {"entity": "u1", "kind": "n", "value": 2, "mode": "incr"} for s in posts)
    # Failed attempts moved from one gateway to the other.
    assert [s.gateway for s in posts[:3]] == ["gw1", "gw2", "gw1"]


def test_a_caller_request_id_is_the_one_sent(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: ok({"id": "a", "created": True, "seq": 5}))
    with sync_client(f.urls) as c:
        assert c.put("a", {"v": 1}, request_id="mine-1").created is True
    assert f.seen[0].headers["x-request-id"] == "mine-1" and f.seen[0].body == {"v": 1}
    with pytest.raises(ValueError):
        sync_client(f.urls).put("a", 1, request_id="has#hash")


def test_a_400_is_not_retried(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: err("bad_request"))
    for res in run_both(f.urls, lambda c: c.put("a", {"v": 1})):
        assert isinstance(res, BadRequest) and res.status == 400 and res.code == "bad_request"
        assert res.applied is False and res.attempts == 1 and res.message == "fake bad_request"
    assert len(f.seen) == 2  # one per client


def test_not_leader_is_retried_on_the_other_gateway(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: err("not_leader", leader="w3") if gw == "gw1" else ok({"v": 1}, by="w3"))
    for res in run_both(f.urls, lambda c: c.get("k")):
        assert res.doc == {"v": 1} and res.served_by == "w3" and res.attempts == 2
    assert [s.gateway for s in f.seen] == ["gw1", "gw2", "gw1", "gw2"]


def test_a_refused_gateway_moves_on_to_the_next(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: ok({"id": "a", "created": True, "seq": 9}, seq=9), names=("gw2",))
    urls = [refused_url(), f.urls[0]]
    with sync_client(urls) as c:
        first = c.put("a", {})
        second = c.put("b", {})
    assert first.seq == 9 and first.attempts == 2
    assert second.attempts == 1  # the refusing gateway is tried last for a while

    async def go() -> Any:
        async with AsyncClient(urls, seed=1) as ac:
            return await ac.put("a", {})

    assert asyncio.run(go()).attempts == 2
    assert len(f.seen) == 3


def test_no_gateway_answering_is_gateway_unreachable() -> None:
    for res in run_both([refused_url(), refused_url()], lambda c: c.put("a", {})):
        assert isinstance(res, GatewayUnreachable) and res.applied is False and res.status is None


def test_the_deadline_bounds_retries_and_x_deadline_ms_carries_the_rest(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: err("unavailable"))
    t = FakeTime()
    with Client(f.urls, clock=t.clock, sleep=t.sleep, seed=1, deadline_s=3.5) as c:
        with pytest.raises(Unavailable) as info:
            c.put("a", {})
    budgets = [int(s.headers["x-deadline-ms"]) for s in f.seen]
    # `unavailable`: the retry-after (1 s, no real sleeping) before every next attempt, whichever gateway.
    assert budgets == [3500, 2500, 1500, 500] and [s.gateway for s in f.seen[:2]] == ["gw1", "gw2"]
    assert info.value.attempts == 4 and info.value.applied is False
    assert t.slept == [1.0, 1.0, 1.0]


def test_read_your_writes_carries_x_min_seq_for_the_entity_shard(fakes: Callable[..., Fakes]) -> None:
    shards = 3
    key = "user-1"
    other = next(k for k in (f"x{i}" for i in range(100)) if shard_for(k, shards) != shard_for(key, shards))

    def script(gw: str, s: Seen) -> Answer:
        if s.path == "/healthz":
            return 200, {"ok": True, "shards": shards}, {}
        if s.method == "POST":
            entity = s.body["entity"]
            return ok({"entity": entity, "value": 1, "seq": 41}, shard=shard_for(entity, shards), seq=41)
        entity = s.path.rsplit("/", 1)[1]
        return ok({"entity": entity, "counters": {"n": 1}, "last": {}}, shard=shard_for(entity, shards), seq=41)

    f = fakes(script)
    for res in run_both(f.urls, lambda c: c.incr(key, "n"), read_your_writes=True):
        assert res.seq == 41
    with sync_client(f.urls, read_your_writes=True, consistency="follower") as c:
        before = c.signals(key)  # nothing written yet: no x-min-seq, no /healthz
        c.incr(key, "n")
        c.signals(key)
        c.signals(other)
    assert before.counters == {"n": 1}
    reads = [s for s in f.seen if s.method == "GET" and s.path.startswith("/signals/")]
    assert [r.headers.get("x-min-seq") for r in reads] == [None, "41", None]
    assert all(r.headers["x-consistency"] == "follower" for r in reads)
    assert sum(1 for s in f.seen if s.path == "/healthz") == 1

    async def go() -> None:
        async with AsyncClient(f.urls, read_your_writes=True) as ac:
            await ac.incr(key, "n")
            await ac.signals(key)

    f.seen.clear()
    asyncio.run(go())
    assert [s.headers.get("x-min-seq") for s in f.seen if s.path.startswith("/signals/")] == ["41"]


def test_a_batch_with_failed_entries_is_resent_whole_with_its_request_id(fakes: Callable[..., Fakes]) -> None:
    rounds: list[str] = []

    def script(gw: str, s: Seen) -> Answer:
        rounds.append(s.headers["x-request-id"])
        if len(rounds) % 2 == 1:
            return 200, {"results": [{"shard": 0, "seq": 4, "term": 2, "served_by": "w1", "result": {"id": "a"}},
                                     {"error": {"code": "unavailable", "message": "no leader", "shard": 1}},
                                     {"error": {"code": "bad_request", "message": "never"}}]}, {}
        return 200, {"results": [{"shard": 0, "seq": 4, "term": 2, "served_by": "w1", "result": None},
                                 {"shard": 1, "seq": 8, "term": 5, "served_by": "w2", "result": 3},
                                 {"error": {"code": "bad_request", "message": "never"}}]}, {}

    f = fakes(script)
    writes = [{"op": "put_item", "id": "a", "doc": 1}, {"op": "signal", "entity": "e", "kind": "n", "value": 3},
              {"op": "delete_item", "id": "c"}]
    for res in run_both(f.urls, lambda c: c.batch(writes)):
        assert res.results[0].result == {"id": "a"} and res.results[0].seq == 4  # the first answer kept
        assert res.results[1].result == 3 and res.results[1].served_by == "w2"
        assert isinstance(res.results[2], BadRequest) and list(res.errors) == [2]
    assert len(rounds) == 4 and rounds[0] == rounds[1] and rounds[2] == rounds[3] and rounds[0] != rounds[2]


def test_not_found_and_over_budget(fakes: Callable[..., Fakes]) -> None:
    def script(gw: str, s: Seen) -> Answer:
        if s.path.startswith("/v1/models/"):
            return err("over_budget")
        return err("not_found", shard=2)

    f = fakes(script)
    with sync_client(f.urls) as c:
        with pytest.raises(NotFound) as nf:
            c.get("nope")
        assert nf.value.context == {"shard": 2}
        with pytest.raises(OverBudget):
            c.infer("m", [[0.0, 1.0]])
    assert len(f.seen) == 2
    assert f.seen[1].path == "/v1/models/m/infer" and f.seen[1].body == {"input": [[0.0, 1.0]]}


def test_gateway_answer_shapes(fakes: Callable[..., Fakes]) -> None:
    def script(gw: str, s: Seen) -> Answer:
        if s.path == "/search":
            return 200, {"results": [{"id": "e1", "score": 0.9}], "degraded": True, "unavailable_shards": [2]}, {}
        if s.path.startswith("/v1/models/"):
            return 200, {"output": [[1.0]], "route": [{"group": 0}], "tried": []}, {"x-served-by": "w1,w2"}
        if s.method == "DELETE":
            return ok({"id": "x", "deleted": True, "seq": 3}, seq=3)
        return ok({"id": "x", "vector": [0.5]})

    f = fakes(script)
    with sync_client(f.urls) as c:
        found = c.search([0.5, 0.5], k=3)
        assert found.hits[0].id == "e1" and found.degraded and found.unavailable_shards == [2]
        assert c.infer("m", [[1.0]]).served_by == ["w1", "w2"]
        assert c.delete_embedding("x").deleted is True
        assert c.get_embedding("x").vector == [0.5]
        c.get("a b/c")
    assert f.seen[0].body == {"vector": [0.5, 0.5], "k": 3}
    assert f.seen[-1].path == "/items/a%20b/c"


# -- regressions of the review (issue 29) ----------------------------------------------------------

OK_ENTRY = {"shard": 0, "seq": 4, "term": 2, "served_by": "w1", "result": 1}
TWO_SIGNALS = [{"op": "signal", "entity": "a", "kind": "n", "value": 1},
               {"op": "signal", "entity": "b", "kind": "n", "value": 1}]


def test_a_batch_entry_error_carries_the_batch_id_not_a_request_id_to_resend_it_alone(
        fakes: Callable[..., Fakes]) -> None:
    # The worker keeps entry 1 under `<id>#1`: the same write resent alone with `<id>` would apply again.
    f = fakes(lambda gw, s: (200, {"results": [OK_ENTRY, {"error": {"code": "quorum_timeout", "message": "m",
                                                                    "shard": 1}}]},
                             {"x-request-id": s.headers["x-request-id"]}), names=("gw1",))
    for res in run_both(f.urls, lambda c: c.batch(TWO_SIGNALS, request_id="batch-R"),
                        policy=RetryPolicy(max_attempts=1)):
        e = res.errors[1]
        assert isinstance(e, QuorumTimeout) and e.applied is None
        assert e.request_id is None and e.batch_request_id == "batch-R" and e.batch_index == 1
        assert "resend the whole batch" in str(e) and res.request_id == "batch-R"


def _async_fake_time() -> tuple[FakeTime, Callable[[float], Any]]:
    t = FakeTime()

    async def sleep(s: float) -> None:
        t.sleep(s)

    return t, sleep


def test_a_batch_entry_stays_perhaps_applied_when_a_later_round_raises(fakes: Callable[..., Fakes]) -> None:
    def script(gw: str, s: Seen) -> Answer:
        if sum(1 for x in f.seen if x.headers["x-request-id"] == s.headers["x-request-id"]) == 1:
            # round 1 of each client: entry 1 not applied
            return 200, {"results": [OK_ENTRY, {"error": {"code": "unavailable", "message": "m", "shard": 1}}]}, {}
        # round 2 reached the gateway (it may have applied entry 1), then no answer came
        return err("quorum_timeout", shard=1)

    f = fakes(script, names=("gw1",))
    for res in run_both(f.urls, lambda c: c.batch(TWO_SIGNALS), deadline_s=3.0, policy=RetryPolicy(max_attempts=2)):
        assert isinstance(res.errors[1], Unavailable) and res.errors[1].applied is None
        assert res.attempts == 3  # round 1's one, round 2's two
    assert len(f.seen) == 6


def test_a_batch_entry_perhaps_applied_is_not_made_not_applied_by_a_later_round(fakes: Callable[..., Fakes]) -> None:
    def script(gw: str, s: Seen) -> Answer:
        if sum(1 for x in f.seen if x.headers["x-request-id"] == s.headers["x-request-id"]) == 1:
            return 200, {"results": [OK_ENTRY, {"error": {"code": "quorum_timeout", "message": "m", "shard": 1}}]}, {}
        return 200, {"results": [dict(OK_ENTRY, result=None),
                                 {"error": {"code": "unavailable", "message": "no leader", "shard": 1}}]}, {}

    f = fakes(script, names=("gw1",))
    for res in run_both(f.urls, lambda c: c.batch(TWO_SIGNALS), deadline_s=3.0, policy=RetryPolicy(max_attempts=3)):
        assert isinstance(res.errors[1], Unavailable) and res.errors[1].applied is None
        assert res.results[0].result == 1  # the first answer kept


def test_batch_rounds_keep_one_write_retry_window(fakes: Callable[..., Fakes]) -> None:
    t = FakeTime()

    def script(gw: str, s: Seen) -> Answer:
        t.now += 2.0  # every answer takes 2 s
        return 200, {"results": [OK_ENTRY, {"error": {"code": "quorum_timeout", "message": "m", "shard": 1}}]}, {}

    f = fakes(script, names=("gw1",))
    with Client(f.urls, clock=t.clock, sleep=t.sleep, seed=1, policy=RetryPolicy(write_retry_window_s=1.0)) as c:
        res = c.batch(TWO_SIGNALS)
    assert len(f.seen) == 1 and res.errors[1].applied is None  # a resend 2 s after the first send: past the window

    f.seen.clear()
    t2, sleep = _async_fake_time()

    async def go() -> Any:
        async with AsyncClient(f.urls, clock=lambda: t.now, sleep=sleep, seed=1,
                               policy=RetryPolicy(write_retry_window_s=1.0)) as ac:
            return await ac.batch(TWO_SIGNALS)

    asyncio.run(go())
    assert len(f.seen) == 1


def test_the_write_window_is_checked_when_the_resend_would_go_out() -> None:
    p = plan(WRITE, gateways=1, deadline=10.0, write_retry_window_s=1.0)
    p.start(0.0)
    assert isinstance(p.next(Outcome(status=504, code="quorum_timeout"), 0.5), Send)
    # Decided at 0.9, but the retry-after of 1 s would send it at 1.9: past the window.
    stop = p.next(Outcome(status=503, code="unavailable", retry_after_s=1.0), 0.9)
    assert isinstance(stop, Stop) and stop.applied is None


def _drip_server(total: int, every_s: float) -> tuple[str, threading.Event, socket.socket]:
    """An HTTP server promising `total` body bytes and sending one every `every_s` (real time)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    stop = threading.Event()

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % total)
            for _ in range(total):
                if stop.wait(every_s):
                    return
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", stop, srv


def test_the_sync_client_bounds_the_whole_answer_not_each_recv() -> None:
    # A byte every 0.1 s for 4 s: every recv is quick, the answer is not. Bounded by the deadline
    # (0.3 s) plus the margin (0.1 s); before, the call took the whole 4 s.
    import time
    url, stop, srv = _drip_server(40, 0.1)
    t0 = time.monotonic()
    try:
        with Client([url], deadline_s=0.3, policy=RetryPolicy(response_margin_s=0.1, max_attempts=1)) as c:
            with pytest.raises(DeadlineExceeded) as info:
                c.get("x")
        took = time.monotonic() - t0
    finally:
        stop.set()
        srv.close()
    assert took < 2.0 and info.value.status is None


def test_the_deadline_reader_never_waits_past_its_end() -> None:
    from shardgrid.client.sync import _DeadlineReader, _Read

    class Sock:
        timeouts: list[float] = []

        def settimeout(self, t: float) -> None:
            self.timeouts.append(t)

        def recv_into(self, b: Any) -> int:
            b[0:1] = b"x"
            return 1

    import time
    progress = _Read()
    reader = _DeadlineReader(Sock(), time.monotonic() + 60.0, progress)
    assert reader.readinto(bytearray(8)) == 1 and progress.bytes == 1
    assert 0 < Sock.timeouts[-1] <= 60.0  # what is left, not a fixed per-recv timeout
    with pytest.raises(TimeoutError):
        _DeadlineReader(Sock(), time.monotonic() - 0.001, progress).readinto(bytearray(8))


def test_the_shard_count_lookup_is_charged_to_the_read_deadline(fakes: Callable[..., Fakes]) -> None:
    t = FakeTime()

    def script(gw: str, s: Seen) -> Answer:
        if s.path == "/healthz":
            t.now += 0.9
            return 200, {"ok": True, "shards": 3}, {}
        if s.method == "POST":
            return ok({"entity": "u", "value": 1, "seq": 5}, shard=shard_for("u", 3), seq=5)
        return ok({"entity": "u", "counters": {}, "last": {}}, shard=shard_for("u", 3), seq=5)

    f = fakes(script)
    with Client(f.urls, clock=t.clock, sleep=t.sleep, seed=1, read_your_writes=True, deadline_s=1.0) as c:
        c.incr("u", "n")
        c.signals("u")
    read = [s for s in f.seen if s.path.startswith("/signals/")][0]
    assert read.headers["x-deadline-ms"] == "100"  # 1 s for the call, 0.9 of it spent on /healthz


def test_an_ipv6_gateway_address() -> None:
    from shardgrid.client.core import Gateway
    gw = Gateway.parse("http://[::1]:8080")
    assert gw.host == "::1" and gw.base == "http://[::1]:8080"
    assert Gateway.parse("https://[fe80::1]").base == "https://[fe80::1]:443"
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def go() -> Any:
        async def h(request: web.Request) -> web.Response:
            return web.json_response({"v": 1}, headers={"x-shard": "0"})

        app = web.Application()
        app.router.add_get("/items/{id}", h)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "::1", 0).start()
        try:
            port = runner.addresses[0][1]
            async with AsyncClient([f"http://[::1]:{port}"]) as ac:
                return await ac.get("k")
        finally:
            await runner.cleanup()

    assert asyncio.run(go()).doc == {"v": 1}


def test_gateway_unreachable_is_not_an_unavailable_and_says_applied() -> None:
    assert not issubclass(GatewayUnreachable, Unavailable) and not issubclass(ProxyError, Unavailable)
    p = plan(WRITE)
    p.start(0.0)
    stop = p.next(Outcome(failure="broken"), 0.1)
    stop = p.next(Outcome(failure="broken"), 0.2)
    while isinstance(stop, Send):
        stop = p.next(Outcome(failure="broken"), stop.at + 0.1)
    assert isinstance(stop, Stop) and isinstance(stop.error, GatewayUnreachable) and stop.error.applied is None
    assert stop.error.code == "gateway_unreachable"


def test_a_proxy_bare_503_is_a_proxy_error_with_unknown_outcome(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: (503, "<html>503 Service Unavailable</html>", {}))
    for res in run_both(f.urls, lambda c: c.incr("u", "n"), deadline_s=0.5):
        assert type(res) is ProxyError and res.status == 503 and res.applied is None


_OK_PAYLOAD = b'{"entity":"u","value":1,"seq":3}'
_OK_ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
              b"x-shard: 0\r\nx-seq: 3\r\nContent-Length: %d\r\n\r\n" % len(_OK_PAYLOAD) + _OK_PAYLOAD)


def _read_request(conn: socket.socket, buf: bytes) -> bytes:
    """Read one whole HTTP request (head, then Content-Length bytes) that starts in `buf`;
    what follows it. ConnectionError when the client closes before the head is whole."""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return body[length:]


class _ClosingServer:
    """Answers one request per connection, says keep-alive, then closes it: the client pools
    a connection the server has closed (a gateway restart, a proxy's idle timeout)."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.srv.settimeout(0.1)
        self.connections = 0
        self.requests = 0
        self.stop = threading.Event()
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(2.0)
                try:
                    _read_request(conn, b"")
                    self.requests += 1
                    conn.sendall(_OK_ANSWER)
                except OSError:  # ConnectionError too: closed before a whole request
                    continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.srv.close()


def test_a_stale_pooled_connection_is_resent_once_on_a_new_one_without_counting_an_attempt() -> None:
    server = _ClosingServer()
    try:
        other = refused_url()
        with sync_client([server.url, other]) as c:
            first = c.incr("u", "n")
            second = c.incr("u", "n")  # on the pooled connection the server has closed
            assert c._core.pool.down_until == [0.0, 0.0] and c._core.pool.preferred == 0
        assert first.attempts == 1 and second.attempts == 1
        assert server.requests == 2 and server.connections >= 2

        async def go() -> list[int]:
            async with AsyncClient([server.url, other], seed=1) as ac:
                out = [(await ac.incr("u", "n")).attempts for _ in range(3)]
                assert ac._core.pool.down_until == [0.0, 0.0]
                return out

        assert asyncio.run(go()) == [1, 1, 1]
    finally:
        server.close()


def test_overloaded_waits_its_retry_after_on_the_next_gateway_too() -> None:
    p = plan(WRITE, gateways=3, deadline=10.0)
    s = p.start(0.0)
    s = p.next(Outcome(status=503, code="overloaded", retry_after_s=1.0), 0.01)
    assert isinstance(s, Send) and s.gateway == 1 and s.at == pytest.approx(1.01)
    # A proxy's 429: the same.
    s = p.next(Outcome(status=429, code="overloaded", retry_after_s=2.0, shaped=False), 1.02)
    assert isinstance(s, Send) and s.gateway == 2 and s.at == pytest.approx(3.02)
    # not_leader has nothing to wait for.
    s = p.next(Outcome(status=503, code="not_leader", retry_after_s=1.0), 3.03)
    assert isinstance(s, Send) and s.at < 3.3


def test_a_408_is_retried_and_a_proxy_429_is_overloaded(fakes: Callable[..., Fakes]) -> None:
    def script(gw: str, s: Seen) -> Answer:
        if gw == "gw1":
            return err("request_timeout")
        return ok({"id": "a", "created": True, "seq": 3})

    f = fakes(script)
    for res in run_both(f.urls, lambda c: c.put("a", {})):
        assert res.attempts == 2
    f429 = fakes(lambda gw, s: (429, "Too Many Requests", {"retry-after": "1"}))
    for res in run_both(f429.urls, lambda c: c.put("a", {}), deadline_s=2.5):
        assert isinstance(res, errors.Overloaded) and res.status == 429 and res.applied is False
        assert res.attempts == 3  # at 0, 1 and 2 s: the retry-after honoured


def test_a_bare_404_is_not_not_found(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: (404, "<html>no such vhost</html>", {}))
    for res in run_both(f.urls, lambda c: c.get("k")):
        assert type(res) is ProxyError and res.status == 404 and res.attempts == 1


def test_a_500_is_resent_once_with_an_error_body_or_without() -> None:
    for shaped in (True, False):
        p = plan(WRITE, gateways=1, deadline=100.0, backoff_cap_s=0.01)
        s = p.start(0.0)
        while isinstance(s, Send):
            s = p.next(Outcome(status=500, code="internal", shaped=shaped), s.at + 0.001)
        assert p.attempts == 2 and isinstance(s, Stop) and s.applied is None, shaped


def test_a_batch_entry_internal_is_resent_once(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: (200, {"results": [OK_ENTRY, {"error": {"code": "internal", "message": "bug"}}]}, {}),
              names=("gw1",))
    for res in run_both(f.urls, lambda c: c.batch(TWO_SIGNALS), deadline_s=5.0):
        assert isinstance(res.errors[1], errors.InternalError) and res.errors[1].applied is None
    assert len(f.seen) == 4  # two rounds per client


def test_a_call_deadline_is_validated_like_the_client_deadline(fakes: Callable[..., Fakes]) -> None:
    f = fakes(lambda gw, s: ok({"v": 1}))
    with sync_client(f.urls) as c:
        for bad in (0, -1.0, 300.001, 1000):
            with pytest.raises(ValueError):
                c.get("k", deadline_s=bad)
            with pytest.raises(ValueError):
                c.batch(TWO_SIGNALS, deadline_s=bad)
        assert c.get("k", deadline_s=300).doc == {"v": 1}
    assert [s.headers["x-deadline-ms"] for s in f.seen] == ["300000"]


def test_x_deadline_ms_is_what_is_left_when_the_request_is_written(fakes: Callable[..., Fakes]) -> None:
    # A sleep that oversleeps by 0.25 s (a loaded machine): the gateway is promised only what is left.
    f = fakes(lambda gw, s: err("unavailable") if len(f.seen) % 2 == 1 else ok({"v": 1}))
    t = FakeTime()

    def oversleep(s: float) -> None:
        t.sleep(s + 0.25)

    with Client(f.urls, clock=t.clock, sleep=oversleep, seed=1, deadline_s=3.0) as c:
        c.get("k")

    async def asleep(s: float) -> None:
        t.sleep(s + 0.25)

    async def go() -> None:
        async with AsyncClient(f.urls, clock=t.clock, sleep=asleep, seed=1, deadline_s=3.0) as ac:
            await ac.get("k")

    asyncio.run(go())
    assert [s.headers["x-deadline-ms"] for s in f.seen] == ["3000", "1750"] * 2


def test_the_client_copies_of_the_gateway_limits() -> None:
    from gateway import limits
    from gateway.routes import _RID
    from shardgrid.client import core, policy
    assert policy.MAX_DEADLINE_MS == limits.MAX_DEADLINE_MS and core.MAX_DEADLINE_S * 1000 == limits.MAX_DEADLINE_MS
    assert core.ACKS == limits.ACKS and core.CONSISTENCIES == limits.CONSISTENCIES
    assert core.MAX_REQUEST_ID == limits.MAX_REQUEST_ID
    samples = ["", "a", "a" * 100, "a" * 101, "has#hash", "sp ace", "tab\t", "é", "\x7f", "!~\"$", "batch-R", "#"]
    samples += [chr(c) for c in range(0x20, 0x80)]
    for rid in samples:
        assert core.valid_request_id(rid) == bool(_RID.fullmatch(rid)), repr(rid)


class _DyingServer:
    """A gateway that dies with a write in flight: it answers the first request (keep-alive, so
    the client pools the connection), reads the second whole, then closes that connection and
    its listening socket without answering (a SIGKILL after it forwarded the write)."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.requests = 0
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.srv.accept()
            with conn:
                conn.settimeout(5.0)
                rest = _read_request(conn, b"")
                self.requests += 1
                conn.sendall(_OK_ANSWER)
                _read_request(conn, rest)
                self.requests += 1
                self.srv.close()  # no more connections: the gateway is gone
        except OSError:
            pass
        finally:
            self.srv.close()


def test_a_write_sent_on_a_pooled_connection_to_a_gateway_that_then_died_is_perhaps_applied() -> None:
    # The write reached the gateway (it may have forwarded it and the group applied it); the
    # resend on a fresh connection is refused: that says nothing of the write already sent.
    # Reporting applied=False would invite a resend under a new request id: a second increment.
    for make in ("sync", "async"):
        server = _DyingServer()
        other = refused_url()
        if make == "sync":
            with sync_client([server.url, other]) as c:
                c.incr("u", "n")
                res = _catch(lambda: c.incr("u", "n", request_id="r-1"))
        else:
            t = FakeTime()

            async def fake_sleep(s: float) -> None:
                t.sleep(s)

            async def go() -> Any:
                async with AsyncClient([server.url, other], seed=1, clock=t.clock, sleep=fake_sleep) as ac:
                    await ac.incr("u", "n")
                    try:
                        return await ac.incr("u", "n", request_id="r-1")
                    except ShardgridError as exc:
                        return exc

            res = asyncio.run(go())
        server.thread.join(5)
        assert server.requests == 2, make
        assert isinstance(res, GatewayUnreachable), (make, res)
        assert res.applied is None and res.request_id == "r-1", (make, res, res.applied)
