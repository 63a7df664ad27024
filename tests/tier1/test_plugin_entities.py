"""The `entities` plugin (worker/plugins/entities.py) and the plugin contract (base.py)."""
from __future__ import annotations

import math
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import orjson
import pytest
import xxhash

from worker.plugins import (
    ApplyContext,
    BadOp,
    NotFound,
    Plugin,
    PluginSettings,
    SnapshotError,
    Unappliable,
    available_plugins,
    load_plugin,
)
from worker.plugins.entities import (FORMAT, FORMAT_VERSION, MAX_K, MAX_PUT_ITEMS, SNAPSHOT_RUN, STATE_FILE,
                                     EntitiesPlugin)

DIM = 8
CTX = ApplyContext(seq=1, term=1, ts_ms=1_700_000_000_000)


def make(dim: int = DIM, **kw: Any) -> EntitiesPlugin:
    p = load_plugin("entities", PluginSettings(embedding_dim=dim, **kw))
    assert isinstance(p, EntitiesPlugin)
    return p


def apply_all(p: Plugin, ops: list[dict[str, Any]]) -> list[Any]:
    return [p.apply(op, ApplyContext(seq=i + 1, term=1, ts_ms=1000 + i)) for i, op in enumerate(ops)]


def snapshot_bytes(p: Plugin, d: Path) -> dict[str, bytes]:
    d.mkdir()
    p.snapshot(d)
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())}


def put_vec(id: str, v: list[float]) -> dict[str, Any]:
    return {"kind": "put_embedding", "id": id, "vector": v}


def search(p: Plugin, v: list[float], k: int) -> list[dict[str, Any]]:
    return p.query({"kind": "search", "vector": v, "k": k})


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def random_ops(rng: random.Random, n: int, dim: int = DIM) -> list[dict[str, Any]]:
    """A mixed stream over small id pools, so re-puts, deletes and row reuse happen."""
    ops: list[dict[str, Any]] = []
    for _ in range(n):
        r = rng.random()
        id = f"id{rng.randrange(12)}"
        if r < 0.2:
            ops.append({"kind": "put_item", "id": id, "doc": {"n": rng.randrange(100), "f": rng.random(), "t": [id]}})
        elif r < 0.3:
            ops.append({"kind": "delete_item", "id": id})
        elif r < 0.6:
            value: int | float = rng.randrange(-5, 10) if rng.random() < 0.5 else rng.uniform(-1, 1)
            ops.append({"kind": "signal", "entity": f"e{rng.randrange(4)}", "name": f"s{rng.randrange(3)}",
                        "value": value, "mode": rng.choice(["incr", "set"])})
        elif r < 0.85:
            ops.append(put_vec(id, [rng.gauss(0, 1) for _ in range(dim)]))
        else:
            ops.append({"kind": "delete_embedding", "id": id})
    return ops


# ---------------------------------------------------------------- registry and contract


def test_registry() -> None:
    assert available_plugins() == ("entities", "layers")
    p = load_plugin("entities", PluginSettings())
    assert isinstance(p, Plugin) and p.name == "entities"
    assert load_plugin("entities").settings == PluginSettings()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown plugin 'nope'.*entities"):
        load_plugin("nope", PluginSettings())


