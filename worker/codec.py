"""msgpack encoding of the replication core's messages for the wire and the WAL.

Entries are encoded as flat lists (they are the bulk of every Append and of
the WAL); messages as `[type, {field: value}]`. The mapping of type names is a
constant, so adding a message type is one line here.

`decode_message` reads what a peer sent, so it checks the shape of every
field before the core sees it (`MalformedMessage`): the core trusts the
types and the structure of what it handles (an Append whose entries do not
follow its prev_seq trips an assertion and fails the group), and a wrong
type there would fail the group too.
"""
from __future__ import annotations

from dataclasses import MISSING, fields
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


class MalformedMessage(ValueError):
    """A peer's message of the wrong shape: dropped before the core sees it."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind  # the message type, or "unknown"
        self.reason = reason


# Far beyond anything a legitimate peer sends (an Append carries at most
# max_batch_entries entries, an "ops" entry one write_batch's writes), yet
# small enough that a hostile message cannot make the core do unbounded work.
MAX_INT = (1 << 63) - 1
MAX_ID_CHARS = 1024  # worker ids, request ids
MAX_ENTRIES = 1 << 16  # per message
MAX_OPS = 1 << 17  # per "ops" entry
MAX_MEMBERS = 1024  # voters or learners of a config entry
_INT, _OPT_INT, _BOOL, _ENTRIES, _OPT_DIGEST = "int", "int?", "bool", "entries", "digest?"
MAX_DIGEST_CHARS = 128
# Each field past the envelope (src, dst, group, term) of each message type: what its value must be.
_SHAPES: dict[str, dict[str, str]] = {
    "Begin": {},
    "BeginOk": {"last_term": _INT, "last_seq": _INT, "commit": _INT},
    "StaleTerm": {},
    "Fetch": {"prev_term": _INT, "prev_seq": _INT},
    "FetchReply": {"ok": _BOOL, "prev_seq": _INT, "prev_term": _INT, "entries": _ENTRIES, "hint_seq": _INT,
                   "hint_term": _INT},
    "Append": {"prev_term": _INT, "prev_seq": _INT, "entries": _ENTRIES, "commit": _INT},
    "AppendReply": {"ok": _BOOL, "prev_seq": _INT, "match": _INT, "hint_seq": _INT, "hint_term": _INT},
    "Heartbeat": {"commit": _INT, "round": _INT, "leader_commit": _OPT_INT},
    "HeartbeatReply": {"round": _INT, "commit": _OPT_INT},
    "SnapshotNeeded": {"snap_term": _INT, "snap_seq": _INT, "digest": _OPT_DIGEST, "size": _OPT_INT},
}
_WITH_ENTRIES = frozenset(name for name, shape in _SHAPES.items() if "entries" in shape)
_ABSENT = object()


def _is_id(v: Any) -> bool:
    return type(v) is str and 0 < len(v) <= MAX_ID_CHARS


def _entry_problem(raw: Any, seq: int, term: int, msg_term: int) -> str | None:
    """Why `raw` is not the wire form of the entry at `seq` in a log whose
    previous entry has term `term`, sent at `msg_term`; None if it is."""
    if type(raw) is not list or len(raw) != 6:
        return "an entry must be a list of 6"
    e_term, e_seq, kind, data, rid, ts = raw
    # (type(x) is int: a bool is an int too)
    if type(e_seq) is not int or e_seq != seq:
        return f"entry seq {str(e_seq)[:32]} where {seq} follows"  # the core appends them as contiguous
    if type(e_term) is not int or not term <= e_term <= msg_term:
        # Terms never decrease along a log, and no entry is newer than its sender's term.
        return f"entry term {str(e_term)[:32]} outside [{term}, {msg_term}]"
    if type(ts) is not int or not 0 <= ts <= MAX_INT:
        return "entry ts must be a non-negative integer"
    if kind == "ops":
        if type(data) is not list or type(rid) is not list or not 0 < len(data) <= MAX_OPS or len(rid) != len(data):
            return "an ops entry needs equal-length lists of ops and rids"
        if not all(type(op) is dict for op in data):
            return "an ops entry's ops must be maps"  # what the workers' routes admit; a plugin applies only those
        for r in rid:
            if r is not None and (type(r) is not str or not 0 < len(r) <= MAX_ID_CHARS):
                return "an ops entry's rids must be None or short strings"
    elif kind == "op":
        if type(data) is not dict:
            return "an op entry's op must be a map"
        if rid is not None and not _is_id(rid):
            return "an op's rid must be None or a short string"
    elif kind == "config":
        if (type(data) is not list or len(data) != 2 or rid is not None
                or not all(type(g) is list and len(g) <= MAX_MEMBERS and all(map(_is_id, g)) for g in data)):
            return "a config entry's data must be [voters, learners], lists of worker ids"
    elif kind == "term_start":
        if data is not None or rid is not None:
            return "a term_start entry carries no data"
    else:
        return f"unknown entry kind {str(kind)[:32]!r}"
    return None


def _message_problem(name: str, body: dict[Any, Any]) -> str | None:
    """Why `body` is not a `name` message; None if it is."""
    get = body.get
    src, dst, group, term = get("src"), get("dst"), get("group"), get("term")
    if not (_is_id(src) and _is_id(dst)):
        return "src and dst must be worker ids"
    if type(group) is not int or type(term) is not int or not (0 <= group <= MAX_INT and 0 <= term <= MAX_INT):
        return "group and term must be non-negative integers"
    for f, shape, required in _CHECKS[name]:
        v = get(f, _ABSENT)
        if v is _ABSENT:
            if required:
                return f"missing {f}"
            continue
        if shape is _INT:
            ok = type(v) is int and 0 <= v <= MAX_INT
        elif shape is _BOOL:
            ok = type(v) is bool
        elif shape is _OPT_INT:
            ok = v is None or (type(v) is int and 0 <= v <= MAX_INT)
        elif shape is _OPT_DIGEST:
            ok = v is None or (type(v) is str and 0 < len(v) <= MAX_DIGEST_CHARS)
        else:
            ok = type(v) is list and len(v) <= MAX_ENTRIES
        if not ok:
            return f"{f} has the wrong type or size"
    entries = get("entries") if name in _WITH_ENTRIES else None  # (another type's extra field is ignored)
    if entries:
        prev_seq = body["prev_seq"]
        t = body["prev_term"]
        for i, raw in enumerate(entries):
            problem = _entry_problem(raw, prev_seq + 1 + i, t, term)
            if problem is not None:
                return f"entries[{i}]: {problem}"
            t = raw[0]
    return None


# (field, shape, required) per message type: a field with a default (FetchReply's
# entries and hints, HeartbeatReply's commit) may be left out by the sender.
_CHECKS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    name: tuple((f.name, _SHAPES[name][f.name], f.default is MISSING)
                for f in fields(cls) if f.name not in ("src", "dst", "group", "term"))
    for name, cls in _MESSAGE_TYPES.items()
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


def decode_message(raw: Any) -> m.Message:
    """A peer's message, as `encode_message` wrote it. Raises MalformedMessage
    for anything else: unknown type, missing field, wrong type, negative or
    absurd number, entries that do not follow prev_seq and prev_term."""
    if type(raw) is not list or len(raw) != 2:
        raise MalformedMessage("unknown", "a message must be [type, {fields}]")
    name, body = raw
    cls = _MESSAGE_TYPES.get(name) if type(name) is str else None
    if cls is None:
        raise MalformedMessage("unknown", f"unknown message type {str(name)[:64]!r}")
    if type(body) is not dict:
        raise MalformedMessage(name, "fields must be a map")
    problem = _message_problem(name, body)
    if problem is not None:
        raise MalformedMessage(name, problem)
    known = _FIELDS[name]
    if len(body) > len(known) or any(k not in known for k in body):
        body = {k: v for k, v in body.items() if k in known}  # a newer peer's extra fields
    if "entries" in body:  # a new dict: the caller's value stays as it was
        body = {**body, "entries": tuple(decode_entry(e) for e in body["entries"])}
    return cls(**body)
