"""The `layers` plugin (worker/plugins/layers.py) and its model (worker/plugins/layers_model.py)."""
from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tier1.test_group_shell import _started, _until
from worker.plugins import ApplyContext, BadOp, Plugin, PluginSettings, SnapshotError, Unappliable, load_plugin
from worker.plugins.layers import STATE_FILE, LayersPlugin
from worker.plugins.layers_model import (
    LayerWeights,
    ModelConfig,
    Weights,
    decode_layers,
    encode_layers,
    generate_layers,
    rows_to_tensor,
    run_model,
    tensor_from_bytes,
    tensor_to_bytes,
)

MODEL = {"name": "m", "layers": 24, "d_model": 64, "d_hidden": 128, "seed": 7,
         "replication_factor": 3, "groups": [{"layers": [0, 11]}, {"layers": [12, 23]}]}
CFG = ModelConfig.from_dict(MODEL)
CTX = ApplyContext(seq=1, term=1, ts_ms=0)
ROWS = 20


@functools.cache
def _all_layers() -> dict[int, LayerWeights]:
    return generate_layers(CFG, CFG.seed, 0, CFG.layers - 1)


def _holding(first: int, last: int) -> Weights:
    """A Weights for first..last built from that range alone (not sliced out of the full model)."""
    return Weights.build(CFG, 1, first, last, generate_layers(CFG, CFG.seed, first, last))


def _inputs(n: int = ROWS, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, CFG.d_model, generator=torch.Generator().manual_seed(seed))


@functools.cache
def _reference() -> torch.Tensor:
    return run_model(CFG, _inputs())


def make(first: int = 8, last: int = 17, model: dict[str, Any] | None = None) -> LayersPlugin:
    p = load_plugin("layers", PluginSettings(model=model or MODEL, layer_range=(first, last)))
    assert isinstance(p, LayersPlugin) and isinstance(p, Plugin)
    return p


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and tensor_to_bytes(a) == tensor_to_bytes(b)


# ---------------------------------------------------------------- the model


def test_config_takes_what_it_needs_from_a_topology_model_dict() -> None:
    assert CFG == ModelConfig(layers=24, d_model=64, d_hidden=128, seed=7)
    with pytest.raises(ValueError, match="missing 'seed'"):
        ModelConfig.from_dict({"layers": 2, "d_model": 4, "d_hidden": 4})
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        ModelConfig.from_dict({**MODEL, "d_model": 0})


def test_a_layer_is_generated_from_the_seed_and_its_index_alone() -> None:
    part = generate_layers(CFG, CFG.seed, 8, 17)
    assert sorted(part) == list(range(8, 18))
    assert all(part[i].equal(_all_layers()[i]) for i in part)
    other = generate_layers(CFG, CFG.seed + 1, 8, 8)[8]
    assert not other.equal(part[8]) and not part[8].equal(part[9])  # the seed and the index both matter
    w = part[8]
    assert (w.w1.shape, w.b1.shape, w.w2.shape, w.b2.shape, w.gain.shape) == ((128, 64), (128,), (64, 128), (64,), (64,))


def test_activations_stay_of_order_one_over_all_layers() -> None:
    out = _reference()
    assert out.dtype == torch.float32 and out.shape == (ROWS, CFG.d_model)
    assert 0.3 < float(out.std()) < 10 and bool(torch.isfinite(out).all())


