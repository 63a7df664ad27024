"""How a shard's part of a /batch becomes writes, and their results the client's (gateway/batching.py)."""
from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.batching import shard_writes, spread_results
from shardgrid.common.wire import ApiError, error_body


def put(id: str, doc: Any) -> dict[str, Any]:
    return {"kind": "put_item", "id": id, "doc": doc}


OPS = [put("a", {"x": 1}), {"kind": "delete_item", "id": "b"}, put("c", [1, "é"]), put("d", None),
       {"kind": "signal", "entity": "e", "name": "n", "value": 1, "mode": "incr"}, put("f", 2)]


def test_a_shards_puts_go_as_one_put_items_under_one_id() -> None:
    sw = shard_writes(OPS, [0, 1, 2, 3, 4], "R", 7, 1 << 20)
    assert sw.writes == [
        ({"kind": "put_items", "ids": ["a", "c", "d"], "docs": [b'{"x":1}', b'[1,"\xc3\xa9"]', b"null"]}, "R#s7"),
        (OPS[1], "R#1"),
        (OPS[4], "R#4"),
    ]
    assert sw.owners == [[0, 2, 3], [1], [4]]


def test_a_lone_put_keeps_its_own_op_and_id() -> None:
    sw = shard_writes(OPS, [1, 5], "R", 0, 1 << 20)
    assert sw.writes == [(OPS[1], "R#1"), (OPS[5], "R#5")] and sw.owners == [[1], [5]]


def test_the_same_part_gives_the_same_writes() -> None:
    # A retried request (through any gateway) must reuse the ids it used.
    assert shard_writes(OPS, [0, 2, 3], "R", 1, 1 << 20) == shard_writes(OPS, [0, 2, 3], "R", 1, 1 << 20)


def test_a_doc_over_the_limit_is_refused_naming_its_index() -> None:
    with pytest.raises(ApiError) as ei:
        shard_writes(OPS, [0, 2, 3], "R", 0, 7)
    assert ei.value.code == "bad_request"
    assert "writes[2]: the document is 8 bytes of JSON; the limit is 7" in str(ei.value)


def test_a_doc_that_cannot_be_encoded_is_a_400_naming_its_index() -> None:
    ops = [put("a", {"x": 1}), put("b", {"big": 1 << 70}), put("c", 3)]
    with pytest.raises(ApiError) as ei:
        shard_writes(ops, [0, 1, 2], "R", 0, 1 << 20)
    assert ei.value.code == "bad_request" and "writes[1]: the document cannot be encoded" in str(ei.value)


def ok(result: Any, seq: int = 9) -> dict[str, Any]:
    return {"shard": 7, "seq": seq, "term": 2, "served_by": "w1", "result": result}


def test_results_land_at_their_batch_indices() -> None:
    sw = shard_writes(OPS, [0, 1, 2, 3, 4], "R", 7, 1 << 20)
    out: list[Any] = [None] * len(OPS)
    spread_results(sw, OPS, [ok({"created": [True, False, True]}), ok({"id": "b", "deleted": False}, 10), ok(5, 11)],
                   out)
    assert out[:5] == [ok({"id": "a", "created": True}), ok({"id": "b", "deleted": False}, 10),
                       ok({"id": "c", "created": False}), ok({"id": "d", "created": True}), ok(5, 11)]
    assert out[5] is None  # not this shard's


def test_an_error_of_the_put_items_is_every_put_s_answer() -> None:
    sw = shard_writes(OPS, [0, 2, 3], "R", 7, 1 << 20)
    out: list[Any] = [None] * len(OPS)
    err = error_body("quorum_timeout", "outcome unknown", shard=7)
    spread_results(sw, OPS, [err], out)
    assert [out[i] for i in (0, 2, 3)] == [err, err, err]
    assert orjson.loads(orjson.dumps(out))[0]["error"]["code"] == "quorum_timeout"


@pytest.mark.parametrize("result", [None, {"created": [True]}, {"created": "yes"}, 3])
def test_a_result_without_flags_for_each_put_is_acknowledged_with_no_result(result: Any) -> None:
    # A retry answered from the workers' dedup table once the result is gone.
    sw = shard_writes(OPS, [0, 2, 3], "R", 7, 1 << 20)
    out: list[Any] = [None] * len(OPS)
    spread_results(sw, OPS, [ok(result)], out)
    assert [out[i] for i in (0, 2, 3)] == [ok(None)] * 3
