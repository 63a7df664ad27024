"""What the sync and the async client share: building calls, reading answers,
read-your-writes bookkeeping. No I/O here either: each client only moves
bytes (`Response`) and sleeps where the `CallPlan` says."""
from __future__ import annotations

import copy
import json
import random
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar
from urllib.parse import quote, urlsplit

from shardgrid.client.errors import STATUS_FOR_CODE, ShardgridError, error_code, error_from
from shardgrid.client.policy import (MAX_DEADLINE_MS, NOT_APPLIED_RETRYABLE, UNKNOWN_RETRYABLE, Call, CallPlan,
                                     GatewayPool, Outcome, RetryPolicy, SeqTracker, Stop, WriteWindow)
from shardgrid.client.results import (BatchEntry, BatchResult, Deleted, Embedding, Hit, InferResult, Item,
                                      SearchResult, SignalWritten, Signals, Written)

T = TypeVar("T")
# Copies of gateway/limits.py (the client imports nothing above shardgrid.common;
# tests/tier1/test_client.py holds them equal): x-ack, x-consistency, x-request-id.
ACKS = ("leader", "quorum", "all")
CONSISTENCIES = ("strong", "follower")
MAX_REQUEST_ID = 100
MAX_DEADLINE_S = MAX_DEADLINE_MS / 1000
# A /batch entry that failed with one of these is resent (the whole batch, same request id).
BATCH_RETRYABLE = NOT_APPLIED_RETRYABLE | UNKNOWN_RETRYABLE | {"internal"}


@dataclass(frozen=True)
class Gateway:
    scheme: str
    host: str
    port: int

    @property
    def base(self) -> str:
        # An IPv6 literal goes in brackets in a URL (urlsplit took them off); http.client takes it bare.
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> "Gateway":
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a gateway must be http://HOST:PORT or https://HOST:PORT, got {url!r}")
        if parts.path not in ("", "/"):
            raise ValueError(f"a gateway address has no path, got {url!r}")
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))


@dataclass(frozen=True)
class Response:
    """One HTTP answer as either client read it (header names in lower case)."""

    status: int
    headers: Mapping[str, str]
    body: Any  # decoded JSON, or the text when it is not JSON


@dataclass(frozen=True)
class Op(Generic[T]):
    """A call and how to read its successful answer."""

    call: Call
    parse: Callable[[Response, int], T]
    deadline_s: float
    key: str | None = None  # the entity a point read routes by (read-your-writes)
    seqs: Callable[[Response], list[tuple[int | None, int | None]]] = field(default=lambda r: [])


def decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None


def served(r: Response, attempts: int) -> dict[str, Any]:
    h = r.headers
    return {"shard": _int(h.get("x-shard")), "term": _int(h.get("x-term")), "seq": _int(h.get("x-seq")),
            "served_by": h.get("x-served-by"), "request_id": h.get("x-request-id"), "attempts": attempts}


def _header_seq(r: Response) -> list[tuple[int | None, int | None]]:
    return [(_int(r.headers.get("x-shard")), _int(r.headers.get("x-seq")))]


def _path(prefix: str, key: str) -> str:
    # Ids may hold '/', which the gateway's routes take as part of the id; the rest is escaped.
    return prefix + quote(key, safe="/")


