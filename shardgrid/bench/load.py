"""The load generator of `shardgrid bench`: operation mix, schedule, targets, engine.

One generator process runs one `Engine` on uvloop and sends pre-built request
bodies (orjson, built once or by byte concatenation) over keep-alive
connections: the lean client of `http_client.py` (`--client raw`, the
default) or one aiohttp ClientSession (`--client aiohttp`); nothing is
logged per request.
`bench.py` starts `--procs` of them (multiprocessing, spawn) and merges what
they report.

Two ways to generate load:

- closed loop (`--concurrency N`): N workers, each sends its next request
  when the previous one has been answered. The offered load adapts to the
  server: when the server slows down, fewer requests are sent, and the
  latency a client *would* have seen while waiting to send is never
  measured (coordinated omission).
- open loop (`--rate R`): request j of the run is due at `start + j / R`
  whatever happened to earlier requests; each process takes the requests
  j = proc, proc + P, proc + 2P, ... of the global schedule. Latency is
  measured from the INTENDED send time, so time spent waiting for a
  connection, for the event loop or for the server to catch up shows in the
  percentiles. When `--max-inflight` requests are outstanding, due requests
  wait (their latency keeps growing); requests still held back by that cap
  when the run ends are reported as `unsent`. Requests that fell due before
  the end are sent even when the generator is late (a stall of its loop),
  and their latency shows the lateness. The dispatch delay (actual send - intended)
  is recorded separately as `schedule_lag`: a large lag with few requests in
  flight means the generator itself is short of CPU (add --procs).

Targets: `shardgrid` (the gateway's public API) and `etcd` (its gRPC
gateway's JSON API, `POST /v3/kv/put|range|deleterange|txn` with base64 keys
and values, so no gRPC dependency is needed).
"""
from __future__ import annotations

import asyncio
import base64
import ctypes
import math
import random
import re
import signal
import string
import time
from typing import Any, Callable
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

# Re-exported: run.py and the tests take the config and the outcomes from here.
from shardgrid.bench.config import (INFER_POOL, MISS1, OK1, LoadConfig, Outcome, Prepared, Send, fail,  # noqa: F401
                                    infer_inputs)
from shardgrid.bench.stats import KindStats, encode, new_histogram, record_us
from topology.model import MAX_INFER_ROWS

# -- the operation mix -----------------------------------------------------------------------

# kind -> what it sends (shardgrid target)
KINDS: dict[str, str] = {
    "put": "PUT /items/{id}",
    "get": "GET /items/{id}",
    "delete": "DELETE /items/{id}",
    "incr": "POST /signals {mode: incr}",
    "set": "POST /signals {mode: set}",
    "signals": "GET /signals/{entity}",
    "embed": "PUT /embeddings/{id}",
    "search": "POST /search",
    "infer": "POST /v1/models/{model}/infer",
}
WRITE_KINDS = frozenset({"put", "delete", "incr", "set", "embed"})
MISS_KINDS = frozenset({"get", "delete", "signals"})  # 404 = served, nothing there: counted ok (a miss)
ETCD_KINDS = ("put", "get", "delete")
TARGETS = ("shardgrid", "etcd", "etcd-grpc", "inproc")
ETCD_TARGETS = ("etcd", "etcd-grpc")
MAX_BATCH = 1000  # the gateway's limit on writes per /batch

_WEIGHT = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


class MixError(ValueError):
    """A bad --mix spec; the message says what is wrong and how to write it."""