@pytest.mark.parametrize("kw", [{"embedding_dim": 0}, {"max_item_bytes": -1}, {"max_id_len": True}, {"embedding_dim": 1.5}])
def test_settings_are_validated(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        PluginSettings(**kw)


def test_error_types_carry_message_and_code() -> None:
    nf = NotFound("no item 'x'")
    assert isinstance(nf, KeyError) and nf.message == str(nf) == "no item 'x'" and nf.code == "not_found"
    bad = BadOp("nope")
    assert isinstance(bad, ValueError) and bad.message == "nope" and bad.code == "bad_request"


def test_importing_and_applying_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from worker.plugins import load_plugin, PluginSettings, ApplyContext\n"
        "p = load_plugin('entities', PluginSettings(embedding_dim=2))\n"
        "p.apply({'kind': 'put_embedding', 'id': 'a', 'vector': [1.0, 2.0]}, ApplyContext(1, 1, 0))\n"
        "p.query({'kind': 'get_embedding', 'id': 'a'})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# ---------------------------------------------------------------- items


def test_items_put_get_delete() -> None:
    p = make()
    doc = {"name": "ada", "tags": ["x", 1, 2.5, None, True], "nested": {"z": 1, "a": 2}}
    assert p.apply({"kind": "put_item", "id": "u1", "doc": doc}, CTX) == {"id": "u1", "created": True}
    got = p.query({"kind": "get_item", "id": "u1"})
    assert got == doc and list(got["nested"]) == ["z", "a"]  # stored as given, key order too
    got["name"] = "mutated"  # a query result is a copy
    assert p.query({"kind": "get_item", "id": "u1"})["name"] == "ada"

    assert p.apply({"kind": "put_item", "id": "u1", "doc": [1, 2]}, CTX) == {"id": "u1", "created": False}
    assert p.query({"kind": "get_item", "id": "u1"}) == [1, 2]
    assert p.apply({"kind": "put_item", "id": "s", "doc": "just a string"}, CTX)["created"]
    assert p.stats()["items"] == 2 and p.stats()["item_bytes"] == len(b"[1,2]") + len(b'"just a string"')

    assert p.apply({"kind": "delete_item", "id": "u1"}, CTX) == {"id": "u1", "deleted": True}
    assert p.apply({"kind": "delete_item", "id": "u1"}, CTX) == {"id": "u1", "deleted": False}
    with pytest.raises(NotFound, match="no item 'u1'"):
        p.query({"kind": "get_item", "id": "u1"})
    assert p.stats()["items"] == 1


def test_doc_size_limit_is_on_the_json_encoding() -> None:
    p = make(max_item_bytes=100)
    fits = "x" * 98  # '"' + 98 + '"' = 100 bytes
    p.validate({"kind": "put_item", "id": "a", "doc": fits})
    with pytest.raises(BadOp, match="put_item: doc is 101 bytes of JSON; the limit is 100"):
        p.validate({"kind": "put_item", "id": "a", "doc": fits + "x"})


_PUTS = [
    {"kind": "put_item", "id": "a" * 16, "doc": {"v": "x"}},  # the id limit exactly
    {"kind": "put_item", "id": "a" * 17, "doc": 1},  # one over it
    {"kind": "put_item", "id": "", "doc": 1},
    {"kind": "put_item", "id": "é", "doc": 1},  # not ASCII: the general path counts UTF-8 bytes
    {"kind": "put_item", "id": "é" * 9, "doc": 1},  # 9 characters, 18 bytes
    {"kind": "put_item", "id": "\ud800", "doc": 1},  # a lone surrogate
    {"kind": "put_item", "id": 7, "doc": 1},
    {"kind": "put_item", "id": "a", "doc": "x" * 61},  # 63 bytes of JSON: over the doc limit
    {"kind": "put_item", "id": "a", "doc": float("nan")},
    {"kind": "put_item", "id": "a", "doc": {1: 2}},  # orjson refuses non-str keys
    {"kind": "put_item", "id": "a", "doc": 1, "extra": 2},
    {"kind": "put_item", "id": "a"},
]


@pytest.mark.parametrize("op", _PUTS, ids=range(len(_PUTS)))
def test_validate_fast_path_for_puts_agrees_with_the_general_parse(op: dict[str, Any]) -> None:
    p = make(max_id_len=16, max_item_bytes=62)
    general: str | None = None
    try:
        p._parse(op, limits=True)
    except BadOp as exc:
        general = exc.message
    fast: str | None = None
    try:
        p.validate(op)
    except BadOp as exc:
        fast = exc.message
    assert fast == general


# ---------------------------------------------------------------- signals


@pytest.mark.parametrize("seed", range(5))
def test_put_items_is_the_state_of_the_same_puts_one_by_one(seed: int, tmp_path: Path) -> None:
    # Snapshots byte for byte (insertion order, sizes and stats included), and
    # the same `created` flags, with ids repeated inside a batch and across.
    rng = random.Random(seed)
    bulk, single = make(), make()
    for p in (bulk, single):
        apply_all(p, [{"kind": "put_item", "id": f"k{i}", "doc": {"old": i}} for i in range(0, 40, 3)])
    for b in range(6):
        ids = [f"k{rng.randrange(40)}" for _ in range(rng.randint(1, 25))] + ["é-ü"]
        docs = [{"v": rng.random(), "s": "x" * rng.randrange(50), "n": [1, None, True]} for _ in ids]
        out = bulk.apply({"kind": "put_items", "ids": ids, "docs": [orjson.dumps(d) for d in docs]}, CTX)
        one = [single.apply({"kind": "put_item", "id": i, "doc": d}, CTX) for i, d in zip(ids, docs)]
        assert out == {"created": [r["created"] for r in one]}
    assert bulk.stats() == single.stats()
    assert snapshot_bytes(bulk, tmp_path / "bulk") == snapshot_bytes(single, tmp_path / "single")
    assert bulk.query({"kind": "get_item", "id": "é-ü"}) == single.query({"kind": "get_item", "id": "é-ü"})


def test_put_items_validation_admits_what_the_one_by_one_puts_would() -> None:
    p = make()
    p.validate({"kind": "put_items", "ids": ["é" * 128, "a"], "docs": [b'{"a": [1, 2.5]}', b'"s"']})
    with pytest.raises(BadOp, match=r"ids\[0\] is 258 bytes"):
        p.validate({"kind": "put_items", "ids": ["é" * 129], "docs": [b"1"]})
    with pytest.raises(BadOp, match=r"ids\[0\] is not valid Unicode"):
        p.validate({"kind": "put_items", "ids": ["\udc80"], "docs": [b"1"]})
    with pytest.raises(BadOp, match=r"docs\[0\] is 11 bytes of JSON; the limit is 10"):
        make(max_item_bytes=10).validate({"kind": "put_items", "ids": ["a"], "docs": [b'"123456789"']})


def test_weight_counts_the_records_of_a_bulk_op() -> None:
    p = make()
    assert p.weight({"kind": "put_items", "ids": ["a", "b", "c"], "docs": [b"1"] * 3}) == 3
    assert p.weight({"kind": "put_item", "id": "a", "doc": 1}) == 1
    for odd in ({"kind": "put_items", "ids": []}, {"kind": "put_items", "ids": "abc"}, {"kind": "put_items"},
                "put_items", None, {"kind": "signal"}):
        assert p.weight(odd) == 1  # never raises, whatever the op


def test_signal_incr_totals_and_set_last() -> None:
    p = make()
    results = apply_all(p, [{"kind": "signal", "entity": "u", "name": "clicks", "value": 3, "mode": "incr"}] * 500)
    assert results == [3 * (i + 1) for i in range(500)]
    assert p.apply({"kind": "signal", "entity": "u", "name": "clicks", "value": -1500, "mode": "incr"}, CTX) == 0
    assert p.apply({"kind": "signal", "entity": "u", "name": "score", "value": 0.5, "mode": "incr"}, CTX) == 0.5
    assert p.apply({"kind": "signal", "entity": "u", "name": "score", "value": 2, "mode": "incr"}, CTX) == 2.5
    assert p.apply({"kind": "signal", "entity": "u", "name": "temp", "value": 21.5, "mode": "set"}, CTX) == 21.5
    assert p.apply({"kind": "signal", "entity": "u", "name": "temp", "value": 19, "mode": "set"}, CTX) == 19
    # Counters and last values are separate namespaces.
    assert p.apply({"kind": "signal", "entity": "u", "name": "clicks", "value": 7, "mode": "set"}, CTX) == 7
    assert p.query({"kind": "get_signals", "entity": "u"}) == {
        "counters": {"clicks": 0, "score": 2.5},
        "last": {"temp": 19, "clicks": 7},
    }
    assert p.stats()["signal_entities"] == 1 and p.stats()["signal_values"] == 4
    with pytest.raises(NotFound, match="no signals for entity 'other'"):
        p.query({"kind": "get_signals", "entity": "other"})


@pytest.mark.parametrize(("start", "add", "msg"), [
    (2**63 - 1, 1, "would leave the int64 range"),
    (1.5e308, 1.5e308, "would become inf"),
])
def test_counter_overflow_is_a_badop_that_changes_nothing(start: float, add: float, msg: str) -> None:
    p = make()
    p.apply({"kind": "signal", "entity": "u", "name": "c", "value": start, "mode": "incr"}, CTX)
    before = p.query({"kind": "get_signals", "entity": "u"})
    with pytest.raises(BadOp, match=msg):
        p.apply({"kind": "signal", "entity": "u", "name": "c", "value": add, "mode": "incr"}, CTX)
    assert p.query({"kind": "get_signals", "entity": "u"}) == before
    # The entity must not have been created by a failed op either (NaN is the
    # leader's to refuse: in a committed op it is a shape this version cannot apply).
    with pytest.raises(Unappliable):
        p.apply({"kind": "signal", "entity": "new", "name": "c", "value": float("nan"), "mode": "incr"}, CTX)
    with pytest.raises(NotFound):
        p.query({"kind": "get_signals", "entity": "new"})


# ---------------------------------------------------------------- validation

V = [1.0] * DIM
SIG = {"kind": "signal", "entity": "u", "name": "n", "value": 1, "mode": "incr"}

# (op, message fragment, limit_only): limit-only failures are admission limits,
# which apply does not re-check (a follower applies what a leader admitted).
BAD_OPS: list[tuple[Any, str, bool]] = [
    ([1, 2], "write op must be an object (dict), got list", False),
    ({"id": "a"}, "needs a string 'kind'; got null", False),
    ({"kind": 7}, "needs a string 'kind'; got int", False),
    ({"kind": "nope"}, "unknown write op kind 'nope'; expected one of: put_item", False),
    ({"kind": "get_item", "id": "a"}, "'get_item' is a query, not a write op", False),
    ({"kind": "put_item", "id": "a"}, "put_item: missing 'doc'", False),
    ({"kind": "put_item", "id": "a", "doc": 1, "request_id": "r"}, "unexpected key(s) 'request_id'; allowed: id, doc", False),
    ({"kind": "put_item", "id": 5, "doc": 1}, "put_item: id must be a string, got int", False),
    ({"kind": "put_item", "id": "", "doc": 1}, "put_item: id must not be empty", False),
    ({"kind": "put_item", "id": "\udc80", "doc": 1}, "lone surrogate", False),
    ({"kind": "put_item", "id": "x" * 257, "doc": 1}, "put_item: id is 257 bytes of UTF-8; the limit is 256", True),
    ({"kind": "put_item", "id": "é" * 129, "doc": 1}, "id is 258 bytes of UTF-8", True),
    ({"kind": "put_item", "id": "a", "doc": "x" * (1 << 20)}, "put_item: doc is 1048578 bytes of JSON; the limit is 1048576", True),
    ({"kind": "put_item", "id": "a", "doc": {"v": float("nan")}}, "doc contains NaN or Infinity", False),
    ({"kind": "put_item", "id": "a", "doc": [float("inf")]}, "doc contains NaN or Infinity", False),
    ({"kind": "put_item", "id": "a", "doc": {1: "x"}}, "put_item: doc is not JSON-encodable", False),
    ({"kind": "put_item", "id": "a", "doc": b"bytes"}, "put_item: doc is not JSON-encodable", False),
    ({"kind": "put_item", "id": "a", "doc": 2**70}, "put_item: doc is not JSON-encodable", False),
    ({"kind": "put_items", "ids": "a", "docs": [b"1"]}, "put_items: ids and docs must be lists, got str and list", False),
    ({"kind": "put_items", "ids": [], "docs": []}, "ids and docs must be non-empty and of one length, got 0 and 0", False),
    ({"kind": "put_items", "ids": ["a", "b"], "docs": [b"1"]}, "of one length, got 2 and 1", False),
    ({"kind": "put_items", "ids": ["a"] * (MAX_PUT_ITEMS + 1), "docs": [b"1"] * (MAX_PUT_ITEMS + 1)},
     f"put_items: {MAX_PUT_ITEMS + 1} ids; the limit is {MAX_PUT_ITEMS}", False),
    ({"kind": "put_items", "ids": ["a", 7], "docs": [b"1", b"2"]}, "put_items: ids[1] must be a string, got int", False),
    ({"kind": "put_items", "ids": ["a", ""], "docs": [b"1", b"2"]}, "put_items: ids[1] must not be empty", False),
    ({"kind": "put_items", "ids": ["a", "x" * 257], "docs": [b"1", b"2"]},
     "put_items: ids[1] is 257 bytes of UTF-8; the limit is 256", True),
    ({"kind": "put_items", "ids": ["a", "b"], "docs": [b"1", {"v": 1}]},
     "put_items: docs[1] must be the doc's JSON as bytes, got dict", False),
    ({"kind": "put_items", "ids": ["a"], "docs": [b"1" * ((1 << 20) + 1)]},
     "put_items: docs[0] is 1048577 bytes of JSON; the limit is 1048576", True),
    ({"kind": "put_items", "ids": ["a", "b"], "docs": [b"1", b"{nope"]}, "put_items: docs[1] is not JSON", True),
    ({"kind": "put_items", "ids": ["a"], "docs": [b"1"], "x": 1}, "put_items: unexpected key(s) 'x'", False),
    ({"kind": "put_items", "ids": ["a"]}, "put_items: missing 'docs'", False),
    ({"kind": "delete_item"}, "delete_item: missing 'id'", False),
    ({"kind": "delete_item", "id": None}, "delete_item: id must be a string, got null", False),
    ({**SIG, "value": True}, "signal: value must be a number (int or float), got bool", False),
    ({**SIG, "value": "1"}, "signal: value must be a number (int or float), got str", False),
    ({**SIG, "value": float("nan")}, "signal: value must be finite, got nan", False),
    ({**SIG, "value": float("-inf")}, "signal: value must be finite, got -inf", False),
    ({**SIG, "value": 2**63}, "signal: value = 9223372036854775808 is outside the int64 range", False),
    ({**SIG, "mode": "add"}, "signal: mode must be 'incr' or 'set', got 'add'", False),
    ({**SIG, "entity": 1}, "signal: entity must be a string", False),
    ({**SIG, "name": ""}, "signal: name must not be empty", False),
    ({k: v for k, v in SIG.items() if k != "mode"}, "signal: missing 'mode'", False),
    (put_vec("a", V[:-1]), f"put_embedding: vector has {DIM - 1} values; this group's embedding_dim is {DIM}", False),
    (put_vec("a", V + [1.0]), f"has {DIM + 1} values", False),
    (put_vec("a", "1,2"), f"put_embedding: vector must be a list of {DIM} numbers, got str", False),  # type: ignore[arg-type]
    (put_vec("a", [1.0] * (DIM - 1) + [True]), f"put_embedding: vector[{DIM - 1}] must be a number, got bool", False),
    (put_vec("a", [1.0, None] + [1.0] * (DIM - 2)), "put_embedding: vector[1] must be a number, got null", False),  # type: ignore[list-item]
    (put_vec("a", [float("nan")] + [1.0] * (DIM - 1)), "put_embedding: vector[0] must be finite, got nan", False),
    (put_vec("a", [1.0, 1e39] + [1.0] * (DIM - 2)), "put_embedding: vector[1] = 1e+39 is outside the float32 range", False),
    (put_vec("a", [1.0, 10**400] + [1.0] * (DIM - 2)), "vector[1] = 1000000000", False),
    (put_vec("a", [0.0] * DIM), "put_embedding: vector is all zeros (in float32)", False),
    (put_vec("a", [1e-50] * DIM), "all zeros (in float32)", False),
    (put_vec("", V), "put_embedding: id must not be empty", False),
    ({"kind": "delete_embedding", "id": ["a"]}, "delete_embedding: id must be a string, got list", False),
]


@pytest.mark.parametrize(("op", "msg", "limit_only"), BAD_OPS)
def test_bad_ops_are_rejected_with_a_clear_message(op: Any, msg: str, limit_only: bool, tmp_path: Path) -> None:
    p = make()
    with pytest.raises(BadOp) as ei:
        p.validate(op)
    assert msg in ei.value.message
    assert len(ei.value.message) < 200  # never echoes a huge value back
    before = snapshot_bytes(p, tmp_path / "before")
    if limit_only:
        p.apply(op, CTX)
        return
    # A committed op only a newer leader would admit: apply refuses it loudly
    # (not a BadOp, which the shell would record as a no-op), changing nothing.
    with pytest.raises(Unappliable) as ei2:
        p.apply(op, CTX)
    assert not isinstance(ei2.value, BadOp) and ei.value.message in ei2.value.message
    assert snapshot_bytes(p, tmp_path / "after") == before


BAD_QUERIES: list[tuple[Any, str]] = [
    ("get_item", "query must be an object (dict), got str"),
    ({"kind": "put_item", "id": "a", "doc": 1}, "'put_item' is a write op, not a query"),
    ({"kind": "get_everything"}, "unknown query kind 'get_everything'; expected one of: get_item, get_signals"),
    ({"kind": "get_item", "id": 1}, "get_item: id must be a string, got int"),
    ({"kind": "get_item", "id": "a", "x": 1}, "get_item: unexpected key(s) 'x'"),
    ({"kind": "get_signals"}, "get_signals: missing 'entity'"),
    ({"kind": "get_embedding", "id": "x" * 300}, "get_embedding: id is 300 bytes"),
    ({"kind": "search", "vector": V}, "search: missing 'k'"),
    ({"kind": "search", "vector": V, "k": 0}, f"search: k must be between 1 and {MAX_K}, got 0"),
    ({"kind": "search", "vector": V, "k": MAX_K + 1}, f"search: k must be between 1 and {MAX_K}, got {MAX_K + 1}"),
    ({"kind": "search", "vector": V, "k": True}, "search: k must be an integer, got bool"),
    ({"kind": "search", "vector": V, "k": 2.0}, "search: k must be an integer, got float"),
    ({"kind": "search", "vector": V[:3], "k": 1}, "search: vector has 3 values; this group's embedding_dim is 8"),
    ({"kind": "search", "vector": [0] * DIM, "k": 1}, "search: vector is all zeros"),
    ({"kind": "search", "vector": [float("inf")] * DIM, "k": 1}, "search: vector[0] must be finite, got inf"),
]


@pytest.mark.parametrize(("q", "msg"), BAD_QUERIES)
def test_bad_queries_are_rejected_with_a_clear_message(q: Any, msg: str) -> None:
    p = make()
    p.apply(put_vec("a", V), CTX)
    with pytest.raises(BadOp) as ei:
        p.query(q)
    assert msg in ei.value.message


# ---------------------------------------------------------------- embeddings


def test_vectors_are_stored_as_float32_the_same_way_from_ints_and_floats() -> None:
    p = make(dim=4)
    p.apply(put_vec("a", [0.1, 1, -2.5, 1e-40]), CTX)
    p.apply(put_vec("b", [0.1, 1.0, -2.5, 1e-40]), CTX)
    got = p.query({"kind": "get_embedding", "id": "a"})
    assert got == [f32(0.1), 1.0, -2.5, f32(1e-40)] == p.query({"kind": "get_embedding", "id": "b"})
    assert struct.pack("<4f", *got) == struct.pack("<4f", 0.1, 1, -2.5, 1e-40)
    with pytest.raises(NotFound, match="no embedding 'c'"):
        p.query({"kind": "get_embedding", "id": "c"})


def test_search_returns_the_true_nearest_neighbours() -> None:
    rng = random.Random(1234)
    dim, n = 16, 400
    p = make(dim=dim)
    vecs = {f"v{i:03d}": [rng.gauss(0, 1) for _ in range(dim)] for i in range(n)}
    for id, v in vecs.items():
        p.apply(put_vec(id, v), CTX)

    def cosine(a: list[float], b: list[float]) -> float:
        return math.fsum(x * y for x, y in zip(a, b)) / math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))

    for k in (1, 5, 37, n, MAX_K):
        for _ in range(5):
            q = [rng.gauss(0, 1) for _ in range(dim)]
            exact = sorted(((cosine(v, q), id) for id, v in vecs.items()), reverse=True)
            got = search(p, q, k)
            assert len(got) == min(k, n)
            scores = [r["score"] for r in got]
            assert scores == sorted(scores, reverse=True)
            by_id = {id: s for s, id in exact}
            for r in got:
                assert r["score"] == pytest.approx(by_id[r["id"]], abs=1e-5)
            # The returned set is the top k up to float32 rounding of near-ties.
            returned = {r["id"] for r in got}
            worst_returned = min(by_id[i] for i in returned)
            best_left_out = max((s for s, i in exact if i not in returned), default=-2.0)
            assert worst_returned >= best_left_out - 1e-5