def test_the_split_pipeline_equals_the_one_process_run_bit_for_bit() -> None:
    x = _inputs()
    a = _holding(0, 11).forward(x, 0, 11)
    b = _holding(8, 17).forward(a, 12, 17)
    c = _holding(14, 23).forward(b, 18, 23)
    assert _same_bits(c, _reference())
    ones = torch.cat([_holding(0, 23).forward(x[i:i + 1], 0, 23) for i in range(ROWS)])
    assert _same_bits(ones, _reference())


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_any_split_and_any_batching_gives_the_same_bytes(data: st.DataObject) -> None:
    # The property the cluster relies on: a row's output depends on neither
    # where the model is cut nor which other rows shared its forward passes.
    cut1 = data.draw(st.integers(1, CFG.layers - 2), label="cut1")
    cut2 = data.draw(st.integers(cut1 + 1, CFG.layers - 1), label="cut2")
    stages = [(0, cut1 - 1), (cut1, cut2 - 1), (cut2, CFG.layers - 1)]
    full = _all_layers()
    holders = []
    for lo, hi in stages:
        # A group may hold more than the stage it runs.
        first = data.draw(st.integers(0, lo), label="first")
        last = data.draw(st.integers(hi, CFG.layers - 1), label="last")
        holders.append(Weights.build(CFG, 1, first, last, {i: full[i] for i in range(first, last + 1)}))
    order = data.draw(st.permutations(range(ROWS)), label="order")
    x = _inputs()
    outputs: dict[int, torch.Tensor] = {}
    for (lo, hi), weights in zip(stages, holders):
        # Each stage batches the rows its own way: shuffled groups of random sizes.
        rows = list(order)
        while rows:
            n = data.draw(st.integers(1, len(rows)), label="batch")
            batch, rows = rows[:n], rows[n:]
            cur = torch.stack([outputs.get(r, x[r]) for r in batch])
            for r, out in zip(batch, weights.forward(cur, lo, hi)):
                outputs[r] = out
    assert _same_bits(torch.stack([outputs[r] for r in range(ROWS)]), _reference())


def test_forward_refuses_layers_it_does_not_hold_and_bad_inputs() -> None:
    w = _holding(8, 17)
    x = _inputs(2)
    with pytest.raises(ValueError, match="not within the held 8..17"):
        w.forward(x, 7, 10)
    with pytest.raises(ValueError, match="not within the held 8..17"):
        w.forward(x, 12, 18)
    with pytest.raises(ValueError, match="float32 tensor"):
        w.forward(x.double(), 8, 9)
    with pytest.raises(ValueError, match=r"\[rows, 64\]"):
        w.forward(x[:, :10], 8, 9)
    with pytest.raises(ValueError, match="exactly layers"):
        Weights.build(CFG, 1, 8, 10, generate_layers(CFG, 7, 8, 9))


def test_rows_and_bytes_helpers() -> None:
    t = rows_to_tensor([[1.5] * 64, [0.1] * 64], 64)
    assert t.dtype == torch.float32 and t.shape == (2, 64) and float(t[1, 0]) == float(torch.tensor(0.1))
    raw = tensor_to_bytes(t)
    assert len(raw) == 2 * 64 * 4 and raw[:4] == b"\x00\x00\xc0\x3f"  # little-endian float32 1.5
    assert torch.equal(tensor_from_bytes(raw, 2, 64), t)
    with pytest.raises(ValueError, match="expected 512 bytes"):
        tensor_from_bytes(raw[:-1], 2, 64)
    with pytest.raises(ValueError, match="row 1 must be a list of 64"):
        rows_to_tensor([[0.0] * 64, [0.0] * 63], 64)
    with pytest.raises(ValueError, match="non-finite"):
        rows_to_tensor([[float("nan")] * 64], 64)
    with pytest.raises(ValueError, match="non-finite"):
        rows_to_tensor([[1e39] * 64], 64)  # finite as a double, inf as float32
    with pytest.raises(ValueError, match="non-number bool"):
        rows_to_tensor([[True] * 64], 64)


# ---------------------------------------------------------------- the weights file


