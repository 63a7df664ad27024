"""`shardgrid bench --target inproc`: the model of a topology computed in the generator's own process.

The baseline a cluster's `POST /v1/models/{name}/infer` is compared with: no
HTTP, no routing, no hops, the whole model (all its layers, version 1
weights, built once before the run starts) in this process.

Concurrency is emulated the way a worker serves it: the closed loop's N
clients put their requests on an asyncio queue, and one compute thread runs
forward passes over what is queued, concatenating the rows of queued requests
up to `--infer-max-rows` rows per pass (default 64, like a worker; 1 = one
request per pass). Unlike a worker it never waits for company: a pass starts
as soon as the previous one ended, with whatever has queued meanwhile. The
compute thread uses one torch intra-op thread, as a worker's does, so the
event loop keeps the other core of a small machine.

torch is imported here only (run.py and load.py import this module
when the target is inproc), so the other targets never pay for it.
"""
from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from shardgrid.bench.config import LoadConfig, Outcome, fail, infer_inputs

def compute_description(max_rows: int) -> str:
    """How --target inproc serves concurrent requests (the report line and the JSON say it)."""
    if max_rows == 1:
        return "one compute thread; one request per forward pass (--infer-max-rows 1)"
    return f"one compute thread; each forward pass concatenates the queued requests' rows, up to {max_rows} rows"


def _init_thread() -> None:
    from worker.plugins.base import import_torch

    # One intra-op thread, as a worker's compute thread: the event loop needs the other core.
    import_torch().set_num_threads(1)


@dataclass
class _Pending:
    x: Any  # float32 tensor [rows, d_model]
    rows: int
    fut: asyncio.Future[Outcome]


@dataclass
class PassStats:
    """Forward passes run and the rows and requests they held (the report's batching figures)."""

    passes: int = 0
    rows: int = 0
    requests: int = 0


class InprocSender:
    """send(kind index) -> Outcome, computing the model here; never raises."""

    def __init__(self, cfg: LoadConfig, weights: Any, inputs: list[Any], executor: ThreadPoolExecutor) -> None:
        self.cfg = cfg
        self.weights = weights
        self.inputs = inputs
        self.executor = executor
        self.rng = random.Random(cfg.seed * 1_000_003 + cfg.proc)
        self.last = weights.last
        self.max_rows = max(1, cfg.infer_max_rows)
        self.queue: list[_Pending] = []
        self.task: asyncio.Task[None] | None = None
        self.stats = PassStats()

    @classmethod
    async def create(cls, cfg: LoadConfig) -> "InprocSender":
        """Build the whole model's weights (on the compute thread) and the request inputs."""
        if not cfg.model_spec:
            raise ValueError("--target inproc needs the model's spec (from --topology)")
        spec = orjson.loads(cfg.model_spec)
        executor = ThreadPoolExecutor(1, thread_name_prefix="inproc", initializer=_init_thread)
        loop = asyncio.get_running_loop()
        try:
            weights, inputs = await loop.run_in_executor(executor, _build, spec, cfg.infer_rows, cfg.seed)
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        return cls(cfg, weights, inputs, executor)

    async def __call__(self, kind: int) -> Outcome:
        x = self.inputs[self.rng.randrange(len(self.inputs))]
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.queue.append(_Pending(x, self.cfg.infer_rows, fut))
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self.queue:
            batch, rows = [], 0
            # At least one request per pass, even one larger than max_rows (as a worker does).
            while self.queue and (not batch or rows + self.queue[0].rows <= self.max_rows):
                p = self.queue.pop(0)
                batch.append(p)
                rows += p.rows
            try:
                await loop.run_in_executor(self.executor, _forward, self.weights, [p.x for p in batch], self.last)
            except Exception as exc:  # noqa: BLE001 - a failed pass fails its requests, not the run
                for p in batch:
                    if not p.fut.done():
                        p.fut.set_result(fail(f"compute_{type(exc).__name__}"))
                continue
            self.stats.passes += 1
            self.stats.rows += rows
            self.stats.requests += len(batch)
            for p in batch:
                if not p.fut.done():
                    p.fut.set_result((True, None, p.rows, None, False))

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        for p in self.queue:
            if not p.fut.done():
                p.fut.set_result(fail("stopped"))
        self.queue.clear()
        self.executor.shutdown(wait=True, cancel_futures=True)


def _build(spec: dict[str, Any], rows: int, seed: int) -> tuple[Any, list[Any]]:
    from worker.plugins.layers_model import ModelConfig, Weights, generate_layers, rows_to_tensor

    cfg = ModelConfig.from_dict(spec)
    last = cfg.layers - 1
    weights = Weights.build(cfg, 1, 0, last, generate_layers(cfg, cfg.seed, 0, last))
    # The inputs the HTTP target sends for the same --seed, as tensors once.
    inputs = [rows_to_tensor(x, cfg.d_model) for x in infer_inputs(rows, cfg.d_model, seed)]
    return weights, inputs


def _forward(weights: Any, xs: list[Any], last: int) -> Any:
    from worker.plugins.base import import_torch

    torch = import_torch()
    x = xs[0] if len(xs) == 1 else torch.cat(xs)
    return weights.forward(x, 0, last)
