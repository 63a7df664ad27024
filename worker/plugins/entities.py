"""`entities`: the default shard-group state machine.

Three kinds of state, all keyed by a string id (the gateway routes by it):

items       JSON documents. Stored as their orjson encoding (compact, immutable,
            and the size limit is measured on exactly what is stored).
signals     per entity: named counters (`mode: incr`, summed) and named last
            values (`mode: set`, overwritten). Counters and last values are
            separate namespaces. An entity exists once it has a signal; there
            is no delete, so `get_signals` of an unknown entity is NotFound
            (not empty dicts): a typo in an entity id shows up as an error.
embeddings  `embedding_dim` float32 vectors; `search` is cosine top-k.

Ops (apply) and what apply returns:

    {"kind": "put_item", "id", "doc"}          -> {"id", "created": bool}
    {"kind": "put_items", "ids": [id, ...], "docs": [bytes, ...]}
                                               -> {"created": [bool, ...]}
    {"kind": "delete_item", "id"}              -> {"id", "deleted": bool}
    {"kind": "signal", "entity", "name", "value", "mode": "incr"|"set"}
                                               -> the counter's new total (incr)
                                                  or the value (set): a number
    {"kind": "put_embedding", "id", "vector"}  -> {"id", "created": bool}
    {"kind": "delete_embedding", "id"}         -> {"id", "deleted": bool}

`put_items` is the bulk form of `put_item` (a gateway sends one per shard of
a `/batch`): docs[i] is already the JSON encoding of ids[i]'s doc, so no
replica decodes or re-encodes it, and the batch is one op, one log entry and
one request id. It is all or nothing like every op; an id may repeat (the
last doc wins, `created` is true only for the first). Its weight (`weight`)
is its number of ids: the replication layer counts client writes with it.

Deleting something absent is not an error (`deleted: false`): a log entry is
applied whatever the state, and the HTTP layer can still answer 404 from it.

Queries:

    {"kind": "get_item", "id"}         -> the doc                      | NotFound
    {"kind": "get_signals", "entity"}  -> {"counters": {..}, "last": {..}} | NotFound
    {"kind": "get_embedding", "id"}    -> [float, ...] (the stored float32 values)
    {"kind": "search", "vector", "k"}  -> [{"id", "score"}, ...] best first,
                                          ties by id; at most k (1..1000)

Numbers are int (int64 range) or finite float, never bool. An int counter that
would leave int64, or a float counter that would become infinite, is a BadOp at
apply (nothing changes, on every replica alike). int + float gives a float.

Floats and determinism. A vector's floats are rounded to float32 by
`struct.pack` (IEEE round-to-nearest-even, the same on every machine). Each row
is normalised once, at insert, in exactly rounded Python arithmetic
(`math.fsum`, `math.sqrt`, one division, one rounding to float32) rather than
by torch, whose vectorised reductions may sum in a different order on a
different CPU or for a different batch shape. So both the stored vectors and
the unit rows are bit-identical on every replica, and search is one matmul.
Search scores are derived data: the same on one machine for the same state
(restore included); across CPU types they may differ in the last bit.

Storage of embeddings. Two preallocated, doubling `bytearray`s of
little-endian float32 rows (the vectors as given, and unit rows), a live-row
mask, an id<->row map and a LIFO free list of deleted rows. torch views them
with `torch.frombuffer` (no copy) only when searching, so torch is imported by
the first search, never by import or apply. Deleted rows are zeroed and masked
out of search.

Snapshot files (names never start with "_"):

    entities.msgpack   header + items + signals + the embedding row map, in
                       insertion order (restore reproduces dict order too)
    entities.raw.f32   rows x dim little-endian float32, the vectors as given
    entities.unit.f32  the same rows normalised (a cache of a pure function of
                       the raw rows, kept so restore is a read, not a recompute)

No pickle anywhere; the float files carry xxh3-128 digests in the header. The
row layout (holes and free list included) is snapshotted as is, so a restored
replica computes exactly what the original would.
"""
from __future__ import annotations

import math
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Union

import msgpack
import orjson
import xxhash

