"""shardgrid.client against a real cluster: two gateways, one SIGKILLed while
clients increment counters. Every increment the clients saw acknowledged is
counted exactly once: none lost, none applied twice (a write in flight on the
killed gateway is resent to the other with its request id)."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from shardgrid.client import AsyncClient, Client, ShardgridError
from tests.support.cluster import Cluster, wait_until

pytestmark = pytest.mark.tier3

ENTITIES = [f"ctr-{i}" for i in range(8)]
MAX_OPS = 1500  # all clients together
MAX_SECONDS = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster.create(tmp_path / "cluster", n_workers=3, n_gateways=2)
    try:
        c.boot(c.topology_yaml(shards=3), gateways=True)
        yield c
    finally:
        c.close()


@dataclass
class Tally:
    """What the clients saw, under one lock (threads and a loop add to it)."""

    acked: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    max_attempts: int = 0
    ops: int = 0
    ryw_reads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def take(self) -> bool:
        with self.lock:
            if self.stop.is_set() or self.ops >= MAX_OPS:
                return False
            self.ops += 1
            return True

    def ack(self, entity: str, attempts: int) -> None:
        with self.lock:
            self.acked[entity] += 1
            self.max_attempts = max(self.max_attempts, attempts)

    def total(self) -> int:
        with self.lock:
            return sum(self.acked.values())


def sync_worker(urls: list[str], tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    # Follower reads with read-your-writes: each read must see this client's last increment.
    with Client(urls, deadline_s=10.0, read_your_writes=True, consistency="follower", seed=seed) as c:
        while tally.take():
            entity = rng.choice(ENTITIES)
            try:
                res = c.incr(entity, "n")
                tally.ack(entity, res.attempts)
                if rng.random() < 0.1 and isinstance(res.value, int):
                    seen = c.signals(entity).counters.get("n", 0)
                    if seen < res.value:
                        tally.errors.append(f"{entity}: read {seen} after an increment answered {res.value}")
                    with tally.lock:
                        tally.ryw_reads += 1
            except ShardgridError as exc:
                tally.errors.append(f"{entity}: {exc!r} applied={exc.applied}")


async def async_workers(urls: list[str], tally: Tally, seed: int, tasks: int = 3) -> None:
    async with AsyncClient(urls, deadline_s=10.0, seed=seed) as c:
        async def one(rng: random.Random) -> None:
            while tally.take():
                entity = rng.choice(ENTITIES)
                try:
                    res = await c.incr(entity, "n")
                    tally.ack(entity, res.attempts)
                except ShardgridError as exc:
                    tally.errors.append(f"{entity}: {exc!r} applied={exc.applied}")

        await asyncio.gather(*(one(random.Random(seed * 10 + i)) for i in range(tasks)))


def test_counters_survive_a_gateway_sigkill(cluster: Cluster) -> None:
    urls = [f"http://{g}" for g in cluster.gateways]
    tally = Tally()
    threads = [threading.Thread(target=sync_worker, args=(urls, tally, s), daemon=True) for s in (1, 2, 3)]
    threads.append(threading.Thread(target=lambda: asyncio.run(async_workers(urls, tally, 4)), daemon=True))
    started = time.monotonic()
    for t in threads:
        t.start()
    try:
        wait_until(lambda: tally.total() >= 150, 30, "150 acknowledged increments before the kill")
        cluster.kill("g1")  # SIGKILL: connections in flight on it break
        before = tally.total()
        wait_until(lambda: tally.total() >= before + 150 or tally.ops >= MAX_OPS, 40,
                   "150 more acknowledged increments through the other gateway")
    finally:
        tally.stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a client thread did not finish"
    assert time.monotonic() - started < MAX_SECONDS + 60
    assert tally.errors == [], tally.errors[:10]
    # Every client preferred g1 until it failed: their first calls after the kill were resent.
    assert tally.max_attempts >= 2
    assert tally.ryw_reads > 0
    with Client([urls[1]], deadline_s=10.0) as c:
        final = {e: c.signals(e).counters.get("n", 0) for e in ENTITIES}
    assert final == {e: tally.acked[e] for e in ENTITIES}, (final, dict(tally.acked))
    print(f"\n{sum(final.values())} increments over {len(ENTITIES)} counters, each counted once; "
          f"max attempts of one call {tally.max_attempts}; {tally.ryw_reads} read-your-writes follower reads")
