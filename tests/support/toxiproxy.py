"""A small TCP fault proxy that speaks Toxiproxy's REST API, for chaos tests.

No Toxiproxy binary can be installed on these machines (see shared TESTING.md,
"Network faults"), so this module serves the subset of Toxiproxy 2.x's HTTP API
that `toxiproxy-python` 0.1.1 uses, with the same JSON shapes and status codes:

    GET  /proxies                 {name: proxy, ...}
    POST /proxies                 create {name, upstream, listen?, enabled?} -> 201
    GET  /proxies/{p}             proxy
    POST /proxies/{p}             update {enabled?, listen?, upstream?} (PATCH too)
    DELETE /proxies/{p}           204
    GET  /proxies/{p}/toxics      [toxic, ...]
    POST /proxies/{p}/toxics      create {name?, type, stream?, toxicity?, attributes?}
    GET  /proxies/{p}/toxics/{t}  toxic
    POST /proxies/{p}/toxics/{t}  update {toxicity?, attributes?} (PATCH too)
    DELETE /proxies/{p}/toxics/{t} 204
    POST /reset                   enable every proxy, remove every toxic -> 204
    GET  /version                 {"version": "..."}

A proxy is {"name", "listen", "upstream", "enabled", "toxics": [...]}; a toxic is
{"attributes", "name", "type", "stream", "toxicity"}; errors are
{"error": message, "status": code} with 400 / 404 / 409 (toxiproxy-python maps
those to InvalidToxic / NotFound / ProxyExists) and 500 when a port can't be bound.

Toxics (each with `stream` upstream|downstream and `toxicity`, the chance that
it applies to a given connection):
  latency     {latency, jitter} ms: each chunk leaves `latency +/- jitter` ms after
              it was read (delays are relative to arrival, so they don't pile up).
  timeout     {timeout} ms: data is dropped; if timeout > 0 the connection is closed
              that long after the toxic reached it, else it is held open forever.
              As in Toxiproxy, removing the toxic closes the connections it held.
  reset_peer  {timeout} ms: the first data to reach it arms a timer; when it fires
              both sides get a TCP RST (SO_LINGER 0, then close).
  bandwidth   {rate} KB/s (1 KB = 1000 bytes, as Toxiproxy counts), in 100 ms slices.
Toxics act on new and existing connections. Disabling a proxy closes its listener
(new connections are refused) and every connection through it; enabling it
listens again on the same port.

Deliberate differences from real Toxiproxy, all on the side of safety:
  * every listener (the API's and each proxy's) is on 127.0.0.1 only; another
    listen host is a 400, and an omitted `listen` means 127.0.0.1:0;
  * a half-close (FIN) is passed on as a half-close instead of closing both sides;
  * toxicity is rolled once per connection per toxic (and again when the toxic is
    updated); Toxiproxy also re-rolls when a neighbouring toxic is added/removed;
  * only the four toxic types above exist (others are a 400), and bandwidth rate
    <= 0 means unlimited (Toxiproxy stalls).

Use it from synchronous tests with `toxiproxy_url()` (honours $TOXIPROXY_URL) or
`start_in_thread()`, and point toxiproxy-python at it with `configure_client()`.
By hand: `python -m tests.support.toxiproxy --port 8474`.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import random
import signal
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from aiohttp import web

if TYPE_CHECKING:
    import toxiproxy as toxiproxy_client

log = logging.getLogger(__name__)

# What GET /version reports: the Toxiproxy API level this mimics, plus semver
# build metadata so nobody mistakes it for the real server.
VERSION = "2.12.0+shardgrid"
LOCALHOST = "127.0.0.1"
DEFAULT_API_PORT = 8474
STREAMS = ("upstream", "downstream")
# Attribute names and defaults of each toxic, as Toxiproxy's structs serialise them.
TOXIC_ATTRIBUTES: MappingProxyType[str, MappingProxyType[str, int]] = MappingProxyType({
    "latency": MappingProxyType({"latency": 0, "jitter": 0}),
    "timeout": MappingProxyType({"timeout": 0}),
    "reset_peer": MappingProxyType({"timeout": 0}),
    "bandwidth": MappingProxyType({"rate": 0}),
})
READ_SIZE = 64 * 1024
# Chunks read but not yet written, per direction: bounded so that a throttled
# stream pushes back on its sender instead of buffering without limit.
QUEUE_CHUNKS = 16
# A graceful close flushes buffered data first; a peer that stopped reading
# must not stall a disable or a shutdown longer than this.
CLOSE_GRACE_S = 1.0


class ApiError(Exception):
    """An error the REST API reports as {"error": message, "status": status}."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _proxy_not_found() -> ApiError:
    return ApiError("proxy not found", 404)


