"""Inference on a worker's model groups (worker/infer.py): batching, budgets, versions."""
from __future__ import annotations

import asyncio
import struct
import threading
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gateway.models import output_rows, parse_input, slice_weights
from shardgrid.common.wire import ApiError
from tests.support.waiting import until
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


# -- the worker's call op


class _Replica:
    role, applied_seq, commit_seq, term, ready, has_quorum, leader_heard_at = "leader", 3, 3, 2, True, True, None


class _Shell:
    def __init__(self, gid: int, p: Any) -> None:
        from worker.group import GroupSettings

        self.gid, self.plugin, self.replica, self.failed, self.settings = gid, p, _Replica(), None, GroupSettings()


class _Node:
    def __init__(self, svc: InferenceService) -> None:
        self.id, self.infer = "w1", svc


@pytest.mark.parametrize(("body", "message"), [
    ({"start": 0, "end": 5, "rows": 1}, "infer needs"),
    ({"start": 0, "end": 5, "rows": 1, "x": b"", "extra": 1}, "infer needs"),
    ({"start": "0", "end": 5, "rows": 1, "x": b""}, "must be integers"),
    ({"start": 0, "end": 9, "rows": 1, "x": b"\0" * 64}, "not within group 1's 0-5"),
    ({"start": 3, "end": 2, "rows": 1, "x": b"\0" * 64}, "not within"),
    ({"start": 0, "end": 5, "rows": 2, "x": b"\0" * 64}, "got 64 bytes for 2 rows"),
    ({"start": 0, "end": 5, "rows": 0, "x": b""}, "rows (1..1024)"),
    ([1, 2], "infer needs"),
])
async def test_the_infer_call_refuses_bad_bodies_with_400(body: Any, message: str) -> None:
    from worker.server import WorkerApi

    svc, _ = service()
    api = WorkerApi(_Node(svc))  # type: ignore[arg-type]
    try:
        with pytest.raises(ApiError) as info:
            await api.do_infer(_Shell(1, plugin()), body)
    finally:
        await svc.close()
    assert info.value.code == "bad_request" and message in info.value.message, info.value.message


async def test_the_infer_call_answers_with_its_worker_and_refuses_an_entities_group() -> None:
    from worker.server import WorkerApi

    svc, _ = service()
    api = WorkerApi(_Node(svc))  # type: ignore[arg-type]
    x = tensor_to_bytes(rows_to_tensor([row(0)], CFG.d_model))
    try:
        res = await api.do_infer(_Shell(1, plugin()), {"start": 0, "end": 5, "rows": 1, "x": x})
        with pytest.raises(ApiError) as info:
            await api.do_infer(_Shell(0, load_plugin("entities")), {"start": 0, "end": 5, "rows": 1, "x": x})
    finally:
        await svc.close()
    assert res.status == 200 and res.body["worker"] == "w1" and res.body["y"] == tensor_to_bytes(
        run_model(CFG, rows_to_tensor([row(0)], CFG.d_model)))
    assert info.value.code == "bad_request" and "holds no model layers" in info.value.message


class _HeldWeights:
    """Stands in for a Weights whose forward pass holds the compute thread until the test releases it."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate, self.version, self.first, self.last, self.d_model = gate, 1, 0, 5, CFG.d_model

    def forward(self, x: Any, start: int, end: int) -> Any:
        assert self.gate.wait(10), "the test never released the pass"
        return x


class _HeldPlugin:
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.w = _HeldWeights(self.gate)

    def pending_build(self) -> None:
        return None

    def current(self) -> _HeldWeights:
        return self.w


async def test_a_request_whose_budget_is_gone_when_the_thread_gets_to_it_is_refused_not_answered_late() -> None:
    svc, reg = service(max_wait_ms=0.0)
    x = tensor_to_bytes(rows_to_tensor([row(0)], CFG.d_model))
    held, other = _HeldPlugin(), plugin()
    loop = asyncio.get_running_loop()
    try:
        await svc.ensure_built(other)  # so the second request reaches the thread's queue, not a build
        slow = asyncio.create_task(svc.infer(1, held, 0, 5, x, 1, 5.0))
        await until(lambda: svc._running, "the held pass to take the compute thread", interval_s=0.005)
        t0 = loop.time()
        late = asyncio.create_task(svc.infer(2, other, 0, 5, x, 1, 0.1))
        # Its budget runs out while the thread is held; only then is the thread free.
        await until(lambda: loop.time() - t0 > 0.15, "the second request's budget to run out", interval_s=0.01)
        assert not late.done()
        held.gate.set()
        with pytest.raises(ApiError) as info:
            await late
        assert (await slow)["version"] == 1
    finally:
        held.gate.set()
        await svc.close()
    assert info.value.code == "over_budget"  # refused when the thread got to it, not computed and sent late
    assert reg.get_sample_value("shardgrid_worker_infer_batch_requests_count") == 1  # only the held pass ran


async def test_close_answers_the_requests_in_a_running_pass() -> None:
    svc, _ = service(max_wait_ms=0.0)
    x = tensor_to_bytes(rows_to_tensor([row(0)], CFG.d_model))
    held = _HeldPlugin()
    try:
        task = asyncio.create_task(svc.infer(1, held, 0, 5, x, 1, 5.0))
        await until(lambda: svc._running, "the pass to start", interval_s=0.005)
        await svc.close()
        with pytest.raises(ApiError) as info:
            await asyncio.wait_for(task, 1.0)
    finally:
        held.gate.set()
    assert info.value.code == "unavailable"


async def test_a_worker_holding_its_limit_refuses_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.infer as infer_mod

    monkeypatch.setattr(infer_mod, "MAX_PENDING", 2)
    svc, reg = service(max_wait_ms=0.0)
    x = tensor_to_bytes(rows_to_tensor([row(0)], CFG.d_model))
    held = _HeldPlugin()
    try:
        tasks = [asyncio.create_task(svc.infer(1, held, 0, 5, x, 1, 5.0)) for _ in range(2)]
        await until(lambda: svc._pending == 2, "both requests to be held", interval_s=0.005)
        with pytest.raises(ApiError) as info:
            await svc.infer(1, held, 0, 5, x, 1, 5.0)
        held.gate.set()
        await asyncio.gather(*tasks)
    finally:
        held.gate.set()
        await svc.close()
    assert info.value.code == "overloaded" and info.value.status == 503
    assert reg.get_sample_value("shardgrid_worker_infer_refused_total", {"reason": "overloaded"}) == 1


async def test_weights_set_by_seed_are_built_off_the_loop_and_an_apply_meanwhile_wins() -> None:
    svc, _ = service()
    p = plugin()
    try:
        assert not p.loaded
        await svc.ensure_built(p)
        assert p.loaded and p.current().version == 1
        p.apply({"kind": "set_weights", "version": 2, "seed": 11}, ApplyContext(2, 1, 0))
        token, build = p.pending_build()
        p.apply({"kind": "set_weights", "version": 3, "seed": 12}, ApplyContext(3, 1, 0))
        assert not p.install_built(token, build())  # version 2's weights arrive after version 3 was applied
        await svc.ensure_built(p)
        assert p.current().version == 3
    finally:
        await svc.close()
