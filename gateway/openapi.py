"""The gateway's public API as an OpenAPI 3.1 document, and `runbook/api.md` rendered from it.

`build_document()` returns the document, a new dict on every call (nothing
here is shared or mutated). The gateway serves it at `GET /openapi.json`
(gateway/routes.py); `python -m gateway.openapi --markdown > runbook/api.md`
renders the reference, and `python -m gateway.openapi` prints the JSON.

The document is written by hand, next to the code, and held to it by
tests/tier1/test_openapi.py: its (method, path) pairs against the gateway's
router both ways, its error codes against `STATUS_FOR_CODE`
(shardgrid/common/wire.py) and against the codes the gateway's source
raises, its limits against gateway/limits.py, and runbook/api.md against
`render_markdown()`. So a route added without docs, or docs of a route that
is gone, fail a test rather than mislead a client.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.limits import (ACKS, CONSISTENCIES, MAX_BATCH, MAX_BODY_BYTES, MAX_DEADLINE_MS, MAX_DOC_BYTES,
                            MAX_DOC_DEPTH, MAX_ID_BYTES, MAX_K, MAX_REQUEST_ID, OPERATOR_DEADLINE_MS, SIGNAL_MODES)
from gateway.models import MAX_WEIGHTS_BYTES
from gateway.router import RETRY_AFTER_S
from shardgrid.common.identity import package_version
from shardgrid.common.serving import BODY_READ_S
from shardgrid.common.wire import STATUS_FOR_CODE
from topology.model import MAX_INFER_ROWS, Settings

OPENAPI_VERSION = "3.1.0"
JSON = "application/json"
_DEFAULTS = Settings()


def _size(n: int) -> str:
    """Bytes as a person reads them: 1 MiB, 256 MiB."""
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


# -- error codes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorCode:
    """One code the gateway answers with. Its HTTP status is STATUS_FOR_CODE's."""

    code: str
    retry: str  # "no" | "yes" | "same request id" | "depends": may a client send it again
    applied: str  # for a write: was it applied? "no" | "unknown" | "-" (not a write's outcome)
    meaning: str

    @property
    def status(self) -> int:
        return STATUS_FOR_CODE[self.code]


def error_codes() -> tuple[ErrorCode, ...]:
    """Every code a client of the gateway can get, in status order."""
    codes = (
        ErrorCode("bad_request", "no", "no",
                  "The request is malformed: a header, the body, an id, a vector, `k`, a batch write (named by "
                  "index; the whole batch is refused). The message names the field. Fix it; never resend it "
                  "unchanged."),
        ErrorCode("unauthorized", "no", "no",
                  "`/cluster/*` only: the gateway has an admin token and the request's `Authorization: Bearer` "
                  "header is missing, malformed or wrong (meta may also refuse the token it forwards)."),
        ErrorCode("forbidden", "no", "no",
                  "`/cluster/*` POST verbs only, passed through from meta: it refuses this gateway "
                  "(revoked, or a version `settings.allowed_versions` does not admit)."),
        ErrorCode("not_found", "no", "no",
                  "No such item, embedding, model, shard (`/cluster/*` verbs) or path. A `DELETE` of a missing "
                  "id is a 404 that changed nothing; in `/batch` it is a result with `\"deleted\": false`."),
        ErrorCode("method_not_allowed", "no", "no", "The path exists, the method does not (see the endpoints)."),
        ErrorCode("request_timeout", "yes", "no",
                  f"The request's body did not arrive whole within {BODY_READ_S:g} s; its handler never ran. "
                  "Resend it (a write with the same `x-request-id`)."),
        ErrorCode("conflict", "depends", "-",
                  "`/cluster/*` verbs: another change of the group is in progress or won (retry in a few seconds, "
                  "after reading `/cluster/shards`). `POST /v1/models/{name}/weights`: a group refused the version "
                  "(it holds another one): do not resend it unchanged."),
        ErrorCode("payload_too_large", "no", "no",
                  f"The body is over {_size(MAX_BODY_BYTES)} ({_size(MAX_WEIGHTS_BYTES)} for a weights file), or a "
                  "`/batch` part for one shard is over what one call to a worker may carry. Split it. (A doc "
                  f"over {_size(MAX_DOC_BYTES)} once encoded is a `400`.)"),
        ErrorCode("internal", "same request id", "unknown",
                  "A bug; the trace is in the server's `unhandled_error` log line. Retry once with the same "
                  "`x-request-id`, then report it."),
        ErrorCode("unavailable", "yes", "no",
                  "Nothing was applied: no leader could take it within the deadline (failover, no routing table "
                  "yet, a group failed on its worker), no shard answered a search, meta did not answer a "
                  "`/cluster/*` call, or meta refuses this gateway (`reason`: `unknown_credentials`, "
                  "`version_mismatch`, `revoked`). With `\"reason\": \"no_quorum\"` it comes at once: the shard's "
                  "leader cannot reach a majority. Retry after `retry-after`, with backoff."),
        ErrorCode("overloaded", "yes", "no",
                  "Nothing was queued: the group's queue on its leader, or the gateway's stream to that worker, is "
                  "full. Retry after `retry-after`, with backoff."),
        ErrorCode("over_budget", "yes", "no",
                  "`/v1/models/{name}/infer` only: no route through the model fits the request's `x-deadline-ms` "
                  "(refused at once, with `estimate_ms`, `budget_ms`, `hops`). Retry later or with a larger budget."),
        ErrorCode("quorum_timeout", "same request id", "unknown",
                  "A write was not acknowledged within the deadline; it may still commit. Retry with the same "
                  "`x-request-id`, promptly: the group's dedup table answers a retry with the original `seq` "
                  "(10 minutes and 100,000 newer request ids per group, whichever ends first)."),
        ErrorCode("deadline_exceeded", "yes", "-",
                  "A read or an inference could not be served in time (no quorum for a strong read, a follower "
                  "below `x-min-seq`); a `/cluster/shards/{gid}/transfer` that did not finish in time (read "
                  "`/cluster/shards` first). Retry, perhaps with a larger `x-deadline-ms`."),
    )
    return tuple(sorted(codes, key=lambda c: c.status))


