"""Hostile input against the worker changes nothing (issue 25).

Three layers, each driven by hypothesis:
- the replication codec (worker/codec.py `decode_message`): anything that
  is not a well-formed message raises MalformedMessage (a ValueError), never
  another exception, and a message it returns is well typed;
- `POST /v1/raft` and the peer stream: malformed bytes, malformed messages,
  or one bad message among good ones are refused (400 / the stream closes)
  and no message reaches a group;
- the data and control routes (write, write_batch, read, transfer, members,
  assignments) and the call stream: bodies with the wrong shape, wrong
  types, NaN/Infinity, ints beyond 64 bits, deep nesting, non-UTF-8, in
  JSON or msgpack or under the wrong content type, are a 4xx with the error
  body and nothing is queued to the group.
A valid request afterwards must still be served.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import msgpack
import orjson
import pytest
import structlog
from aiohttp.test_utils import TestClient
from hypothesis import strategies as st

from shardgrid.common.wire import pack_frames, packb, unpack_frame, unpackb
from tests.support.rawhttp import raw_request
from tests.tier1.fuzz_support import BAD_JSON_BYTES, HUGE_INTS, JSONISH, NON_FINITE, Tally, assert_error_answer, \
    deep_json, drive_sync, dumps, fuzz
from worker import replica_msgs as m
from worker.codec import MalformedMessage, decode_message, encode_message
from worker.process import WorkerConfig, WorkerNode
from tests.support.waiting import until
from tests.tier1.test_codec import ENTRIES
from shardgrid.common.protocol import CALLS_PATH
from worker.server import WorkerApi
from worker.transport import STREAM_PATH

MSGPACK = "application/msgpack"
INT64_MAX = (1 << 63) - 1

# -- the codec ------------------------------------------------------------------------------

ENV = dict(src="w1", dst="w2", group=0, term=3)
GOOD_MESSAGES = [
    m.Begin(**ENV), m.BeginOk(**ENV, last_term=2, last_seq=9, commit=8), m.StaleTerm(**ENV),
    m.Fetch(**ENV, prev_term=2, prev_seq=4), m.FetchReply(**ENV, ok=True, prev_seq=9, prev_term=2, entries=ENTRIES),
    m.Append(**ENV, prev_term=3, prev_seq=9, entries=ENTRIES, commit=9),
    m.AppendReply(**ENV, ok=False, prev_seq=9, match=0, hint_seq=5, hint_term=2),
    m.Heartbeat(**ENV, commit=4, round=7), m.HeartbeatReply(**ENV, round=7), m.HeartbeatReply(**ENV, round=0, commit=3),
    m.SnapshotNeeded(**ENV, snap_term=2, snap_seq=100),
]
ENCODED = [unpackb(packb(encode_message(msg))) for msg in GOOD_MESSAGES]
GOOD_HEARTBEAT = m.Heartbeat(**ENV, commit=1, round=12345)

# Values msgpack can carry (ints within 64 bits, bytes, NaN), for the msgpack paths.
MP_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=True),
                       st.text(max_size=20), st.binary(max_size=20))
MSGPACKISH = st.recursive(MP_SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), kids,
                                                  max_size=4)), max_leaves=12)

NOT_INT = st.one_of(st.text(max_size=5), st.floats(allow_nan=True), st.booleans(), st.none(), st.just([1]),
                    st.just({"a": 1}), st.binary(max_size=4), st.integers(max_value=-1),
                    st.integers(INT64_MAX + 1, (1 << 64) - 1))
NOT_STR = MSGPACKISH.filter(lambda v: type(v) is not str)
NOT_BOOL = MSGPACKISH.filter(lambda v: type(v) is not bool)
BAD_ENTRY = st.one_of(
    MSGPACKISH.filter(lambda v: type(v) is not list or len(v) != 6),
    # term, seq or ts not a non-negative int64
    st.tuples(st.integers(0, 2), NOT_INT).map(lambda t: [t[1] if i == t[0] else 1 for i in range(3)]).map(
        lambda p: [p[0], p[1], "term_start", None, None, p[2]]),
    MSGPACKISH.filter(lambda v: v not in ("op", "ops", "term_start", "config")).map(
        lambda k: [1, 1, k, None, None, 0]),
    MSGPACKISH.filter(lambda v: type(v) is not dict).map(lambda d: [1, 1, "op", d, None, 0]),
    NOT_STR.filter(lambda v: v is not None).map(lambda r: [1, 1, "op", {}, r, 0]),
    st.one_of(MSGPACKISH.filter(lambda v: type(v) is not list),
              st.lists(MSGPACKISH.filter(lambda v: type(v) is not dict), min_size=1, max_size=3)).map(
        lambda d: [1, 1, "ops", d, [None] * (len(d) if type(d) is list else 1), 0]),
    st.integers(0, 3).map(lambda n: [1, 1, "ops", [{}] * n, [None] * (n + 1), 0]),
    MSGPACKISH.filter(lambda v: not (type(v) is list and len(v) == 2 and all(type(p) is list for p in v)
                                     and all(type(w) is str for p in v for w in p))).map(
        lambda c: [1, 1, "config", c, None, 0]),
    MSGPACKISH.filter(lambda v: v is not None).map(lambda d: [1, 1, "term_start", d, None, 0]),
)
ENTRY_FIELDS = {"entries"}
BOOL_FIELDS = {"ok"}
STR_FIELDS = {"src", "dst"}


@st.composite
def bad_message(draw: st.DrawFn) -> Any:
    """An encoded message broken in one way that no reading of the format allows."""
    how = draw(st.sampled_from(["field", "missing", "entry", "type", "shape", "body"]))
    name, body = draw(st.sampled_from(ENCODED))
    body = dict(body)
    if how == "shape":
        return draw(MSGPACKISH.filter(lambda v: type(v) is not list or len(v) != 2 or type(v[1]) is not dict))
    if how == "type":
        return [draw(MSGPACKISH.filter(lambda v: v not in {"Begin", "BeginOk", "StaleTerm", "Fetch", "FetchReply",
                                                           "Append", "AppendReply", "Heartbeat",
                                                           "HeartbeatReply", "SnapshotNeeded"}
                                       if isinstance(v, str) else True)), body]
    if how == "body":
        return [name, draw(MSGPACKISH.filter(lambda v: type(v) is not dict))]
    if how == "missing":
        required = [k for k in body if not (name == "HeartbeatReply" and k == "commit")
                    and not (name in ("FetchReply", "AppendReply") and k in ("entries", "hint_seq", "hint_term",
                                                                              "match"))]
        del body[draw(st.sampled_from(sorted(required)))]
        return [name, body]
    if how == "entry" and "entries" in body:
        entries = list(body["entries"])
        entries.insert(draw(st.integers(0, len(entries))), draw(BAD_ENTRY))
        body["entries"] = entries
        return [name, body]
    key = draw(st.sampled_from(sorted(body)))
    if key in ENTRY_FIELDS:
        body[key] = draw(MSGPACKISH.filter(lambda v: type(v) is not list))
    elif key in BOOL_FIELDS:
        body[key] = draw(NOT_BOOL)
    elif key in STR_FIELDS:
        body[key] = draw(NOT_STR)
    else:
        body[key] = draw(NOT_INT.filter(lambda v: not (key == "commit" and name == "HeartbeatReply" and v is None)))
    return [name, body]


def _well_typed(msg: m.Message) -> bool:
    """Every field of `msg` has its declared type (the core relies on it)."""
    for f in msg.__dataclass_fields__.values():
        v = getattr(msg, f.name)
        kind = str(f.type)
        if kind == "int" and not (type(v) is int and 0 <= v <= INT64_MAX):
            return False
        if kind == "str" and type(v) is not str or kind == "bool" and type(v) is not bool:
            return False
        if kind == "int | None" and not (v is None or type(v) is int and 0 <= v <= INT64_MAX):
            return False
        if kind == "tuple[Entry, ...]" and not all(isinstance(e, m.Entry) for e in v):
            return False
    return True


CODEC_EXAMPLES = 600


def _check_decode(case: tuple[str, Any]) -> None:
    kind, raw = case
    if kind == "bytes":
        try:
            items = unpack_frame(raw)
        except ValueError:
            return
    else:
        items = [unpackb(packb(raw))]  # as the receiver sees it (tuples come back as lists)
    for item in items:
        try:
            msg = decode_message(item)
        except MalformedMessage:
            continue
        assert kind != "bad", item
        assert _well_typed(msg), (kind, msg.__class__.__name__)
        if kind != "deep":  # == on a value nested ~1000 deep exceeds the recursion limit
            assert decode_message(unpackb(packb(encode_message(msg)))) == msg


def test_the_codec_refuses_every_malformed_message_with_one_error(record_property: Any) -> None:
    for raw, msg in zip(ENCODED, GOOD_MESSAGES):
        assert decode_message(raw) == msg
    tally = Tally("worker codec")
    cases = st.one_of(bad_message().map(lambda r: ("bad", r)), MSGPACKISH.map(lambda r: ("any", r)),
                      st.binary(max_size=64).map(lambda b: ("bytes", b)),
                      deep_json(max_depth=1000).map(lambda t: ("deep", orjson.loads(t))).map(
                          lambda c: (c[0], ["Append", {**ENV, "prev_term": 0, "prev_seq": 0, "commit": 0,
                                                       "entries": [[1, 1, "op", c[1], None, 0]]}])))
    drive_sync(cases, _check_decode, CODEC_EXAMPLES, tally, lambda c: c[0])
    print(tally.line())
    record_property("fuzz_cases", tally.total)


# -- the entities plugin's op and query checks ------------------------------------------------
# A write's op is checked by the group's plugin (EntitiesPlugin.validate)
# before it enters the log; a read's query by EntitiesPlugin.query. Either
# refuses with BadOp (a 400) or NotFound (a 404); anything else is a 500 on
# the write path, and an op that validates but then fails to apply or to
# encode would fail the group on every replica.

PLUGIN_EXAMPLES = 500
OPS = {
    "put_item": {"kind": "put_item", "id": "a", "doc": {"x": [1, 2]}},
    "put_items": {"kind": "put_items", "ids": ["a", "b"], "docs": [b"{}", b"[1]"]},
    "delete_item": {"kind": "delete_item", "id": "a"},
    "signal": {"kind": "signal", "entity": "e", "name": "n", "value": 1, "mode": "incr"},
    "put_embedding": {"kind": "put_embedding", "id": "v", "vector": [0.1, 0.2, 0.3, 0.4]},
    "delete_embedding": {"kind": "delete_embedding", "id": "v"},
}
QUERIES = {
    "get_item": {"kind": "get_item", "id": "a"},
    "get_signals": {"kind": "get_signals", "entity": "e"},
    "get_embedding": {"kind": "get_embedding", "id": "v"},
    "search": {"kind": "search", "vector": [0.1, 0.2, 0.3, 0.4], "k": 3},
}
HOSTILE_VALUES = st.one_of(MSGPACKISH, HUGE_INTS, NON_FINITE, st.integers(max_value=-1),
                           st.text(min_size=257, max_size=300),
                           deep_json(max_depth=1000).map(orjson.loads),
                           st.lists(MSGPACKISH, min_size=4, max_size=4))


@st.composite
def hostile_op(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    table = draw(st.sampled_from([OPS, QUERIES]))
    name = draw(st.sampled_from(sorted(table)))
    op = dict(table[name])
    how = draw(st.sampled_from(["field", "field", "missing", "extra"]))
    if how == "field":
        op[draw(st.sampled_from(sorted(op)))] = draw(HOSTILE_VALUES)
    elif how == "missing":
        del op[draw(st.sampled_from(sorted(op)))]
    else:
        op[draw(st.text(max_size=8).filter(lambda k: k not in op))] = draw(HOSTILE_VALUES)
    return ("op" if table is OPS else "query") + ":" + name, op


def test_the_plugin_refuses_hostile_ops_and_queries_with_bad_op(record_property: Any) -> None:
    from worker.plugins.base import ApplyContext, BadOp, NotFound, PluginSettings
    from worker.plugins.entities import EntitiesPlugin

    plugin = EntitiesPlugin(PluginSettings(embedding_dim=4))
    tally = Tally("worker plugin")

    def check(case: tuple[str, dict[str, Any]]) -> None:
        kind, op = case
        if kind.startswith("query:"):
            try:
                answer = plugin.query(op)
            except (BadOp, NotFound):
                return
            packb(answer)
            return
        try:
            plugin.validate(op)
        except BadOp:
            return
        # Admitted: it must go into the log and apply on every replica.
        packb(op)
        try:
            plugin.apply(op, ApplyContext(seq=1, term=1, ts_ms=0))
        except BadOp:
            pass  # what the state refuses (a counter that would leave int64) is fine

    drive_sync(hostile_op(), check, PLUGIN_EXAMPLES, tally, lambda c: c[0].split(":")[0])
    print(tally.line())
    record_property("fuzz_cases", tally.total)


# -- the HTTP routes and streams --------------------------------------------------------


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
class _Replica:
    leader: str | None = "w1"
    term: int = 1


@dataclass
class _Shell:
    """Group 0 as the routes see it; records everything that reaches it."""

    gid: int = 0
    queued: list[tuple[str, Any]] = field(default_factory=list)
    replica: _Replica = field(default_factory=_Replica)

    def deliver(self, event: Any) -> None:
        self.queued.append(("deliver", event))

    async def write(self, op: Any, ack: str, rid: str | None, timeout_s: float, size: int = 0) -> _Out:
        self.queued.append(("write", op))
        return _Out()

    async def write_many(self, writes: list[tuple[Any, str | None]], ack: str, timeout_s: float,
                         size: int = 0) -> list[_Out]:
        self.queued.append(("write_many", writes))
        return [_Out(seq=i + 1) for i in range(len(writes))]

    async def read(self, query: Any, consistency: str, min_seq: int, timeout_s: float, size: int = 0) -> _Out:
        self.queued.append(("read", query))
        return _Out()

    async def change_members(self, change: dict[str, str], timeout_s: float) -> _Out:
        self.queued.append(("members", change))
        return _Out()


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


# What each route accepts, written independently of worker/server.py.

def _num_ms_ok(v: Any) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and 0 < v <= 3_600_000)


def _envelope_ok(body: dict[str, Any]) -> bool:
    return (body.get("ack", "quorum") in ("leader", "quorum", "all")
            and ("deadline_ms" not in body or _num_ms_ok(body["deadline_ms"])))


def _rid_ok(v: Any) -> bool:
    return v is None or isinstance(v, str) and 0 < len(v) <= 128


def write_ok(b: Any) -> bool:
    return isinstance(b, dict) and isinstance(b.get("op"), dict) and _envelope_ok(b) and _rid_ok(b.get("rid"))


def write_batch_ok(b: Any) -> bool:
    # Per-write problems are answered per write (200): only the envelope can be a 4xx.
    return (isinstance(b, dict) and isinstance(b.get("writes"), list) and bool(b["writes"])
            and len(b["writes"]) <= 10_000 and _envelope_ok(b))


def read_ok(b: Any) -> bool:
    if not isinstance(b, dict) or not isinstance(b.get("query"), dict):
        return False
    min_seq = b.get("min_seq", 0)
    return (b.get("consistency", "strong") in ("strong", "follower") and isinstance(min_seq, int)
            and not isinstance(min_seq, bool) and min_seq >= 0
            and ("deadline_ms" not in b or _num_ms_ok(b["deadline_ms"])))


def transfer_ok(b: Any) -> bool:
    return isinstance(b, dict) and isinstance(b.get("to"), str) and bool(b["to"])


def members_ok(b: Any) -> bool:
    if not isinstance(b, dict):
        return False
    set_ = [b[k] for k in ("add_learner", "promote", "remove") if b.get(k)]
    return len(set_) == 1 and isinstance(set_[0], str)


def assignment_ok(b: Any) -> bool:
    if not isinstance(b, dict):
        return False
    g, n = b.get("group"), b.get("bytes", 0)
    return (isinstance(g, int) and not isinstance(g, bool) and isinstance(n, int) and not isinstance(n, bool)
            and n >= 0)


# route -> (path, accepts, a valid body, {field: candidate values})
OP = {"kind": "put_item", "id": "a", "doc": {}}
ROUTES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "write": ("/v1/groups/0/write", write_ok, {"op": OP, "ack": "quorum", "rid": "r1", "deadline_ms": 1000}),
    "write_batch": ("/v1/groups/0/write_batch", write_batch_ok,
                    {"writes": [{"op": OP, "rid": "r1"}], "ack": "leader", "deadline_ms": 1000}),
    "read": ("/v1/groups/0/read", read_ok, {"query": {"kind": "get_item", "id": "a"}, "consistency": "follower",
                                            "min_seq": 3, "deadline_ms": 1000}),
    "transfer": ("/v1/groups/0/transfer", transfer_ok, {"to": "w2"}),
    "members": ("/v1/groups/0/members", members_ok, {"add_learner": "w4"}),
    "assignments": ("/v1/assignments", assignment_ok, {"group": 3, "bytes": 100}),
}
CONFUSED = st.one_of(JSONISH, HUGE_INTS, NON_FINITE, st.integers(max_value=-1), st.just(""), st.just([]),
                     st.just({}), st.text(min_size=129, max_size=140))
_UNREADABLE = object()


def decoded(raw: bytes, content_type: str) -> Any:
    """The body as the worker reads it (its rules for content types), or _UNREADABLE."""
    if not raw:
        return {}
    try:
        return unpackb(raw) if content_type == MSGPACK else orjson.loads(raw)
    except (ValueError, orjson.JSONDecodeError):
        return _UNREADABLE


def _encode(value: Any, content_type: str) -> bytes | None:
    if content_type == MSGPACK:
        try:
            return msgpack.packb(value, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):
            return None  # beyond what msgpack carries (an int over 64 bits)
    try:
        return dumps(value).encode()
    except (TypeError, ValueError, RecursionError):
        return None  # beyond what JSON carries (bytes)


@dataclass(frozen=True)
class Case:
    kind: str
    route: str
    content_type: str
    body: bytes


CONTENT_TYPES = (MSGPACK, "application/json", "text/plain", "")


@st.composite
def hostile_body(draw: st.DrawFn, routes: tuple[str, ...] = tuple(sorted(ROUTES)),
                 content_types: tuple[str, ...] = CONTENT_TYPES) -> Case:
    route = draw(st.sampled_from(routes))
    path, ok, good = ROUTES[route]
    content_type = draw(st.sampled_from(content_types))
    how = draw(st.sampled_from(["field", "field", "missing", "not_object", "bytes", "deep", "wrong_encoding",
                                "non_utf8"]))
    value: Any = dict(good)
    raw: bytes | None
    if how == "field":
        value[draw(st.sampled_from(sorted(good)))] = draw(CONFUSED)
    elif how == "missing":
        del value[draw(st.sampled_from(sorted(good)))]
    elif how == "not_object":
        value = draw(st.one_of(JSONISH, MSGPACKISH).filter(lambda v: not isinstance(v, dict)))
    if how == "bytes":
        raw = draw(st.one_of(st.binary(max_size=64), BAD_JSON_BYTES))
    elif how == "deep":
        raw = draw(deep_json(min_depth=255, max_depth=1100)).encode()
        if content_type == MSGPACK:
            raw = b"\x91" * len(raw) + b"\x01"  # an array of an array of ... as deep, in msgpack
    elif how == "wrong_encoding":
        other = "application/json" if content_type == MSGPACK else MSGPACK
        raw = _encode(value, other)
    elif how == "non_utf8":
        raw = (b"\x81\xa2to\xa2\xff\xfe" if content_type == MSGPACK
               else b'{"to": "\xff\xfe", "op": {"k": "\xc3\x28"}, "group": 1}')
    else:
        raw = _encode(value, content_type)
    if raw is None:
        raw = b"\xc1"  # the value cannot be written this way: send bytes no decoder reads
    body = decoded(raw, content_type)
    if body is not _UNREADABLE and ok(body):
        raw = b"\xc1"  # this draw happened to be valid: make it malformed in every encoding
    return Case(f"{route}:{how}", path, content_type, raw)


@st.composite
def raft_batch(draw: st.DrawFn) -> Case:
    """A body for POST /v1/raft that must deliver nothing: garbage, or good messages and one bad."""
    how = draw(st.sampled_from(["bytes", "not_array", "one_bad"]))
    if how == "bytes":
        raw = draw(st.binary(min_size=1, max_size=64).filter(lambda b: decoded(b, MSGPACK) is _UNREADABLE))
    elif how == "not_array":
        raw = packb(draw(MSGPACKISH.filter(lambda v: not isinstance(v, list))))
    else:
        batch = draw(st.lists(st.sampled_from(ENCODED), max_size=3))
        batch.insert(draw(st.integers(0, len(batch))), draw(bad_message()))
        raw = packb(batch)
    return Case(f"raft:{how}", "/v1/raft", draw(st.sampled_from([MSGPACK, ""])), raw)


@st.composite
def stream_frame(draw: st.DrawFn) -> bytes:
    """A peer stream frame (messages back to back) with good messages and one bad."""
    items = draw(st.lists(st.sampled_from(ENCODED), max_size=3))
    items.insert(draw(st.integers(0, len(items))), draw(bad_message()))
    return b"".join(packb(item) for item in items)


WORKER_EXAMPLES = 450


async def _served(w: Worker) -> None:
    """Valid requests after the fuzz: the worker still serves, and they reach the group."""
    w.shell.queued.clear()  # what the last fuzz case delivered (a stream case ends with a good heartbeat)
    resp = await w.client.post("/v1/groups/0/write", data=packb({"op": OP}), headers={"Content-Type": MSGPACK})
    assert resp.status == 200, await resp.text()
    resp = await w.client.post("/v1/raft", data=packb([ENCODED[0]]), headers={"Content-Type": MSGPACK})
    assert resp.status == 204, await resp.text()
    assert [k for k, _ in w.shell.queued] == ["write", "deliver"], w.shell.queued


async def test_hostile_bodies_are_4xx_and_reach_no_group(worker: Worker, record_property: Any) -> None:
    tally = Tally("worker http")
    port = worker.client.port

    async def check(case: Case) -> None:
        worker.shell.queued.clear()  # per case, so that a failure replays alone when hypothesis shrinks it
        headers = [b"Content-Type: " + case.content_type.encode()] if case.content_type else []
        status, answer_headers, body = await raw_request("127.0.0.1", port, "POST", case.route.encode(), headers,
                                                         case.body)
        assert_error_answer(status, answer_headers, body, case)
        assert worker.shell.queued == [], (case, worker.shell.queued)

    await fuzz(st.one_of(hostile_body(), hostile_body(), raft_batch()), check, WORKER_EXAMPLES, tally,
               lambda c: c.kind.split(":")[0])
    await _served(worker)
    print(tally.line())
    record_property("fuzz_cases", tally.total)


STREAM_EXAMPLES = 200


async def test_hostile_frames_on_the_streams_reach_no_group(worker: Worker, record_property: Any) -> None:
    """The peer stream drops a malformed frame and delivers none of it; the
    call stream answers each hostile call with a 4xx and queues nothing."""
    tally = Tally("worker streams")

    good = b"".join(pack_frames([encode_message(GOOD_HEARTBEAT)]))

    async def peer(frame: bytes) -> None:
        # A malformed frame or message is dropped and counted; the stream goes on
        # (the core retransmits what a dropped one carried).
        worker.shell.queued.clear()
        ws = await worker.client.ws_connect(STREAM_PATH)
        try:
            await ws.send_bytes(frame)
            await ws.send_bytes(good)
            await until(lambda: any(e == GOOD_HEARTBEAT for _, e in worker.shell.queued),
                        "the good frame after a hostile one", timeout_s=3)
        finally:
            await ws.close()
        # A well-formed message beside a malformed one in a frame is delivered;
        # nothing malformed ever is.
        assert all(k == "deliver" and _well_typed(e) for k, e in worker.shell.queued), worker.shell.queued

    async def call(case: Case) -> None:
        worker.shell.queued.clear()
        op = {"/v1/groups/0/write": "write", "/v1/groups/0/write_batch": "write_batch",
              "/v1/groups/0/read": "read"}[case.route]
        body = decoded(case.body, case.content_type)
        ws = await worker.client.ws_connect(CALLS_PATH)
        try:
            await ws.send_bytes(b"".join(pack_frames([[7, op, 0, None if body is _UNREADABLE else body]])))
            msg = await asyncio.wait_for(ws.receive(), 3)
            assert msg.type == aiohttp.WSMsgType.BINARY, msg
            [[cid, status, answer]] = unpack_frame(msg.data)
            assert cid == 7 and 400 <= status <= 499, (case, status, answer)
            assert isinstance(answer["error"]["code"], str) and isinstance(answer["error"]["message"], str)
        finally:
            await ws.close()
        assert worker.shell.queued == [], (case, worker.shell.queued)

    frames = st.one_of(stream_frame(), st.binary(min_size=1, max_size=64).filter(lambda b: not _frame_ok(b)))
    calls = hostile_body(("read", "write", "write_batch"), (MSGPACK,))

    async def bad_call(case: tuple[Any, Any]) -> None:
        worker.shell.queued.clear()
        op, gid = case
        ws = await worker.client.ws_connect(CALLS_PATH)
        try:
            await ws.send_bytes(b"".join(pack_frames([[8, op, gid, {"op": OP}]])))
            msg = await asyncio.wait_for(ws.receive(), 3)
            assert msg.type == aiohttp.WSMsgType.BINARY, msg
            [[cid, status, answer]] = unpack_frame(msg.data)
            assert cid == 8 and 400 <= status <= 499, (case, status, answer)
        finally:
            await ws.close()
        assert worker.shell.queued == [], worker.shell.queued

    async def check(case: Any) -> None:
        if isinstance(case, bytes):
            await peer(case)
        elif isinstance(case, tuple):
            await bad_call(case)
        else:
            await call(case)

    deep_msgpack = st.integers(255, 1000).map(lambda n: msgpack.unpackb(b"\x91" * n + b"\x90"))
    names = st.one_of(MSGPACKISH.filter(lambda v: v not in ("write", "write_batch", "read")
                                        if isinstance(v, str) else True), deep_msgpack)
    gids = st.one_of(MSGPACKISH.filter(lambda v: type(v) is not int), deep_msgpack)
    bad_calls = st.one_of(st.tuples(names, st.just(0)), st.tuples(st.just("write"), gids))
    await fuzz(st.one_of(frames, calls, calls, bad_calls), check, STREAM_EXAMPLES, tally,
               lambda c: "peer_stream" if isinstance(c, bytes) else "call_name_or_group" if isinstance(c, tuple)
               else "call_stream")
    await _served(worker)
    print(tally.line())
    record_property("fuzz_cases", tally.total)


def _frame_ok(frame: bytes) -> bool:
    try:
        items = unpack_frame(frame)
    except ValueError:
        return False
    return bool(items) and all(type(i) is list and i and type(i[0]) is str for i in items)