def _toxic_not_found() -> ApiError:
    return ApiError("toxic not found", 404)


@dataclass(eq=False)
class Toxic:
    # Server-unique key for per-connection state: a toxic deleted and re-added
    # under the same name is a new toxic.
    uid: int
    name: str
    type: str
    stream: str
    toxicity: float
    attributes: dict[str, int]
    # Bumped on every update: connections re-roll toxicity and restart timers.
    generation: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "attributes": dict(self.attributes),
            "name": self.name,
            "type": self.type,
            "stream": self.stream,
            "toxicity": self.toxicity,
        }


@dataclass(eq=False)
class _Proxy:
    name: str
    listen: str
    upstream: str
    enabled: bool = False
    toxics: dict[str, list[Toxic]] = field(default_factory=lambda: {s: [] for s in STREAMS})
    connections: set[_Connection] = field(default_factory=set)
    listener: asyncio.Server | None = None
    # Set (and replaced) whenever the toxics change, to wake chunks that are
    # sleeping in a latency or bandwidth toxic so they re-read the chain.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def all_toxics(self) -> list[Toxic]:
        # Toxiproxy lists the upstream chain first, then the downstream one.
        return [t for s in STREAMS for t in self.toxics[s]]

    def find_toxic(self, name: str) -> Toxic | None:
        return next((t for t in self.all_toxics() if t.name == name), None)

    def notify_change(self) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": [t.to_json() for t in self.all_toxics()],
        }


@dataclass(eq=False)
class _Chunk:
    arrived: float  # loop.time() when read; latency counts from here
    data: bytes
    # Jittered delay drawn per latency toxic, kept so a re-walk of the chain
    # (after a toxic change) doesn't draw again.
    delays: dict[int, float] = field(default_factory=dict)


def _set_linger_zero(writer: asyncio.StreamWriter) -> None:
    # SO_LINGER {on, 0 s}: close() then discards unsent data and sends RST.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _sleep_until(deadline: float, changed: asyncio.Event) -> bool:
    """Sleep until loop time `deadline`; False if `changed` fired first."""
    delay = deadline - asyncio.get_running_loop().time()
    if delay <= 0:
        return True
    if changed.is_set():
        return False
    try:
        await asyncio.wait_for(changed.wait(), delay)
    except TimeoutError:
        return True
    return False


