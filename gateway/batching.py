"""How one shard's part of a `/batch` becomes the writes of one `write_batch`
call, and how their results map back to the client's writes. Pure: no I/O.

A shard's plain puts go as ONE `put_items` op (ids, and each doc already
encoded as JSON) under one request id, `<request id>#s<shard>`. Every
replica then stores the encoded docs as they are (no per-replica decode and
re-encode), and the whole part is one log entry and one dedup record instead
of one per write. That is most of the per-record work of a batch: see
runbook/benchmarking.md ("Bulk puts"). The part is the same for the same
request body (the shard count cannot change on a live cluster), so a retry
of the request, through any gateway, reuses the same id and applies once.

Every other write (and a lone put) keeps its own op and the id
`<request id>#<index>`, as before.

`put_items` is all or nothing: one error (a quorum timeout, a refusal) is the
answer of every put it carries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from shardgrid.common.wire import ApiError


@dataclass(slots=True)
class ShardWrites:
    """The writes of one shard's `write_batch` call and, for each, the batch
    indices it answers: one index for a single write, several for a put_items."""

    writes: list[tuple[dict[str, Any], str]]
    owners: list[list[int]]


def shard_writes(ops: list[dict[str, Any]], idxs: list[int], request_id: str, gid: int,
                 max_doc_bytes: int) -> ShardWrites:
    """The writes for batch writes `idxs` (all of shard `gid`); `ops[i]` is write i's op.

    Raises 400 (ApiError) for a doc whose JSON is over `max_doc_bytes` or
    that cannot be encoded at all: the caller builds every shard's writes
    before sending any, so a bad batch changes nothing.
    """
    puts = [i for i in idxs if ops[i]["kind"] == "put_item"]
    if len(puts) < 2:
        for i in puts:
            # A lone put goes as its own op, but a doc orjson cannot encode
            # (nested past its depth limit) must be refused here all the same.
            _doc_json(ops[i]["doc"], i)
        puts = []
    writes: list[tuple[dict[str, Any], str]] = []
    owners: list[list[int]] = []
    if puts:
        docs = [_doc_json(ops[i]["doc"], i) for i in puts]
        if any(len(d) > max_doc_bytes for d in docs):
            j = next(j for j, d in enumerate(docs) if len(d) > max_doc_bytes)
            raise ApiError("bad_request", f"writes[{puts[j]}]: the document is {len(docs[j])} bytes of JSON; "
                                          f"the limit is {max_doc_bytes}")
        writes.append(({"kind": "put_items", "ids": [ops[i]["id"] for i in puts], "docs": docs},
                       f"{request_id}#s{gid}"))
        owners.append(puts)
    rest = idxs if not puts else [i for i in idxs if ops[i]["kind"] != "put_item"]
    for i in rest:
        writes.append((ops[i], f"{request_id}#{i}"))
        owners.append([i])
    return ShardWrites(writes, owners)


def _doc_json(doc: Any, i: int) -> bytes:
    """Write i's doc as JSON; one that cannot be encoded is a 400 naming it
    (raised before any shard's call leaves, so the batch changes nothing)
    rather than a 500 for the whole request."""
    try:
        return orjson.dumps(doc)
    except orjson.JSONEncodeError as exc:
        raise ApiError("bad_request", f"writes[{i}]: the document cannot be encoded as JSON: {exc}") from None


def spread_results(sw: ShardWrites, ops: list[dict[str, Any]], results: list[dict[str, Any]],
                   out: list[Any]) -> None:
    """Put each write's result (Forwarder.write_batch's, one per write of
    `sw`) at its batch indices in `out`, as if every write had gone alone."""
    for owner, res in zip(sw.owners, results):
        if len(owner) == 1:
            out[owner[0]] = res
            continue
        if "error" in res:
            for i in owner:
                out[i] = res
            continue
        shard, seq, term, served_by = res["shard"], res["seq"], res["term"], res["served_by"]
        result = res.get("result")
        created = result.get("created") if type(result) is dict else None
        if type(created) is not list or len(created) != len(owner):
            # A retry answered from the workers' dedup table once the original
            # result is gone: acknowledged, `created` unknown (as for one put).
            for i in owner:
                out[i] = {"shard": shard, "seq": seq, "term": term, "served_by": served_by, "result": None}
            continue
        for i, c in zip(owner, created):
            out[i] = {"shard": shard, "seq": seq, "term": term, "served_by": served_by,
                      "result": {"id": ops[i]["id"], "created": c}}