def _json(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _dict(body: Any) -> dict[str, Any]:
    return body if isinstance(body, dict) else {}


class Core:
    """The state one client keeps across calls (not global: every client has its own)."""

    def __init__(self, gateways: Sequence[str], *, deadline_s: float = 10.0, ack: str | None = None,
                 consistency: str = "strong", read_your_writes: bool = False, policy: RetryPolicy | None = None,
                 seed: int | None = None) -> None:
        if isinstance(gateways, str):
            raise TypeError("gateways is a list of addresses, e.g. ['http://gw1:8080']")
        if not gateways:
            raise ValueError("at least one gateway address is needed")
        if ack is not None and ack not in ACKS:
            raise ValueError(f"ack must be one of {', '.join(ACKS)}, got {ack!r}")
        if consistency not in CONSISTENCIES:
            raise ValueError(f"consistency must be one of {', '.join(CONSISTENCIES)}, got {consistency!r}")
        _check_deadline(deadline_s)
        self.gateways = [Gateway.parse(g) for g in gateways]
        self.deadline_s = deadline_s
        self.ack = ack
        self.consistency = consistency
        self.policy = policy or RetryPolicy()
        self.pool = GatewayPool(len(self.gateways))
        self.tracker = SeqTracker() if read_your_writes else None
        self.rng = random.Random(seed)
        # The sync client's threads share the pool, the tracker and the rng.
        self.lock = threading.Lock()

    # -- driving one call

    def plan(self, op: Op[Any], deadline: float, window: WriteWindow | None = None) -> CallPlan:
        call = op.call
        if self.tracker is not None and op.key is not None:
            with self.lock:
                min_seq = self.tracker.min_seq(op.key)
            if min_seq > 0:
                call = replace(call, headers={**call.headers, "x-min-seq": str(min_seq)})
        return CallPlan(call, self.pool, self.policy, deadline, self.rng, window)

    @staticmethod
    def outcome(r: Response) -> Outcome:
        if 200 <= r.status < 300:
            return Outcome(status=r.status)
        err = r.body.get("error") if isinstance(r.body, dict) else None
        shaped = isinstance(err, dict) and isinstance(err.get("code"), str)
        return Outcome(status=r.status, code=error_code(r.status, r.body), shaped=shaped,
                       retry_after_s=_retry_after(r.headers))

    def finish(self, op: Op[T], plan: CallPlan, stop: Stop, last: Response | None) -> T:
        """The result of a call that stopped, or raise its error."""
        if stop.error is not None:
            raise stop.error
        assert last is not None, "a Stop without an error follows an answer"
        if 200 <= last.status < 300:
            if self.tracker is not None:
                with self.lock:
                    for shard, seq in op.seqs(last):
                        self.tracker.saw(shard, seq)
                    if op.key is not None:
                        self.tracker.check_shard(op.key, _int(last.headers.get("x-shard")))
            return op.parse(last, plan.attempts)
        raise error_from(last.status, last.body, request_id=last.headers.get("x-request-id") or op.call.request_id,
                         applied=stop.applied, attempts=plan.attempts)

    def needs_shard_count(self, op: Op[Any]) -> bool:
        if self.tracker is None or op.key is None:
            return False
        with self.lock:
            return self.tracker.needs_shard_count()

    def learn_shard_count(self, health: dict[str, Any]) -> None:
        shards = health.get("shards")
        if self.tracker is not None and isinstance(shards, int) and shards > 0:
            with self.lock:
                self.tracker.shards = shards

    # -- building calls

    def _deadline(self, deadline_s: float | None) -> float:
        if deadline_s is None:
            return self.deadline_s
        _check_deadline(deadline_s)
        return deadline_s

    def _read(self, method: str, path: str, body: bytes | None, consistency: str | None) -> Call:
        consistency = consistency or self.consistency
        if consistency not in CONSISTENCIES:
            raise ValueError(f"consistency must be one of {', '.join(CONSISTENCIES)}, got {consistency!r}")
        headers = {"x-consistency": consistency} if consistency != "strong" else {}
        return Call(method, path, body, "read", None, headers)

    def _write(self, method: str, path: str, body: bytes | None, ack: str | None, request_id: str | None) -> Call:
        ack = ack or self.ack
        if ack is not None and ack not in ACKS:
            raise ValueError(f"ack must be one of {', '.join(ACKS)}, got {ack!r}")
        if request_id is not None and not valid_request_id(request_id):
            raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID} visible ASCII characters other than '#'")
        # One id per logical write, made here once: every attempt of this call reuses it.
        rid = request_id or uuid.uuid4().hex
        return Call(method, path, body, "write", rid, {"x-ack": ack} if ack else {})

    def healthz(self, deadline_s: float | None = None) -> Op[dict[str, Any]]:
        return Op(Call("GET", "/healthz", None, "read"), lambda r, n: _dict(r.body), self._deadline(deadline_s))

    def put_item(self, id: str, doc: Any, *, ack: str | None, request_id: str | None,
                 deadline_s: float | None) -> Op[Written]:
        return Op(self._write("PUT", _path("/items/", id), _json(doc), ack, request_id),
                  lambda r, n: Written(id=id, created=_dict(r.body).get("created"), **served(r, n)),
                  self._deadline(deadline_s), seqs=_header_seq)

    def get_item(self, id: str, *, consistency: str | None, deadline_s: float | None) -> Op[Item]:
        return Op(self._read("GET", _path("/items/", id), None, consistency),
                  lambda r, n: Item(id=id, doc=r.body, **served(r, n)), self._deadline(deadline_s), key=id,
                  seqs=_header_seq)

    def delete_item(self, id: str, *, ack: str | None, request_id: str | None,
                    deadline_s: float | None) -> Op[Deleted]:
        return Op(self._write("DELETE", _path("/items/", id), None, ack, request_id),
                  lambda r, n: Deleted(id=id, deleted=_dict(r.body).get("deleted"), **served(r, n)),
                  self._deadline(deadline_s), seqs=_header_seq)

    def signal(self, entity: str, kind: str, value: int | float, mode: str, *, ack: str | None,
               request_id: str | None, deadline_s: float | None) -> Op[SignalWritten]:
        body = _json({"entity": entity, "kind": kind, "value": value, "mode": mode})

        def parse(r: Response, n: int) -> SignalWritten:
            b = _dict(r.body)
            return SignalWritten(entity=entity, kind=kind, mode=mode, value=b.get("value"), **served(r, n))

        return Op(self._write("POST", "/signals", body, ack, request_id), parse, self._deadline(deadline_s),
                  seqs=_header_seq)

    def get_signals(self, entity: str, *, consistency: str | None, deadline_s: float | None) -> Op[Signals]:
        def parse(r: Response, n: int) -> Signals:
            b = _dict(r.body)
            return Signals(entity=entity, counters=b.get("counters") or {}, last=b.get("last") or {}, **served(r, n))

        return Op(self._read("GET", _path("/signals/", entity), None, consistency), parse,
                  self._deadline(deadline_s), key=entity, seqs=_header_seq)

    def put_embedding(self, id: str, vector: Sequence[float], *, ack: str | None, request_id: str | None,
                      deadline_s: float | None) -> Op[Written]:
        return Op(self._write("PUT", _path("/embeddings/", id), _json({"vector": list(vector)}), ack, request_id),
                  lambda r, n: Written(id=id, created=_dict(r.body).get("created"), **served(r, n)),
                  self._deadline(deadline_s), seqs=_header_seq)

    def get_embedding(self, id: str, *, consistency: str | None, deadline_s: float | None) -> Op[Embedding]:
        return Op(self._read("GET", _path("/embeddings/", id), None, consistency),
                  lambda r, n: Embedding(id=id, vector=_dict(r.body).get("vector"), **served(r, n)),
                  self._deadline(deadline_s), key=id, seqs=_header_seq)

    def delete_embedding(self, id: str, *, ack: str | None, request_id: str | None,
                         deadline_s: float | None) -> Op[Deleted]:
        return Op(self._write("DELETE", _path("/embeddings/", id), None, ack, request_id),
                  lambda r, n: Deleted(id=id, deleted=_dict(r.body).get("deleted"), **served(r, n)),
                  self._deadline(deadline_s), seqs=_header_seq)

    def search(self, vector: Sequence[float], k: int, *, consistency: str | None,
               deadline_s: float | None) -> Op[SearchResult]:
        def parse(r: Response, n: int) -> SearchResult:
            b = _dict(r.body)
            return SearchResult(hits=[Hit(h["id"], h["score"]) for h in b.get("results") or []],
                                degraded=bool(b.get("degraded")),
                                unavailable_shards=list(b.get("unavailable_shards") or []),
                                request_id=r.headers.get("x-request-id"), attempts=n)

        return Op(self._read("POST", "/search", _json({"vector": list(vector), "k": k}), consistency), parse,
                  self._deadline(deadline_s))

    def batch(self, writes: Sequence[Mapping[str, Any]], *, ack: str | None, request_id: str | None,
              deadline_s: float | None) -> Op[BatchResult]:
        call = self._write("POST", "/batch", _json({"writes": [dict(w) for w in writes]}), ack, request_id)

        def parse(r: Response, n: int) -> BatchResult:
            # The id the entries were deduped under is the one sent (the gateway echoes it).
            rid = call.request_id
            return BatchResult(results=[_batch_entry(i, e, rid)
                                        for i, e in enumerate(_dict(r.body).get("results") or [])],
                               request_id=rid, attempts=n)

        def seqs(r: Response) -> list[tuple[int | None, int | None]]:
            return [(_int(e.get("shard")), _int(e.get("seq"))) for e in _dict(r.body).get("results") or []
                    if isinstance(e, dict) and "error" not in e]

        return Op(call, parse, self._deadline(deadline_s), seqs=seqs)

    def infer(self, model: str, rows: Sequence[Sequence[float]], *, deadline_s: float | None) -> Op[InferResult]:
        def parse(r: Response, n: int) -> InferResult:
            b = _dict(r.body)
            by = r.headers.get("x-served-by")
            return InferResult(output=b.get("output") or [], route=b.get("route") or [], tried=b.get("tried") or [],
                               served_by=by.split(",") if by else [], request_id=r.headers.get("x-request-id"),
                               attempts=n)

        # Inference changes nothing: a read, resent freely.
        return Op(Call("POST", _path("/v1/models/", model) + "/infer", _json({"input": [list(x) for x in rows]}),
                       "read"), parse, self._deadline(deadline_s))

    def backoff(self, round_: int) -> float:
        """The wait before resending a batch whose entries failed (round_ >= 1)."""
        p = self.policy
        with self.lock:
            jitter = 0.5 + self.rng.random() / 2
        return min(p.backoff_cap_s, p.backoff_base_s * 2 ** (round_ - 1)) * jitter


