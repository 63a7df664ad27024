"""What a worker accepts on its data routes and call stream (worker/server.py):
hostile or oversized bodies are refused before anything reaches the group,
and an answer that cannot be encoded fails only its own call."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import msgpack
import pytest
import structlog
from aiohttp.test_utils import TestClient

from shardgrid.common.wire import pack_frames, packb, unpack_frame
from worker.group import GroupOverloaded
from worker.process import WorkerConfig, WorkerNode
from worker.server import MAX_BATCH_WRITES, MAX_DEADLINE_MS, MAX_WRITE_BYTES, WorkerApi
from shardgrid.common.protocol import CALLS_PATH, STREAM_PATH

MSGPACK = {"Content-Type": "application/msgpack"}


@dataclass
class _Out:
    ok: bool = True
    seq: int = 1
    term: int = 1
    result: Any = None
    error_code: str | None = None
    message: str | None = None
    leader: str | None = None
    maybe_applied: bool = False


@dataclass
class _Shell:
    """A group as the data routes see one; records what was queued to it."""

    gid: int = 0
    queued: list[tuple[str, Any]] = field(default_factory=list)
    result: Any = None
    full: bool = False  # refuse every call as a group holding its limit does
    sizes: list[int] = field(default_factory=list)  # the `size` each call was admitted with

    def deliver(self, event: Any) -> None:
        self.queued.append(("deliver", event))

    def _admit(self, size: int) -> None:
        if self.full:
            raise GroupOverloaded(self.gid, 2, 10, 2, 1 << 20)
        self.sizes.append(size)

    async def write(self, op: Any, ack: str, rid: str | None, timeout_s: float, size: int = 0) -> _Out:
        self._admit(size)
        self.queued.append(("write", op))
        return _Out(result=self.result)

    async def write_many(self, writes: list[tuple[Any, str | None]], ack: str, timeout_s: float,
                         size: int = 0) -> list[_Out]:
        self._admit(size)
        self.queued.append(("write_many", writes))
        return [_Out(seq=i + 1) for i in range(len(writes))]

    async def read(self, query: Any, consistency: str, min_seq: int, timeout_s: float, size: int = 0) -> _Out:
        self._admit(size)
        self.queued.append(("read", query))
        return _Out(result=self.result)


@dataclass
class Worker:
    node: WorkerNode
    client: TestClient
    shell: _Shell


@pytest.fixture
async def worker(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Worker]:
    node = WorkerNode(WorkerConfig("w1", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path / "w1"),
                      structlog.get_logger())
    shell = _Shell()
    node.groups[0] = shell  # type: ignore[assignment]
    try:
        yield Worker(node, await aiohttp_client(WorkerApi(node).app()), shell)
    finally:
        await node.meta.close()
        await node.transport.close()


async def _post(w: Worker, route: str, body: Any, packed: bool = True) -> tuple[int, Any]:
    if packed:
        resp = await w.client.post(f"/v1/groups/0/{route}", data=packb(body), headers=MSGPACK)
    else:
        resp = await w.client.post(f"/v1/groups/0/{route}", json=body)
    # Errors are JSON whatever the request's encoding (shardgrid.common.wire.error_middleware).
    if resp.content_type == MSGPACK["Content-Type"]:
        return resp.status, msgpack.unpackb(await resp.read(), raw=False)
    return resp.status, await resp.json()


OP = {"kind": "put", "id": "a", "doc": {}}
BAD_DEADLINES = [float("nan"), float("inf"), float("-inf"), -5, 0, MAX_DEADLINE_MS + 1, 1e300, True, "100"]


@pytest.mark.parametrize("deadline", BAD_DEADLINES, ids=repr)
async def test_a_bad_deadline_is_a_400_and_nothing_is_queued(worker: Worker, deadline: Any) -> None:
    for route, body in [("write", {"op": OP}), ("write_batch", {"writes": [{"op": OP}]}),
                        ("read", {"query": {"kind": "get", "id": "a"}})]:
        status, answer = await _post(worker, route, {**body, "deadline_ms": deadline})
        assert status == 400, (route, answer)
        assert answer["error"]["code"] == "bad_request" and "deadline_ms" in answer["error"]["message"]
    assert worker.shell.queued == []


async def test_a_deadline_within_the_limit_is_served(worker: Worker) -> None:
    status, _ = await _post(worker, "write", {"op": OP, "deadline_ms": MAX_DEADLINE_MS})
    assert status == 200 and worker.shell.queued == [("write", OP)]


@pytest.mark.parametrize("writes", [None, [], {"op": OP}, "x", 5])
async def test_a_write_batch_without_a_list_of_writes_is_a_400(worker: Worker, writes: Any) -> None:
    status, answer = await _post(worker, "write_batch", {"writes": writes})
    assert status == 400 and answer["error"]["code"] == "bad_request", answer
    assert worker.shell.queued == []


async def test_a_write_batch_over_the_count_limit_is_a_413_naming_it(worker: Worker) -> None:
    status, answer = await _post(worker, "write_batch", {"writes": [{"op": {}}] * (MAX_BATCH_WRITES + 1)})
    assert status == 413, answer
    assert answer["error"]["code"] == "payload_too_large" and answer["error"]["limit"] == MAX_BATCH_WRITES
    assert str(MAX_BATCH_WRITES) in answer["error"]["message"]
    assert worker.shell.queued == []
    status, answer = await _post(worker, "write_batch", {"writes": [{"op": {}}] * MAX_BATCH_WRITES})
    assert status == 200 and len(answer["results"]) == MAX_BATCH_WRITES


def _big_doc(nbytes: int) -> dict[str, Any]:
    return {"kind": "put", "id": "a", "doc": {"pad": "x" * nbytes}}


@pytest.mark.parametrize("packed", [True, False], ids=["msgpack", "json"])
async def test_writes_over_the_byte_limit_are_a_413_naming_it(worker: Worker, packed: bool) -> None:
    big = _big_doc(MAX_WRITE_BYTES)
    for route, body in [("write", {"op": big}), ("write_batch", {"writes": [{"op": big}]})]:
        status, answer = await _post(worker, route, body, packed)
        assert status == 413, (route, answer)
        assert answer["error"]["code"] == "payload_too_large" and answer["error"]["limit"] == MAX_WRITE_BYTES
        assert str(MAX_WRITE_BYTES) in answer["error"]["message"]
    # Many writes each well under the limit, together over it: one entry too.
    many = [{"op": _big_doc(MAX_WRITE_BYTES // 8)} for _ in range(9)]
    status, answer = await _post(worker, "write_batch", {"writes": many}, packed)
    assert status == 413, answer
    assert worker.shell.queued == []
    status, _ = await _post(worker, "write", {"op": _big_doc(MAX_WRITE_BYTES // 2)}, packed)
    assert status == 200


async def _calls(w: Worker, calls: list[Any], n: int) -> dict[int, tuple[int, Any]]:
    """Send `calls` in one frame on the call stream; the first `n` answers by call id."""
    ws = await w.client.ws_connect(CALLS_PATH, max_msg_size=0)
    try:
        await ws.send_bytes(b"".join(pack_frames(calls, limit=1 << 30)))
        answers: dict[int, tuple[int, Any]] = {}
        while len(answers) < n:
            msg = await asyncio.wait_for(ws.receive(), 10)
            assert msg.type == aiohttp.WSMsgType.BINARY, msg
            for cid, status, body in unpack_frame(msg.data):
                answers[cid] = (status, body)
        return answers
    finally:
        await ws.close()


async def test_the_call_stream_applies_the_same_limits_per_call(worker: Worker) -> None:
    big = _big_doc(MAX_WRITE_BYTES)
    answers = await _calls(worker, [
        [1, "write", 0, {"op": OP, "deadline_ms": float("nan")}],
        [2, "write_batch", 0, {"writes": [{"op": big}]}],
        [3, "write_batch", 0, {"writes": [{"op": {}}] * (MAX_BATCH_WRITES + 1)}],
        [4, "read", 0, {"query": {}, "deadline_ms": -1}],
        [5, "write", 0, {"op": big}],
        [6, "write", 0, {"op": OP}],  # a neighbour in the same frame is served
    ], 6)
    assert {cid: status for cid, (status, _) in answers.items()} == {1: 400, 2: 413, 3: 413, 4: 400, 5: 413, 6: 200}
    assert answers[2][1]["error"]["limit"] == MAX_WRITE_BYTES
    assert worker.shell.queued == [("write", OP)]


async def test_an_answer_that_cannot_be_encoded_fails_only_its_call(worker: Worker) -> None:
    worker.shell.result = {1, 2}  # a set: msgpack cannot pack it
    answers = await _calls(worker, [[1, "write", 0, {"op": OP}], [2, "write_batch", 0, {"writes": [{"op": OP}]}]], 2)
    assert answers[1][0] == 500 and answers[1][1]["error"]["code"] == "internal"
    assert answers[2][0] == 200
    # The stream's writer is still alive: later answers still come.
    worker.shell.result = None
    again = await _calls(worker, [[3, "write", 0, {"op": OP}]], 1)
    assert again[3][0] == 200


async def test_a_full_group_is_a_503_overloaded_on_every_route_and_the_stream(worker: Worker) -> None:
    worker.shell.full = True
    for route, body in [("write", {"op": OP}), ("write_batch", {"writes": [{"op": OP}]}),
                        ("read", {"query": {"kind": "get", "id": "a"}})]:
        status, answer = await _post(worker, route, body)
        assert status == 503, (route, answer)
        err = answer["error"]
        assert err["code"] == "overloaded" and err["shard"] == 0 and err["limit"] == 2, err
        assert "retry_elsewhere" not in err  # only the leader takes a write or a strong read
    status, answer = await _post(worker, "read", {"query": {"kind": "get", "id": "a"}, "consistency": "follower"})
    assert status == 503 and answer["error"]["retry_elsewhere"] is True
    answers = await _calls(worker, [[1, "write", 0, {"op": OP}], [2, "read", 0, {"query": {}}]], 2)
    assert [answers[c][0] for c in (1, 2)] == [503, 503]
    assert answers[1][1]["error"]["code"] == "overloaded"
    assert worker.shell.queued == []
    worker.shell.full = False
    status, _ = await _post(worker, "write", {"op": OP})
    assert status == 200 and worker.shell.sizes and worker.shell.sizes[0] > 0  # admitted by its encoded size


async def test_refusals_for_a_full_group_are_counted_on_metrics(worker: Worker) -> None:
    worker.node.groups.clear()  # the fake group has no report for the gauges
    worker.node.pass_stats.overloaded = 3
    text = await (await worker.client.get("/metrics")).text()
    assert "shardgrid_worker_overloaded_total 3.0" in text


async def test_an_answer_too_large_for_the_stream_fails_only_its_call(worker: Worker, monkeypatch: Any) -> None:
    from worker import server

    monkeypatch.setattr(server, "MAX_BODY", 10_000)
    worker.shell.result = "x" * 20_000  # an answer the gateway's stream limit would refuse
    answers = await _calls(worker, [[1, "write", 0, {"op": OP}], [2, "write_batch", 0, {"writes": [{"op": OP}]}]], 2)
    assert answers[1][0] == 413 and answers[1][1]["error"]["code"] == "payload_too_large"
    assert answers[2][0] == 200


class _StuckWs:
    """A call stream whose gateway reads nothing until `go` is set."""

    def __init__(self) -> None:
        self.closed = False
        self.go = asyncio.Event()
        self.sent: list[bytes] = []

    async def send_bytes(self, data: bytes) -> None:
        await self.go.wait()
        self.sent.append(data)


async def test_a_call_stream_whose_answers_are_not_read_stops_taking_calls(monkeypatch: Any) -> None:
    # Backpressure: a gateway that sends calls and reads no answers holds at
    # most MAX_OUTBOX_ANSWERS of them in the worker (the stream reads no
    # more calls meanwhile), and the stream goes on once it reads again.
    from worker import server

    monkeypatch.setattr(server, "MAX_OUTBOX_ANSWERS", 4)
    ws = _StuckWs()
    out = server._Outbox(ws, structlog.get_logger())  # type: ignore[arg-type]
    try:
        out.put([1, 200, {}])
        await asyncio.sleep(0)  # the writer takes it and blocks on the socket
        for cid in (2, 3, 4):
            out.put([cid, 200, {}])
        assert not out.room.is_set()
        ws.go.set()
        await asyncio.wait_for(out.room.wait(), 5)
        end = asyncio.get_running_loop().time() + 5
        while len([c for f in ws.sent for c, *_ in unpack_frame(f)]) < 4:
            assert asyncio.get_running_loop().time() < end, ws.sent
            await asyncio.sleep(0.005)
        assert out.held == 0 and not out.items
    finally:
        out.close()


BEGIN = ["Begin", {"src": "w2", "dst": "w1", "group": 0, "term": 3}]


@pytest.mark.parametrize("body", [b"\x00\x00", b"\x92\x01", b"\x81\x90\x01", packb({"not": "a list"}),
                                  packb([["Begin", {"src": "w2", "dst": None, "group": 0, "term": 3}]]),
                                  packb([BEGIN, ["Begin", []]])], ids=range(6))
async def test_malformed_replication_messages_are_a_400_and_none_is_delivered(worker: Worker, body: bytes) -> None:
    # Found by tests/tier1/test_fuzz_worker.py: garbage was a 500, and a
    # message with a field of the wrong type (dst None) reached the group.
    resp = await worker.client.post("/v1/raft", data=body, headers=MSGPACK)
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["code"] == "bad_request"
    assert worker.shell.queued == []
    resp = await worker.client.post("/v1/raft", data=packb([BEGIN]), headers=MSGPACK)
    assert resp.status == 204 and [k for k, _ in worker.shell.queued] == ["deliver"]


async def test_a_msgpack_map_keyed_by_an_array_is_a_400(worker: Worker) -> None:
    # msgpack raises TypeError (unhashable key) for it: it was a 500.
    for route in ("write", "write_batch", "read"):
        resp = await worker.client.post(f"/v1/groups/0/{route}", data=b"\x81\x90\x01", headers=MSGPACK)
        assert resp.status == 400, (route, await resp.text())
    assert worker.shell.queued == []


async def test_an_unknown_call_nested_past_the_recursion_limit_is_a_400(worker: Worker) -> None:
    # Its name went into the error message through repr(): RecursionError, a 500.
    deep = msgpack.unpackb(b"\x91" * 1000 + b"\x90")
    answers = await _calls(worker, [[1, deep, 0, {"op": OP}], [2, "write", deep, {"op": OP}],
                                    [3, "write", "0", {"op": OP}]], 3)
    assert {cid: status for cid, (status, _) in answers.items()} == {1: 400, 2: 400, 3: 400}, answers
    assert worker.shell.queued == []
