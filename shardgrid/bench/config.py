"""What one generator process is told (LoadConfig) and what one request yields (Outcome).

Its own module, below load.py and the senders (http_client.py, grpc_client.py,
inproc.py): load.py picks a sender and the senders speak in these types, so
with them here neither side imports the other.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

from yarl import URL

INFER_POOL = 64  # distinct request bodies an infer load cycles through


# -- configuration of one generator process --------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    target: str = "shardgrid"
    urls: tuple[str, ...] = ("http://127.0.0.1:8080",)
    mix: tuple[tuple[str, float], ...] = (("put", 100.0),)
    concurrency: int = 16  # closed loop: this process's workers
    rate: float | None = None  # open loop: requests/s of the whole run (every process)
    duration_s: float = 10.0  # measured part, after the warm-up
    warmup_s: int = 0
    ack: str | None = None
    deadline_ms: int | None = None
    value_bytes: int = 100
    batch: int = 0  # > 0: writes go as /batch (etcd: txn) requests of this many writes
    keys: int = 100_000
    key_prefix: str = "bench-"
    embedding_dim: int = 64
    search_k: int = 10
    timeout_s: float = 10.0
    max_inflight: int = 10_000  # open loop: this process's cap
    seed: int = 1
    proc: int = 0
    procs: int = 1
    run_id: str = "run"
    client: str = "raw"  # HTTP targets: "raw" (http_client.py) or "aiohttp"
    # infer: the model, the rows of each request and their width (the model's d_model)
    model: str = "tiny"
    infer_rows: int = 1
    model_dim: int = 64
    # --target inproc: the model's ModelSpec.to_dict() as JSON, and the most rows one forward pass takes
    model_spec: str | None = None
    infer_max_rows: int = 64

    @property
    def kinds(self) -> list[str]:
        return [k for k, _ in self.mix]

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    def for_proc(self, proc: int, procs: int) -> "LoadConfig":
        """This config's share for process `proc` of `procs`."""
        conc = self.concurrency // procs + (1 if proc < self.concurrency % procs else 0)
        return replace(self, proc=proc, procs=procs, concurrency=conc,
                       max_inflight=max(1, -(-self.max_inflight // procs)))


# Outcome of one request: (ok, error code, records acknowledged, per-record errors, miss)
Outcome = tuple[bool, str | None, int, dict[str, int] | None, bool]
Send = Callable[[int], Awaitable[Outcome]]
Prepared = tuple[str, URL, bytes | None, dict[str, str], int]
OK1: Outcome = (True, None, 1, None, False)
MISS1: Outcome = (True, None, 1, None, True)


def fail(code: str) -> Outcome:
    return (False, code, 0, None, False)


def infer_inputs(rows: int, d_model: int, seed: int, count: int = INFER_POOL) -> list[list[list[float]]]:
    """`count` inputs of `rows` rows of `d_model` floats in [-1, 1), a function of `seed` alone.

    Rounded to 6 digits: the JSON stays short, and every value is exact
    enough for a float32 model.
    """
    rng = random.Random(seed * 1_000_033 + 17)
    return [[[round(rng.uniform(-1.0, 1.0), 6) for _ in range(d_model)] for _ in range(rows)] for _ in range(count)]


