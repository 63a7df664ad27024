"""Typed results. Single-entity answers carry where they were served:
`shard` (the group), `term` (its term at the serving replica: a change means
a leader change), `seq` (a write's log position; a read's applied seq at the
replica), `served_by` (the worker), from the gateway's x-shard, x-term, x-seq
and x-served-by headers, and the `request_id` the gateway echoed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardgrid.client.errors import ShardgridError


@dataclass(frozen=True, kw_only=True)
class Served:
    shard: int | None = None
    term: int | None = None
    seq: int | None = None
    served_by: str | None = None
    request_id: str | None = None
    attempts: int = 1  # attempts the client made (retries included)


@dataclass(frozen=True, kw_only=True)
class Written(Served):
    """A put of an item or an embedding. `created` is None when the write was answered
    from the dedup table (a retry of a write that had applied) or acknowledged with x-ack: leader."""

    id: str
    created: bool | None


@dataclass(frozen=True, kw_only=True)
class Deleted(Served):
    id: str
    deleted: bool | None  # None: answered from the dedup table


@dataclass(frozen=True, kw_only=True)
class Item(Served):
    id: str
    doc: Any


@dataclass(frozen=True, kw_only=True)
class SignalWritten(Served):
    """`value`: the counter's new total (incr) or the value set; None from the dedup table."""

    entity: str
    kind: str
    mode: str
    value: int | float | None


@dataclass(frozen=True, kw_only=True)
class Signals(Served):
    entity: str
    counters: dict[str, int | float]
    last: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Embedding(Served):
    id: str
    vector: list[float] | None


@dataclass(frozen=True)
class Hit:
    id: str
    score: float


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """`degraded`: some shards (`unavailable_shards`) did not answer in time."""

    hits: list[Hit]
    degraded: bool
    unavailable_shards: list[int]
    request_id: str | None = None
    attempts: int = 1


@dataclass(frozen=True, kw_only=True)
class BatchEntry:
    """One write of a batch that succeeded; `result` as the worker answered it
    (None when answered from the dedup table)."""

    index: int
    shard: int | None
    term: int | None
    seq: int | None
    served_by: str | None
    result: Any


@dataclass(frozen=True, kw_only=True)
class BatchResult:
    """One entry per write, in request order: a `BatchEntry` or the `ShardgridError` of that write."""

    results: list[BatchEntry | ShardgridError]
    request_id: str | None = None
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> dict[int, ShardgridError]:
        return {i: r for i, r in enumerate(self.results) if isinstance(r, ShardgridError)}

    def raise_for_errors(self) -> None:
        errors = self.errors
        if errors:
            raise next(iter(errors.values()))


@dataclass(frozen=True, kw_only=True)
class InferResult:
    """`route`: the hops taken (group, worker, layer range); `served_by`: their workers in order."""

    output: list[list[float]]
    route: list[dict[str, Any]]
    tried: list[dict[str, Any]]
    served_by: list[str] = field(default_factory=list)
    request_id: str | None = None
    attempts: int = 1