@dataclass(eq=False)
class _Connection:
    """One client connection and its upstream connection, with two one-way links."""

    proxy: _Proxy
    rng: random.Random
    client_reader: asyncio.StreamReader
    client_writer: asyncio.StreamWriter
    upstream_reader: asyncio.StreamReader | None = None
    upstream_writer: asyncio.StreamWriter | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    rolls: dict[int, tuple[int, bool]] = field(default_factory=dict)  # uid -> (generation, applies)
    timers: dict[int, asyncio.Task[Any]] = field(default_factory=dict)  # timeout toxics' close timers
    reset_task: asyncio.Task[Any] | None = None
    closed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # --- toxic bookkeeping -------------------------------------------------

    def applies(self, toxic: Toxic) -> bool:
        """Whether `toxic` acts on this connection (toxicity, rolled once per generation)."""
        cached = self.rolls.get(toxic.uid)
        if cached is not None and cached[0] == toxic.generation:
            return cached[1]
        # random() is in [0, 1): toxicity 1 always applies, 0 never (as Toxiproxy).
        hit = self.rng.random() < toxic.toxicity
        self.rolls[toxic.uid] = (toxic.generation, hit)
        return hit

    def attach(self, toxic: Toxic) -> None:
        """The toxic was added or updated: (re)start what runs on its own clock."""
        timer = self.timers.pop(toxic.uid, None)
        if timer is not None:
            timer.cancel()
        if self.closed:
            return
        if self.applies(toxic) and toxic.type == "timeout" and toxic.attributes["timeout"] > 0:
            self.timers[toxic.uid] = self.spawn(self._close_after(toxic.attributes["timeout"] / 1000))

    def detach(self, toxic: Toxic) -> bool:
        """The toxic was removed; True if this connection must now be closed."""
        timer = self.timers.pop(toxic.uid, None)
        if timer is not None:
            timer.cancel()
        _, applied = self.rolls.pop(toxic.uid, (0, False))
        # Toxiproxy's timeout toxic closes its link on removal (TimeoutToxic.Cleanup):
        # the data it swallowed is gone, so the stream can't be resumed.
        return applied and toxic.type == "timeout"

    def active(self, stream: str) -> list[Toxic]:
        return [t for t in self.proxy.toxics[stream] if self.applies(t)]

    async def _close_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.aclose()

    def _arm_reset(self, toxic: Toxic) -> None:
        if self.reset_task is None:
            self.reset_task = self.spawn(self._reset_after(toxic.attributes["timeout"] / 1000))

    async def _reset_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.aclose(rst=True)

    # --- data path ---------------------------------------------------------

    async def run(self, upstream: tuple[str, int]) -> None:
        try:
            try:
                reader, writer = await asyncio.open_connection(*upstream)
            except OSError as exc:
                # As Toxiproxy: the client's connection is simply closed.
                log.warning("proxy %s: upstream %s:%s unreachable: %s",
                            self.proxy.name, *upstream, exc)
                return
            if self.closed:  # disabled while we were connecting
                writer.transport.abort()
                return
            self.upstream_reader, self.upstream_writer = reader, writer
            # Toxics added while we were connecting were attached already.
            for toxic in self.proxy.all_toxics():
                if toxic.uid not in self.rolls:
                    self.attach(toxic)
            # asyncio.wait, not gather: a link that fails calls aclose(), which
            # cancels and awaits this task; had this task gathered the links,
            # that cancel would recurse through the two gathers forever.
            links = [
                self.spawn(self._link("upstream", self.client_reader, writer)),
                self.spawn(self._link("downstream", reader, self.client_writer)),
            ]
            await asyncio.wait(links)
            for link in links:
                if not link.cancelled():
                    link.result()  # a link's bug surfaces here, not as "never retrieved"
        finally:
            await self.aclose()

    async def _link(self, stream: str, source: asyncio.StreamReader,
                    sink: asyncio.StreamWriter) -> None:
        # The pump keeps reading while this task sleeps in toxics, so latency
        # is measured from arrival and timeout toxics can drop data as it comes.
        queue: asyncio.Queue[_Chunk | None] = asyncio.Queue(QUEUE_CHUNKS)
        self.spawn(self._pump(source, queue))
        try:
            while (chunk := await queue.get()) is not None:
                await self._deliver(stream, chunk, sink)
            await self._deliver_eof(stream, sink)
        except OSError as exc:
            log.debug("proxy %s: %s write failed: %s", self.proxy.name, stream, exc)
            await self.aclose()

    async def _pump(self, source: asyncio.StreamReader, queue: asyncio.Queue[_Chunk | None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await source.read(READ_SIZE):
                await queue.put(_Chunk(loop.time(), data))
        except OSError as exc:
            # A peer that reset its side ends the whole proxied connection.
            log.debug("proxy %s: read failed: %s", self.proxy.name, exc)
            await self.aclose()
            return
        await queue.put(None)

    async def _deliver(self, stream: str, chunk: _Chunk, sink: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:  # walk the chain again whenever it changes mid-chunk
            changed = self.proxy.changed
            due = chunk.arrived
            rate: int | None = None
            interrupted = False
            for toxic in self.active(stream):
                if toxic.type == "latency":
                    if toxic.uid not in chunk.delays:
                        jitter = toxic.attributes["jitter"]
                        extra = self.rng.randrange(-jitter, jitter) if jitter > 0 else 0
                        chunk.delays[toxic.uid] = (toxic.attributes["latency"] + extra) / 1000
                    due += chunk.delays[toxic.uid]
                    if not await _sleep_until(due, changed):
                        interrupted = True
                        break
                elif toxic.type == "bandwidth":
                    if toxic.attributes["rate"] > 0:
                        rate = toxic.attributes["rate"] if rate is None else min(rate, toxic.attributes["rate"])
                elif toxic.type == "timeout":
                    return  # dropped; the toxic's timer (if any) closes the connection
                elif toxic.type == "reset_peer":
                    self._arm_reset(toxic)
                    return
            if not interrupted:
                break
        data = chunk.data
        if rate is not None:
            # Like Toxiproxy: data larger than 100 ms' worth goes out in 100 ms slices.
            piece = rate * 100
            while len(data) > piece:
                if not await _sleep_until(loop.time() + 0.1, changed):
                    break  # toxics changed: flush the rest now, as Toxiproxy does
                sink.write(data[:piece])
                await sink.drain()
                data = data[piece:]
            else:
                await _sleep_until(loop.time() + len(data) / (rate * 1000), changed)
        sink.write(data)
        await sink.drain()

    async def _deliver_eof(self, stream: str, sink: asyncio.StreamWriter) -> None:
        for toxic in self.active(stream):
            if toxic.type == "timeout":
                await self.aclose()  # Toxiproxy closes a timed-out link on EOF
                return
            if toxic.type == "reset_peer":
                self._arm_reset(toxic)
                break
        if self.reset_task is not None:
            # Keep this link alive so a graceful close can't pre-empt the reset.
            await self.done.wait()
            return
        if sink.can_write_eof():
            sink.write_eof()

    # --- shutdown ----------------------------------------------------------

    def _writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client_writer, self.upstream_writer) if w is not None]

    async def aclose(self, rst: bool = False) -> None:
        """Close both sides (with RST if `rst`) and stop every task; idempotent."""
        if self.closed:
            # A task of ours is being cancelled by the closer: waiting for it
            # to finish would deadlock. Anyone else waits for the close.
            if asyncio.current_task() not in self.tasks:
                await self.done.wait()
            return
        self.closed = True
        self.proxy.connections.discard(self)
        try:
            me = asyncio.current_task()
            others = [t for t in self.tasks if t is not me]
            for task in others:
                task.cancel()
            writers = self._writers()
            for writer in writers:
                if rst:
                    _set_linger_zero(writer)
                    writer.transport.abort()
                else:
                    writer.close()
            for result in await asyncio.gather(*others, return_exceptions=True):
                if isinstance(result, Exception) and not isinstance(result, OSError):
                    log.error("proxy %s: connection task failed", self.proxy.name, exc_info=result)
            if not rst:
                try:
                    await asyncio.wait_for(
                        asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True),
                        CLOSE_GRACE_S)
                except TimeoutError:
                    for writer in writers:
                        writer.transport.abort()
        finally:
            self.done.set()