def _check_deadline(deadline_s: float) -> None:
    # The gateway refuses an x-deadline-ms over its cap with a 400: refuse it here, before any attempt.
    if not 0 < deadline_s <= MAX_DEADLINE_S:
        raise ValueError(f"deadline_s must be in (0, {MAX_DEADLINE_S:g}], got {deadline_s!r}")


def valid_request_id(rid: str) -> bool:
    """The gateway's rule (gateway/routes.py _RID): 1 to 100 visible ASCII characters, no '#' (batch entries use it)."""
    return 1 <= len(rid) <= MAX_REQUEST_ID and "#" not in rid and all(0x21 <= ord(c) <= 0x7e for c in rid)


def _batch_entry(index: int, e: Any, rid: str | None) -> BatchEntry | ShardgridError:
    if isinstance(e, dict) and "error" in e:
        code = error_code(0, e)
        # No `request_id`: the entry is deduped under `<rid>#<i>` (or `#s<shard>`), so resending this
        # write alone with `rid` would apply it again. The batch's id goes in `batch_request_id`.
        return error_from(STATUS_FOR_CODE.get(code, 500), e, batch_request_id=rid, batch_index=index,
                          applied=None if code in UNKNOWN_RETRYABLE | {"internal"} else False)
    d = _dict(e)
    return BatchEntry(index=index, shard=_int(d.get("shard")), term=_int(d.get("term")), seq=_int(d.get("seq")),
                      served_by=d.get("served_by"), result=d.get("result"))