from shardgrid.common.ids import id_problem
from shardgrid.common.wire import short_repr
from worker.plugins.base import ApplyContext, BadOp, NotFound, PluginSettings, SnapshotError, SnapshotWriter, Unappliable, \
    import_torch

FORMAT = "shardgrid.entities"
FORMAT_VERSION = 1
STATE_FILE = "entities.msgpack"
RAW_FILE = "entities.raw.f32"
UNIT_FILE = "entities.unit.f32"

MAX_K = 1000
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# Matrix capacity is a pure function of the high-water row count (see
# _capacity_for), so a restored replica has the same capacity and stats.
_MIN_ROWS = 16

Number = Union[int, float]

# kind -> its keys besides "kind" (all required, nothing else allowed).
_OPS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "put_item": ("id", "doc"),
    "put_items": ("ids", "docs"),
    "delete_item": ("id",),
    "signal": ("entity", "name", "value", "mode"),
    "put_embedding": ("id", "vector"),
    "delete_embedding": ("id",),
})
_QUERIES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "get_item": ("id",),
    "get_signals": ("entity",),
    "get_embedding": ("id",),
    "search": ("vector", "k"),
})
_SIGNAL_MODES = ("incr", "set")
# The exact key set of each op and query ("kind" included): one C-level set
# comparison admits a well-formed op; only a bad one pays for the diagnosis.
_EXACT_KEYS: Mapping[str, frozenset[str]] = MappingProxyType(
    {kind: frozenset(("kind",) + keys) for kind, keys in (*_OPS.items(), *_QUERIES.items())})
_PUT_KEYS = _EXACT_KEYS["put_item"]
_PUTS_KEYS = _EXACT_KEYS["put_items"]
MAX_PUT_ITEMS = 10_000  # ids in one put_items (a gateway's /batch holds at most 1,000 writes)


# ---------------------------------------------------------------- parsed ops


@dataclass(frozen=True, slots=True)
class _PutItem:
    id: str
    encoded: bytes  # the doc's orjson encoding: what is stored


@dataclass(frozen=True, slots=True)
class _PutItems:
    ids: list[str]
    docs: list[bytes]  # each one's JSON encoding: what is stored


@dataclass(frozen=True, slots=True)
class _DeleteItem:
    id: str


@dataclass(frozen=True, slots=True)
class _Signal:
    entity: str
    name: str
    value: Number
    mode: str


@dataclass(frozen=True, slots=True)
class _PutEmbedding:
    id: str
    raw: bytes  # dim little-endian float32
    unit: bytes  # the same, normalised


@dataclass(frozen=True, slots=True)
class _DeleteEmbedding:
    id: str


_Op = Union[_PutItem, _PutItems, _DeleteItem, _Signal, _PutEmbedding, _DeleteEmbedding]


# ---------------------------------------------------------------- validation helpers


def _tname(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any) -> str:
    """repr for an error message: a client's 1 MB string must not come back in it,
    nor a value nested deep enough to make repr() raise RecursionError."""
    return short_repr(value)


def _check_shape(obj: Any, table: Mapping[str, tuple[str, ...]], other: Mapping[str, tuple[str, ...]],
                 what: str, other_what: str) -> str:
    """Check `obj` is a dict with a known kind and exactly that kind's keys; return the kind."""
    if not isinstance(obj, dict):
        raise BadOp(f"{what} must be an object (dict), got {_tname(obj)}")
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise BadOp(f"{what} needs a string 'kind'; got {_tname(kind)}")
    if kind in table and obj.keys() == _EXACT_KEYS[kind]:
        return kind
    if kind not in table:
        if kind in other:
            raise BadOp(f"{_short(kind)} is a {other_what}, not a {what}")
        raise BadOp(f"unknown {what} kind {_short(kind)}; expected one of: {', '.join(table)}")
    expected = table[kind]
    missing = [k for k in expected if k not in obj]
    if missing:
        raise BadOp(f"{kind}: missing {', '.join(repr(k) for k in missing)}")
    extra = [k for k in obj if k != "kind" and k not in expected]
    if extra:
        raise BadOp(f"{kind}: unexpected key(s) {', '.join(_short(k) for k in extra)}; "
                    f"allowed: {', '.join(expected)}")
    return kind