def codes_not_answered() -> dict[str, str]:
    """Codes of STATUS_FOR_CODE that no gateway answer carries, and why."""
    return {
        "not_leader": "a worker's refusal: the gateway retries at the leader it names, and answers `unavailable` "
                      "or `quorum_timeout` when the deadline runs out. Only a client calling a worker directly "
                      "sees it.",
        "not_implemented": "no handler of the gateway, a worker or meta raises it; only a bare 501 without an "
                           "error body from a worker would be mapped to it.",
    }


# -- building blocks -------------------------------------------------------------------------------


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _param(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/parameters/{name}"}


def _header(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/headers/{name}"}


def _obj(props: dict[str, Any], required: tuple[str, ...] = (), description: str | None = None,
         closed: bool = False) -> dict[str, Any]:
    """An object schema; `closed`: the gateway refuses any other key (400)."""
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    if description:
        schema["description"] = description
    return schema


def _t(kind: str | list[str], description: str | None = None, **more: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": kind, **more}
    if description:
        schema["description"] = description
    return schema


# Functions, not module-level dicts: every document gets its own (a caller may change the one it got).
def _id() -> dict[str, Any]:
    return _t("string", f"1 to {MAX_ID_BYTES} UTF-8 bytes; any characters, `/` included", minLength=1)


def _seq() -> dict[str, Any]:
    return _t(["integer", "null"], "the write's position in its shard's log (null for an `x-ack: leader` write "
              "answered before it had one)")


def _vector() -> dict[str, Any]:
    return _t("array", "exactly the topology's `settings.embedding_dim` finite numbers, within the float32 range "
              "and not all zero (search is cosine)", items={"type": "number"})


def _schemas() -> dict[str, Any]:
    num_or_null = _t(["number", "null"])
    error_inner = _obj({
        "code": _t("string", "one of the error codes (see the error code table)",
                   enum=[c.code for c in error_codes()]),
        "message": _t("string", "for a person: what went wrong, naming the field or the group"),
        "shard": _t("integer", "the group concerned"),
        "term": _t("integer", "that group's term as last seen"),
        "leader": _t("string", "the worker last seen leading it"),
        "attempts": _t("integer", "attempts the gateway made before answering"),
        "reason": _t("string", "a finer cause: `no_quorum`; for a refused gateway `unknown_credentials`, "
                     "`version_mismatch`, `revoked`"),
        "maybe_applied": _t("boolean", "a write's outcome is unknown"),
        "unavailable_shards": _t("array", "a search no shard answered", items={"type": "integer"}),
        "retry_elsewhere": _t("boolean", "nothing was sent: another gateway or replica may take it"),
        "limit": _t("integer", "the limit that was exceeded"),
        "estimate_ms": _t("number", "`over_budget`: what the planned route would take"),
        "budget_ms": _t("number", "`over_budget`: what was left of `x-deadline-ms`"),
        "hops": _t("array", "`over_budget`: the planned hops", items={"type": "object"}),
        "tried": _t("array", "models: every replica tried, `{group, worker, ok, error?}`", items={"type": "object"}),
    }, ("code", "message"), "what went wrong; the context fields appear when they are known, and others may be "
       "added")
    return {
        "Error": _obj({"error": _ref("ErrorDetail")}, ("error",), "the one error body of every shardgrid HTTP API"),
        "ErrorDetail": error_inner,
        "Doc": {"description": f"any JSON value, at most {_size(MAX_DOC_BYTES)} encoded and {MAX_DOC_DEPTH} levels "
                               "deep; `GET` answers it as stored"},
        "PutResult": _obj({
            "id": _id(),
            "created": _t(["boolean", "null"], "true for a new id; null when a retry was answered from the dedup "
                          "table or with `x-ack: leader`"),
            "seq": _seq(),
        }, ("id", "created", "seq")),
        "DeleteResult": _obj({
            "id": _id(),
            "deleted": _t(["boolean", "null"], "true; null when a retry was answered from the dedup table"),
            "seq": _seq(),
        }, ("id", "deleted", "seq")),
        "SignalWrite": _obj({
            "entity": _id(),
            "kind": _t("string", f"the signal's name, 1 to {MAX_ID_BYTES} UTF-8 bytes", minLength=1),
            "value": _t("number", "an int64 or a finite number"),
            "mode": _t("string", "`incr` adds to a counter, `set` keeps the last value",
                       enum=list(SIGNAL_MODES), default="incr"),
        }, ("entity", "kind", "value"), closed=True),
        "SignalResult": _obj({
            "entity": _id(), "kind": _t("string"), "mode": _t("string", enum=list(SIGNAL_MODES)),
            "value": _t(["number", "null"], "the counter's new total, or the value set; null when answered from "
                        "the dedup table"),
            "seq": _seq(),
        }, ("entity", "kind", "mode", "value", "seq")),
        "Signals": _obj({
            "entity": _id(),
            "counters": _t("object", "counter totals by kind", additionalProperties={"type": "number"}),
            "last": _t("object", "last values by kind (`mode: set`)", additionalProperties={"type": "number"}),
        }, ("entity", "counters", "last")),
        "EmbeddingWrite": _obj({"vector": _vector()}, ("vector",), closed=True),
        "Embedding": _obj({"id": _id(), "vector": _t("array", items={"type": "number"})}, ("id", "vector")),
        "SearchRequest": _obj({
            "vector": _vector(),
            "k": _t("integer", "how many results", minimum=1, maximum=MAX_K),
        }, ("vector", "k"), closed=True),
        "SearchResult": _obj({
            "results": _t("array", "the k best by cosine similarity, best first",
                          items=_obj({"id": _id(), "score": _t("number")}, ("id", "score"))),
            "degraded": _t("boolean", "some shard did not answer in time: the results lack its embeddings"),
            "unavailable_shards": _t("array", items={"type": "integer"}),
        }, ("results", "degraded", "unavailable_shards")),
        "BatchWrite": {"oneOf": [
            _obj({"op": _t("string", const="put_item"), "id": _id(), "doc": _ref("Doc")}, ("op", "id", "doc"),
                 closed=True),
            _obj({"op": _t("string", const="delete_item"), "id": _id()}, ("op", "id"), closed=True),
            _obj({"op": _t("string", const="signal"), "entity": _id(), "kind": _t("string", minLength=1),
                  "value": _t("number"), "mode": _t("string", enum=list(SIGNAL_MODES), default="incr")},
                 ("op", "entity", "kind", "value"), closed=True),
            _obj({"op": _t("string", const="put_embedding"), "id": _id(), "vector": _vector()}, ("op", "id", "vector"),
                 closed=True),
            _obj({"op": _t("string", const="delete_embedding"), "id": _id()}, ("op", "id"), closed=True),
        ], "description": "one write: `op` names its shape"},
        "BatchRequest": _obj({
            "writes": _t("array", f"1 to {MAX_BATCH} writes; write i has request id `<x-request-id>#<i>`, except "
                         "that a shard's puts (two or more) go as one write `<x-request-id>#s<shard>`",
                         items=_ref("BatchWrite"), minItems=1, maxItems=MAX_BATCH),
        }, ("writes",), closed=True),
        "BatchItemResult": _obj({
            "shard": _t("integer"), "seq": _seq(), "term": _t(["integer", "null"]),
            "served_by": _t("string", "the worker that led the group"),
            "result": {"description": "the worker's result: `{created}` for a put, `{deleted}` for a delete "
                                      "(false: nothing to delete), the new value for a signal; null when "
                                      "answered from the dedup table"},
        }, ("shard", "seq", "term", "served_by", "result")),
        "BatchResult": _obj({
            "results": _t("array", "one per write, in request order: a result, or an error body with `shard`. "
                          "To retry the failed ones, resend the whole batch, unchanged, with the same "
                          "`x-request-id`: never a write alone with that id (its dedup id is "
                          "`<x-request-id>#<i>`), nor a smaller batch",
                          items={"oneOf": [_ref("BatchItemResult"), _ref("Error")]}),
        }, ("results",)),
        "Health": _obj({
            "ok": _t("boolean"),
            "version": _t("string", "the gateway's software version (also in shardgrid_build_info)"),
            "revision": _t(["integer", "null"], "meta revision of the routing table"),
            "shards": _t("integer"),
            "groups_without_ready_leader": _t("array", items={"type": "integer"}),
            "admission": _t("string", "present when the cluster has a secret", enum=["pending", "admitted",
                                                                                     "refused"]),
            "reason": _t("string", "why meta refused this gateway"),
            "message": _t("string", "why it is not ok"),
        }, ("ok", "version"), "more fields may be added"),
        "ModelReplica": _obj({
            "worker": _t("string"), "live": _t(["boolean", "null"]), "warm": _t(["boolean", "null"]),
            "version": _t(["integer", "null"], "weights version"), "queued": _t(["integer", "null"]),
            "ms_per_layer": num_or_null,
        }, ("worker",)),
        "Model": _obj({
            "name": _t("string"), "layers": _t("integer"), "d_model": _t("integer"),
            "groups": _t("array", items=_obj({
                "id": _t("integer"), "first": _t("integer", "first layer"), "last": _t("integer", "last layer"),
                "leader": _t(["string", "null"]),
                "replicas": _t("array", items=_ref("ModelReplica")),
            }, ("id", "first", "last", "leader", "replicas"))),
        }, ("name", "layers", "d_model", "groups")),
        "ModelList": _obj({"models": _t("array", items=_ref("Model"))}, ("models",)),
        "InferRequest": _obj({
            "input": _t("array", f"1 to {MAX_INFER_ROWS} rows of `d_model` finite float32 numbers",
                        items=_t("array", items={"type": "number"}), minItems=1, maxItems=MAX_INFER_ROWS),
        }, ("input",), closed=True),
        "InferResult": _obj({
            "output": _t("array", "one row per input row", items=_t("array", items={"type": "number"})),
            "route": _t("array", "the hops taken", items=_obj({
                "group": _t("integer"), "worker": _t("string"), "start_layer": _t("integer"),
                "end_layer": _t("integer"), "version": _t(["integer", "null"]), "batch": _t(["integer", "null"]),
                "queue_ms": num_or_null, "compute_ms": num_or_null})),
            "tried": _t("array", "every attempt, `{group, worker, ok, error?}`", items={"type": "object"}),
        }, ("output", "route", "tried")),
        "WeightsRequest": _obj({
            "seed": _t("integer", "regenerate the weights from this seed", minimum=0),
            "version": _t("integer", "default: one more than the highest any group holds", minimum=1),
        }, ("seed",), closed=True),
        "WeightsResult": _obj({
            "model": _t("string"), "version": _t("integer"),
            "groups": _t("array", "per group `{group, version, seq}` or `{group, error}`", items={"type": "object"}),
            "error": _obj({"code": _t("string", enum=["conflict", "unavailable"]), "message": _t("string")},
                          description="present when some group did not take the version (409 or 503)"),
        }, ("model", "version", "groups")),
        "TransferRequest": _obj({
            "to": _t("string", "the voter to lead; absent: meta picks the best live voter"),
        }, closed=False),
        "TransferResult": _obj({
            "group": _t("integer"), "changed": _t("boolean", "false when `to` leads already"),
            "leader": _t("string"), "term": _t("integer"),
            "old_leader": _t("string"), "old_term": _t("integer"),
            "new_leader": _t("string"), "new_term": _t("integer"),
        }, ("group", "changed"), "meta's answer: `{group, changed: false, leader, term}` or `{group, changed: true, "
           "old_term, old_leader, new_term, new_leader}`"),
        "ReplicasRequest": {"oneOf": [
            _obj({"add": _t("string", "a live registered worker: learner, catch up, promote")}, ("add",)),
            _obj({"remove": _t("string", "a member; a leader hands over first")}, ("remove",)),
        ], "description": "exactly one of `add` or `remove`"},
        "Operator": _obj({
            "group": _t("integer"), "kind": _t("string", enum=["add", "remove"]), "worker": _t("string"),
            "step": _t("string", "where it is: add_learner, catch_up, promote, transfer, remove, ..."),
            "message": _t("string"), "started_ms": _t("integer", "wall clock, ms"), "by": _t("string"),
        }, ("group", "kind", "worker", "step"), "the staged operator meta started (follow it with "
           "`topoctl operators`)"),
        "ClusterStatus": _obj({
            "revision": _t("integer"), "topology": _t(["object", "null"]),
            "workers": _t("object", "by worker id; `live` null when the view is not the meta leader's",
                          additionalProperties={"type": "object"}),
            "groups": _t("object", "by group id", additionalProperties={"type": "object"}),
            "meta_leader": _t(["string", "null"]), "served_by": _t("string"),
            "liveness_known": _t("boolean", "the view came from the meta leader, which alone knows liveness"),
            "gateway": _obj({"routing_revision": _t(["integer", "null"])}),
        }, ("revision", "liveness_known", "gateway"), "meta's cluster view (`GET /v1/cluster`) with the "
           "gateway's additions; more fields than listed"),
        "ShardSummary": _obj({
            "id": _t("integer"), "term": _t(["integer", "null"]), "leader": _t(["string", "null"]),
            "ready": _t(["boolean", "null"]), "preferred_leader": _t(["string", "null"]),
            "voters": _t(["array", "null"], items={"type": "string"}),
            "learners": _t(["array", "null"], items={"type": "string"}),
            "conf_ver": _t(["integer", "null"]),
            "replicas": _t("array", items=_obj({
                "worker": _t("string"), "role": _t("string", enum=["voter", "learner"]), "leader": _t("boolean"),
                "live": _t(["boolean", "null"]), "term": _t(["integer", "null"]),
                "last_seq": _t(["integer", "null"]), "commit": _t(["integer", "null"]),
                "applied": _t(["integer", "null"]),
                "lag": _t(["integer", "null"], "the leader's commit minus this replica's applied seq"),
            })),
        }, ("id", "replicas")),
        "ClusterShards": _obj({"revision": _t(["integer", "null"]), "shards": _t("array", items=_ref("ShardSummary"))},
                              ("revision", "shards")),
    }


def _parameters() -> dict[str, Any]:
    def header(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "in": "header", "required": False, "description": description, "schema": schema}

    def path(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}

    return {
        "XAck": header("x-ack", "Writes: when a write is acknowledged. `quorum`: a majority of voters has it "
                       "durably; `all`: every voter; `leader`: the leader alone (a leader crash can lose it; result "
                       f"fields come back null). Default: the topology's `settings.ack` (`{_DEFAULTS.ack}`).",
                       _t("string", enum=list(ACKS))),
        "XConsistency": header("x-consistency", "Reads and search: `strong` (the leader confirms its leadership "
                               "with a quorum round: linearizable) or `follower` (any live replica, rotating; "
                               "possibly stale unless `x-min-seq` is set).",
                               _t("string", enum=list(CONSISTENCIES), default="strong")),
        "XMinSeq": header("x-min-seq", "Follower point reads wait until the replica applied this seq (take it "
                          "from a write's `x-seq`: read-your-writes). Ignored by search.",
                          _t("integer", minimum=0, default=0)),
        "XDeadlineMs": header("x-deadline-ms", "The whole request's budget in ms, retries included; the gateway "
                              "answers by then. Default: the topology's `settings.deadline_ms` "
                              f"({_DEFAULTS.deadline_ms}).", _t("integer", minimum=1, maximum=MAX_DEADLINE_MS)),
        "XDeadlineMsOperator": header("x-deadline-ms", f"The budget of the call to meta, in ms (default "
                                      f"{OPERATOR_DEADLINE_MS}).",
                                      _t("integer", minimum=1, maximum=MAX_DEADLINE_MS)),
        "XRequestId": header("x-request-id", f"1 to {MAX_REQUEST_ID} visible ASCII characters other than `#`; a "
                             "uuid4 hex when absent. A write's dedup id at the workers: resend a write with the "
                             "same id to retry it (applied once), and never reuse an id for another write.",
                             _t("string", pattern=f"^[\\x21-\\x22\\x24-\\x7e]{{1,{MAX_REQUEST_ID}}}$")),
        "ItemId": path("id", "the item's id (may contain `/`)", _id()),
        "EmbeddingId": path("id", "the embedding's id (may contain `/`)", _id()),
        "Entity": path("entity", "the entity's id (may contain `/`)", _id()),
        "ModelName": path("name", "a model of the topology's `models:`", _t("string")),
        "ShardId": path("gid", "the shard (group) id", _t("integer", minimum=0)),
        "WeightsVersion": {"name": "version", "in": "query", "required": False,
                           "description": "with a weights file (`application/octet-stream`): the version to write",
                           "schema": _t("integer", minimum=1)},
    }


def _headers() -> dict[str, Any]:
    def h(description: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"description": description, "schema": schema}

    return {
        "XRequestId": h("The request id: the client's, or the one generated. On every answer of a data route once "
                        "its headers were validated (not on a 400 for a header, nor on a 408 or a 413 for the body "
                        "size, which come before). Log it; reuse it to retry the same write.", _t("string")),
        "XShard": h("The shard (group) that served it, when a worker answered.", _t("integer")),
        "XTerm": h("That group's term at the replica that answered; a change means a new leader.", _t("integer")),
        "XSeq": h("Writes: the write's log position. Reads: the replica's applied seq. Pass it as `x-min-seq`.",
                  _t("integer")),
        "XServedBy": h("The worker that did the work.", _t("string")),
        "RetryAfter": h(f"On every 503: seconds to wait before retrying ({RETRY_AFTER_S}).", _t("integer")),
        "XRoute": h("Inference: the hops taken, `group@worker:start-end`, comma-separated.", _t("string")),
        "XServedByRoute": h("Inference: the worker of each hop, comma-separated.", _t("string")),
    }


# -- operations ------------------------------------------------------------------------------------

_DATA = ("XAck", "XConsistency", "XMinSeq", "XDeadlineMs", "XRequestId")
_ENTITY_HEADERS = ("XRequestId", "XShard", "XTerm", "XSeq", "XServedBy")
_WRITE_ERRORS = ("bad_request", "payload_too_large", "request_timeout", "unavailable", "overloaded",
                 "quorum_timeout", "internal")
_DELETE_ERRORS = ("bad_request", "not_found", "unavailable", "overloaded", "quorum_timeout", "internal")
_READ_ERRORS = ("bad_request", "not_found", "unavailable", "overloaded", "deadline_exceeded", "internal")
_VERB_ERRORS = ("bad_request", "unauthorized", "forbidden", "not_found", "conflict", "payload_too_large",
                "request_timeout", "unavailable", "deadline_exceeded", "internal")
_VIEW_ERRORS = ("bad_request", "unauthorized", "unavailable", "internal")


@dataclass(frozen=True)
class _Ok:
    status: int
    description: str
    schema: dict[str, Any] | None = None
    media: str = JSON
    headers: tuple[str, ...] = ()


def _operation(op_id: str, tag: str, summary: str, description: str, ok: tuple[_Ok, ...],
               errors: tuple[str, ...], params: tuple[str, ...] = (), body: dict[str, Any] | None = None,
               error_headers: tuple[str, ...] = (), admin: bool = False,
               special: dict[int, _Ok] | None = None) -> dict[str, Any]:
    """One operation. `errors` become one response per status (the codes in `x-error-codes`);
    `special` replaces the body of an error status that is not the error shape."""
    responses: dict[str, Any] = {}
    for o in ok:
        responses[str(o.status)] = _response(o)
    by_status: dict[int, list[str]] = {status: [] for status in special or {}}
    for code in errors:
        by_status.setdefault(STATUS_FOR_CODE[code], []).append(code)
    for status in sorted(by_status):
        codes = by_status[status]
        names = ", ".join(f"`{c}`" for c in codes)
        # A 408 comes before the handler read any header (no request id yet); the
        # gateway's middleware adds retry-after to every 503, whatever answered it.
        headers = (() if codes == ["request_timeout"] else error_headers) + (("RetryAfter",) if status == 503 else ())
        alt = (special or {}).get(status)
        if alt is not None:
            text = f"{names}: {alt.description}" if names else alt.description
            resp = _response(_Ok(status, text, alt.schema, alt.media, headers))
        else:
            resp = _response(_Ok(status, names, _ref("Error"), JSON, headers))
        if codes:
            resp["x-error-codes"] = codes
        responses[str(status)] = resp
    op: dict[str, Any] = {"operationId": op_id, "tags": [tag], "summary": summary, "description": description,
                          "responses": responses}
    if params:
        op["parameters"] = [_param(p) for p in params]
    if body is not None:
        op["requestBody"] = body
    if admin:
        # {}: no token needed when the gateway has none (--admin-token-file).
        op["security"] = [{"adminToken": []}, {}]
    return op


def _response(o: _Ok) -> dict[str, Any]:
    resp: dict[str, Any] = {"description": o.description}
    if o.schema is not None:
        resp["content"] = {o.media: {"schema": o.schema}}
    if o.headers:
        resp["headers"] = {_HEADER_NAMES[h]: _header(h) for h in o.headers}
    return resp


_HEADER_NAMES = {"XRequestId": "x-request-id", "XShard": "x-shard", "XTerm": "x-term", "XSeq": "x-seq",
                 "XServedBy": "x-served-by", "RetryAfter": "retry-after", "XRoute": "x-route",
                 "XServedByRoute": "x-served-by"}


def _json_body(schema: str, description: str = "", required: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"required": required, "content": {JSON: {"schema": _ref(schema)}}}
    if description:
        body["description"] = description
    return body


def _paths() -> dict[str, Any]:
    entity = ("XRequestId",)
    return {
        "/healthz": {"get": _operation(
            "healthz", "health", "Is this gateway serving?",
            "200 once it has a routing table with a topology and meta has not refused it; 503 otherwise. No "
            "headers are read. Served even while meta refuses the gateway.",
            (_Ok(200, "serving", _ref("Health")),), (),
            special={503: _Ok(503, "not serving (the body says why; not the error shape)", _ref("Health"))})},
        "/metrics": {"get": _operation(
            "metrics", "health", "Prometheus metrics",
            "The gateway's metrics in the Prometheus text format (runbook/operations.md, \"Metrics to watch\").",
            (_Ok(200, "the exposition", _t("string"), "text/plain"),), ())},
        "/openapi.json": {"get": _operation(
            "openapi", "health", "This document",
            "The OpenAPI document of the gateway's API. Needs no token; served even while meta refuses the "
            "gateway.", (_Ok(200, "the OpenAPI 3.1 document", _t("object")),), ())},
        "/items/{id}": {
            "parameters": [_param("ItemId")],
            "put": _operation(
                "putItem", "items", "Write an item",
                "The body is the document, any JSON value. Routed to the leader of the id's shard.",
                (_Ok(200, "written", _ref("PutResult"), headers=_ENTITY_HEADERS),), _WRITE_ERRORS, _DATA,
                {"required": True, "content": {JSON: {"schema": _ref("Doc")}}}, entity),
            "get": _operation(
                "getItem", "items", "Read an item",
                "Answers the document as it was written.",
                (_Ok(200, "the document", _ref("Doc"), headers=_ENTITY_HEADERS),), _READ_ERRORS, _DATA,
                error_headers=entity),
            "delete": _operation(
                "deleteItem", "items", "Delete an item",
                "404 when there was nothing to delete (nothing changed).",
                (_Ok(200, "deleted", _ref("DeleteResult"), headers=_ENTITY_HEADERS),), _DELETE_ERRORS, _DATA,
                error_headers=entity),
        },
        "/signals": {"post": _operation(
            "postSignal", "signals", "Add to a counter or set a last value",
            "Routed by `entity`. `mode: incr` adds `value` to the counter `kind`; `mode: set` keeps it as the "
            "last value of `kind`. A retry with the same `x-request-id` counts once.",
            (_Ok(200, "applied", _ref("SignalResult"), headers=_ENTITY_HEADERS),), _WRITE_ERRORS, _DATA,
            _json_body("SignalWrite"), entity)},
        "/signals/{entity}": {
            "parameters": [_param("Entity")],
            "get": _operation(
                "getSignals", "signals", "Read an entity's signals",
                "An entity never written has empty `counters` and `last`.",
                (_Ok(200, "the signals", _ref("Signals"), headers=_ENTITY_HEADERS),),
                tuple(c for c in _READ_ERRORS if c != "not_found"), _DATA, error_headers=entity)},
        "/embeddings/{id}": {
            "parameters": [_param("EmbeddingId")],
            "put": _operation(
                "putEmbedding", "embeddings", "Write an embedding",
                "Stored as float32.",
                (_Ok(200, "written", _ref("PutResult"), headers=_ENTITY_HEADERS),), _WRITE_ERRORS, _DATA,
                _json_body("EmbeddingWrite"), entity),
            "get": _operation(
                "getEmbedding", "embeddings", "Read an embedding", "The vector as stored (float32).",
                (_Ok(200, "the embedding", _ref("Embedding"), headers=_ENTITY_HEADERS),), _READ_ERRORS, _DATA,
                error_headers=entity),
            "delete": _operation(
                "deleteEmbedding", "embeddings", "Delete an embedding",
                "404 when there was nothing to delete (nothing changed).",
                (_Ok(200, "deleted", _ref("DeleteResult"), headers=_ENTITY_HEADERS),), _DELETE_ERRORS, _DATA,
                error_headers=entity),
        },
        "/search": {"post": _operation(
            "search", "search", "Top-k embeddings by cosine similarity",
            "Scattered to one replica of every shard (`x-consistency`), merged. 200 with `degraded: true` when "
            "some shard did not answer in time, 503 when none did.",
            (_Ok(200, "the results", _ref("SearchResult"), headers=entity),),
            ("bad_request", "payload_too_large", "request_timeout", "unavailable", "internal"), _DATA,
            _json_body("SearchRequest"), entity)},
        "/batch": {"post": _operation(
            "batch", "batch", "Several writes in one request",
            "Every write is validated first: one bad write refuses the whole batch (400 naming its index) and "
            "nothing is sent. Then each shard's writes go to its leader; the answer is 200 with one result per "
            "write, each a result or an error body (`unavailable`, `overloaded`, `quorum_timeout`, "
            "`payload_too_large`, `bad_request`, `internal`). Resend the whole batch, unchanged, with the same "
            "`x-request-id` to retry: the writes already applied are answered from the dedup table. Never resend "
            "one of its writes alone with that id: it would be a new write, applied again.",
            (_Ok(200, "one result per write, in order", _ref("BatchResult"), headers=entity),),
            ("bad_request", "payload_too_large", "request_timeout", "unavailable", "internal"), _DATA,
            _json_body("BatchRequest"), entity)},
        "/v1/models": {"get": _operation(
            "listModels", "models", "The topology's models",
            "Each model's groups (layer ranges) and replicas, with the workers' reported load when meta has it.",
            (_Ok(200, "the models", _ref("ModelList"), headers=entity),), ("bad_request", "unavailable", "internal"),
            _DATA, error_headers=entity)},
        "/v1/models/{name}": {
            "parameters": [_param("ModelName")],
            "get": _operation(
                "getModel", "models", "One model", "As one entry of `GET /v1/models`.",
                (_Ok(200, "the model", _ref("Model"), headers=entity),),
                ("bad_request", "not_found", "unavailable", "internal"), _DATA, error_headers=entity)},
        "/v1/models/{name}/infer": {
            "parameters": [_param("ModelName")],
            "post": _operation(
                "infer", "models", "Run the model",
                "Routed through the fewest hops (one replica per layer range), each failed hop retried on another "
                "replica or around its group, all within `x-deadline-ms`. A route that cannot fit the budget is "
                "refused at once: 503 `over_budget`. Nothing is written: any failure may be retried.",
                (_Ok(200, "the output", _ref("InferResult"), headers=("XRequestId", "XRoute", "XServedByRoute")),),
                ("bad_request", "not_found", "payload_too_large", "request_timeout", "unavailable", "over_budget",
                 "deadline_exceeded", "internal"), _DATA, _json_body("InferRequest"), entity)},
        "/v1/models/{name}/weights": {
            "parameters": [_param("ModelName")],
            "post": _operation(
                "putWeights", "models", "Write a new weights version",
                "`{\"seed\": N, \"version\"?: V}` regenerates the weights from a seed; a weights file sent as "
                f"`application/octet-stream` (at most {_size(MAX_WEIGHTS_BYTES)}; `?version=V` optional) gives "
                "each group its own layers. Groups are updated one by one, through their logs: a retry with the "
                "same `x-request-id` and version finishes a partial update without applying anything twice.",
                (_Ok(200, "every group took the version", _ref("WeightsResult"), headers=entity),),
                ("bad_request", "not_found", "conflict", "payload_too_large", "request_timeout", "unavailable",
                 "overloaded", "quorum_timeout", "deadline_exceeded", "internal"),
                (*_DATA, "WeightsVersion"),
                {"required": True, "content": {JSON: {"schema": _ref("WeightsRequest")},
                                               "application/octet-stream": {"schema": _t("string",
                                                                                         format="binary")}}},
                entity,
                special={409: _Ok(409, "some group refused the version; the others' results are listed",
                                  _ref("WeightsResult")),
                         503: _Ok(503, "the error shape, or the per-group results when some group failed",
                                  {"anyOf": [_ref("WeightsResult"), _ref("Error")]})})},
        "/cluster/status": {"get": _operation(
            "clusterStatus", "cluster", "The cluster as meta sees it",
            "Meta's view, preferring the meta leader's (it alone knows liveness).",
            (_Ok(200, "the view", _ref("ClusterStatus")),), _VIEW_ERRORS, ("XDeadlineMsOperator",), admin=True)},
        "/cluster/shards": {"get": _operation(
            "clusterShards", "cluster", "Every shard's term, leader and replicas",
            "Per replica: live, last_seq, commit, applied and lag behind the leader's commit.",
            (_Ok(200, "the shards", _ref("ClusterShards")),), _VIEW_ERRORS, ("XDeadlineMsOperator",), admin=True)},
        "/cluster/shards/{gid}/transfer": {
            "parameters": [_param("ShardId")],
            "post": _operation(
                "transferLeader", "cluster", "Move a shard's leadership",
                "Forwarded to meta with the client's bearer token; meta's status and body come back as it sent "
                "them. Returns once the new leader is ready.",
                (_Ok(200, "done (or `to` led already)", _ref("TransferResult")),), _VERB_ERRORS,
                ("XDeadlineMsOperator",), _json_body("TransferRequest", "Without one, meta picks the target",
                                                     required=False), admin=True)},
        "/cluster/shards/{gid}/replicas": {
            "parameters": [_param("ShardId")],
            "post": _operation(
                "changeReplicas", "cluster", "Add or remove a replica (staged)",
                "Forwarded to meta with the client's bearer token; 202 once the operator started (follow it "
                "with `topoctl operators`).",
                (_Ok(202, "started", _ref("Operator")),), _VERB_ERRORS, ("XDeadlineMsOperator",),
                _json_body("ReplicasRequest"), admin=True)},
    }


def build_document() -> dict[str, Any]:
    """The OpenAPI document of the gateway's API (a new dict on every call)."""
    tags = [("items", "JSON documents by id"), ("signals", "counters and last values per entity"),
            ("embeddings", "vectors by id"), ("search", "top-k over every shard"),
            ("batch", "several writes in one request"), ("models", "layer-sharded models (runbook/models.md)"),
            ("health", "health, metrics and this document"),
            ("cluster", "operator verbs: the admin token when the gateway has one")]
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "shardgrid gateway",
            "version": package_version(),
            "description": "The public API of a shardgrid gateway: every entity is routed by the FNV-1a hash of "
                           "its id to its shard's leader, with retries within the request's deadline. Bodies are "
                           f"JSON (at most {_size(MAX_BODY_BYTES)}); every error has the body of the `Error` schema.",
        },
        "tags": [{"name": n, "description": d} for n, d in tags],
        "paths": _paths(),
        "components": {
            "schemas": _schemas(),
            "parameters": _parameters(),
            "headers": _headers(),
            "securitySchemes": {"adminToken": {
                "type": "http", "scheme": "bearer",
                "description": "the admin token (`--admin-token-file` or SHARDGRID_ADMIN_TOKEN); checked by the "
                               "gateway when it has one, and forwarded to meta by the POST verbs"}},
            "x-error-codes": {c.code: {"status": c.status, "retry": c.retry, "applied": c.applied,
                                       "description": c.meaning} for c in error_codes()},
            "x-codes-not-answered": codes_not_answered(),
        },
    }


def document_bytes() -> bytes:
    """The document as JSON, as `GET /openapi.json` serves it."""
    return orjson.dumps(build_document())


# -- runbook/api.md ------------------------------------------------------------------------------

MARKDOWN_PATH = "runbook/api.md"
REGENERATE = "python -m gateway.openapi --markdown > runbook/api.md"
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path, operation) of every operation, in the document's order."""
    return [(method.upper(), path, op) for path, item in doc["paths"].items()
            for method, op in item.items() if method in _METHODS]


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    target: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        target = target[part]
    return target


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(schema: dict[str, Any]) -> str:
    """A schema as a short phrase for a table cell."""
    ref = schema.get("$ref")
    if ref is not None:
        name = ref.rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for alt in ("oneOf", "anyOf"):
        if alt in schema:
            return " or ".join(_type(s) for s in schema[alt])
    if "const" in schema:
        return f"`{schema['const']}`"
    if "enum" in schema:
        return " or ".join(f"`{v}`" for v in schema["enum"])
    kinds = schema.get("type")
    if kinds is None:
        return "any JSON"
    parts = []
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind == "array" and "items" in schema:
            parts.append(f"array of {_type(schema['items'])}")
        elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
            parts.append(f"object of {_type(schema['additionalProperties'])}")
        elif kind == "object" and schema.get("properties"):
            parts.append("`{" + ", ".join(schema["properties"]) + "}`")
        elif kind == "string" and schema.get("format") == "binary":
            parts.append("bytes")
        else:
            parts.append(kind)
    text = " or ".join(parts)
    low, high = schema.get("minimum", schema.get("minItems")), schema.get("maximum", schema.get("maxItems"))
    if low is not None or high is not None:
        text += f" ({'' if low is None else low}..{'' if high is None else high})"
    if "default" in schema:
        text += f", default `{schema['default']}`"
    return text


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _tags_using(doc: dict[str, Any], wanted: str, kind: str) -> str:
    """The tags of the operations that use parameter or response header `wanted` (a $ref)."""
    tags: list[str] = []
    for _, _, op in operations(doc):
        if kind == "parameters":
            used = any(p.get("$ref") == wanted for p in op.get("parameters", ()))
        else:
            used = any(h.get("$ref") == wanted for r in op["responses"].values()
                       for h in r.get("headers", {}).values())
        if used and op["tags"][0] not in tags:
            tags.append(op["tags"][0])
    return ", ".join(tags)