def test_search_ties_are_ordered_and_cut_by_id() -> None:
    p = make(dim=2)
    for id in ["d", "b", "e", "a", "c"]:
        p.apply(put_vec(id, [3.0, 4.0]), CTX)  # identical direction: identical scores
    p.apply(put_vec("z", [4.0, 3.0]), CTX)
    assert search(p, [3, 4], 3) == [{"id": "a", "score": 1.0}, {"id": "b", "score": 1.0}, {"id": "c", "score": 1.0}]
    assert [r["id"] for r in search(p, [3, 4], 10)] == ["a", "b", "c", "d", "e", "z"]


def test_deletes_leave_search_and_reputs_replace() -> None:
    p = make(dim=3)
    assert search(p, [1, 0, 0], 5) == []  # empty group
    assert p.apply(put_vec("x", [1, 0, 0]), CTX) == {"id": "x", "created": True}
    p.apply(put_vec("y", [0, 1, 0]), CTX)
    p.apply(put_vec("z", [0, 0, 1]), CTX)
    assert p.apply({"kind": "delete_embedding", "id": "x"}, CTX) == {"id": "x", "deleted": True}
    assert p.apply({"kind": "delete_embedding", "id": "x"}, CTX) == {"id": "x", "deleted": False}
    # A deleted row must not show up even when every live score is negative.
    assert [r["id"] for r in search(p, [1, -1, -1], 5)] == ["y", "z"]
    with pytest.raises(NotFound):
        p.query({"kind": "get_embedding", "id": "x"})

    assert p.apply(put_vec("y", [-1, 0, 0]), CTX) == {"id": "y", "created": False}
    assert search(p, [-1, 0, 0], 1) == [{"id": "y", "score": 1.0}]
    assert search(p, [0, 1, 0], 2)[0]["score"] < 0.5  # y's old vector is gone
    p.apply(put_vec("w", [1, 1, 0]), CTX)  # reuses x's row
    assert p.stats()["embedding_rows"] == 3 and p.stats()["embeddings"] == 3
    assert search(p, [1, 1, 0], 1) == [{"id": "w", "score": pytest.approx(1.0)}]
    for id in ["y", "z", "w"]:
        p.apply({"kind": "delete_embedding", "id": id}, CTX)
    assert search(p, [1, 0, 0], 5) == []


