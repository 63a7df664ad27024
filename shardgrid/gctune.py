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
  each still cheap; older generations keep their defaults, and CPython only
  runs a full collection when the survivors since the last one exceed 25 %
  of what it already tracks.
"""
from __future__ import annotations

import gc

YOUNG = 50_000


def tune_gc() -> None:
    """Call once, after imports and start-up, before serving."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG, older, oldest)