def _ident(value: Any, where: str, max_len: int | None) -> str:
    """A non-empty str that encodes to UTF-8 (msgpack and orjson need that)."""
    problem = id_problem(value, where, max_len, _tname)
    if problem is not None:
        raise BadOp(problem)
    return str(value)


def _number(value: Any, where: str) -> Number:
    # bool is an int subclass; True as a counter increment is a client bug.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadOp(f"{where} must be a number (int or float), got {_tname(value)}")
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise BadOp(f"{where} = {_short(value)} is outside the int64 range")
        return int(value)
    if not math.isfinite(value):
        raise BadOp(f"{where} must be finite, got {value!r}")
    return float(value)


def _doc(value: Any, where: str, max_bytes: int | None) -> bytes:
    try:
        encoded = orjson.dumps(value)
    except orjson.JSONEncodeError as e:
        raise BadOp(f"{where} is not JSON-encodable: {e}") from None
    if max_bytes is not None and len(encoded) > max_bytes:
        raise BadOp(f"{where} is {len(encoded)} bytes of JSON; the limit is {max_bytes}")
    # orjson writes NaN and Infinity as null rather than failing; a doc that does
    # not come back equal would silently change. Only such a doc contains "null"
    # where the input had none, so the round trip is skipped in the common case.
    if b"null" in encoded and orjson.loads(encoded) != value:
        raise BadOp(f"{where} contains NaN or Infinity, which JSON cannot represent")
    return encoded


def _plain_put_id(op: Any, max_len: int | None) -> str | None:
    """The id of a put_item that passes _parse's shape and id checks (an ASCII
    id of 1..max_len characters), without building a parsed op; None when the
    general path must decide."""
    if type(op) is dict and op.get("kind") == "put_item" and op.keys() == _PUT_KEYS:
        id = op["id"]
        if type(id) is str and id and id.isascii() and (max_len is None or len(id) <= max_len):
            return id
    return None


def _put_items_parts(op: dict[str, Any], max_id: int | None, max_bytes: int | None,
                     admit: bool) -> tuple[list[str], list[bytes]]:
    """(ids, docs) of a put_items op of the right shape; BadOp naming the first bad index.

    `admit` (the leader, before the op enters the log) also checks that every
    doc is JSON: a stored doc is served as is. The common case runs as C-level
    loops; only a bad op pays for finding which element is bad.
    """
    ids, docs = op["ids"], op["docs"]
    if type(ids) is not list or type(docs) is not list:
        raise BadOp(f"put_items: ids and docs must be lists, got {_tname(ids)} and {_tname(docs)}")
    if not ids or len(ids) != len(docs):
        raise BadOp(f"put_items: ids and docs must be non-empty and of one length, got {len(ids)} and {len(docs)}")
    if len(ids) > MAX_PUT_ITEMS:
        raise BadOp(f"put_items: {len(ids)} ids; the limit is {MAX_PUT_ITEMS}")
    longest = sys.maxsize if max_id is None else max_id
    if not all(type(i) is str and 0 < len(i) <= longest and i.isascii() for i in ids):
        for n, id in enumerate(ids):  # non-ASCII ids are fine when they encode within the limit
            problem = id_problem(id, f"put_items: ids[{n}]", max_id, _tname)
            if problem is not None:
                raise BadOp(problem)
    biggest = sys.maxsize if max_bytes is None else max_bytes
    if not all(type(d) is bytes and len(d) <= biggest for d in docs):
        for n, doc in enumerate(docs):
            if type(doc) is not bytes:
                raise BadOp(f"put_items: docs[{n}] must be the doc's JSON as bytes, got {_tname(doc)}")
            if len(doc) > biggest:
                raise BadOp(f"put_items: docs[{n}] is {len(doc)} bytes of JSON; the limit is {max_bytes}")
    if admit:
        for n, doc in enumerate(docs):
            try:
                orjson.loads(doc)
            except orjson.JSONDecodeError as e:
                raise BadOp(f"put_items: docs[{n}] is not JSON: {e}") from None
    return ids, docs


