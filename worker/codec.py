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


def decode_message(raw: list[Any]) -> m.Message:
    name, body = raw
    cls = _MESSAGE_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    if "entries" in body:
        body["entries"] = tuple(decode_entry(e) for e in body["entries"])
    try:
        return cls(**body)
    except TypeError:
        known = _FIELDS[name]
        return cls(**{k: v for k, v in body.items() if k in known})  # a newer peer's extra fields