def test_weights_file_round_trip_is_deterministic() -> None:
    layers = generate_layers(CFG, 3, 2, 4)
    raw = encode_layers(CFG, layers)
    doc = msgpack.unpackb(raw, raw=False)
    assert doc["format"] == "shardgrid-weights/1" and list(doc["layers"]) == ["2", "3", "4"]
    assert doc["layers"]["3"]["w1"] == tensor_to_bytes(layers[3].w1)
    back = decode_layers(raw, CFG, 2, 4)
    assert all(back[i].equal(layers[i]) for i in layers)
    assert encode_layers(CFG, back) == raw
    # ascending numeric order (not string order, not the dict's): equal weights, equal bytes
    wide = {i: w for i, w in reversed(generate_layers(CFG, 3, 8, 11).items())}
    assert list(msgpack.unpackb(encode_layers(CFG, wide), raw=False)["layers"]) == ["8", "9", "10", "11"]


def _doc(first: int = 2, last: int = 3) -> dict[str, Any]:
    return msgpack.unpackb(encode_layers(CFG, generate_layers(CFG, 3, first, last)), raw=False)


def _pack(doc: Any) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _nan_w1() -> dict[str, Any]:
    doc = _doc()
    blob = bytearray(doc["layers"]["3"]["w1"])
    blob[0:4] = b"\x00\x00\xc0\x7f"
    doc["layers"]["3"]["w1"] = bytes(blob)
    return doc


