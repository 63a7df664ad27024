"""Every bad-input class gets 400 (or 413) with the error body, and no worker is called."""
from __future__ import annotations

import io
from typing import Any

import orjson
import pytest

from gateway.routes import batch_write
from shardgrid.common.wire import ApiError
from tests.tier1.test_gateway_fakes import make_fakes, start_gateway

V4 = [0.1, 0.2, 0.3, 0.4]


def _batch(*writes: Any) -> bytes:
    return orjson.dumps({"writes": list(writes)})


BAD: list[tuple[str, str, str, Any, dict[str, str], str]] = [
    # name, method, path, body, headers, expected message fragment
    ("malformed json", "PUT", "/items/k", b'{"a": ', {}, "malformed JSON"),
    ("empty body", "PUT", "/items/k", b"", {}, "empty"),
    ("nan literal", "PUT", "/items/k", b"NaN", {}, "malformed JSON"),
    ("empty id", "PUT", "/items/", b"{}", {}, "must not be empty"),
    ("long id", "PUT", "/items/" + "x" * 257, b"{}", {}, "257 bytes"),
    ("long utf8 id", "GET", "/items/" + "é" * 129, None, {}, "258 bytes"),
    ("empty entity", "GET", "/signals/", None, {}, "must not be empty"),
    ("signal body not object", "POST", "/signals", b"[1]", {}, "must be a JSON object"),
    ("signal missing value", "POST", "/signals", b'{"entity": "e", "kind": "k"}', {}, "missing 'value'"),
    ("signal unknown key", "POST", "/signals", b'{"entity": "e", "kind": "k", "value": 1, "x": 2}', {},
     "unexpected key"),
    ("signal bool value", "POST", "/signals", b'{"entity": "e", "kind": "k", "value": true}', {},
     "must be a number, got boolean"),
    ("signal string value", "POST", "/signals", b'{"entity": "e", "kind": "k", "value": "1"}', {},
     "must be a number, got string"),
    ("signal huge int", "POST", "/signals", b'{"entity": "e", "kind": "k", "value": 9223372036854775808}', {},
     "int64"),
    ("signal bad mode", "POST", "/signals", b'{"entity": "e", "kind": "k", "value": 1, "mode": "add"}', {}, "mode"),
    ("signal entity int", "POST", "/signals", b'{"entity": 5, "kind": "k", "value": 1}', {}, "entity must be a string"),
    ("signal empty kind", "POST", "/signals", b'{"entity": "e", "kind": "", "value": 1}', {}, "kind must not be empty"),
    ("vector wrong dim", "PUT", "/embeddings/e", b'{"vector": [1, 2, 3]}', {}, "embedding_dim is 4"),
    ("vector bool", "PUT", "/embeddings/e", b'{"vector": [1, 2, true, 4]}', {}, "vector[2] must be a number"),
    ("vector not list", "PUT", "/embeddings/e", b'{"vector": "1234"}', {}, "must be an array"),
    ("vector zeros", "PUT", "/embeddings/e", b'{"vector": [0, 0, 0.0, 0]}', {}, "all zeros"),
    ("vector float32 overflow", "PUT", "/embeddings/e", b'{"vector": [1e39, 0, 0, 1]}', {}, "float32"),
    ("search k zero", "POST", "/search", orjson.dumps({"vector": V4, "k": 0}), {}, "between 1 and 1000"),
    ("search k too big", "POST", "/search", orjson.dumps({"vector": V4, "k": 1001}), {}, "between 1 and 1000"),
    ("search k bool", "POST", "/search", orjson.dumps({"vector": V4, "k": True}), {}, "k must be an integer"),
    ("search k float", "POST", "/search", orjson.dumps({"vector": V4, "k": 2.0}), {}, "k must be an integer"),
    ("search wrong dim", "POST", "/search", orjson.dumps({"vector": [1], "k": 1}), {}, "embedding_dim"),
    ("batch not list", "POST", "/batch", b'{"writes": {}}', {}, "non-empty array"),
    ("batch empty", "POST", "/batch", b'{"writes": []}', {}, "non-empty array"),
    ("batch too large", "POST", "/batch",
     _batch(*({"op": "delete_item", "id": f"k{i}"} for i in range(1001))), {}, "at most 1000"),
    ("batch unknown op", "POST", "/batch",
     _batch({"op": "put_item", "id": "a", "doc": 1}, {"op": "drop_table", "id": "b"}), {}, "writes[1]: unknown op"),
    ("batch one bad item", "POST", "/batch",
     _batch({"op": "put_item", "id": "a", "doc": 1}, {"op": "delete_item", "id": "b"},
            {"op": "put_embedding", "id": "c", "vector": [1, 2]}), {}, "writes[2].vector"),
    ("batch bool signal", "POST", "/batch",
     _batch({"op": "signal", "entity": "e", "kind": "k", "value": False}), {}, "writes[0].value"),
    ("batch missing key", "POST", "/batch", _batch({"op": "put_item", "id": "a"}), {}, "writes[0]: missing 'doc'"),
    ("batch empty id", "POST", "/batch", _batch({"op": "delete_item", "id": ""}), {}, "writes[0].id must not be"),
    ("batch extra top key", "POST", "/batch", b'{"writes": [], "x": 1}', {}, "unexpected key"),
    ("bad x-ack", "PUT", "/items/k", b"{}", {"x-ack": "some"}, "x-ack"),
    ("bad x-consistency", "GET", "/items/k", None, {"x-consistency": "eventual"}, "x-consistency"),
    ("bad x-deadline-ms text", "PUT", "/items/k", b"{}", {"x-deadline-ms": "soon"}, "x-deadline-ms"),
    ("bad x-deadline-ms zero", "PUT", "/items/k", b"{}", {"x-deadline-ms": "0"}, "x-deadline-ms"),
    ("bad x-deadline-ms negative", "GET", "/items/k", None, {"x-deadline-ms": "-5"}, "x-deadline-ms"),
    ("bad x-deadline-ms float", "GET", "/items/k", None, {"x-deadline-ms": "1.5"}, "x-deadline-ms"),
    ("bad x-min-seq", "GET", "/items/k", None, {"x-min-seq": "-1"}, "x-min-seq"),
    ("bad x-min-seq text", "GET", "/items/k", None, {"x-min-seq": "abc"}, "x-min-seq"),
    ("bad x-request-id", "PUT", "/items/k", b"{}", {"x-request-id": "has#hash"}, "x-request-id"),
    ("long x-request-id", "PUT", "/items/k", b"{}", {"x-request-id": "r" * 101}, "x-request-id"),
]


