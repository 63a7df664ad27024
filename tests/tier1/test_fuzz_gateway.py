"""Hostile input against the gateway's public API changes nothing (issue 25).

Hypothesis builds requests that are wrong by construction (malformed or
non-UTF-8 JSON, NaN/Infinity, nesting past what orjson writes, type-confused
fields, ints beyond 64 bits, oversized bodies, msgpack or form bodies, bad
`x-*` headers, bad Authorization on the operator verbs) and sends them as
raw bytes. Every answer must be a 4xx with the one error body, no fake
worker or meta verb may have been called, and a valid request afterwards
must still be served.
"""
from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import orjson
from hypothesis import strategies as st

from tests.support.rawhttp import raw_request
from tests.tier1.fuzz_support import BAD_JSON_BYTES, JSONISH, Case, Tally, assert_error_answer, deep_json, dumps, fuzz, \
    header_value
from tests.tier1.test_gateway_fakes import Fakes, make_fakes, start_gateway

TOKEN = "fuzz-admin-token"
DIM = 4
V4 = [0.1, 0.2, 0.3, 0.4]
MAX_EXAMPLES = 500


# -- what the API accepts, written independently of gateway/routes.py ---------------------

def id_ok(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v.encode("utf-8", "surrogatepass")) <= 256


def number_ok(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return -(1 << 63) <= v < (1 << 63) if isinstance(v, int) else math.isfinite(v)


def vector_ok(v: Any) -> bool:
    if not isinstance(v, list) or len(v) != DIM or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                      for x in v):
        return False
    try:
        packed = struct.pack(f"<{DIM}f", *v)
    except (OverflowError, struct.error):
        return False
    return any(struct.unpack(f"<{DIM}f", packed))