def _split_hostport(value: Any, what: str) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise ApiError(f"{what}: expected host:port, got {value!r}", 400)
    host, _, port_text = value.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ApiError(f"{what}: bad port in {value!r}", 400) from None
    if not 0 <= port <= 65535:
        raise ApiError(f"{what}: bad port in {value!r}", 400)
    return host, port


def _parse_listen(value: Any) -> str:
    host, port = _split_hostport(value, "listen")
    # Chaos tests must never open ports beyond this machine's loopback.
    if host != LOCALHOST:
        raise ApiError(f"listen: only {LOCALHOST} is allowed, got {value!r}", 400)
    return f"{LOCALHOST}:{port}"


def _parse_upstream(value: Any) -> str:
    host, port = _split_hostport(value, "upstream")
    if not host or port == 0:
        raise ApiError(f"upstream: expected host:port, got {value!r}", 400)
    return value


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = data.get(key)
    if value is None:  # absent or null: Go's decoder leaves the default too
        return default
    # bool is an int subclass; JSON true is no number here (nor in Go).
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ApiError(f"bad request body: field {key!r} has the wrong type", 400)
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _parse_toxicity(data: dict[str, Any], default: float) -> float:
    value = float(_field(data, "toxicity", (int, float), default))
    if not 0.0 <= value <= 1.0:
        raise ApiError(f"toxicity must be within 0..1, got {value}", 400)
    return value


def _parse_attributes(toxic_type: str, raw: Any, base: dict[str, int]) -> dict[str, int]:
    if raw is None:
        return dict(base)
    if not isinstance(raw, dict):
        raise ApiError("bad request body: attributes must be an object", 400)
    attrs = dict(base)
    for key in TOXIC_ATTRIBUTES[toxic_type]:
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        # Toxiproxy's attributes are int64 milliseconds / KB/s; accept 5.0 but not 5.5.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ApiError(f"bad request body: attribute {key!r} must be an integer", 400)
        attrs[key] = int(value)
    return attrs  # unknown keys are ignored, as Go's decoder does