def test_matrix_grows_past_its_initial_capacity() -> None:
    p = make(dim=2)
    for i in range(100):
        p.apply(put_vec(f"v{i:03d}", [1.0, i / 100]), CTX)
    assert p.query({"kind": "get_embedding", "id": "v000"}) == [1.0, 0.0]
    assert search(p, [1.0, 0.99], 1)[0]["id"] == "v099"
    assert p.stats()["embeddings"] == 100


# ---------------------------------------------------------------- results, snapshots, determinism


def test_results_are_plain_data() -> None:
    p = make(dim=2)
    ops = [
        {"kind": "put_item", "id": "a", "doc": {"x": [1.5]}},
        {"kind": "signal", "entity": "e", "name": "n", "value": 2, "mode": "incr"},
        {"kind": "signal", "entity": "e", "name": "m", "value": 2.5, "mode": "set"},
        put_vec("v", [1, 2]),
        {"kind": "delete_embedding", "id": "v"},
        {"kind": "delete_item", "id": "a"},
    ]
    out = apply_all(p, ops)
    out.append(p.query({"kind": "get_signals", "entity": "e"}))
    p.apply(put_vec("v", [1, 2]), CTX)
    out += [p.query({"kind": "search", "vector": [1, 1], "k": 3}), p.query({"kind": "get_embedding", "id": "v"}), p.stats()]
    for r in out:
        assert orjson.loads(orjson.dumps(r)) == r
        assert msgpack.unpackb(msgpack.packb(r)) == r


