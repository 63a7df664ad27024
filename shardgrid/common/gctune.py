"""Garbage-collector settings for long-running servers.

A worker holds its group's state and in-memory log as millions of small
containers (decoded entries, documents, the dedup table), and every process
holds its imported modules (torch in workers). CPython's default collector
runs a young collection every 700 allocations and, from time to time, walks
all of that: under a write load it took about a quarter of a worker's CPU
(`perf`: gc_collect_main, visit_decref, visit_reachable). Almost nothing in
these servers forms reference cycles, so:

- `freeze()` once start-up is done moves everything alive then (modules,
  configuration) out of the collector's sight for good;
- a young generation of `YOUNG` allocations makes collections rare and
  each still cheap;
- no automatic full collection. CPython starts one whenever the survivors
  since the last one exceed 25 % of what it tracks, and it walks the whole
  in-memory log: under a steady write load that was a 60-230 ms pause every
  10-20 s, and since every replica of a group allocates alike, all three
  workers paused at the same moment, which stalled every write in flight
  (the p99.9 of a 10 s benchmark was 300 ms);
- no automatic collection of the middle generation either. What survives a
  young collection is nearly all long-lived state (log entries, documents,
  request ids), and collecting the middle generation walked all of it once
  more: under sustained `/batch` load each such collection was a 150-210 ms
  pause of the worker, every 10 young collections. Survivors now stay in the
  middle generation.

The gateway keeps no state of its own: what its young generation holds is
the requests in flight (a `/batch` of 100 is some 700 containers), and every
young collection walked all of them again. At 128 concurrent batches that
was 4-5 % of the gateway's CPU per record, so its young generation is
`GATEWAY_YOUNG`: net allocations, which in a process whose objects die with
their request grow only with what is still in flight. Cyclic garbage waits
longer for it, so the gateway's paths do not make any per request (a failed
attempt raises a fresh exception rather than one its own frame holds).

Cyclic garbage that lived through a young collection (a closed connection's
objects, say) is found by one full collection every `FULL_EVERY_S`, which
logs how long it took and what it found (`gc_full_collection`). Measured
with full collections every 20 s under 4,600 writes/s: they found 0-9
unreachable objects per process, so that garbage does not pile up.
"""
from __future__ import annotations

import asyncio
import gc
import random
import time
from typing import Any

YOUNG = 50_000
GATEWAY_YOUNG = 1_000_000
# gc.set_threshold takes a C int; no generation's counter gets this far.
NEVER = 1 << 30
FULL_EVERY_S = 600.0


def tune_gc(young: int = YOUNG) -> None:
    """Call once, after imports and start-up, before serving."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, NEVER, NEVER)


async def collect_fully_every(interval_s: float, log: Any, first_s: float | None = None) -> None:
    """The only full collections: the first after `first_s` (default `interval_s`),
    then one every `interval_s`, logged (run as a task)."""
    wait = interval_s if first_s is None else first_s
    while True:
        await asyncio.sleep(wait)
        wait = interval_s
        started = time.perf_counter()
        found = gc.collect()
        log.info("gc_full_collection", unreachable=found, ms=round((time.perf_counter() - started) * 1000, 1))


def start_gc_policy(log: Any, interval_s: float = FULL_EVERY_S, young: int = YOUNG) -> asyncio.Task[None]:
    """`tune_gc()` and the task of periodic full collections; cancel it on shutdown.

    A full collection stops a worker for a few hundred milliseconds (it walks
    the in-memory log). Processes started together would all stop together,
    every write of the cluster with them: each starts its cycle at a random
    point of the first interval instead.
    """
    tune_gc(young)
    return asyncio.create_task(collect_fully_every(interval_s, log, first_delay(interval_s)),
                               name="gc-full-collections")


def first_delay(interval_s: float) -> float:
    """When a process's first full collection comes: a random point of the second half of the first interval."""
    return interval_s * random.uniform(0.5, 1.0)