def merge_batch(prev: BatchResult, new: BatchResult) -> BatchResult:
    """`new` (a resend with the same request id) filling the entries `prev` lacks.

    An entry that succeeded before keeps its first answer: the resend is
    answered from the dedup table, with the result fields null.
    """
    merged = [p if not isinstance(p, ShardgridError) or i >= len(new.results) else new.results[i]
              for i, p in enumerate(prev.results)]
    return BatchResult(results=merged, request_id=prev.request_id, attempts=prev.attempts + new.attempts)


@dataclass
class BatchRounds:
    """The resend rounds of one batch, without I/O (both clients drive it).

    A batch is resent whole, with its one request id, while some entries
    failed in a way a resend may fix. Across rounds it keeps:
    - one deadline and one dedup window (`window`: from the batch's first
      send, never restarted by a round);
    - which entries some round left with an unknown outcome (`unknown`): an
      entry that was perhaps applied in round 1 and then refused in round 2 is
      still perhaps applied, so its final error says `applied=None`;
    - how many `internal` errors each entry got: resent once, as a single
      call's 500.
    """

    policy: RetryPolicy
    deadline: float  # monotonic time, the whole batch's
    window: WriteWindow = field(default_factory=WriteWindow)
    result: BatchResult | None = None
    rounds: int = 0
    unknown: set[int] = field(default_factory=set)
    internal: dict[int, int] = field(default_factory=dict)

    def took(self, answer: BatchResult) -> None:
        """A round's answer (the first round's, or a resend's)."""
        self.result = answer if self.result is None else merge_batch(self.result, answer)
        self.rounds += 1
        for i, r in enumerate(answer.results):
            if isinstance(r, ShardgridError):
                if r.applied is None:
                    self.unknown.add(i)
                if r.code == "internal":
                    self.internal[i] = self.internal.get(i, 0) + 1

    def failed(self, exc: ShardgridError) -> None:
        """A resend round raised instead of answering (504s, no gateway...)."""
        assert self.result is not None, "the first round's error is the batch's"
        self.rounds += 1
        self.result = replace(self.result, attempts=self.result.attempts + exc.attempts)
        if exc.applied is not False:
            # That round reached a gateway and may have applied what was still failing.
            self.unknown.update(self.result.errors)

    def retryable(self) -> bool:
        """Whether some entries failed in a way a resend (same request id) may fix."""
        assert self.result is not None
        return any(err.code in BATCH_RETRYABLE and
                   (err.code != "internal" or self.internal.get(i, 0) <= self.policy.internal_retries)
                   for i, err in self.result.errors.items())

    def resend_at(self, now: float, wait: float) -> float | None:
        """When to send the next round (after `wait` of backoff), or None: no more rounds."""
        at = now + wait
        if not self.retryable() or self.rounds >= self.policy.max_attempts:
            return None
        if self.deadline - at < self.policy.min_attempt_s or not self.window.admits(at, self.policy):
            return None
        return at

    def final(self) -> BatchResult:
        """The merged result; an entry some round left unknown says `applied=None` whatever came after."""
        assert self.result is not None
        results = list(self.result.results)
        for i in self.unknown:
            r = results[i] if i < len(results) else None
            if isinstance(r, ShardgridError) and r.applied is not None:
                r = copy.copy(r)
                r.applied = None
                results[i] = r
        return replace(self.result, results=results)