def k_ok(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1000


def parsed(value: Any) -> Any:
    """`value` as the gateway sees it after the JSON round trip (orjson reads an
    integer beyond 64 bits as a float), or a marker when it cannot be read at all."""
    try:
        return orjson.loads(dumps(value))
    except orjson.JSONDecodeError:
        return _UNREADABLE


_UNREADABLE = object()


def bad(ok: Any) -> Any:
    """Values that `ok` refuses once read as JSON (or that are not JSON at all)."""
    return JSONISH.filter(lambda v: (p := parsed(v)) is _UNREADABLE or not ok(p))


BAD_ID = st.one_of(bad(id_ok), st.just(""), st.text(min_size=257, max_size=300),
                   st.text(st.characters(min_codepoint=0x80, max_codepoint=0xFFFF, exclude_categories=("Cs",)),
                           min_size=129, max_size=140).filter(lambda s: len(s.encode()) > 256))
BAD_VECTOR = st.one_of(
    bad(vector_ok),
    st.lists(st.floats(-1, 1), max_size=8).filter(lambda v: len(v) != DIM),
    st.lists(st.sampled_from([0, 0.0, -0.0, 1e-46]), min_size=DIM, max_size=DIM),
    st.lists(st.floats(allow_nan=True), min_size=DIM, max_size=DIM).filter(lambda v: not vector_ok(parsed(v))),
    st.tuples(st.integers(0, DIM - 1), st.sampled_from([1e39, -1e39, True, None, "1", [1], {}])).map(
        lambda t: [t[1] if i == t[0] else 0.5 for i in range(DIM)]),
)

def seed_ok(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**63


def rows_ok(v: Any) -> bool:
    return isinstance(v, list) and 1 <= len(v) <= 1024 and all(
        isinstance(r, list) and len(r) == DIM and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and abs(x) < 3e38 for x in r) for r in v)


BAD_INPUT = st.one_of(bad(rows_ok), st.just([]),
                      st.lists(st.floats(-1, 1), max_size=8).filter(lambda v: len(v) != DIM).map(lambda v: [v]),
                      st.tuples(st.integers(0, DIM - 1), st.sampled_from([1e39, -1e39, True, None, "1", [1], {}])).map(
                          lambda t: [[t[1] if i == t[0] else 0.5 for i in range(DIM)]]),
                      st.lists(st.just(V4), min_size=1, max_size=3).map(lambda rows: [*rows, [1.0]]))

# route -> (method, target, a valid body, {field: strategy of a value the field refuses}, optional keys)
ROUTES: dict[str, tuple[str, bytes, dict[str, Any], dict[str, st.SearchStrategy[Any]], tuple[str, ...]]] = {
    "signal": ("POST", b"/signals", {"entity": "e", "kind": "k", "value": 1},
               {"entity": BAD_ID, "kind": BAD_ID, "value": bad(number_ok),
                "mode": JSONISH.filter(lambda v: v not in (None, "incr", "set"))}, ("mode",)),
    "search": ("POST", b"/search", {"vector": V4, "k": 3}, {"vector": BAD_VECTOR, "k": bad(k_ok)}, ()),
    "embedding": ("PUT", b"/embeddings/e", {"vector": V4}, {"vector": BAD_VECTOR}, ()),
    "infer": ("POST", b"/v1/models/m/infer", {"input": [V4]}, {"input": BAD_INPUT}, ()),
    "weights": ("POST", b"/v1/models/m/weights", {"seed": 1, "version": 2},
                {"seed": bad(seed_ok), "version": bad(lambda v: v is None or seed_ok(v) and v >= 1)}, ("version",)),
    "batch": ("POST", b"/batch", {"writes": [{"op": "delete_item", "id": "a"}]},
              {"writes": JSONISH.filter(lambda v: not isinstance(parsed(v), list) or parsed(v) == [])}, ()),
}
BODY_ROUTES = [("PUT", b"/items/k"), *((m, t) for m, t, *_ in ROUTES.values())]


def _json(value: Any) -> bytes:
    return dumps(value).encode()


@st.composite
def type_confused(draw: st.DrawFn) -> Case:
    name = draw(st.sampled_from(sorted(ROUTES)))
    method, target, good, fields, optional = ROUTES[name]
    how = draw(st.sampled_from(["field", "missing", "extra", "not_object"]))
    body: Any = dict(good)
    if how == "field":
        field = draw(st.sampled_from(sorted(fields)))
        body[field] = draw(fields[field])
    elif how == "missing":
        required = [k for k in good if k not in optional]
        del body[draw(st.sampled_from(required))]
    elif how == "extra":
        body[draw(st.text(max_size=10).filter(lambda k: k not in good and k not in optional))] = draw(JSONISH)
    else:
        body = draw(JSONISH.filter(lambda v: not isinstance(parsed(v), dict)))
    return Case(f"type_confused:{name}", method, target, _json(body))


# One bad write among good ones: the whole batch is refused, nothing is sent.
GOOD_WRITES = st.sampled_from([
    {"op": "put_item", "id": "a", "doc": {"x": [1, 2]}}, {"op": "delete_item", "id": "b"},
    {"op": "signal", "entity": "e", "kind": "k", "value": 2, "mode": "set"},
    {"op": "put_embedding", "id": "v", "vector": V4}, {"op": "delete_embedding", "id": "v"},
])
BAD_WRITES = st.one_of(
    JSONISH.filter(lambda v: not isinstance(parsed(v), dict)),
    st.fixed_dictionaries({"op": JSONISH.filter(lambda v: v not in ("put_item", "delete_item", "signal",
                                                                     "put_embedding", "delete_embedding")),
                           "id": st.just("a")}),
    BAD_ID.map(lambda i: {"op": "put_item", "id": i, "doc": 1}),
    BAD_ID.map(lambda i: {"op": "delete_embedding", "id": i}),
    st.just({"op": "put_item", "id": "a"}),
    st.just({"op": "delete_item", "id": "a", "doc": 1}),
    bad(number_ok).map(lambda v: {"op": "signal", "entity": "e", "kind": "k", "value": v}),
    BAD_VECTOR.map(lambda v: {"op": "put_embedding", "id": "v", "vector": v}),
)


@st.composite
def bad_batch(draw: st.DrawFn) -> Case:
    writes = draw(st.lists(GOOD_WRITES, max_size=4))
    writes.insert(draw(st.integers(0, len(writes))), draw(BAD_WRITES))
    return Case("batch_one_bad_write", "POST", b"/batch", _json({"writes": writes}))


@st.composite
def too_deep(draw: st.DrawFn) -> Case:
    """Valid JSON nested deeper than orjson can write back: a doc nobody could read again."""
    deep = draw(deep_json())
    where = draw(st.sampled_from(["item", "signal", "signal_mode", "signal_entity", "embedding", "search",
                                  "search_k", "batch", "batch_put", "batch_op", "batch_id"]))
    method, target, text = {
        "item": ("PUT", b"/items/k", deep),
        "signal": ("POST", b"/signals", '{"entity": "e", "kind": "k", "value": %s}' % deep),
        "signal_mode": ("POST", b"/signals", '{"entity": "e", "kind": "k", "value": 1, "mode": %s}' % deep),
        "signal_entity": ("POST", b"/signals", '{"entity": %s, "kind": "k", "value": 1}' % deep),
        "search_k": ("POST", b"/search", '{"vector": [1, 0, 0, 0], "k": %s}' % deep),
        "batch_op": ("POST", b"/batch", '{"writes": [{"op": %s, "id": "a"}]}' % deep),
        "batch_id": ("POST", b"/batch", '{"writes": [{"op": "delete_item", "id": %s}]}' % deep),
        "embedding": ("PUT", b"/embeddings/e", '{"vector": %s}' % deep),
        "search": ("POST", b"/search", '{"vector": %s, "k": 1}' % deep),
        "batch": ("POST", b"/batch", '{"writes": [%s]}' % deep),
        "batch_put": ("POST", b"/batch", '{"writes": [{"op": "put_item", "id": "a", "doc": %s}]}' % deep),
    }[where]
    return Case(f"too_deep:{where}", method, target, text.encode())


@st.composite
def malformed(draw: st.DrawFn) -> Case:
    method, target = draw(st.sampled_from(BODY_ROUTES))
    return Case("malformed_json", method, target, draw(BAD_JSON_BYTES))


@st.composite
def wrong_content_type(draw: st.DrawFn) -> Case:
    method, target = draw(st.sampled_from(BODY_ROUTES))
    value = draw(st.sampled_from([{"entity": "e", "kind": "k", "value": 1}, {"vector": V4, "k": 1}, {"x": 1},
                                  [1, 2], "text"]))
    content_type, body = draw(st.sampled_from([
        (b"application/msgpack", msgpack.packb(value)),
        (b"application/x-www-form-urlencoded", b"entity=e&kind=k&value=1"),
        (b"multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--"),
    ]))
    return Case("wrong_content_type", method, target, body, (b"Content-Type: " + content_type,))


def _ack_ok(v: bytes) -> bool:
    return v in (b"leader", b"quorum", b"all")


def _digits_ok(low: int, high: int) -> Any:
    return lambda v: v.isdigit() and v.isascii() and len(v) <= 19 and low <= int(v) <= high


def _rid_ok(v: bytes) -> bool:
    return 0 < len(v) <= 100 and all(0x21 <= c <= 0x7E and c != 0x23 for c in v)


HEADERS = {
    b"x-ack": _ack_ok, b"x-consistency": lambda v: v in (b"strong", b"follower"),
    b"x-min-seq": _digits_ok(0, (1 << 63) - 1), b"x-deadline-ms": _digits_ok(1, 300_000), b"x-request-id": _rid_ok,
}


@st.composite
def bad_header(draw: st.DrawFn) -> Case:
    name = draw(st.sampled_from(sorted(HEADERS)))
    value = draw(header_value(HEADERS[name]))
    method, target, body = draw(st.sampled_from([("PUT", b"/items/k", b'{"x": 1}'), ("GET", b"/items/k", b""),
                                                 ("DELETE", b"/items/k", b""),
                                                 ("POST", b"/signals", b'{"entity": "e", "kind": "k", "value": 1}'),
                                                 ("POST", b"/batch", b'{"writes": [{"op": "delete_item", "id": "a"}]}'),
                                                 ("POST", b"/search", b'{"vector": [1, 0, 0, 0], "k": 1}')]))
    return Case(f"bad_header:{name.decode()}", method, target, body, (name + b": " + value,))


def _quote(s: str) -> bytes:
    return "".join(c if c.isascii() and c.isalnum() else "".join(f"%{b:02X}" for b in c.encode()) for c in s).encode()


@st.composite
def bad_path_id(draw: st.DrawFn) -> Case:
    key = draw(st.one_of(st.just(""), st.text(min_size=257, max_size=300).filter(lambda s: len(s.encode()) > 256)))
    method, prefix, body = draw(st.sampled_from([("PUT", b"/items/", b"{}"), ("GET", b"/items/", b""),
                                                 ("DELETE", b"/items/", b""), ("GET", b"/signals/", b""),
                                                 ("PUT", b"/embeddings/", b'{"vector": [1, 2, 3, 4]}'),
                                                 ("GET", b"/embeddings/", b""), ("DELETE", b"/embeddings/", b"")]))
    return Case("bad_path_id", method, prefix + _quote(key), body)


def _auth_ok(v: bytes) -> bool:
    return v[:7].lower() == b"bearer " and v[7:] == TOKEN.encode()


@st.composite
def bad_operator(draw: st.DrawFn) -> Case:
    how = draw(st.sampled_from(["authorization", "no_authorization", "gid", "deadline"]))
    method, target = draw(st.sampled_from([("POST", b"/cluster/shards/0/transfer"),
                                           ("POST", b"/cluster/shards/1/replicas"),
                                           ("GET", b"/cluster/status"), ("GET", b"/cluster/shards")]))
    auth = b"Authorization: Bearer " + TOKEN.encode()
    body = draw(st.sampled_from([b"", b'{"to": "w2"}', b'{"add": "w4"}']))
    if how == "authorization":
        auth = b"Authorization: " + draw(st.one_of(
            header_value(_auth_ok),
            st.sampled_from([b"Bearer", b"Bearer ", b"Bearer  " + TOKEN.encode(), b"Basic " + TOKEN.encode(),
                             b"Bearer " + TOKEN.encode() + b"\xff", b"Bearer \xc3\x28", b"bearer\t" + TOKEN.encode(),
                             b"Bearer " + TOKEN.encode() + b" x", b"Bearer " + TOKEN[:-1].encode()])))
        return Case("bad_authorization", method, target, body, (auth,), (401, 401))
    if how == "no_authorization":
        return Case("bad_authorization", method, target, body, (), (401, 401))
    if how == "gid":
        gid = draw(st.one_of(st.text(min_size=1, max_size=25).filter(lambda s: not (s.isascii() and s.isdigit()
                                                                                    and len(s) <= 19)),
                             st.integers(min_value=10 ** 19, max_value=10 ** 40).map(str),
                             st.integers(max_value=-1).map(str)))
        verb = draw(st.sampled_from([b"transfer", b"replicas"]))
        return Case("bad_operator_gid", "POST", b"/cluster/shards/" + _quote(gid) + b"/" + verb, body, (auth,))
    value = draw(header_value(HEADERS[b"x-deadline-ms"]))
    return Case("bad_operator_deadline", method, target, body, (auth, b"x-deadline-ms: " + value))


@st.composite
def oversized(draw: st.DrawFn) -> Case:
    extra = draw(st.integers(1, 4096))
    # A weights file may be far larger than a data request (gateway/models.py MAX_WEIGHTS_BYTES).
    method, target = draw(st.sampled_from([r for r in BODY_ROUTES if not r[1].endswith(b"/weights")]))
    return Case("oversized", method, target, b'"' + b"x" * ((1 << 20) + extra) + b'"', (), (413, 413))


CASES = st.one_of(malformed(), too_deep(), too_deep(), type_confused(), bad_batch(), wrong_content_type(), bad_header(),
                  bad_path_id(), bad_operator())


async def _serving(port: int, f: Fakes) -> None:
    """A valid write and read after the fuzz: the gateway still serves, and the write lands."""
    auth = b"Authorization: Bearer " + TOKEN.encode()
    status, _, body = await raw_request("127.0.0.1", port, "PUT", b"/items/after-fuzz", [], b'{"ok": true}')
    assert status == 200, body
    status, _, body = await raw_request("127.0.0.1", port, "GET", b"/items/after-fuzz", [])
    assert status == 200 and orjson.loads(body) == {"ok": True}, body
    status, _, body = await raw_request("127.0.0.1", port, "GET", b"/cluster/shards", [auth])
    assert status == 200, body


async def _run(aiohttp_server: Any, aiohttp_client: Any, strategy: st.SearchStrategy[Case], max_examples: int,
               surface: str) -> Tally:
    f = await make_fakes(aiohttp_server, shards=3, dim=DIM)
    client, _ = await start_gateway(aiohttp_client, [f.meta_addr], admin_token=TOKEN)
    port = client.port
    tally = Tally(surface)

    async def check(case: Case) -> None:
        # Per case, so that a failure replays alone when hypothesis shrinks it.
        for w in f.workers.values():
            w.calls.clear()
            w.items.clear()
        f.meta.verbs.clear()
        status, headers, body = await raw_request("127.0.0.1", port, case.method, case.target, list(case.headers),
                                                  case.body)
        assert_error_answer(status, headers, body, case, *case.status)
        assert f.calls() == [], (case, f.calls())
        assert f.meta.verbs == [], (case, f.meta.verbs)

    await fuzz(strategy, check, max_examples, tally, lambda c: c.kind)
    assert all(not w.items and not w.signals and not w.embeddings for w in f.workers.values())
    await _serving(port, f)
    print(tally.line())
    return tally


async def test_hostile_requests_are_4xx_and_change_nothing(aiohttp_server: Any, aiohttp_client: Any,
                                                           record_property: Any) -> None:
    tally = await _run(aiohttp_server, aiohttp_client, CASES, MAX_EXAMPLES, "gateway")
    record_property("fuzz_cases", tally.total)
    assert tally.total >= MAX_EXAMPLES // 2


async def test_oversized_bodies_are_413_and_change_nothing(aiohttp_server: Any, aiohttp_client: Any,
                                                           record_property: Any) -> None:
    # Apart, and few: each case moves a megabyte.
    tally = await _run(aiohttp_server, aiohttp_client, oversized(), 15, "gateway oversized")
    record_property("fuzz_cases", tally.total)


@st.composite
def unparseable(draw: st.DrawFn) -> Case:
    """Requests aiohttp's HTTP parser refuses before any handler runs: control
    bytes in a header, raw non-ASCII in the path, a line over 8190 bytes."""
    how = draw(st.sampled_from(["header_control", "path_byte", "long_line", "header_name"]))
    if how == "header_control":
        value = draw(st.binary(min_size=1, max_size=20)).replace(b"\r", b"").replace(b"\n", b"")
        value += bytes([draw(st.sampled_from([0, 1, 8, 0x0B, 0x0C, 0x1F, 0x7F]))])
        return Case(how, "PUT", b"/items/k", b'{"x": 1}', (b"x-request-id: " + value,))
    if how == "path_byte":
        return Case(how, "PUT", b"/items/k" + bytes([draw(st.integers(0x80, 0xFF))]), b'{"x": 1}')
    if how == "long_line":
        return Case(how, "PUT", b"/items/" + b"k" * draw(st.integers(8200, 9000)), b'{"x": 1}')
    name = draw(st.sampled_from([b"x ack", b"x-ack\xff", b"(x)", b"x@y", b""]))
    return Case(how, "PUT", b"/items/k", b'{"x": 1}', (name + b": leader",))


async def test_what_the_http_parser_refuses_is_400_and_changes_nothing(aiohttp_server: Any, aiohttp_client: Any,
                                                                      record_property: Any) -> None:
    """These never reach the gateway's code, so their body is aiohttp's short
    plain-text reason, not the JSON error body: a 400 without a trace, and
    nothing stored."""
    f = await make_fakes(aiohttp_server, shards=3, dim=DIM)
    client, _ = await start_gateway(aiohttp_client, [f.meta_addr], admin_token=TOKEN)
    tally = Tally("gateway http parser")

    async def check(case: Case) -> None:
        status, _, body = await raw_request("127.0.0.1", client.port, case.method, case.target, list(case.headers),
                                            case.body)
        assert status == 400 and b"Traceback" not in body and b'File "' not in body, (case, status, body[:300])
        assert f.calls() == [], case

    await fuzz(unparseable(), check, 40, tally, lambda c: c.kind)
    await _serving(client.port, f)
    print(tally.line())
    record_property("fuzz_cases", tally.total)