def _vector(value: Any, where: str, dim: int) -> tuple[bytes, bytes]:
    """(raw, unit): the vector rounded to float32, and that normalised, both packed."""
    if not isinstance(value, (list, tuple)):
        raise BadOp(f"{where} must be a list of {dim} numbers, got {_tname(value)}")
    if len(value) != dim:
        raise BadOp(f"{where} has {len(value)} values; this group's embedding_dim is {dim}")
    floats: list[float] = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise BadOp(f"{where}[{i}] must be a number, got {_tname(x)}")
        try:
            f = float(x)
        except OverflowError:
            raise BadOp(f"{where}[{i}] = {_short(x)} is outside the float32 range") from None
        if not math.isfinite(f):
            raise BadOp(f"{where}[{i}] must be finite, got {f!r}")
        floats.append(f)
    fmt = f"<{dim}f"
    try:
        raw = struct.pack(fmt, *floats)
    except OverflowError:
        bad = next(i for i, f in enumerate(floats) if abs(f) > 3.4028235677973366e38)
        raise BadOp(f"{where}[{bad}] = {floats[bad]!r} is outside the float32 range") from None
    return raw, _normalise(raw, fmt, where)


def _normalise(raw: bytes, fmt: str, where: str) -> bytes:
    # Exactly rounded at every step (float32*float32 fits a double exactly; fsum,
    # sqrt and / are correctly rounded): the same bits on every IEEE machine.
    vals = struct.unpack(fmt, raw)
    norm = math.sqrt(math.fsum([x * x for x in vals]))
    if norm == 0.0:
        raise BadOp(f"{where} is all zeros (in float32); cosine similarity needs a non-zero vector")
    return struct.pack(fmt, *[x / norm for x in vals])