def answers(p: Plugin, probe: list[list[float]]) -> list[Any]:
    """Every read the tests can think of, errors included, as plain data."""
    out: list[Any] = [p.stats()]
    reads = [{"kind": "get_item", "id": f"id{i}"} for i in range(12)]
    reads += [{"kind": "get_embedding", "id": f"id{i}"} for i in range(12)]
    reads += [{"kind": "get_signals", "entity": f"e{i}"} for i in range(4)]
    reads += [{"kind": "search", "vector": v, "k": k} for v in probe for k in (1, 3, 50)]
    for q in reads:
        try:
            out.append(orjson.dumps(p.query(q)))
        except NotFound as e:
            out.append(("not_found", e.message))
    return out


def test_snapshot_restore_reproduces_every_answer(tmp_path: Path) -> None:
    rng = random.Random(7)
    probe = [[rng.gauss(0, 1) for _ in range(DIM)] for _ in range(4)]
    p = make()
    apply_all(p, random_ops(rng, 600))
    assert p.stats()["embeddings"] > 0 and len(p._state.matrix.free) > 0  # holes are exercised
    files = snapshot_bytes(p, tmp_path / "s1")
    assert not any(name.startswith("_") for name in files)

    q = make()
    apply_all(q, random_ops(random.Random(99), 50))  # restore replaces, it does not merge
    (tmp_path / "s1" / "_group.msgpack").write_bytes(b"the shell's own file")  # ignored
    q.restore(tmp_path / "s1")
    assert answers(q, probe) == answers(p, probe)
    assert snapshot_bytes(q, tmp_path / "s2") == files

    # And both keep evolving identically (row allocation, dict order, free list).
    more = random_ops(rng, 300)
    assert apply_all(p, more) == apply_all(q, more)
    assert snapshot_bytes(p, tmp_path / "s3") == snapshot_bytes(q, tmp_path / "s4")
    assert answers(q, probe) == answers(p, probe)


