"""msgpack encoding of the replication core's messages for the wire and the WAL.

Entries are encoded as flat lists (they are the bulk of every Append and of
the WAL); messages as `[type, {field: value}]`. The mapping of type names is a
constant, so adding a message type is one line here.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from worker import replica_msgs as m

_MESSAGE_TYPES: dict[str, type[m.Message]] = {
    cls.__name__: cls
    for cls in (m.Begin, m.BeginOk, m.StaleTerm, m.Fetch, m.FetchReply, m.Append, m.AppendReply,
                m.Heartbeat, m.HeartbeatReply, m.SnapshotNeeded)
}
_FIELDS: dict[str, tuple[str, ...]] = {name: tuple(f.name for f in fields(cls)) for name, cls in _MESSAGE_TYPES.items()}
# Fields added after a message type first shipped default to None and are left
# out while None, and decoding ignores fields it does not know: a worker one
# version apart reads what the other sends (HeartbeatReply.commit, 2026-12-03).
_OPTIONAL: dict[str, tuple[str, ...]] = {
    name: tuple(f.name for f in fields(cls) if f.default is None) for name, cls in _MESSAGE_TYPES.items()
}


def encode_config(c: m.Config | None) -> list[list[str]] | None:
    return None if c is None else [list(c.voters), list(c.learners)]


def decode_config(raw: list[list[str]] | None) -> m.Config | None:
    return None if raw is None else m.Config(tuple(raw[0]), tuple(raw[1]))


def encode_entry(e: m.Entry) -> list[Any]:
    data = encode_config(e.data) if e.kind == "config" else e.data
    return [e.term, e.seq, e.kind, data, e.rid, e.ts]


def decode_entry(raw: list[Any]) -> m.Entry:
    term, seq, kind, data, rid, ts = raw
    if kind == "config":
        data = decode_config(data)
    elif kind == "ops":
        data, rid = tuple(data), tuple(rid)  # msgpack reads tuples back as lists
    return m.Entry(term, seq, kind, data, rid, ts)


def encode_snapshot_meta(s: m.SnapshotMeta) -> dict[str, Any]:
    # The dedup triples as they are: msgpack packs a tuple as the array a list
    # would make (the same bytes), and copying up to dedup_max of them into
    # lists stalled the loop at every snapshot point.
    return {"term": s.term, "seq": s.seq, "dedup": s.dedup, "config": encode_config(s.config),
            "config_seq": s.config_seq, "ts": s.ts}


def decode_snapshot_meta(raw: dict[str, Any]) -> m.SnapshotMeta:
    return m.SnapshotMeta(raw["term"], raw["seq"], tuple((r, s, t) for r, s, t in raw["dedup"]),
                          decode_config(raw["config"]), raw["config_seq"], raw["ts"])


def encode_message(msg: m.Message) -> list[Any]:
    name = type(msg).__name__
    body: dict[str, Any] = {}
    for f in _FIELDS[name]:
        value = getattr(msg, f)
        if f == "entries":
            value = [encode_entry(e) for e in value]
        body[f] = value
    for f in _OPTIONAL[name]:
        if body[f] is None:
            del body[f]
    return [name, body]


class MalformedMessage(ValueError):
    """A replication message that is not one this version can hand to the core.

    Raised instead of whatever a malformed shape would trip over
    (TypeError, KeyError, AttributeError...): the receiver answers 400 or
    drops the stream, and nothing malformed reaches a replica, where a bad
    field would fail the group (or corrupt it) far from its cause."""


# Every int a message or entry carries (terms, seqs, group ids, rounds, log
# time) is non-negative and fits the int64 the WAL and the peers assume.
_INT_MAX = (1 << 63) - 1
_ENTRY_KINDS = ("op", "ops", "term_start", "config")


def _is_int(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _INT_MAX


def _is_str(v: Any) -> bool:
    return type(v) is str


def _is_bool(v: Any) -> bool:
    return type(v) is bool


def _is_opt_int(v: Any) -> bool:
    return v is None or _is_int(v)


def _is_entries(v: Any) -> bool:
    return type(v) is list  # each entry is checked as it is decoded


_CHECKS = {"int": _is_int, "str": _is_str, "bool": _is_bool, "int | None": _is_opt_int,
           "tuple[Entry, ...]": _is_entries}
# Field name -> its check, per message type; a field of a type not above is
# a new shape this table must learn, and fails at import rather than on the wire.
_FIELD_CHECKS: dict[str, dict[str, Any]] = {
    name: {f.name: _CHECKS[str(f.type)] for f in fields(cls)} for name, cls in _MESSAGE_TYPES.items()
}


def _is_config(raw: Any) -> bool:
    return (type(raw) is list and len(raw) == 2 and all(type(part) is list for part in raw)
            and all(type(w) is str for part in raw for w in part))


def _what(value: Any) -> str:
    # Never str() of a hostile value: a deeply nested one overflows the recursion limit.
    return repr(value[:40]) if type(value) is str else f"(a {type(value).__name__})"


def _checked_entry(raw: Any) -> m.Entry:
    """`decode_entry` for an entry from the wire: its shape is checked first."""
    if type(raw) is not list or len(raw) != 6:
        raise MalformedMessage("an entry must be [term, seq, kind, data, rid, ts]")
    term, seq, kind, data, rid, ts = raw
    if not (_is_int(term) and _is_int(seq) and _is_int(ts)):
        raise MalformedMessage("an entry's term, seq and ts must be non-negative int64s")
    if kind == "op":
        ok = type(data) is dict and (rid is None or type(rid) is str)
    elif kind == "ops":
        ok = (type(data) is list and type(rid) is list and len(data) == len(rid)
              and all(type(op) is dict for op in data) and all(r is None or type(r) is str for r in rid))
    elif kind == "config":
        ok = _is_config(data)
    elif kind == "term_start":
        ok = data is None
    else:
        raise MalformedMessage(f"unknown entry kind {_what(kind)}; expected one of {', '.join(_ENTRY_KINDS)}")
    if not ok:
        raise MalformedMessage(f"a {kind!r} entry with data or rid of the wrong shape")
    return decode_entry(raw)


def decode_message(raw: Any) -> m.Message:
    """The message `raw` (a decoded msgpack value) encodes. Raises MalformedMessage
    (a ValueError) for anything else: an unknown type, a missing field, a field
    of the wrong type, a negative or beyond-int64 number, a malformed entry."""
    if type(raw) is not list or len(raw) != 2:
        raise MalformedMessage("a message must be [type, {field: value}]")
    name, body = raw
    cls = _MESSAGE_TYPES.get(name) if type(name) is str else None
    if cls is None:
        raise MalformedMessage(f"unknown message type {_what(name)}")
    if type(body) is not dict:
        raise MalformedMessage(f"a {name}'s fields must be a map")
    checks = _FIELD_CHECKS[name]
    args: dict[str, Any] = {}
    for k, v in body.items():
        check = checks.get(k) if type(k) is str else None
        if check is None:
            continue  # a newer peer's extra field
        if not check(v):
            raise MalformedMessage(f"{name}.{k} has the wrong type or range")
        args[k] = v
    if "entries" in args:
        args["entries"] = tuple(_checked_entry(e) for e in args["entries"])
    try:
        return cls(**args)
    except TypeError:
        missing = [f for f in _FIELDS[name] if f not in args]
        raise MalformedMessage(f"a {name} needs {', '.join(missing)}") from None