def _operation_md(doc: dict[str, Any], method: str, path: str, op: dict[str, Any],
                  path_params: list[dict[str, Any]]) -> list[str]:
    summary = op["summary"] if op["summary"].endswith(("?", ".")) else op["summary"] + "."
    out = [f"### `{method} {path}`", "", f"**{summary}** {op['description']}", ""]
    if "security" in op:
        out += ["Needs `Authorization: Bearer <admin token>` when the gateway has an admin token.", ""]
    params = [_resolve(doc, p) for p in (*path_params, *op.get("parameters", ()))]
    fields = [(f"`{p['name']}`", p["in"], _type(p["schema"]), p.get("description", ""))
              for p in params if p["in"] != "header"]
    if fields:
        out += _table(("parameter", "in", "type", "meaning"), fields) + [""]
    headers = sorted({p["name"] for p in params if p["in"] == "header"})
    if headers:
        out += ["Request headers: " + ", ".join(f"`{h}`" for h in headers) + " ([request headers](#request-headers)).",
                ""]
    body = op.get("requestBody")
    if body is not None:
        kinds = "; ".join(f"`{media}`: {_type(c['schema'])}" for media, c in body["content"].items())
        note = f" {body['description']}." if body.get("description") else ""
        out += [f"Body ({'required' if body.get('required') else 'optional'}): {kinds}.{note}", ""]
    rows = []
    for status, resp in op["responses"].items():
        content = resp.get("content", {})
        shape = "; ".join(_type(c["schema"]) if media == JSON else f"`{media}`" for media, c in content.items())
        heads = ", ".join(f"`{h}`" for h in resp.get("headers", {}))
        rows.append((status, resp["description"], shape or "-", heads or "-"))
    out += _table(("status", "meaning", "body", "headers"), rows) + [""]
    return out