@pytest.fixture
async def env(aiohttp_server: Any, aiohttp_client: Any) -> Any:
    f = await make_fakes(aiohttp_server, shards=3, dim=4)
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr])
    return f, client


async def test_every_bad_input_is_400_and_reaches_no_worker(env: Any) -> None:
    # One gateway for every case (starting one per case would cost seconds).
    f, client = env
    for name, method, path, body, headers, fragment in BAD:
        resp = await client.request(method, path, data=body, headers=headers)
        assert resp.status == 400, (name, resp.status, await resp.text())
        assert resp.content_type == "application/json", name
        error = (await resp.json())["error"]
        assert error["code"] == "bad_request", name
        assert fragment in error["message"], (name, error["message"])
    assert f.calls() == []


async def test_oversized_body_is_413(env: Any) -> None:
    f, client = env
    resp = await client.put("/items/k", data=io.BytesIO(b'"' + b"x" * (1 << 20) + b'"'))
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "payload_too_large"
    assert f.calls() == []


async def test_good_inputs_at_the_limits_pass(env: Any) -> None:
    f, client = env
    ok = [
        ("PUT", "/items/" + "x" * 256, b"null", {"x-ack": "all", "x-deadline-ms": "300000"}),
        ("PUT", "/items/" + "é" * 128, b"[1, 2]", {"x-request-id": "A-b_c.d:e/f=g+h"}),
        ("POST", "/search", orjson.dumps({"vector": [0, 0, 0, 1e-3], "k": 1000}), {"x-min-seq": "0"}),
        ("POST", "/batch", _batch(*({"op": "delete_item", "id": f"k{i}"} for i in range(1000))), {}),
        ("POST", "/signals", b'{"entity": "e", "kind": "k", "value": -9223372036854775808}', {}),
    ]
    for method, path, body, headers in ok:
        resp = await client.request(method, path, data=body, headers=headers)
        assert resp.status == 200, (path[:40], await resp.text())
    assert f.calls()


