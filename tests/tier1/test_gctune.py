"""The servers' collector policy: young collections only, and a periodic,
logged full collection that still finds cyclic garbage the young ones
promoted. The collector is process-wide state, so each test restores it."""
from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest

from shardgrid.common.gctune import GATEWAY_YOUNG, NEVER, YOUNG, collect_fully_every, first_delay, start_gc_policy, tune_gc


@pytest.fixture
def restore_gc() -> Iterator[None]:
    saved = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_only_young_collections_after_tuning(restore_gc: None) -> None:
    tune_gc()
    assert gc.get_threshold() == (YOUNG, NEVER, NEVER)
    assert gc.get_freeze_count() > 0
    middle_before = gc.get_stats()[1]["collections"]
    full_before = gc.get_stats()[2]["collections"]
    # What makes CPython start a full collection by itself: many middle
    # collections since the last full one, and survivors promoted since
    # then beyond a quarter of what it tracked at that full collection.
    survivors = [[] for _ in range(400_000)]
    for _ in range(30):
        gc.collect(1)
    more = [[] for _ in range(2 * YOUNG)]  # young collections start on their own
    young_before = gc.get_stats()[0]["collections"]
    kept = [[[] for _ in range(2 * YOUNG)] for _ in range(12)]  # 12+ young collections, all survivors
    assert gc.get_stats()[0]["collections"] >= young_before + 12
    del survivors, more, kept
    assert gc.get_stats()[2]["collections"] == full_before
    # the 30 explicit ones above, and none of the default's one per 10 young collections
    assert gc.get_stats()[1]["collections"] == middle_before + 30


async def test_periodic_full_collection_finds_promoted_cycles(restore_gc: None) -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    gc.collect(1)
    gc.collect(1)  # the cycle, still alive, now sits in the oldest generation
    del a, b
    assert gc.collect(1) == 0  # young collections cannot see it
    log = Log()
    task = asyncio.create_task(collect_fully_every(0.01, log))
    try:
        async with asyncio.timeout(5):
            while not log.events:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
    event, fields = log.events[0]
    assert event == "gc_full_collection"
    assert fields["unreachable"] >= 2 and fields["ms"] >= 0


async def test_full_collections_start_at_a_random_point_then_keep_the_interval(restore_gc: None) -> None:
    log = Log()
    task = asyncio.create_task(collect_fully_every(0.2, log, first_s=0.01))
    try:
        async with asyncio.timeout(5):
            while not log.events:
                await asyncio.sleep(0.005)
        first = asyncio.get_running_loop().time()
        while len(log.events) < 2:
            await asyncio.sleep(0.005)
        assert asyncio.get_running_loop().time() - first >= 0.19  # then the interval
    finally:
        task.cancel()
    phases = {first_delay(100.0) for _ in range(20)}
    assert len(phases) > 1 and all(50.0 <= p <= 100.0 for p in phases)


async def test_the_gateway_s_young_generation_holds_its_requests_in_flight(restore_gc: None) -> None:
    task = start_gc_policy(Log(), young=GATEWAY_YOUNG)
    try:
        assert gc.get_threshold() == (GATEWAY_YOUNG, NEVER, NEVER)
        # 128 batches of 100 writes in flight are some 90,000 live containers:
        # collections walked them again and again under YOUNG; not any more.
        young_before = gc.get_stats()[0]["collections"]
        in_flight = [[{"op": "put_item", "id": f"k{i}", "doc": {"v": i}} for i in range(100)] for _ in range(1_000)]
        assert gc.get_stats()[0]["collections"] == young_before
        assert sum(map(len, in_flight)) * 2 > 3 * YOUNG  # the default policy would have collected 3+ times
        del in_flight
    finally:
        task.cancel()