def test_same_ops_give_byte_identical_snapshots(tmp_path: Path) -> None:
    ops = random_ops(random.Random(2024), 800)
    a, b = make(), make()
    results_a, results_b = apply_all(a, ops), apply_all(b, ops)
    assert orjson.dumps(results_a) == orjson.dumps(results_b)
    assert snapshot_bytes(a, tmp_path / "a") == snapshot_bytes(b, tmp_path / "b")

    # Ops that arrive msgpack-decoded (as on a follower) are the same ops.
    c = make()
    apply_all(c, msgpack.unpackb(msgpack.packb(ops)))
    assert snapshot_bytes(c, tmp_path / "c") == snapshot_bytes(a, tmp_path / "a2")


def _state_file_in_one_piece(p: EntitiesPlugin) -> bytes:
    """The state file as the writer made it before it packed piece by piece (one packb of the header)."""
    s, m = p._state, p._state.matrix
    used = m.rows * m.row_bytes
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "embedding_dim": m.dim,
        "items": list(s.items.items()),
        "signals": [[e, list(sig.counters.items()), list(sig.last.items())] for e, sig in s.signals.items()],
        "embeddings": {"rows": m.rows, "dtype": "<f4", "ids": list(m.id_of_row), "free": list(m.free),
                       "raw_xxh3_128": xxhash.xxh3_128_hexdigest(bytes(memoryview(m.raw)[:used])),
                       "unit_xxh3_128": xxhash.xxh3_128_hexdigest(bytes(memoryview(m.unit)[:used]))},
    }
    return msgpack.packb(header, use_bin_type=True)