def _k(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadOp(f"search: k must be an integer, got {_tname(value)}")
    if not 1 <= value <= MAX_K:
        raise BadOp(f"search: k must be between 1 and {MAX_K}, got {_short(value)}")
    return int(value)


def _capacity_for(rows: int) -> int:
    if rows == 0:
        return 0
    cap = _MIN_ROWS
    while cap < rows:
        cap *= 2
    return cap


def _torch() -> Any:
    """torch, imported on first use: it costs seconds, and only search needs it."""
    torch = import_torch()

    if sys.byteorder != "little":
        # The float files and buffers are little-endian; frombuffer is native.
        raise RuntimeError("embeddings search needs a little-endian machine")
    return torch


# ---------------------------------------------------------------- state


@dataclass(slots=True)
class _Signals:
    counters: dict[str, Number] = field(default_factory=dict)
    last: dict[str, Number] = field(default_factory=dict)


class _Matrix:
    """The group's embeddings: float32 rows in growing buffers + id<->row map."""

    __slots__ = ("dim", "row_bytes", "capacity", "rows", "raw", "unit", "live", "row_of", "id_of_row", "free")

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.row_bytes = 4 * dim
        self.capacity = 0
        self.rows = 0  # high-water mark: rows [0, rows) are in use or free
        self.raw = bytearray()
        self.unit = bytearray()
        self.live = bytearray()  # 1 byte per row: 1 live, 0 free (a torch.bool view)
        self.row_of: dict[str, int] = {}
        self.id_of_row: list[str | None] = []
        self.free: list[int] = []  # LIFO

    def __len__(self) -> int:
        return len(self.row_of)

    def _grow_to(self, rows: int) -> None:
        cap = _capacity_for(rows)
        if cap <= self.capacity:
            return
        # New buffers rather than resizing in place: a search in progress may
        # hold a torch view of the old ones (a resize would raise BufferError).
        for name, width in (("raw", self.row_bytes), ("unit", self.row_bytes), ("live", 1)):
            old = getattr(self, name)
            new = bytearray(cap * width)
            new[: len(old)] = old
            setattr(self, name, new)
        self.capacity = cap

    def put(self, id: str, raw: bytes, unit: bytes) -> bool:
        row = self.row_of.get(id)
        created = row is None
        if row is None:
            if self.free:
                row = self.free.pop()
                self.id_of_row[row] = id
            else:
                row = self.rows
                self._grow_to(row + 1)
                self.rows += 1
                self.id_of_row.append(id)
            self.row_of[id] = row
            self.live[row] = 1
        rb = self.row_bytes
        self.raw[row * rb : (row + 1) * rb] = raw
        self.unit[row * rb : (row + 1) * rb] = unit
        return created

    def delete(self, id: str) -> bool:
        row = self.row_of.pop(id, None)
        if row is None:
            return False
        rb = self.row_bytes
        zeros = bytes(rb)
        self.raw[row * rb : (row + 1) * rb] = zeros
        self.unit[row * rb : (row + 1) * rb] = zeros
        self.live[row] = 0
        self.id_of_row[row] = None
        self.free.append(row)
        return True

    def get(self, id: str) -> list[float] | None:
        row = self.row_of.get(id)
        if row is None:
            return None
        rb = self.row_bytes
        return list(struct.unpack(f"<{self.dim}f", self.raw[row * rb : (row + 1) * rb]))

    def search(self, q_unit: bytes, k: int) -> list[dict[str, Any]]:
        count = len(self.row_of)
        if count == 0:
            return []
        torch = _torch()
        n, dim = self.rows, self.dim
        mat = torch.frombuffer(self.unit, dtype=torch.float32, count=n * dim).view(n, dim)
        q = torch.frombuffer(bytearray(q_unit), dtype=torch.float32)
        live = torch.frombuffer(self.live, dtype=torch.bool, count=n)
        scores = mat @ q  # rows are unit vectors: this is the cosine
        scores.masked_fill_(~live, float("-inf"))
        kth = float(torch.topk(scores, min(k, count), sorted=True).values[-1])
        # topk breaks ties at the k-th score by position, which depends on the
        # row layout; take every row tied with it and cut by id instead, so the
        # answer is a function of the contents (and merges across groups).
        rows = torch.nonzero(scores >= kth).flatten()
        vals = scores[rows].tolist()
        ranked = sorted((-v, self.id_of_row[r]) for r, v in zip(rows.tolist(), vals))
        return [{"id": i, "score": -neg} for neg, i in ranked[:k]]

    def nbytes(self) -> int:
        return len(self.raw) + len(self.unit) + len(self.live)


@dataclass(slots=True)
class _State:
    dim: int
    items: dict[str, bytes] = field(default_factory=dict)
    item_bytes: int = 0
    signals: dict[str, _Signals] = field(default_factory=dict)
    signal_values: int = 0
    matrix: _Matrix = field(init=False)

    def __post_init__(self) -> None:
        self.matrix = _Matrix(self.dim)


# ---------------------------------------------------------------- the plugin


class EntitiesPlugin:
    """Items, signals and embeddings of one shard group. Implements `Plugin`."""

    name = "entities"

    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings
        self._state = _State(settings.embedding_dim)

    # -- ops

    def validate(self, op: dict[str, Any]) -> None:
        # The leader runs this for every write it takes.
        if _plain_put_id(op, self.settings.max_id_len) is not None:
            _doc(op["doc"], "put_item: doc", self.settings.max_item_bytes)
            return
        self._parse(op, limits=True)

    def apply(self, op: dict[str, Any], ctx: ApplyContext) -> Any:
        # No parsed object for the common put: every replica runs this for every write.
        id = _plain_put_id(op, None)
        try:
            if id is not None:
                encoded = _doc(op["doc"], "put_item: doc", None)
            else:
                # Re-parse without admission limits (see base.py): structure is what
                # apply needs to be atomic; limits were the leader's business.
                parsed = self._parse(op, limits=False)
        except BadOp as exc:
            # A leader admitted it, so a newer version wrote it: skipping it
            # here would be a divergence (base.py, "Atomic apply").
            raise Unappliable(f"a committed op this version of the entities plugin cannot apply: "
                              f"{exc.message}") from None
        if id is not None:
            return self._put_item(id, encoded)
        s = self._state
        match parsed:
            case _PutItem(id=id, encoded=encoded):
                return self._put_item(id, encoded)
            case _PutItems(ids=ids, docs=docs):
                return self._put_items(ids, docs)
            case _DeleteItem(id=id):
                old = s.items.pop(id, None)
                if old is not None:
                    s.item_bytes -= len(old)
                return {"id": id, "deleted": old is not None}
            case _Signal():
                return self._apply_signal(parsed)
            case _PutEmbedding(id=id, raw=raw, unit=unit):
                return {"id": id, "created": s.matrix.put(id, raw, unit)}
            case _DeleteEmbedding(id=id):
                return {"id": id, "deleted": s.matrix.delete(id)}
        raise AssertionError(f"unhandled op {parsed!r}")

    def _put_item(self, id: str, encoded: bytes) -> dict[str, Any]:
        s = self._state
        old = s.items.get(id)
        s.items[id] = encoded
        s.item_bytes += len(encoded) - (len(old) if old is not None else 0)
        return {"id": id, "created": old is None}

    def _put_items(self, ids: list[str], docs: list[bytes]) -> dict[str, Any]:
        s = self._state
        items = s.items
        get = items.get
        created: list[bool] = []
        grown = 0
        for id, doc in zip(ids, docs):
            old = get(id)
            items[id] = doc
            if old is None:
                grown += len(doc)
                created.append(True)
            else:
                grown += len(doc) - len(old)
                created.append(False)
        s.item_bytes += grown
        return {"created": created}

    def weight(self, op: Any) -> int:
        """Client writes in `op` (see base.py): a put_items counts its ids."""
        if type(op) is dict and op.get("kind") == "put_items":
            ids = op.get("ids")
            if type(ids) is list and ids:
                return len(ids)
        return 1

    def _apply_signal(self, op: _Signal) -> Number:
        s = self._state
        sig = s.signals.get(op.entity)
        if op.mode == "set":
            new = op.value
        else:
            old = sig.counters.get(op.name, 0) if sig is not None else 0
            new = old + op.value
            # Checked before any mutation: the op must be all or nothing.
            if isinstance(new, int) and not INT64_MIN <= new <= INT64_MAX:
                raise BadOp(f"signal: counter {_short(op.name)} of {_short(op.entity)} would leave the int64 range")
            if isinstance(new, float) and not math.isfinite(new):
                raise BadOp(f"signal: counter {_short(op.name)} of {_short(op.entity)} would become {new}")
        if sig is None:
            sig = s.signals[op.entity] = _Signals()
        target = sig.last if op.mode == "set" else sig.counters
        if op.name not in target:
            s.signal_values += 1
        target[op.name] = new
        return new

    def _parse(self, op: Any, *, limits: bool) -> _Op:
        st = self.settings
        id_len = st.max_id_len if limits else None
        kind = _check_shape(op, _OPS, _QUERIES, "write op", "query")
        if kind == "put_item":
            return _PutItem(_ident(op["id"], "put_item: id", id_len),
                            _doc(op["doc"], "put_item: doc", st.max_item_bytes if limits else None))
        if kind == "put_items":
            return _PutItems(*_put_items_parts(op, id_len, st.max_item_bytes if limits else None, admit=limits))
        if kind == "delete_item":
            return _DeleteItem(_ident(op["id"], "delete_item: id", id_len))
        if kind == "signal":
            mode = op["mode"]
            if mode not in _SIGNAL_MODES:
                raise BadOp(f"signal: mode must be 'incr' or 'set', got {_short(mode)}")
            return _Signal(_ident(op["entity"], "signal: entity", id_len),
                           _ident(op["name"], "signal: name", id_len),
                           _number(op["value"], "signal: value"),
                           mode)
        if kind == "put_embedding":
            id = _ident(op["id"], "put_embedding: id", id_len)
            raw, unit = _vector(op["vector"], "put_embedding: vector", st.embedding_dim)
            return _PutEmbedding(id, raw, unit)
        assert kind == "delete_embedding"
        return _DeleteEmbedding(_ident(op["id"], "delete_embedding: id", id_len))

    # -- reads

    def query(self, q: dict[str, Any]) -> Any:
        kind = _check_shape(q, _QUERIES, _OPS, "query", "write op")
        s = self._state
        id_len = self.settings.max_id_len
        if kind == "get_item":
            id = _ident(q["id"], "get_item: id", id_len)
            encoded = s.items.get(id)
            if encoded is None:
                raise NotFound(f"no item {id!r}")
            return orjson.loads(encoded)  # a fresh object: callers cannot alter the state
        if kind == "get_signals":
            entity = _ident(q["entity"], "get_signals: entity", id_len)
            sig = s.signals.get(entity)
            if sig is None:
                raise NotFound(f"no signals for entity {entity!r}")
            return {"counters": dict(sig.counters), "last": dict(sig.last)}
        if kind == "get_embedding":
            id = _ident(q["id"], "get_embedding: id", id_len)
            vec = s.matrix.get(id)
            if vec is None:
                raise NotFound(f"no embedding {id!r}")
            return vec
        assert kind == "search"
        k = _k(q["k"])
        _, unit = _vector(q["vector"], "search: vector", self.settings.embedding_dim)
        return s.matrix.search(unit, k)

    def stats(self) -> dict[str, Any]:
        s = self._state
        m = s.matrix
        # Rough per-entry overheads of the Python containers; "approx" means it.
        approx = (s.item_bytes + 100 * len(s.items)
                  + 200 * len(s.signals) + 80 * s.signal_values
                  + m.nbytes() + 100 * len(m))
        return {
            "items": len(s.items),
            "item_bytes": s.item_bytes,
            "signal_entities": len(s.signals),
            "signal_values": s.signal_values,
            "embeddings": len(m),
            "embedding_rows": m.rows,
            "embedding_dim": m.dim,
            "approx_bytes": approx,
        }

    # -- snapshots

    def snapshot_records(self) -> int:
        s = self._state
        return len(s.items) + len(s.signals) + len(s.matrix)

    def snapshot(self, dir: Path) -> None:
        self.capture()(dir)

    def capture(self) -> SnapshotWriter:
        # Copies, not views: the writer runs on another thread while apply
        # goes on. dict.copy is a table copy (values are immutable bytes and
        # numbers); building the lists and packing happen in the writer.
        s = self._state
        m = s.matrix
        used = m.rows * m.row_bytes
        raw = bytes(memoryview(m.raw)[:used])
        unit = bytes(memoryview(m.unit)[:used])
        items = s.items.copy()
        signals = [(e, sig.counters.copy(), sig.last.copy()) for e, sig in s.signals.items()]
        rows, ids, free = m.rows, list(m.id_of_row), list(m.free)

        def write(dir: Path) -> None:
            # The header map, packed piece by piece into the file: the same bytes
            # as packb() of the whole map, without a list of every item or a
            # second copy of the state in memory, and with the GIL free for the
            # event loop between pieces (one packb of 100,000 items held it for
            # about 25 ms: a stall of every group on this worker).
            packer = msgpack.Packer(use_bin_type=True)
            head = (("format", FORMAT), ("version", FORMAT_VERSION), ("embedding_dim", m.dim))
            embeddings = {
                "rows": rows,
                "dtype": "<f4",
                "ids": ids,
                "free": free,
                "raw_xxh3_128": xxhash.xxh3_128_hexdigest(raw),
                "unit_xxh3_128": xxhash.xxh3_128_hexdigest(unit),
            }
            dir = Path(dir)
            with open(dir / STATE_FILE, "xb") as f:  # "x": the caller promised an empty dir
                f.write(packer.pack_map_header(len(head) + 3))
                for key, value in head:
                    f.write(packer.pack(key) + packer.pack(value))
                f.write(packer.pack("items") + packer.pack_array_header(len(items)))
                for run in _packed_runs(packer, items.items()):
                    f.write(run)
                f.write(packer.pack("signals") + packer.pack_array_header(len(signals)))
                rows_of = ([e, list(counters.items()), list(last.items())] for e, counters, last in signals)
                for run in _packed_runs(packer, rows_of):
                    f.write(run)
                f.write(packer.pack("embeddings") + packer.pack(embeddings))
            _write_new(dir / RAW_FILE, raw)
            _write_new(dir / UNIT_FILE, unit)

        return write

    def restore(self, dir: Path) -> None:
        dir = Path(dir)
        try:
            state = self._load(dir)
        except SnapshotError:
            raise
        except (OSError, ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as e:
            raise SnapshotError(f"cannot restore entities snapshot from {dir}: {type(e).__name__}: {e}") from e
        self._state = state  # only now: a failed restore leaves the old state

    def _load(self, dir: Path) -> _State:
        header = msgpack.unpackb((dir / STATE_FILE).read_bytes(), raw=False)
        if not isinstance(header, dict):
            raise SnapshotError(f"{dir / STATE_FILE} is not an entities snapshot header")
        if header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
            raise SnapshotError(f"{dir / STATE_FILE} is not an entities v{FORMAT_VERSION} snapshot "
                                f"(format={header.get('format')!r}, version={header.get('version')!r})")
        dim = self.settings.embedding_dim
        if header["embedding_dim"] != dim:
            raise SnapshotError(f"snapshot has embedding_dim {header['embedding_dim']}, this group has {dim}")
        state = _State(dim)
        for id, encoded in header["items"]:
            if not isinstance(id, str) or not isinstance(encoded, bytes):
                raise SnapshotError("snapshot item entry has the wrong types")
            state.items[id] = encoded
            state.item_bytes += len(encoded)
        for entity, counters, last in header["signals"]:
            sig = state.signals[entity] = _Signals(dict(counters), dict(last))
            state.signal_values += len(sig.counters) + len(sig.last)

        emb = header["embeddings"]
        m = state.matrix
        rows, ids, free = emb["rows"], emb["ids"], emb["free"]
        if emb["dtype"] != "<f4" or len(ids) != rows:
            raise SnapshotError("snapshot embedding header is inconsistent")
        used = rows * m.row_bytes
        blobs = {}
        for fname, key in ((RAW_FILE, "raw_xxh3_128"), (UNIT_FILE, "unit_xxh3_128")):
            data = (dir / fname).read_bytes()
            if len(data) != used:
                raise SnapshotError(f"{fname} is {len(data)} bytes, expected {used}")
            if xxhash.xxh3_128_hexdigest(data) != emb[key]:
                raise SnapshotError(f"{fname} does not match its checksum")
            blobs[fname] = data
        if sorted(free) != [r for r, id in enumerate(ids) if id is None]:
            raise SnapshotError("snapshot embedding free list does not match its holes")
        m._grow_to(rows)
        m.rows = rows
        m.raw[:used] = blobs[RAW_FILE]
        m.unit[:used] = blobs[UNIT_FILE]
        m.id_of_row = list(ids)
        m.free = list(free)
        for row, id in enumerate(ids):
            if id is not None:
                m.row_of[id] = row
                m.live[row] = 1
        if len(m.row_of) != rows - len(free):
            raise SnapshotError("snapshot embedding ids are not unique")
        return state


SNAPSHOT_RUN = 4096  # items packed per call while writing a snapshot


def _packed_runs(packer: msgpack.Packer, values: Iterable[Any]) -> Iterator[memoryview]:
    """`values` packed back to back (the body of a msgpack array), SNAPSHOT_RUN at a time."""
    it = iter(values)
    while run := list(islice(it, SNAPSHOT_RUN)):
        packed = packer.pack(run)
        # Strip this run's own array header: fixarray 1 byte, array16 3, array32 5.
        first = packed[0]
        yield memoryview(packed)[1 if first < 0xdc else 3 if first == 0xdc else 5:]


def _write_new(path: Path, data: bytes | memoryview) -> None:
    # No fsync: the caller makes the snapshot durable (base.Plugin.snapshot).
    with open(path, "xb") as f:  # "x": the caller promised an empty dir
        f.write(data)