@pytest.mark.parametrize("raw, message", [
    (b"\xc1not msgpack", "not msgpack"),
    (_pack([1, 2]), "must be a msgpack map"),
    (_pack({**_doc(), "format": "shardgrid-weights/2"}), "format is 'shardgrid-weights/2'"),
    (_pack({**_doc(), "d_model": 32}), "d_model 32, the model has 64"),
    (_pack({**_doc(), "d_hidden": 64}), "d_hidden 64, the model has 128"),
    (_pack({**_doc(), "extra": 1}), "unexpected key"),
    (_pack(_doc(2, 2)), r"missing \['3'\]"),
    (_pack(_doc(2, 4)), r"extra \['4'\]"),
    (_pack({**_doc(), "layers": {"2": _doc()["layers"]["2"], "03": _doc()["layers"]["3"]}}), r"extra \['03'\]"),
    (_pack({**_doc(), "layers": {**_doc()["layers"], "3": {**_doc()["layers"]["3"], "b1": b"\x00" * 4}}}),
     r"layer 3 b1: expected 512 bytes \(float32 \[128\]\), got 4 bytes"),
    (_pack({**_doc(), "layers": {**_doc()["layers"], "3": {"w1": b""}}}), "layer 3 must be a map of exactly"),
    (_pack(_nan_w1()), "layer 3 w1 holds a non-finite value"),
])
def test_a_bad_weights_file_is_a_value_error_saying_what_is_wrong(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_layers(raw, CFG, 2, 3)


# ---------------------------------------------------------------- the plugin


def test_settings_need_a_model_and_a_range_within_it() -> None:
    with pytest.raises(ValueError, match="needs PluginSettings.model and PluginSettings.layer_range"):
        load_plugin("layers", PluginSettings(model=MODEL))
    with pytest.raises(ValueError, match="beyond the model's 24 layers"):
        PluginSettings(model=MODEL, layer_range=(20, 24))
    with pytest.raises(ValueError, match="first <= last"):
        PluginSettings(layer_range=(5, 4))
    s = PluginSettings(model=MODEL, layer_range=[3, 4])  # type: ignore[arg-type]  # lists come from YAML/JSON
    assert s.layer_range == (3, 4)
    assert PluginSettings().model is None and PluginSettings().layer_range is None


def _file(seed: int, first: int = 8, last: int = 17) -> bytes:
    return encode_layers(CFG, generate_layers(CFG, seed, first, last))


@pytest.mark.parametrize("op, message", [
    ({"kind": "set_weights", "seed": 3}, "missing 'version'"),
    ({"kind": "set_weights", "version": 2}, "missing 'seed' or 'weights'"),
    ({"kind": "set_weights", "version": 2, "seed": 3, "weights": b""}, "either 'seed' or 'weights', not both"),
    ({"kind": "set_weights", "version": 2, "seed": 3, "rid": "x"}, "unexpected key.*'rid'"),
    ({"kind": "set_weights", "version": 0, "seed": 3}, "version must be an int in 1"),
    ({"kind": "set_weights", "version": True, "seed": 3}, "version must be an int"),
    ({"kind": "set_weights", "version": 2, "seed": -1}, "seed must be an int in 0"),
    ({"kind": "set_weights", "version": 2, "seed": 2**63}, "seed must be an int in 0"),
    ({"kind": "set_weights", "version": 2, "weights": "abc"}, "weights must be bytes"),
    ({"kind": "set_weights", "version": 2, "weights": _file(3, 8, 16)}, r"missing \['17'\]"),
    ({"kind": "set_weights", "version": 2, "weights": _file(3, 7, 17)}, r"extra \['7'\]"),
    ({"kind": "info"}, "is a query"),
    ({"kind": "put_item", "id": "a", "doc": 1}, "unknown write op kind"),
    ([1], "must be an object"),
])
def test_validate_refuses_bad_ops(op: Any, message: str) -> None:
    p = make()
    with pytest.raises(BadOp, match=message):
        p.validate(op)
    with pytest.raises(Unappliable, match=message):
        p.apply(op, CTX)  # only a newer version's leader could have admitted it
    assert p.query({"kind": "info"})["version"] == 1


def test_versions_only_move_forward_and_a_retry_is_a_no_op() -> None:
    p = make()
    v1 = p.current()
    assert v1.version == 1 and (v1.first, v1.last) == (8, 17)
    # version 1 is the model's seed: that update again changes nothing
    assert p.apply({"kind": "set_weights", "version": 1, "seed": CFG.seed}, CTX) == {"version": 1, "first": 8, "last": 17}
    assert p.current() is v1
    op = {"kind": "set_weights", "version": 3, "seed": 99}
    p.validate(op)
    assert p.apply(op, CTX) == {"version": 3, "first": 8, "last": 17}
    v3 = p.current()
    assert v3.version == 3 and all(v3.layers[i].equal(generate_layers(CFG, 99, i, i)[i]) for i in (8, 17))
    assert p.apply(dict(op), CTX) == {"version": 3, "first": 8, "last": 17} and p.current() is v3  # the retry
    with pytest.raises(BadOp, match="current version is 3; version 3 with other weights is refused"):
        p.apply({"kind": "set_weights", "version": 3, "seed": 100}, CTX)
    with pytest.raises(BadOp, match="current version is 3; version 2 is refused"):
        p.apply({"kind": "set_weights", "version": 2, "seed": 99}, CTX)
    assert p.current() is v3 and p.query({"kind": "info"})["version"] == 3
    # a weights file: the same file again is the retry, another one at that version is refused
    raw = _file(5)
    assert p.apply({"kind": "set_weights", "version": 4, "weights": raw}, CTX)["version"] == 4
    v4 = p.current()
    assert v4.layers[12].equal(generate_layers(CFG, 5, 12, 12)[12])
    p.apply({"kind": "set_weights", "version": 4, "weights": bytes(raw)}, CTX)
    assert p.current() is v4
    with pytest.raises(BadOp, match="version 4 with other weights"):
        p.apply({"kind": "set_weights", "version": 4, "seed": 5}, CTX)  # the same tensors, another source
    assert p.current() is v4 and v1.version == 1  # what an inference thread held did not change


def test_two_replicas_that_applied_the_same_ops_compute_the_same() -> None:
    ops = [{"kind": "set_weights", "version": 2, "seed": 11}, {"kind": "set_weights", "version": 5, "weights": _file(4)}]
    a, b = make(), make()
    for op in ops:
        a.apply(op, CTX)
    b.apply(ops[1], CTX)
    x = _inputs(3)
    assert _same_bits(a.current().forward(x, 8, 17), b.current().forward(x, 8, 17))


def test_query_info_and_stats() -> None:
    p = make(2, 5)
    assert p.query({"kind": "info"}) == {"version": 1, "first": 2, "last": 5, "layers": 24,
                                         "d_model": 64, "d_hidden": 128}
    assert p.stats() == {"version": 1, "first": 2, "last": 5, "bytes": 4 * 4 * (2 * 64 * 128 + 128 + 2 * 64)}
    for q, message in [({"kind": "nope"}, "unknown query kind"), ({"kind": "info", "x": 1}, "unexpected key"),
                       ({"kind": "set_weights"}, "is a write op"), ("info", "must be an object")]:
        with pytest.raises(BadOp, match=message):
            p.query(q)  # type: ignore[arg-type]
    assert p.weight({"anything": 1}) == 1 and p.weight(None) == 1


def _snap(p: LayersPlugin, dir: Path) -> bytes:
    dir.mkdir()
    p.snapshot(dir)
    return (dir / STATE_FILE).read_bytes()


def test_snapshot_round_trip(tmp_path: Path) -> None:
    p = make()
    p.apply({"kind": "set_weights", "version": 2, "seed": 21}, CTX)
    before = _snap(p, tmp_path / "a")
    assert msgpack.unpackb(before, raw=False)["version"] == 2
    q = make()
    q.restore(tmp_path / "a")
    x = _inputs(5)
    assert _same_bits(q.current().forward(x, 8, 17), p.current().forward(x, 8, 17))
    assert q.current().version == 2 and _snap(q, tmp_path / "b") == before
    # the restored source makes the same update a retry there too
    assert q.apply({"kind": "set_weights", "version": 2, "seed": 21}, CTX)["version"] == 2
    # capture freezes: a later apply does not reach the writer
    write = p.capture()
    p.apply({"kind": "set_weights", "version": 3, "seed": 22}, CTX)
    (tmp_path / "c").mkdir()
    write(tmp_path / "c")
    assert (tmp_path / "c" / STATE_FILE).read_bytes() == before
    # a version 1 never built yet snapshots the same as one already built
    built = make()
    built.current()
    assert _snap(make(), tmp_path / "d") == _snap(built, tmp_path / "e")


def _bad_snapshot(dir: Path, content: bytes) -> Path:
    dir.mkdir()
    (dir / STATE_FILE).write_bytes(content)
    return dir


def test_a_bad_snapshot_is_refused_and_the_state_kept(tmp_path: Path) -> None:
    p = make()
    p.apply({"kind": "set_weights", "version": 2, "seed": 21}, CTX)
    kept = p.current()
    good = msgpack.unpackb(_snap(p, tmp_path / "good"), raw=False)
    other_range = _snap(make(8, 16), tmp_path / "other")
    other_model = _snap(make(model={**MODEL, "d_model": 32}), tmp_path / "small")
    cases = {
        "corrupt": b"\xc1\x00garbage",
        "truncated": _pack(good)[:-100],
        "range": other_range,
        "d_model": other_model,
        "keys": _pack({**good, "extra": 1}),
        "version": _pack({**good, "version": 0}),
    }
    for name, content in cases.items():
        with pytest.raises(SnapshotError):
            p.restore(_bad_snapshot(tmp_path / name, content))
        assert p.current() is kept, name
    with pytest.raises(SnapshotError, match="no such file|No such file"):
        p.restore(tmp_path / "missing")
    with pytest.raises(SnapshotError, match=r"layers 8..17.*missing \['17'\]"):
        p.restore(tmp_path / "range")
    assert p.query({"kind": "info"})["version"] == 2


def test_importing_the_plugin_does_not_import_torch() -> None:
    import subprocess
    import sys
    code = "import sys, worker.plugins.layers; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# ---------------------------------------------------------------- through the log


SMALL = {**MODEL, "layers": 4}


def _group_plugin() -> LayersPlugin:
    p = load_plugin("layers", PluginSettings(model=SMALL, layer_range=(1, 2)))
    assert isinstance(p, LayersPlugin)
    return p


async def test_weight_updates_go_through_the_log_and_survive_a_restart(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dict(SMALL)
    x = _inputs(4)
    g = _started(tmp_path, plugin=_group_plugin())
    try:
        await _until(lambda: g.replica is not None and g.replica.ready)
        plugin = g.plugin
        assert isinstance(plugin, LayersPlugin)
        before = plugin.current().forward(x, 1, 2)
        out = await g.write({"kind": "set_weights", "version": 2, "seed": 5}, "quorum", "u1", 5.0)
        assert out.ok and out.result == {"version": 2, "first": 1, "last": 2}
        assert plugin.current().version == 2
        raw = encode_layers(cfg, generate_layers(cfg, 6, 1, 2))
        out = await g.write({"kind": "set_weights", "version": 3, "weights": raw}, "quorum", "u2", 5.0)
        assert out.ok and plugin.current().version == 3
        after = plugin.current().forward(x, 1, 2)
        assert not _same_bits(after, before)
        expected = Weights.build(cfg, 3, 0, 3, generate_layers(cfg, 6, 0, 3)).forward(x, 1, 2)
        assert _same_bits(after, expected)
        stale = await g.write({"kind": "set_weights", "version": 2, "seed": 9}, "quorum", "u3", 5.0)
        assert not stale.ok and stale.error_code == "bad_request" and "current version is 3" in (stale.message or "")
        with pytest.raises(BadOp, match=r"missing \['2'\]"):
            await g.write({"kind": "set_weights", "version": 4,
                           "weights": encode_layers(cfg, generate_layers(cfg, 6, 1, 1))}, "quorum", "u4", 5.0)
        assert plugin.current().version == 3
    finally:
        await g.close()
    # The same data dir: the WAL replays the updates into a fresh plugin.
    h = _started(tmp_path, plugin=_group_plugin(), term=2)
    try:
        await _until(lambda: h.replica is not None and h.replica.ready)
        replayed = h.plugin
        assert isinstance(replayed, LayersPlugin)
        await _until(lambda: replayed.query({"kind": "info"})["version"] == 3)
        assert _same_bits(replayed.current().forward(x, 1, 2), after)
    finally:
        await h.close()


async def test_a_snapshot_taken_by_the_group_restores_the_version(tmp_path: Path) -> None:
    x = _inputs(2)
    g = _started(tmp_path, snapshot_every=2, plugin=_group_plugin())
    try:
        await _until(lambda: g.replica is not None and g.replica.ready)
        for v in (2, 3):
            out = await g.write({"kind": "set_weights", "version": v, "seed": v * 10}, "quorum", f"s{v}", 5.0)
            assert out.ok
        await _until(lambda: g.latest_snapshot() is not None)
        plugin = g.plugin
        assert isinstance(plugin, LayersPlugin)
        expected = plugin.current().forward(x, 1, 2)
    finally:
        await g.close()
    h = _started(tmp_path, snapshot_every=2, plugin=_group_plugin(), term=2)
    try:
        await _until(lambda: h.replica is not None and h.replica.ready)
        restored = h.plugin
        assert isinstance(restored, LayersPlugin)
        await _until(lambda: restored.query({"kind": "info"})["version"] == 3)
        assert _same_bits(restored.current().forward(x, 1, 2), expected)
    finally:
        await h.close()


def test_shuffled_rows_in_one_batch_give_each_row_its_own_output() -> None:
    # Order within a batch does not matter either (a gateway concatenates in arrival order).
    x = _inputs()
    perm = list(range(ROWS))
    random.Random(3).shuffle(perm)
    w = _holding(0, 23)
    shuffled = w.forward(x[perm], 0, 23)
    assert _same_bits(shuffled[[perm.index(i) for i in range(ROWS)]], _reference())