_BATCH_PUTS: list[Any] = [
    {"op": "put_item", "id": "x" * 256, "doc": {"v": 1}},  # the id limit exactly
    {"op": "put_item", "id": "x" * 257, "doc": 1},
    {"op": "put_item", "id": "", "doc": 1},
    {"op": "put_item", "id": "é" * 128, "doc": 1},  # 256 bytes of UTF-8, not ASCII
    {"op": "put_item", "id": "é" * 129, "doc": 1},
    {"op": "put_item", "id": 5, "doc": 1},
    {"op": "put_item", "id": "a", "doc": 1, "x": 2},
    {"op": "put_item", "id": "a"},
    ["put_item", "a", 1],
]


@pytest.mark.parametrize("item", _BATCH_PUTS, ids=range(len(_BATCH_PUTS)))
def test_batch_put_fast_path_agrees_with_the_general_checks(item: Any) -> None:
    # raw_len=None forces every check of the general path (the fast one needs a small body).
    def outcome(raw_len: int | None) -> Any:
        try:
            return batch_write(item, 3, 4, raw_len)
        except ApiError as exc:
            return exc.message
    assert outcome(100) == outcome(None)


def test_batch_put_fast_path_leaves_large_bodies_to_the_doc_size_check() -> None:
    # A body this large could hold a doc over the limit: the general path measures it.
    item = {"op": "put_item", "id": "a", "doc": "x" * (1 << 20)}
    with pytest.raises(ApiError, match="the limit is"):
        batch_write(item, 0, 4, (1 << 20) + 40)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


@pytest.mark.parametrize("depth", [255, 1000])
async def test_a_doc_nested_past_what_orjson_writes_is_400_and_reaches_no_worker(env: Any, depth: int) -> None:
    # orjson reads 1024 levels but writes 254: found by tests/tier1/test_fuzz_gateway.py,
    # such a doc was stored and could never be served (or re-encoded for a batch) again.
    f, client = env
    for path, body in [("/items/k", _nested(depth)),
                       ("/batch", b'{"writes": [{"op": "put_item", "id": "a", "doc": ' + _nested(depth) + b"}]}")]:
        resp = await client.request("PUT" if path.startswith("/items") else "POST", path, data=body)
        assert resp.status == 400, (path, await resp.text())
        assert (await resp.json())["error"]["code"] == "bad_request"
    assert f.calls() == []


async def test_a_doc_nested_as_deep_as_orjson_writes_is_stored(env: Any) -> None:
    f, client = env
    resp = await client.put("/items/k", data=_nested(254))
    assert resp.status == 200, await resp.text()
    body = b'{"writes": [{"op": "put_item", "id": "a", "doc": ' + _nested(254) + b"}]}"
    resp = await client.post("/batch", data=body)
    assert resp.status == 200 and "error" not in (await resp.json())["results"][0], await resp.text()


@pytest.mark.parametrize("path, body", [
    ("/signals", b'{"entity": "e", "kind": "k", "value": 1, "mode": ' + _nested(1020) + b"}"),
    ("/batch", b'{"writes": [{"op": ' + _nested(1020) + b', "id": "a"}]}'),
], ids=["signal mode", "batch op"])
async def test_a_value_nested_past_the_recursion_limit_is_400(env: Any, path: str, body: bytes) -> None:
    # Found by tests/tier1/test_fuzz_gateway.py: the error message's repr() of
    # the value raised RecursionError, a 500 instead of a 400.
    f, client = env
    resp = await client.post(path, data=body)
    assert resp.status == 400, await resp.text()
    assert f.calls() == []