# Items and signal entities: none, under a fixarray, exactly one run, runs plus a short (fixarray)
# tail, and a long (array16) tail.
@pytest.mark.parametrize("n", [0, 5, SNAPSHOT_RUN, 2 * SNAPSHOT_RUN + 7, SNAPSHOT_RUN + 300])
def test_the_state_file_is_packed_in_runs_to_the_same_bytes(tmp_path: Path, n: int) -> None:
    p = make()
    ops = [{"kind": "put_item", "id": f"i{k}", "doc": {"k": k}} for k in range(n)]
    ops += [{"kind": "signal", "entity": f"e{k}", "name": "hits", "value": k, "mode": "incr"} for k in range(n)]
    ops += random_ops(random.Random(n), 50)
    apply_all(p, ops)
    files = snapshot_bytes(p, tmp_path / "s")
    assert files[STATE_FILE] == _state_file_in_one_piece(p)
    q = make()
    q.restore(tmp_path / "s")
    assert q.stats() == p.stats()


def test_empty_plugin_snapshot_roundtrip(tmp_path: Path) -> None:
    p = make()
    files = snapshot_bytes(p, tmp_path / "s")
    q = make()
    q.restore(tmp_path / "s")
    assert q.stats() == p.stats() and snapshot_bytes(q, tmp_path / "t") == files


