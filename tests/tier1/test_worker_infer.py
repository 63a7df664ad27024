"""Inference on a worker's model groups (worker/infer.py): batching, budgets, versions."""
from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gateway.models import output_rows, parse_input, slice_weights
from shardgrid.wire import ApiError
from worker.infer import InferenceService
from worker.plugins import ApplyContext, PluginSettings, load_plugin
from worker.plugins.layers_model import ModelConfig, encode_layers, generate_layers, rows_to_tensor, run_model, \
    tensor_to_bytes

MODEL = {"name": "m", "layers": 6, "d_model": 16, "d_hidden": 32, "seed": 3, "replication_factor": 1,
         "groups": [{"id": 1, "first": 0, "last": 5, "pinned": False}]}
CFG = ModelConfig.from_dict(MODEL)


def plugin() -> Any:
    return load_plugin("layers", PluginSettings(model=MODEL, layer_range=(0, 5)))


def row(i: int) -> list[float]:
    return [((i * 7 + j) % 11) / 5.0 - 1.0 for j in range(CFG.d_model)]


def service(**kw: Any) -> tuple[InferenceService, CollectorRegistry]:
    reg = CollectorRegistry()
    return InferenceService("w1", _NoLog(), reg, **kw), reg


class _NoLog:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


async def test_concurrent_requests_for_one_range_share_a_pass_and_each_gets_its_own_rows() -> None:
    svc, reg = service(max_rows=64, max_wait_ms=50.0)
    p = plugin()
    try:
        xs = [tensor_to_bytes(rows_to_tensor([row(i), row(i + 1)], CFG.d_model)) for i in range(8)]
        outs = await asyncio.gather(*(svc.infer(1, p, 0, 5, x, 2, 5.0) for x in xs))
    finally:
        await svc.close()
    # The queue starts "rare"; the second arrival onwards waits for company, so most share one pass.
    assert max(o["batch"] for o in outs) >= 4
    assert reg.get_sample_value("shardgrid_worker_infer_batch_requests_count") < 8
    for i, o in enumerate(outs):
        want = run_model(CFG, rows_to_tensor([row(i), row(i + 1)], CFG.d_model))
        assert o["y"] == tensor_to_bytes(want)
        assert o["version"] == 1 and (o["first"], o["last"]) == (0, 5)


async def test_batching_off_runs_one_request_per_pass() -> None:
    svc, reg = service(max_rows=1, max_wait_ms=0.0)
    p = plugin()
    try:
        xs = [tensor_to_bytes(rows_to_tensor([row(i)], CFG.d_model)) for i in range(5)]
        outs = await asyncio.gather(*(svc.infer(1, p, 0, 5, x, 1, 5.0) for x in xs))
    finally:
        await svc.close()
    assert {o["batch"] for o in outs} == {1}
    assert reg.get_sample_value("shardgrid_worker_infer_batch_requests_count") == 5


async def test_a_budget_shorter_than_the_pass_is_refused_at_once() -> None:
    svc, reg = service()
    p = plugin()
    x = tensor_to_bytes(rows_to_tensor([row(0)], CFG.d_model))
    try:
        await svc.infer(1, p, 0, 5, x, 1, 5.0)  # learn what a pass costs
        with pytest.raises(ApiError) as info:
            await svc.infer(1, p, 0, 5, x, 1, 1e-7)
    finally:
        await svc.close()
    assert info.value.code == "over_budget" and info.value.status == 503
    assert reg.get_sample_value("shardgrid_worker_infer_refused_total", {"reason": "over_budget"}) == 1


async def test_a_pass_uses_the_weights_it_started_with_and_names_their_version() -> None:
    svc, _ = service()
    p = plugin()
    x = tensor_to_bytes(rows_to_tensor([row(0)], CFG.d_model))
    try:
        before = await svc.infer(1, p, 2, 5, x, 1, 5.0)
        p.apply({"kind": "set_weights", "version": 2, "seed": 11}, ApplyContext(2, 1, 0))
        after = await svc.infer(1, p, 2, 5, x, 1, 5.0)
    finally:
        await svc.close()
    assert (before["version"], after["version"]) == (1, 2)
    assert before["y"] != after["y"]


# -- the gateway's side of the wire


def test_input_rows_become_float32_bytes_and_back() -> None:
    raw, n = parse_input({"input": [row(0), row(1)]}, CFG.d_model)
    assert n == 2 and len(raw) == 2 * CFG.d_model * 4
    assert output_rows(raw, 2, CFG.d_model) == [list(struct.unpack(f"<{CFG.d_model}f", struct.pack(
        f"<{CFG.d_model}f", *row(i)))) for i in range(2)]


@pytest.mark.parametrize(("body", "message"), [
    ({"input": []}, "list of 1 to 1024 rows"),
    ({"input": [[1.0]]}, "input[0] must be a list of 16 numbers"),
    ({"input": [[*row(0)[:15], "x"]]}, "input[0][15] must be a finite number"),
    ({"input": [[*row(0)[:15], True]]}, "input[0][15] must be a finite number"),
    ({"input": [[*row(0)[:15], 1e39]]}, "outside the float32 range"),
    ({"input": [[*row(0)[:15], 10**400]]}, "outside the float32 range"),
    ({"input": [[*row(0)[:15], float("nan")]]}, "input[0][15] must be a finite number"),
    ({"rows": []}, 'the body must be {"input"'),
    ([], 'the body must be {"input"'),
])
def test_bad_input_is_a_400_naming_the_value(body: Any, message: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_input(body, CFG.d_model)
    assert info.value.code == "bad_request" and message in info.value.message


def test_a_weights_file_is_sliced_per_group_into_files_the_plugin_takes() -> None:
    whole = encode_layers(CFG, generate_layers(CFG, 5, 0, 5))
    part = slice_weights(whole, 2, 4)
    p = load_plugin("layers", PluginSettings(model=MODEL, layer_range=(2, 4)))
    op = {"kind": "set_weights", "version": 2, "weights": part}
    p.validate(op)
    p.apply(op, ApplyContext(1, 1, 0))
    assert p.current().version == 2
    with pytest.raises(ApiError, match="lacks layers 6"):
        slice_weights(whole, 4, 6)
    with pytest.raises(ApiError, match="not msgpack"):
        slice_weights(b"\xc1", 0, 1)