async def _json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(f"bad request body: {exc}", 400) from None
    if not isinstance(data, dict):
        raise ApiError("bad request body: expected a JSON object", 400)
    return data


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


class ToxiproxyServer:
    """The REST API plus every proxy it manages; all state lives here.

    Run it on an existing event loop (`await start()` / `await stop()`), or in a
    thread of its own with `start_in_thread()`.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.proxies: dict[str, _Proxy] = {}
        # One generator for toxicity and jitter, so a seed makes a run repeatable.
        self.rng = random.Random(seed)
        self._uids = itertools.count(1)
        # API calls that change state await (binding, closing connections);
        # serialising them keeps each one atomic as seen by the others.
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self._stopping = False
        self.url: str | None = None

    # --- lifecycle ---------------------------------------------------------

    async def start(self, host: str = LOCALHOST, port: int = 0) -> str:
        """Serve the API on host:port (port 0 picks one); returns its base URL."""
        if host != LOCALHOST:
            raise ValueError(f"the API only listens on {LOCALHOST}, not {host!r}")
        app = web.Application(middlewares=[self._errors])
        app.add_routes([
            web.get("/version", self._version),
            web.post("/reset", self._reset),
            web.get("/proxies", self._proxy_index),
            web.post("/proxies", self._proxy_create),
            web.get("/proxies/{proxy}", self._proxy_show),
            web.post("/proxies/{proxy}", self._proxy_update),
            web.patch("/proxies/{proxy}", self._proxy_update),
            web.delete("/proxies/{proxy}", self._proxy_delete),
            web.get("/proxies/{proxy}/toxics", self._toxic_index),
            web.post("/proxies/{proxy}/toxics", self._toxic_create),
            web.get("/proxies/{proxy}/toxics/{toxic}", self._toxic_show),
            web.post("/proxies/{proxy}/toxics/{toxic}", self._toxic_update),
            web.patch("/proxies/{proxy}/toxics/{toxic}", self._toxic_update),
            web.delete("/proxies/{proxy}/toxics/{toxic}", self._toxic_delete),
        ])
        # API handlers are quick; don't let a stuck client hold shutdown for 60 s.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        bound_port = runner.addresses[0][1]
        self.url = f"http://{host}:{bound_port}"
        log.info("toxiproxy API on %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Close the API, every proxy listener and every proxied connection."""
        self._stopping = True
        if self._runner is not None:
            # API first, so no request re-enables a proxy behind our back.
            await self._runner.cleanup()
            self._runner = None
        async with self._lock:
            await asyncio.gather(*(self._stop_proxy(p) for p in self.proxies.values()))
            self.proxies.clear()

    # --- proxies -----------------------------------------------------------

    async def _start_proxy(self, proxy: _Proxy) -> None:
        if proxy.enabled:
            return
        host, port = _split_hostport(proxy.listen, "listen")
        try:
            proxy.listener = await asyncio.start_server(
                lambda r, w: self._accept(proxy, r, w), host, port)
        except OSError as exc:
            raise ApiError(f"listen {proxy.listen}: {exc}", 500) from None
        # Remember the port actually bound, so re-enabling reuses it (as Toxiproxy).
        proxy.listen = f"{LOCALHOST}:{proxy.listener.sockets[0].getsockname()[1]}"
        proxy.enabled = True
        log.info("proxy %s: %s -> %s", proxy.name, proxy.listen, proxy.upstream)

    async def _stop_proxy(self, proxy: _Proxy) -> None:
        if not proxy.enabled:
            return
        proxy.enabled = False
        listener, proxy.listener = proxy.listener, None
        if listener is not None:
            listener.close()
        await asyncio.gather(*(c.aclose() for c in list(proxy.connections)))
        if listener is not None:
            # After the connections: from 3.12 on this waits for them to close.
            await listener.wait_closed()
        log.info("proxy %s: down", proxy.name)

    def _accept(self, proxy: _Proxy, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> None:
        # A plain callback (not a coroutine), so asyncio makes no task of its
        # own: the connection's tasks are ours to cancel and await.
        if not proxy.enabled or self._stopping:
            writer.transport.abort()
            return
        conn = _Connection(proxy=proxy, rng=self.rng, client_reader=reader, client_writer=writer)
        proxy.connections.add(conn)
        upstream = _split_hostport(proxy.upstream, "upstream")
        conn.spawn(conn.run(upstream))

    def _get_proxy(self, request: web.Request) -> _Proxy:
        proxy = self.proxies.get(request.match_info["proxy"])
        if proxy is None:
            raise _proxy_not_found()
        return proxy

    async def _proxy_index(self, request: web.Request) -> web.Response:
        return _json({name: p.to_json() for name, p in self.proxies.items()})

    async def _proxy_create(self, request: web.Request) -> web.Response:
        data = await _json_body(request)
        name = _field(data, "name", str, "")
        upstream = _field(data, "upstream", str, "")
        if not name:
            raise ApiError("missing required field: name", 400)
        if not upstream:
            raise ApiError("missing required field: upstream", 400)
        async with self._lock:
            if name in self.proxies:
                raise ApiError("proxy already exists", 409)
            proxy = _Proxy(
                name=name,
                listen=_parse_listen(_field(data, "listen", str, "") or f"{LOCALHOST}:0"),
                upstream=_parse_upstream(upstream),
            )
            if _field(data, "enabled", bool, True):
                await self._start_proxy(proxy)
            self.proxies[name] = proxy
            return _json(proxy.to_json(), status=201)

    async def _proxy_show(self, request: web.Request) -> web.Response:
        return _json(self._get_proxy(request).to_json())

    async def _proxy_update(self, request: web.Request) -> web.Response:
        async with self._lock:
            proxy = self._get_proxy(request)
            data = await _json_body(request)
            listen = _parse_listen(_field(data, "listen", str, proxy.listen))
            upstream = _parse_upstream(_field(data, "upstream", str, proxy.upstream))
            enabled = _field(data, "enabled", bool, proxy.enabled)
            if listen != proxy.listen or upstream != proxy.upstream:
                # As Toxiproxy: a new address means stop, then start if wanted.
                await self._stop_proxy(proxy)
                proxy.listen, proxy.upstream = listen, upstream
            if enabled:
                await self._start_proxy(proxy)
            else:
                await self._stop_proxy(proxy)
            return _json(proxy.to_json())

    async def _proxy_delete(self, request: web.Request) -> web.Response:
        async with self._lock:
            proxy = self._get_proxy(request)
            await self._stop_proxy(proxy)
            del self.proxies[proxy.name]
            return web.Response(status=204)

    async def _reset(self, request: web.Request) -> web.Response:
        async with self._lock:
            for proxy in self.proxies.values():
                await self._start_proxy(proxy)
                for toxic in proxy.all_toxics():
                    await self._remove_toxic(proxy, toxic)
            return web.Response(status=204)

    # --- toxics ------------------------------------------------------------

    def _get_toxic(self, proxy: _Proxy, request: web.Request) -> Toxic:
        toxic = proxy.find_toxic(request.match_info["toxic"])
        if toxic is None:
            raise _toxic_not_found()
        return toxic

    async def _toxic_index(self, request: web.Request) -> web.Response:
        return _json([t.to_json() for t in self._get_proxy(request).all_toxics()])

    async def _toxic_show(self, request: web.Request) -> web.Response:
        proxy = self._get_proxy(request)
        return _json(self._get_toxic(proxy, request).to_json())

    async def _toxic_create(self, request: web.Request) -> web.Response:
        async with self._lock:
            proxy = self._get_proxy(request)
            data = await _json_body(request)
            stream = _field(data, "stream", str, "downstream").lower()
            if stream not in STREAMS:
                raise ApiError("stream was invalid, can be either upstream or downstream", 400)
            toxic_type = _field(data, "type", str, "")
            if toxic_type not in TOXIC_ATTRIBUTES:
                raise ApiError(f"invalid toxic type: {toxic_type!r} (this proxy implements "
                               f"{', '.join(TOXIC_ATTRIBUTES)})", 400)
            name = _field(data, "name", str, "") or f"{toxic_type}_{stream}"
            if proxy.find_toxic(name) is not None:
                raise ApiError("toxic already exists", 409)
            toxic = Toxic(
                uid=next(self._uids),
                name=name,
                type=toxic_type,
                stream=stream,
                toxicity=_parse_toxicity(data, 1.0),
                attributes=_parse_attributes(toxic_type, data.get("attributes"),
                                             dict(TOXIC_ATTRIBUTES[toxic_type])),
            )
            proxy.toxics[stream].append(toxic)
            for conn in list(proxy.connections):
                conn.attach(toxic)
            proxy.notify_change()
            return _json(toxic.to_json())

    async def _toxic_update(self, request: web.Request) -> web.Response:
        async with self._lock:
            proxy = self._get_proxy(request)
            toxic = self._get_toxic(proxy, request)
            data = await _json_body(request)
            # Only toxicity and attributes change, as in Toxiproxy.
            toxicity = _parse_toxicity(data, toxic.toxicity)
            attributes = _parse_attributes(toxic.type, data.get("attributes"), toxic.attributes)
            toxic.toxicity, toxic.attributes = toxicity, attributes
            toxic.generation += 1
            for conn in list(proxy.connections):
                conn.attach(toxic)
            proxy.notify_change()
            return _json(toxic.to_json())

    async def _toxic_delete(self, request: web.Request) -> web.Response:
        async with self._lock:
            proxy = self._get_proxy(request)
            await self._remove_toxic(proxy, self._get_toxic(proxy, request))
            return web.Response(status=204)

    async def _remove_toxic(self, proxy: _Proxy, toxic: Toxic) -> None:
        proxy.toxics[toxic.stream].remove(toxic)
        doomed = [c for c in list(proxy.connections) if c.detach(toxic)]
        proxy.notify_change()
        await asyncio.gather(*(c.aclose() for c in doomed))

    # --- misc --------------------------------------------------------------

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": VERSION})

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            return _json({"error": err.message, "status": err.status}, status=err.status)


def start_in_thread(host: str = LOCALHOST, port: int = 0, *,
                    seed: int | None = None) -> tuple[str, Callable[[], None]]:
    """Run a ToxiproxyServer on its own event loop in a daemon thread.

    Returns (base URL, stop); stop() closes everything and joins the thread,
    and may be called more than once.
    """
    loop = asyncio.new_event_loop()
    server = ToxiproxyServer(seed=seed)
    started: concurrent.futures.Future[str] = concurrent.futures.Future()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            started.set_result(loop.run_until_complete(server.start(host, port)))
        except Exception as exc:  # reported to the caller below
            started.set_exception(exc)
            loop.close()
            return
        try:
            loop.run_forever()
        finally:
            # A connection closing itself (a timeout or reset_peer toxic) has
            # left its proxy's set, so stop() did not wait for it: finish it
            # here, or its coroutine is closed mid-await when collected.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    # Daemon: a test that never calls stop() must not keep the interpreter alive.
    thread = threading.Thread(target=run, name="toxiproxy", daemon=True)
    thread.start()
    url = started.result(timeout=10)
    stopped = threading.Event()

    def stop() -> None:
        if stopped.is_set() or not thread.is_alive():
            return
        stopped.set()
        try:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)

    return url, stop