def _schema_md(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [schema["description"][0].upper() + schema["description"][1:] + ".", ""]
    variants = schema.get("oneOf") or schema.get("anyOf")
    if variants is not None:
        for v in variants:
            tags = [f"`{k}`: `{sub['const']}`" for k, sub in v.get("properties", {}).items() if "const" in sub]
            text = f"- {', '.join(tags)}: {_type(v)}" if tags else f"- {_type(v)}"
            out.append(text + (f": {v['description']}" if v.get("description") else ""))
        return out + [""]
    props = schema.get("properties")
    if not props:
        if "type" in schema:
            out += [f"Type: {_type(schema)}.", ""]
        return out
    required = set(schema.get("required", ()))
    rows = [(f"`{field}`", _type(sub), "yes" if field in required else "no", sub.get("description", ""))
            for field, sub in props.items()]
    out += _table(("field", "type", "required", "meaning"), rows)
    if schema.get("additionalProperties") is False:
        out += ["", "Any other field is refused (`400 bad_request`)."]
    return out + [""]


def render_markdown(doc: dict[str, Any]) -> str:
    """runbook/api.md: the reference, from the document alone."""
    comp = doc["components"]
    out = ["# The gateway's HTTP API", "",
           f"<!-- Generated from gateway/openapi.py: do not edit. Regenerate with `{REGENERATE}`;",
           "     tests/tier1/test_openapi.py fails while this file differs from what that prints. -->", "",
           doc["info"]["description"], "",
           "The same reference, as an OpenAPI 3.1 document, is served by every gateway at `GET /openapi.json`. "
           "How to use the headers and retry the errors in practice (read-your-writes, the dedup window, "
           "what clients saw in failures) is in [operations.md](operations.md#errors-a-client-sees).", "",
           "## Endpoints", ""]
    rows = []
    for method, path, op in operations(doc):
        ok = ", ".join(s for s in op["responses"] if s.startswith("2"))
        rows.append((f"`{method}`", f"`{path}`", op["summary"], ok, "admin token" if "security" in op else "-"))
    out += _table(("method", "path", "what", "success", "auth"), rows) + [""]

    out += ["## Request headers", "",
            "Every data route (items, signals, embeddings, search, batch, models) validates every one of these "
            "headers, used or not: a malformed one is a `400 bad_request`.", ""]
    rows = []
    for key, p in comp["parameters"].items():
        if p["in"] == "header":
            rows.append((f"`{p['name']}`", _type(p["schema"]), _tags_using(doc, f"#/components/parameters/{key}",
                                                                         "parameters"), p["description"]))
    scheme = comp["securitySchemes"]["adminToken"]
    rows.append(("`Authorization`", "`Bearer <token>`", "cluster", scheme["description"]))
    out += _table(("header", "values", "read by", "meaning"), rows) + [""]

    out += ["## Response headers", ""]
    rows = []
    for key, h in comp["headers"].items():
        rows.append((f"`{_HEADER_NAMES[key]}`", _type(h["schema"]),
                     _tags_using(doc, f"#/components/headers/{key}", "headers"), h["description"]))
    out += _table(("header", "type", "on", "meaning"), rows) + [""]

    out += ["## Error codes", "",
            "Every error has one body: `{\"error\": {\"code\": ..., \"message\": ..., <context>}}` "
            "([Error](#error)). *Retry*: whether a client may send the same request again; *applied*: for a "
            "write, whether it took effect.", ""]
    rows = [(str(c["status"]), f"`{code}`", c["retry"], c["applied"], c["description"])
            for code, c in comp["x-error-codes"].items()]
    out += _table(("status", "code", "retry", "applied", "meaning"), rows) + [""]
    out += ["Codes of the shared table (shardgrid/common/wire.py) that no gateway answer carries:", ""]
    out += [f"- `{code}`: {why}" for code, why in comp["x-codes-not-answered"].items()] + [""]

    out += ["## Endpoints in detail", ""]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in _METHODS:
                out += _operation_md(doc, method.upper(), path, op, item.get("parameters", []))

    out += ["## Schemas", ""]
    for name, schema in comp["schemas"].items():
        out += _schema_md(name, schema)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.openapi",
                                     description="Print the gateway's OpenAPI document (JSON), or runbook/api.md.")
    parser.add_argument("--markdown", action="store_true", help=f"print {MARKDOWN_PATH} rendered from it")
    args = parser.parse_args(argv)
    doc = build_document()
    if args.markdown:
        sys.stdout.write(render_markdown(doc))
    else:
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
