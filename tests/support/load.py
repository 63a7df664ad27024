"""A bounded load generator for tier3 tests: concurrent clients through gateways.

Each client owns its keys: write-once items with unique values, a few strong
reads of them, and +1 increments of a counter of its own entity. With
`batch_share`, some of its puts go as one `POST /batch` of several keys
(spread over the shards); each is then a write of its own in the history,
judged by its own result in the batch's answer. Every
operation goes into a `History` (invoke/complete/outcome), and every error
code seen is counted, so tests can assert on client-visible errors as well as
on the checkers' verdicts. Bounded in count (ops per client) and time.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import orjson

from tests.support.history import History, outcome_for_error


@dataclass
class LoadResult:
    history: History
    errors: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    items: dict[str, Any] = field(default_factory=dict)  # key -> value of every acknowledged write
    counters: dict[str, str] = field(default_factory=dict)  # counter key -> entity

    @property
    def acked_writes(self) -> int:
        return sum(1 for op in self.history if op.kind in ("write", "incr") and op.acked)

    @property
    def acked_batched_writes(self) -> int:
        """Acknowledged puts that went in a /batch (their keys end in -b<j>)."""
        return sum(1 for op in self.history if op.kind == "write" and op.acked and "-b" in op.key)

    def p99_ms(self) -> float:
        if not self.latencies_ms:
            return 0.0
        s = sorted(self.latencies_ms)
        return s[min(len(s) - 1, int(len(s) * 0.99))]

    def summary(self) -> str:
        ops = len(self.history)
        return (f"ops={ops} acked_writes={self.acked_writes} errors={dict(self.errors)} "
                f"p99={self.p99_ms():.1f}ms")


class LoadGenerator:
    def __init__(self, gateways: list[str], clients: int = 8, ops_per_client: int = 200, seed: int = 1,
                 deadline_ms: int = 4000, incr_share: float = 0.2, read_share: float = 0.3,
                 prefix: str | None = None, batch_share: float = 0.0, batch_size: tuple[int, int] = (4, 12),
                 route: Callable[[str], bool] | None = None) -> None:
        self.gateways = [g if g.startswith("http") else f"http://{g}" for g in gateways]
        self.clients = clients
        self.ops_per_client = ops_per_client
        self.rng = random.Random(seed)
        self.deadline_ms = deadline_ms
        self.incr_share = incr_share
        self.read_share = read_share
        self.batch_share = batch_share
        self.batch_size = batch_size
        self.prefix = prefix or uuid.uuid4().hex[:6]
        # Only keys and entities it accepts (e.g. those of one shard): skewed load.
        self.route = route
        self.result = LoadResult(History())
        self.stop = asyncio.Event()

    async def _call(self, session: aiohttp.ClientSession, method: str, path: str, body: Any,
                    rid: str, client: int) -> tuple[int, Any]:
        gw = self.gateways[(client + self.rng.randrange(len(self.gateways))) % len(self.gateways)]
        headers = {"x-request-id": rid, "x-deadline-ms": str(self.deadline_ms)}
        data = orjson.dumps(body) if body is not None else None
        t0 = time.monotonic()
        try:
            async with session.request(method, gw + path, data=data, headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=self.deadline_ms / 1000 + 2)) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.result.errors[type(exc).__name__] += 1
            return 0, None
        finally:
            self.result.latencies_ms.append((time.monotonic() - t0) * 1000)
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        if status >= 300 and not (method == "GET" and status == 404):  # not found is a read's answer
            code = parsed.get("error", {}).get("code", str(status)) if isinstance(parsed, dict) else str(status)
            self.result.errors[code] += 1
        return status, parsed

    async def _client(self, session: aiohttp.ClientSession, client: int) -> None:
        h = self.result.history
        entity = self._name(f"{self.prefix}-e{client}")
        counter_key = f"{entity}/hits"
        self.result.counters[counter_key] = entity
        written: list[str] = []
        for i in range(self.ops_per_client):
            if self.stop.is_set():
                return
            roll = self.rng.random()
            if roll < self.incr_share:
                rid = uuid.uuid4().hex
                op = h.invoke(client, "incr", counter_key, 1)
                status, body = await self._call(session, "POST", "/signals",
                                                {"entity": entity, "kind": "hits", "value": 1}, rid, client)
                if status == 200:
                    h.complete(op, "ok", body["value"])
                else:
                    h.complete(op, self._outcome(body, status))
            elif roll < self.incr_share + self.read_share and written:
                key = self.rng.choice(written)
                op = h.invoke(client, "read", key)
                status, body = await self._call(session, "GET", f"/items/{key}", None, uuid.uuid4().hex, client)
                if status == 200:
                    h.complete(op, "ok", body.get("v"))
                elif status == 404:
                    h.complete(op, "ok", None)
                else:
                    h.complete(op, "unknown")
            elif roll < self.incr_share + self.read_share + self.batch_share:
                await self._batch(session, client, i, written)
            else:
                key = self._name(f"{self.prefix}-c{client}-k{i}")
                value = f"{key}:{uuid.uuid4().hex[:8]}"
                op = h.invoke(client, "write", key, value)
                status, body = await self._call(session, "PUT", f"/items/{key}", {"v": value}, uuid.uuid4().hex,
                                                client)
                if status == 200:
                    h.complete(op, "ok")
                    self.result.items[key] = value
                else:
                    h.complete(op, self._outcome(body, status))
                written.append(key)

    def _name(self, base: str) -> str:
        """`base`, or the first `base-rN` that `route` accepts."""
        name, n = base, 0
        while self.route is not None and not self.route(name):
            n += 1
            name = f"{base}-r{n}"
        return name

    async def _batch(self, session: aiohttp.ClientSession, client: int, i: int, written: list[str]) -> None:
        h = self.result.history
        keys = [f"{self.prefix}-c{client}-k{i}-b{j}" for j in range(self.rng.randint(*self.batch_size))]
        values = [f"{k}:{uuid.uuid4().hex[:8]}" for k in keys]
        ops = [h.invoke(client, "write", k, v) for k, v in zip(keys, values)]
        body = {"writes": [{"op": "put_item", "id": k, "doc": {"v": v}} for k, v in zip(keys, values)]}
        status, answer = await self._call(session, "POST", "/batch", body, uuid.uuid4().hex, client)
        results = answer.get("results") if status == 200 and isinstance(answer, dict) else None
        if not isinstance(results, list) or len(results) != len(keys):
            # The whole request failed: its outcome is every write's (no answer,
            # status 0, stays unknown; so does a 200 without a result per write).
            results = [answer if status != 200 else None] * len(keys)
        for op, k, v, r in zip(ops, keys, values, results):
            err = r.get("error") if isinstance(r, dict) else None
            if status == 200 and isinstance(r, dict) and err is None:
                h.complete(op, "ok")
                self.result.items[k] = v
            else:
                if isinstance(err, dict):
                    self.result.errors[str(err.get("code"))] += 1
                # A per-item error of a 200 is judged by its code like a whole
                # request's (unavailable: definitely not applied).
                h.complete(op, self._outcome(r, status if status != 200 else 500))
            written.append(k)

    @staticmethod
    def _outcome(body: Any, status: int) -> Any:
        if status == 0 or not isinstance(body, dict):
            return "unknown"
        return outcome_for_error(body.get("error", {}).get("code"))

    async def run(self, max_seconds: float = 120.0) -> LoadResult:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            tasks = [asyncio.create_task(self._client(session, c)) for c in range(self.clients)]
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), max_seconds)
            except asyncio.TimeoutError:
                self.stop.set()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return self.result


async def final_state(gateway: str, result: LoadResult) -> tuple[dict[str, Any], dict[str, int]]:
    """Read back every key the history touched (strong reads, generous deadline)."""
    gw = gateway if gateway.startswith("http") else f"http://{gateway}"
    keys = {op.key for op in result.history if op.kind in ("write", "read")}
    items: dict[str, Any] = {}
    counters: dict[str, int] = {}
    sem = asyncio.Semaphore(16)
    async with aiohttp.ClientSession() as s:
        async def get(path: str) -> Any:
            async with sem:
                for _ in range(20):
                    try:
                        async with s.get(gw + path, headers={"x-deadline-ms": "5000"},
                                         timeout=aiohttp.ClientTimeout(total=8)) as r:
                            if r.status == 404:
                                return None
                            if r.status == 200:
                                return orjson.loads(await r.read())
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        pass
                    await asyncio.sleep(0.2)
                raise AssertionError(f"could not read {path} back after the run")

        async def item(k: str) -> None:
            body = await get(f"/items/{k}")
            items[k] = None if body is None else body.get("v")

        async def counter(ck: str, entity: str) -> None:
            body = await get(f"/signals/{entity}")
            counters[ck] = 0 if body is None else int(body["counters"].get("hits", 0))

        await asyncio.gather(*(item(k) for k in keys),
                             *(counter(ck, e) for ck, e in result.counters.items()))
    return items, counters