def parse_mix(spec: str) -> dict[str, float]:
    """`put=70,incr=20,get=10,search=0` -> {kind: weight}, zero weights dropped.

    Weights are relative (they need not add up to 100). Raises MixError.
    """
    example = "e.g. --mix put=70,incr=20,get=10"
    if spec is None or not spec.strip():
        raise MixError(f"--mix is empty; give kind=weight pairs, {example}")
    mix: dict[str, float] = {}
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            raise MixError(f"--mix {spec!r} has an empty entry (a stray comma?); {example}")
        kind, eq, weight = part.partition("=")
        kind, weight = kind.strip(), weight.strip()
        if kind not in KINDS:
            raise MixError(f"--mix: unknown operation {kind!r}; known: {', '.join(KINDS)}")
        if not eq:
            raise MixError(f"--mix: {kind!r} has no weight; write {kind}=WEIGHT, {example}")
        if not _WEIGHT.fullmatch(weight):
            raise MixError(f"--mix: the weight of {kind} must be a non-negative number, got {weight!r}")
        if kind in mix:
            raise MixError(f"--mix: {kind} is given twice")
        mix[kind] = float(weight)
    if not any(w > 0 for w in mix.values()):
        raise MixError(f"--mix {spec!r}: every weight is zero; at least one operation needs a positive weight")
    return {k: w for k, w in mix.items() if w > 0}


def check_mix_for_target(mix: dict[str, float], target: str) -> None:
    if target in ETCD_TARGETS:
        bad = [k for k in mix if k not in ETCD_KINDS]
        if bad:
            raise MixError(f"--target {target} supports only {', '.join(ETCD_KINDS)} in --mix; "
                           f"got {', '.join(bad)}")
    if target == "inproc" and list(mix) != ["infer"]:
        raise MixError("--target inproc runs the model in this process: it supports only --mix infer=100; "
                       f"got {', '.join(mix)}")


def mix_table(mix: dict[str, float], size: int = 1000, seed: int = 0) -> list[int]:
    """Indices into list(mix) in the mix's proportions (largest remainder), shuffled.

    Cycling through it gives the exact mix every `size` operations at the
    cost of one list lookup per operation.
    """
    kinds = list(mix)
    total = sum(mix.values())
    exact = [mix[k] / total * size for k in kinds]
    counts = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(kinds)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: size - sum(counts)]:
        counts[i] += 1
    table = [i for i, n in enumerate(counts) for _ in range(n)]
    random.Random(seed).shuffle(table)
    return table


# -- the open-loop schedule ------------------------------------------------------------------

NS = 1_000_000_000
# uvloop's timers count whole milliseconds and round down: asyncio.sleep(0.0004)
# returns at once. The open loop, sleeping until its next request was due
# (0.45 ms apart at 2,200 requests/s per process), spun through every such gap
# and used a whole core. It now sleeps at least this long and sends what fell
# due meanwhile; that lateness counts in the latency, as any other.
MIN_SLEEP_NS = 1_000_000


def intended_offset_ns(j: int, rate: float) -> int:
    """When request j (0-based, of the whole run, all processes) is due, after the start."""
    return int(round(j * NS / rate))


def proc_request_index(k: int, proc: int, procs: int) -> int:
    """The global index of the k-th request of process `proc` (of `procs`)."""
    return k * procs + proc


def scheduled_count(span_ns: int, rate: float, proc: int = 0, procs: int = 1) -> int:
    """How many of process `proc`'s requests are due strictly before `span_ns` after the start."""
    if span_ns <= 0:
        return 0
    # j is due before span  <=>  round(j * NS / rate) < span_ns
    total = int(math.ceil(span_ns * rate / NS))
    while total > 0 and intended_offset_ns(total - 1, rate) >= span_ns:
        total -= 1
    while intended_offset_ns(total, rate) < span_ns:
        total += 1
    return (total - proc + procs - 1) // procs if total > proc else 0


def make_value(value_bytes: int, rng: random.Random) -> bytes:
    """The document every put writes: `{"v": "<value_bytes random letters>"}`."""
    letters = string.ascii_letters + string.digits
    return orjson.dumps({"v": "".join(rng.choice(letters) for _ in range(value_bytes))})