@contextlib.contextmanager
def toxiproxy_url() -> Iterator[str]:
    """Yield the base URL of a Toxiproxy API: $TOXIPROXY_URL if set, else a
    built-in server started for the duration of the `with` block."""
    external = os.environ.get("TOXIPROXY_URL")
    if external:
        yield external.rstrip("/")
        return
    url, stop = start_in_thread()
    try:
        yield url
    finally:
        stop()


def configure_client(url: str) -> toxiproxy_client.Toxiproxy:
    """Point toxiproxy-python at `url` and return a client.

    toxiproxy-python keeps host and port as class attributes of its APIConsumer,
    so this is process-wide: every Toxiproxy()/Proxy object talks to the server
    named last. Call it at the start of each test.
    """
    import toxiproxy as toxiproxy_client  # a test extra; the CLI runs without it

    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"need http://host:port, got {url!r}")
    client = toxiproxy_client.Toxiproxy()
    client.update_api_consumer(parts.hostname, parts.port)
    return client


async def _serve(port: int, seed: int | None) -> None:
    server = ToxiproxyServer(seed=seed)
    url = await server.start(LOCALHOST, port)
    print(f"toxiproxy API listening on {url}", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.toxiproxy",
        description=f"Toxiproxy-API-compatible TCP fault proxy (listens on {LOCALHOST} only).")
    parser.add_argument("--port", type=int, default=DEFAULT_API_PORT,
                        help=f"API port (default {DEFAULT_API_PORT}, Toxiproxy's; 0 picks one)")
    parser.add_argument("--seed", type=int, default=None, help="seed for toxicity and jitter")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args.port, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