def test_bad_snapshots_are_refused_and_keep_the_state(tmp_path: Path) -> None:
    src = make()
    apply_all(src, random_ops(random.Random(5), 100))
    snapshot_bytes(src, tmp_path / "good")

    victim = make()
    apply_all(victim, random_ops(random.Random(6), 100))
    before = snapshot_bytes(victim, tmp_path / "before")

    with pytest.raises(SnapshotError, match="embedding_dim 8, this group has 4"):
        make(dim=4).restore(tmp_path / "good")

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in (tmp_path / "good").iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    raw = bytearray((corrupt / "entities.raw.f32").read_bytes())
    raw[5] ^= 0xFF
    (corrupt / "entities.raw.f32").write_bytes(bytes(raw))
    with pytest.raises(SnapshotError, match="does not match its checksum"):
        victim.restore(corrupt)

    (corrupt / "entities.raw.f32").write_bytes(bytes(raw[:-4]))
    with pytest.raises(SnapshotError, match="bytes, expected"):
        victim.restore(corrupt)

    (corrupt / "entities.msgpack").write_bytes(b"\xc1garbage")
    with pytest.raises(SnapshotError):
        victim.restore(corrupt)

    with pytest.raises(SnapshotError):
        victim.restore(tmp_path / "missing")

    assert snapshot_bytes(victim, tmp_path / "after") == before


def _nested(depth: int) -> Any:
    # orjson, not a Python loop: the value is as a client's JSON decodes.
    return orjson.loads(b"[" * depth + b"]" * depth)


@pytest.mark.parametrize("op", [
    {"kind": "signal", "entity": "e", "name": "n", "value": 1, "mode": _nested(1020)},
    {"kind": _nested(1020), "id": "a"},
    {"kind": "search", "vector": [1.0] * DIM, "k": _nested(1020)},
], ids=["signal mode", "kind", "search k"])
def test_a_value_nested_past_the_recursion_limit_is_a_bad_op(op: dict[str, Any]) -> None:
    # Found by tests/tier1/test_fuzz_worker.py: the error message's repr()
    # of the value raised RecursionError, a 500 instead of a 400.
    p = make()
    with pytest.raises(BadOp):
        p.query(op) if op["kind"] == "search" else p.validate(op)