def _error_code(status: int, raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
        code = body["error"]["code"]
        if isinstance(code, str) and code:
            return code
    except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
        pass
    return f"http_{status}"


def infer_body(rows: list[list[float]]) -> bytes:
    """The body of `POST /v1/models/{name}/infer`: `{"input": [[...], ...]}`."""
    return orjson.dumps({"input": rows})


def classify_infer(status: int, raw: bytes, n: int) -> Outcome:
    """An infer answer: 200 is `n` rows computed; anything else an error by its code (over_budget, ...)."""
    if status == 200:
        return (True, None, n, None, False)
    return fail(_error_code(status, raw))


class _Target:
    """Shared by the targets: round-robin over the URLs, keys, request ids."""

    def __init__(self, cfg: LoadConfig, rng: random.Random) -> None:
        if not cfg.urls:
            raise ValueError("no target URL")
        self.cfg = cfg
        self.rng = rng
        self.bases = [u.rstrip("/") for u in cfg.urls]
        self._rr = 0
        self._n = 0
        self._rid = f"{cfg.run_id}-{cfg.proc}-"
        self.doc = make_value(cfg.value_bytes, rng)

    def base(self) -> str:
        i = self._rr
        self._rr = i + 1 if i + 1 < len(self.bases) else 0
        return self.bases[i]

    def key(self) -> str:
        return f"{self.cfg.key_prefix}{self.rng.randrange(self.cfg.keys)}"

    def keys(self, n: int) -> list[str]:
        """n distinct keys (etcd refuses a txn that names a key twice)."""
        p = self.cfg.key_prefix
        if n >= self.cfg.keys:
            return [f"{p}{i}" for i in range(n)]
        return [f"{p}{i}" for i in self.rng.sample(range(self.cfg.keys), n)]

    def rid(self) -> str:
        self._n += 1
        return f"{self._rid}{self._n}"

    def prepare(self, kind: str) -> Callable[[], Prepared]:
        raise NotImplementedError

    def classify(self, kind: str) -> Callable[[int, bytes, int], Outcome]:
        raise NotImplementedError


class ShardgridTarget(_Target):
    """The gateway's public API (DESIGN §6)."""

    def __init__(self, cfg: LoadConfig, rng: random.Random) -> None:
        super().__init__(cfg, rng)
        self.fixed: dict[str, str] = {"content-type": "application/json"}
        if cfg.ack:
            self.fixed["x-ack"] = cfg.ack
        if cfg.deadline_ms:
            self.fixed["x-deadline-ms"] = str(cfg.deadline_ms)
        self.vectors = [orjson.dumps([rng.uniform(-1.0, 1.0) for _ in range(cfg.embedding_dim)]) for _ in range(64)]
        self.infer_bodies: list[bytes] = []
        if "infer" in cfg.kinds:
            # Every process sends the same inputs (a function of --seed), in its own order.
            self.infer_bodies = [infer_body(x) for x in infer_inputs(cfg.infer_rows, cfg.model_dim, cfg.seed)]

    def headers(self) -> dict[str, str]:
        h = dict(self.fixed)
        h["x-request-id"] = self.rid()
        return h

    def _vector(self) -> bytes:
        return self.vectors[self.rng.randrange(len(self.vectors))]

    def _signal(self, entity: str, kind: str) -> bytes:
        if kind == "incr":
            return b'{"entity":"' + entity.encode() + b'","kind":"hits","value":1}'
        return (b'{"entity":"' + entity.encode() + b'","kind":"last","value":'
                + str(self.rng.randrange(1_000_000)).encode() + b',"mode":"set"}')

    def _batch_item(self, kind: str, key: str) -> bytes:
        k = key.encode()
        if kind == "put":
            return b'{"op":"put_item","id":"' + k + b'","doc":' + self.doc + b"}"
        if kind == "delete":
            return b'{"op":"delete_item","id":"' + k + b'"}'
        if kind == "embed":
            return b'{"op":"put_embedding","id":"' + k + b'","vector":' + self._vector() + b"}"
        return b'{"op":"signal",' + self._signal(key, kind)[1:]

    def prepare(self, kind: str) -> Callable[[], Prepared]:
        n = self.cfg.batch
        if n and kind in WRITE_KINDS:
            def batch() -> Prepared:
                body = b'{"writes":[' + b",".join(self._batch_item(kind, k) for k in self.keys(n)) + b"]}"
                return "POST", URL(self.base() + "/batch", encoded=True), body, self.headers(), n
            return batch
        if kind in ("put", "get", "delete"):
            method = {"put": "PUT", "get": "GET", "delete": "DELETE"}[kind]
            doc = self.doc if kind == "put" else None

            def item() -> Prepared:
                return method, URL(f"{self.base()}/items/{self.key()}", encoded=True), doc, self.headers(), 1
            return item
        if kind in ("incr", "set"):
            def sig() -> Prepared:
                return ("POST", URL(self.base() + "/signals", encoded=True), self._signal(self.key(), kind),
                        self.headers(), 1)
            return sig
        if kind == "signals":
            return lambda: ("GET", URL(f"{self.base()}/signals/{self.key()}", encoded=True), None, self.headers(), 1)
        if kind == "embed":
            def embed() -> Prepared:
                return ("PUT", URL(f"{self.base()}/embeddings/{self.key()}", encoded=True),
                        b'{"vector":' + self._vector() + b"}", self.headers(), 1)
            return embed
        if kind == "search":
            k = str(self.cfg.search_k).encode()

            def search() -> Prepared:
                return ("POST", URL(self.base() + "/search", encoded=True),
                        b'{"vector":' + self._vector() + b',"k":' + k + b"}", self.headers(), 1)
            return search
        if kind == "infer":
            path = "/v1/models/" + quote(self.cfg.model, safe="") + "/infer"
            rows = self.cfg.infer_rows
            bodies = self.infer_bodies

            def infer() -> Prepared:
                return ("POST", URL(self.base() + path, encoded=True), bodies[self.rng.randrange(len(bodies))],
                        self.headers(), rows)
            return infer
        raise ValueError(f"unknown operation {kind!r}")

    def classify(self, kind: str) -> Callable[[int, bytes, int], Outcome]:
        if self.cfg.batch and kind in WRITE_KINDS:
            return classify_batch
        if kind == "infer":
            return classify_infer
        miss_ok = kind in MISS_KINDS

        def single(status: int, raw: bytes, n: int) -> Outcome:
            if status < 300:
                return OK1
            if status == 404 and miss_ok:
                return MISS1
            return fail(_error_code(status, raw))
        return single


def classify_batch(status: int, raw: bytes, n: int) -> Outcome:
    """A /batch answer: 200 with one result per write, each a result or an error body."""
    if status != 200:
        return fail(_error_code(status, raw))
    if b'"error"' not in raw:
        return (True, None, n, None, False)
    try:
        results = orjson.loads(raw)["results"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return fail("bad_response")
    errors: dict[str, int] = {}
    for r in results:
        if isinstance(r, dict) and isinstance(r.get("error"), dict):
            code = str(r["error"].get("code") or "unknown")
            errors[code] = errors.get(code, 0) + 1
    acked = n - sum(errors.values())
    if acked <= 0:  # nothing of it was acknowledged: the request failed
        return (False, next(iter(errors)) if errors else "bad_response", 0, errors, False)
    return (True, None, acked, errors or None, False)


# gRPC status codes, as etcd's JSON gateway reports them in `code`
GRPC_CODES = {1: "canceled", 2: "unknown", 3: "invalid_argument", 4: "deadline_exceeded", 5: "not_found",
              6: "already_exists", 7: "permission_denied", 8: "resource_exhausted", 9: "failed_precondition",
              10: "aborted", 11: "out_of_range", 12: "unimplemented", 13: "internal", 14: "unavailable",
              15: "data_loss", 16: "unauthenticated"}


def _b64(data: bytes) -> bytes:
    return base64.b64encode(data)


class EtcdTarget(_Target):
    """etcd v3 through its JSON gateway: put, range (get), deleterange (delete), txn (--batch)."""

    def __init__(self, cfg: LoadConfig, rng: random.Random) -> None:
        super().__init__(cfg, rng)
        self.value64 = _b64(self.doc)
        self.fixed = {"content-type": "application/json"}

    def _put(self, key: str) -> bytes:
        return b'{"key":"' + _b64(key.encode()) + b'","value":"' + self.value64 + b'"}'

    def _key(self, key: str) -> bytes:
        return b'{"key":"' + _b64(key.encode()) + b'"}'

    def prepare(self, kind: str) -> Callable[[], Prepared]:
        n = self.cfg.batch
        if n and kind in ("put", "delete"):
            field = b'{"request_put":' if kind == "put" else b'{"request_delete_range":'
            one = self._put if kind == "put" else self._key

            def txn() -> Prepared:
                body = b'{"success":[' + b",".join(field + one(k) + b"}" for k in self.keys(n)) + b"]}"
                return "POST", URL(self.base() + "/v3/kv/txn", encoded=True), body, self.fixed, n
            return txn
        if kind == "put":
            return lambda: ("POST", URL(self.base() + "/v3/kv/put", encoded=True), self._put(self.key()), self.fixed, 1)
        if kind == "get":
            return lambda: ("POST", URL(self.base() + "/v3/kv/range", encoded=True), self._key(self.key()),
                            self.fixed, 1)
        if kind == "delete":
            return lambda: ("POST", URL(self.base() + "/v3/kv/deleterange", encoded=True), self._key(self.key()),
                            self.fixed, 1)
        raise ValueError(f"--target etcd does not support {kind!r}")

    def classify(self, kind: str) -> Callable[[int, bytes, int], Outcome]:
        batched = bool(self.cfg.batch) and kind in ("put", "delete")
        miss_marker = None if batched else {"get": b'"kvs"', "delete": b'"deleted"'}.get(kind)

        def etcd(status: int, raw: bytes, n: int) -> Outcome:
            if status == 200:
                if miss_marker is not None and miss_marker not in raw:
                    return MISS1
                return (True, None, n, None, False)
            try:
                code = orjson.loads(raw).get("code")
                return fail(f"etcd_{GRPC_CODES.get(code, code)}")
            except (orjson.JSONDecodeError, AttributeError):
                return fail(f"http_{status}")
        return etcd


def make_target(cfg: LoadConfig, rng: random.Random) -> _Target:
    if cfg.target == "shardgrid":
        return ShardgridTarget(cfg, rng)
    if cfg.target in ETCD_TARGETS:
        return EtcdTarget(cfg, rng)  # etcd-grpc uses its keys and value; GrpcEtcdSender its own wire
    raise ValueError(f"unknown target {cfg.target!r}; known: {', '.join(TARGETS)}")


class HttpSender:
    """send(kind index) -> Outcome over one ClientSession; never raises."""

    def __init__(self, target: _Target, session: aiohttp.ClientSession) -> None:
        kinds = target.cfg.kinds
        self.session = session
        self.prepare = [target.prepare(k) for k in kinds]
        self.classify = [target.classify(k) for k in kinds]

    async def __call__(self, kind: int) -> Outcome:
        method, url, body, headers, n = self.prepare[kind]()
        try:
            async with self.session.request(method, url, data=body, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (asyncio.TimeoutError, TimeoutError):
            return fail("timeout")
        except aiohttp.ClientConnectionError:
            return fail("connection_error")
        except aiohttp.ClientError as exc:
            return fail(f"client_{type(exc).__name__}")
        return self.classify[kind](status, raw, n)


# -- the engine --------------------------------------------------------------------------------

Emit = Callable[[dict[str, Any]], None]


async def sleep_until(t_ns: int) -> None:
    delay = t_ns - time.monotonic_ns()
    if delay > 0:
        await asyncio.sleep(delay / NS)


class Engine:
    """Generates the load of one process and emits a tick (dict) every second and at the end.

    `send(kind_index)` does one request and returns its Outcome (never
    raises). Ticks: {"proc", "index", "final", "elapsed_s", "kinds": {kind:
    KindStats.to_wire()}, "lag": encoded histogram or None, "inflight"}.
    Tick k holds what completed in [start + k s, start + k+1 s); the final
    tick what completed after the last full second (including the drain).
    """

    def __init__(self, cfg: LoadConfig, send: Send, emit: Emit,
                 stop_requested: Callable[[], bool] = lambda: False) -> None:
        self.cfg = cfg
        self.kinds = cfg.kinds
        self.send = send
        self.emit = emit
        self.stop_requested = stop_requested
        self.stats = [KindStats() for _ in self.kinds]
        self.lag = new_histogram() if cfg.open_loop else None
        self.table = mix_table(dict(cfg.mix), seed=cfg.seed * 7919 + cfg.proc)
        self._pick = (cfg.proc * 97) % len(self.table)
        self.start_ns = 0
        self.end_ns = 0
        self.tick_index = 0
        self.inflight = 0
        self.sent = 0
        self.scheduled = 0
        self.unsent = 0
        self.stopped_early = False

    def _next_kind(self) -> int:
        i = self._pick
        self._pick = i + 1 if i + 1 < len(self.table) else 0
        return self.table[i]

    def _record(self, kind: int, lat_ns: int, out: Outcome) -> None:
        ok, code, records, record_errors, miss = out
        ks = self.stats[kind]
        if record_errors:
            for c, n in record_errors.items():
                ks.record_errors[c] = ks.record_errors.get(c, 0) + n
        if ok:
            ks.ok += 1
            ks.records += records
            if miss:
                ks.misses += 1
            record_us(ks.hist, lat_ns // 1000)
        else:
            ks.errors[code or "unknown"] = ks.errors.get(code or "unknown", 0) + 1

    def _tick(self, final: bool) -> dict[str, Any]:
        stats, self.stats = self.stats, [KindStats() for _ in self.kinds]
        lag = None
        if self.lag is not None:
            lag = encode(self.lag)
            self.lag = new_histogram()
        tick = {"proc": self.cfg.proc, "index": self.tick_index, "final": final,
                "elapsed_s": round((time.monotonic_ns() - self.start_ns) / NS, 6),
                "kinds": {k: s.to_wire() for k, s in zip(self.kinds, stats)}, "lag": lag,
                "inflight": self.inflight}
        self.tick_index += 1
        return tick

    async def _ticker(self) -> None:
        while True:
            await sleep_until(self.start_ns + (self.tick_index + 1) * NS)
            if self.stop_requested() and not self.stopped_early:
                self.stopped_early = True
                self.end_ns = min(self.end_ns, time.monotonic_ns())
            self.emit(self._tick(final=False))

    async def run(self, start_ns: int) -> dict[str, Any]:
        """Run from `start_ns` (monotonic) for warm-up + duration; return this process's summary."""
        cfg = self.cfg
        self.start_ns = start_ns
        self.end_ns = start_ns + int((cfg.warmup_s + cfg.duration_s) * NS)
        await sleep_until(start_ns)
        cpu0 = time.process_time()
        ticker = asyncio.ensure_future(self._ticker())
        try:
            if cfg.open_loop:
                await self._open_loop()
            else:
                await asyncio.gather(*(self._closed_worker() for _ in range(cfg.concurrency)))
        finally:
            ticker.cancel()
            try:
                await ticker
            except asyncio.CancelledError:
                pass
        self.emit(self._tick(final=True))
        return {"proc": cfg.proc, "cpu_s": round(time.process_time() - cpu0, 3), "sent": self.sent,
                "scheduled": self.scheduled if cfg.open_loop else None,
                "unsent": self.unsent if cfg.open_loop else None, "stopped_early": self.stopped_early}

    async def _closed_worker(self) -> None:
        clock = time.monotonic_ns
        while clock() < self.end_ns:
            kind = self._next_kind()
            self.sent += 1
            t0 = clock()
            try:
                out = await self.send(kind)
            except Exception as exc:  # a bug in a sender must not stop the run silently
                out = fail(f"client_{type(exc).__name__}")
            self._record(kind, clock() - t0, out)

    async def _open_one(self, kind: int, intended_ns: int, slot: asyncio.Event) -> None:
        try:
            out = await self.send(kind)
        except Exception as exc:
            out = fail(f"client_{type(exc).__name__}")
        # From the intended send time: waiting to be sent is part of the latency.
        self._record(kind, time.monotonic_ns() - intended_ns, out)
        self.inflight -= 1
        slot.set()

    async def _open_loop(self) -> None:
        cfg = self.cfg
        assert cfg.rate is not None and cfg.rate > 0
        clock = time.monotonic_ns
        slot = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()
        k = 0
        burst = 0
        while True:
            due = self.start_ns + intended_offset_ns(proc_request_index(k, cfg.proc, cfg.procs), cfg.rate)
            if due >= self.end_ns:
                break
            now = clock()
            if due > now:
                burst = 0
                await asyncio.sleep(min(max(due - now, MIN_SLEEP_NS), 100_000_000) / NS)
                continue
            if self.inflight >= cfg.max_inflight:
                if now >= self.end_ns:
                    break  # the run is over: what the cap held back stays unsent
                slot.clear()
                try:
                    await asyncio.wait_for(slot.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass
                continue
            kind = self._next_kind()
            assert self.lag is not None
            record_us(self.lag, (now - due) // 1000)
            self.inflight += 1
            self.sent += 1
            task = asyncio.ensure_future(self._open_one(kind, due, slot))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
            burst += 1
            if burst >= 64:  # let answers in between bursts of overdue requests
                burst = 0
                await asyncio.sleep(0)
        self.scheduled = scheduled_count(self.end_ns - self.start_ns, cfg.rate, cfg.proc, cfg.procs)
        self.unsent = max(0, self.scheduled - k)
        if tasks:
            await asyncio.wait(set(tasks))


# -- one generator process ---------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def make_session(cfg: LoadConfig) -> aiohttp.ClientSession:
    """One session per process: a connection pool as large as the load can use."""
    limit = cfg.max_inflight if cfg.open_loop else max(cfg.concurrency, 1)
    connector = aiohttp.TCPConnector(limit=limit + 16, limit_per_host=0, ttl_dns_cache=None,
                                     enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
                                 skip_auto_headers=("User-Agent",), auto_decompress=False)


async def _child(cfg: LoadConfig, q: Any, go: Any, stop: Any, start_at: Any) -> None:
    rng = random.Random(cfg.seed * 1_000_003 + cfg.proc)
    async with make_session(cfg) as session:
        grpc_send: Any = None
        raw_send: Any = None
        send: Send
        target: Any = None if cfg.target == "inproc" else make_target(cfg, rng)
        if target is None:
            from shardgrid.bench.inproc import InprocSender

            # Builds the weights before "ready": the run measures inference, not their generation.
            raw_send = send = await InprocSender.create(cfg)
        elif cfg.target == "etcd-grpc":
            from shardgrid.bench.grpc_client import GrpcEtcdSender

            grpc_send = send = GrpcEtcdSender(target)
        elif cfg.client == "raw":
            from shardgrid.bench.http_client import make_raw_sender

            raw_send = send = make_raw_sender(target)
        else:
            send = HttpSender(target, session)
        try:
            q.put(("ready", cfg.proc, None))
            while not go.is_set():
                if stop.is_set():
                    return
                await asyncio.sleep(0.005)
            start_ns = time.monotonic_ns() + int((start_at.value - time.time()) * NS)
            engine = Engine(cfg, send, lambda tick: q.put(("tick", cfg.proc, tick)), stop.is_set)
            summary = await engine.run(start_ns)
            if target is None:
                st = raw_send.stats
                summary["passes"] = {"passes": st.passes, "rows": st.rows, "requests": st.requests}
        finally:
            if grpc_send is not None:
                await grpc_send.close()
            if raw_send is not None:
                await raw_send.close()
    q.put(("done", cfg.proc, summary))


def child_main(cfg: LoadConfig, q: Any, go: Any, stop: Any, start_at: Any) -> None:
    """Entry point of a generator process (multiprocessing, spawn).

    Ctrl-C is the parent's business: it sets `stop`, and the engine ends the
    run within a second and reports what it has.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    import uvloop

    try:
        uvloop.run(_child(cfg, q, go, stop, start_at))
    except BaseException as exc:  # report, so the parent can say what went wrong
        q.put(("error", cfg.proc, f"{type(exc).__name__}: {exc}"))
        raise
