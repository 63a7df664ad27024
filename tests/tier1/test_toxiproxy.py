"""The built-in Toxiproxy server (tests/support/toxiproxy.py), driven through
toxiproxy-python's client API exactly as chaos tests will drive it.

Tests that use the `tp` fixture go through `toxiproxy_url()`, so with
TOXIPROXY_URL set they check a real Toxiproxy instead (a compatibility check);
tests that need the built-in server itself start it directly.
"""
from __future__ import annotations

import asyncio
import socket
import socketserver
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import requests
from aiohttp import web
from toxiproxy import Proxy, Toxiproxy
from toxiproxy.api import APIConsumer
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from tests.support.toxiproxy import (
    ToxiproxyServer,
    configure_client,
    start_in_thread,
    toxiproxy_url,
)

# Timer slack: asyncio may wake a hair before a deadline; the upper bounds are
# loose because CI machines stall.
EARLY = 0.01
LATE = 1.0


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass  # the proxy reset or dropped us: that's what the faults are for


@pytest.fixture(scope="module")
def echo() -> Iterator[str]:
    """host:port of a TCP echo server."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _EchoHandler)
    server.daemon_threads = True
    # A short poll interval: shutdown() waits up to one interval.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class LoopThread:
    """An event loop in a thread, for async servers and clients in sync tests."""

    loop: asyncio.AbstractEventLoop

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 5.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def bg_loop() -> Iterator[LoopThread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield LoopThread(loop)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture(scope="module")
def http_upstream(bg_loop: LoopThread) -> Iterator[str]:
    """host:port of a tiny aiohttp app, standing in for a shardgrid worker."""
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def echo_body(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.add_routes([web.get("/health", health), web.post("/echo", echo_body)])
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, runner.addresses[0][1]

    runner, port = bg_loop.run(start())
    try:
        yield f"127.0.0.1:{port}"
    finally:
        bg_loop.run(runner.cleanup())


@pytest.fixture
def tp() -> Iterator[Toxiproxy]:
    """A toxiproxy-python client on a fresh built-in server (or $TOXIPROXY_URL)."""
    with toxiproxy_url() as url:
        client = configure_client(url)
        try:
            yield client
        finally:
            client.destroy_all()  # matters only for a shared, real server


def _addr(proxy: Proxy) -> tuple[str, int]:
    host, port = proxy.listen.rsplit(":", 1)
    return host, int(port)


def connect(proxy: Proxy, timeout: float = 3.0) -> socket.socket:
    return socket.create_connection(_addr(proxy), timeout=timeout)


def round_trip(sock: socket.socket, payload: bytes = b"ping") -> float:
    """Send `payload` through the echo and wait for all of it; returns seconds."""
    start = time.monotonic()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(got)} of {len(payload)} bytes"
        got += chunk
    assert got == payload
    return time.monotonic() - start


def outcome(sock: socket.socket, timeout: float = 3.0) -> str:
    """What the next read sees: 'eof', 'reset', 'silence' or 'data'."""
    sock.settimeout(timeout)
    try:
        return "eof" if sock.recv(65536) == b"" else "data"
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "silence"


def test_create_and_pass_traffic(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="echo")
    assert proxy.enabled is True and proxy.upstream == echo
    host, port = _addr(proxy)
    assert host == "127.0.0.1" and port != 0  # the bound port, not the requested :0
    assert set(tp.proxies()) == {"echo"}
    assert tp.get_proxy("echo").listen == proxy.listen
    with connect(proxy) as sock:
        assert round_trip(sock, b"hello") < LATE
        round_trip(sock, bytes(range(256)) * 4096)  # 1 MiB, byte-exact, back-pressured
    with pytest.raises(ProxyExists):
        tp.create(upstream=echo, name="echo")


def test_api_errors_map_to_client_exceptions(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="errs")
    with pytest.raises(ProxyExists):  # the server's 409, past the client's own pre-check
        APIConsumer.post("/proxies", json={"name": "errs", "upstream": echo})
    with pytest.raises(NotFound):
        APIConsumer.get("/proxies/nope")
    with pytest.raises(NotFound):
        APIConsumer.delete("/proxies/errs/toxics/nope")
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="no_such_toxic")
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="latency", stream="sideways")
    proxy.add_toxic(type="latency", attributes={"latency": 1})
    with pytest.raises(ProxyExists):  # a duplicate toxic name is a 409 too
        proxy.add_toxic(type="latency", attributes={"latency": 2})
    with pytest.raises(InvalidToxic):
        APIConsumer.post("/proxies", json={"name": "no-upstream"})


def test_rest_shapes_and_toxic_update(tp: Toxiproxy, echo: str) -> None:
    created = APIConsumer.post("/proxies", json={"name": "raw", "upstream": echo,
                                                 "listen": "127.0.0.1:0"})
    assert created.status_code == 201
    body = created.json()
    assert {k: body[k] for k in ("name", "upstream", "enabled", "toxics")} == \
        {"name": "raw", "upstream": echo, "enabled": True, "toxics": []}
    added = APIConsumer.post("/proxies/raw/toxics", json={
        "type": "latency", "stream": "upstream", "attributes": {"latency": 10, "jitter": 5}})
    assert added.status_code == 200
    toxic = added.json()
    assert toxic["name"] == "latency_upstream" and toxic["toxicity"] == 1
    assert toxic["attributes"] == {"latency": 10, "jitter": 5}
    # toxiproxy-python can't update a toxic; the API merges attributes.
    updated = APIConsumer.post("/proxies/raw/toxics/latency_upstream",
                               json={"attributes": {"latency": 20}, "toxicity": 0.5}).json()
    assert updated["attributes"] == {"latency": 20, "jitter": 5} and updated["toxicity"] == 0.5
    shown = APIConsumer.get("/proxies/raw/toxics/latency_upstream").json()
    assert shown == updated
    assert APIConsumer.get("/proxies/raw").json()["toxics"] == [updated]
    assert "version" in APIConsumer.get("/version").json()
    assert tp.running() and tp.version()
    assert APIConsumer.delete("/proxies/raw/toxics/latency_upstream").status_code == 204
    assert APIConsumer.post("/reset").status_code == 204


def test_latency_on_new_and_existing_connections(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="lat")
    with connect(proxy) as old:
        assert round_trip(old) < 0.1
        proxy.add_toxic(type="latency", attributes={"latency": 250})
        assert set(proxy.toxics()) == {"latency_downstream"}
        assert 0.25 - EARLY <= round_trip(old) < 0.25 + LATE
        with connect(proxy) as new:
            assert 0.25 - EARLY <= round_trip(new) < 0.25 + LATE
        # Upstream latency adds to downstream latency.
        proxy.add_toxic(type="latency", stream="upstream", attributes={"latency": 100, "jitter": 20})
        assert 0.33 - EARLY <= round_trip(old) < 0.37 + LATE
        assert proxy.destroy_toxic("latency_downstream") is True
        assert proxy.destroy_toxic("latency_upstream") is True
        assert proxy.toxics() == {}
        assert round_trip(old) < 0.1


def test_toxicity_zero_never_applies(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="tox0")
    proxy.add_toxic(type="latency", toxicity=0.0, attributes={"latency": 2000})
    for _ in range(3):
        with connect(proxy) as sock:
            assert round_trip(sock) < 0.5


def test_timeout_stops_data(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="to")
    with connect(proxy) as held:
        round_trip(held)
        proxy.add_toxic(type="timeout", attributes={"timeout": 0})
        held.sendall(b"lost")
        assert outcome(held, timeout=0.3) == "silence"  # held open, nothing comes back
        # As in Toxiproxy, removing the toxic closes what it held: the data is gone.
        proxy.destroy_toxic("timeout_downstream")
        assert outcome(held) in ("eof", "reset")
    proxy.add_toxic(type="timeout", attributes={"timeout": 300})
    with connect(proxy) as sock:
        sock.sendall(b"lost")
        start = time.monotonic()
        assert outcome(sock) in ("eof", "reset")
        assert 0.3 - 0.05 <= time.monotonic() - start < 0.3 + LATE
    proxy.destroy_toxic("timeout_downstream")
    with connect(proxy) as sock:
        round_trip(sock)


def test_reset_peer(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="rst")
    proxy.add_toxic(type="reset_peer", attributes={"timeout": 0})
    with connect(proxy) as sock:
        sock.sendall(b"ping")
        with pytest.raises(ConnectionResetError):
            sock.settimeout(3)
            sock.recv(100)
    proxy.destroy_toxic("reset_peer_downstream")
    proxy.add_toxic(type="reset_peer", stream="upstream", attributes={"timeout": 200})
    with connect(proxy) as sock:
        start = time.monotonic()
        sock.sendall(b"ping")
        assert outcome(sock) == "reset"
        assert 0.2 - EARLY <= time.monotonic() - start < 0.2 + LATE


def test_bandwidth_throttles(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="bw")
    payload = b"x" * 50_000
    with connect(proxy) as sock:
        assert round_trip(sock, payload) < 0.2
        proxy.add_toxic(type="bandwidth", attributes={"rate": 100})  # KB/s: 50 kB takes 0.5 s
        assert 0.45 <= round_trip(sock, payload) < 0.5 + LATE


def test_disable_and_enable(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="updown")
    addr = _addr(proxy)
    with connect(proxy) as sock:
        round_trip(sock)
        with proxy.down():
            assert tp.get_proxy("updown").enabled is False
            assert outcome(sock) in ("eof", "reset")  # existing connections are closed
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(addr, timeout=2).close()
    fetched = tp.get_proxy("updown")
    assert fetched.enabled is True and _addr(fetched) == addr  # same port again
    with connect(proxy) as sock:
        round_trip(sock)


def test_reset_enables_and_clears_toxics(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="clear")
    proxy.add_toxic(type="latency", attributes={"latency": 2000})
    proxy.add_toxic(type="timeout", stream="upstream", attributes={"timeout": 0})
    proxy.disable()
    assert tp.reset() is True
    fetched = tp.get_proxy("clear")
    assert fetched.enabled is True and fetched.toxics() == {}
    with connect(proxy) as sock:
        assert round_trip(sock) < 0.5


def test_delete_frees_port(tp: Toxiproxy, echo: str) -> None:
    proxy = tp.create(upstream=echo, name="gone")
    addr = _addr(proxy)
    with connect(proxy) as sock:
        round_trip(sock)
        assert tp.destroy(proxy) is True
        assert outcome(sock) in ("eof", "reset")
    assert "gone" not in tp.proxies()
    with pytest.raises(NotFound):
        proxy.toxics()
    with socket.socket() as again:
        # SO_REUSEADDR, as every server sets: the proxied connection we closed
        # leaves a TIME_WAIT entry on the port, which is no listener.
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(addr)
        again.listen()
    again_proxy = tp.create(upstream=echo, name="gone", listen=proxy.listen)
    assert _addr(again_proxy) == addr
    with connect(again_proxy) as sock:
        round_trip(sock)


def test_http_through_proxy(tp: Toxiproxy, bg_loop: LoopThread, http_upstream: str) -> None:
    proxy = tp.create(upstream=http_upstream, name="worker")
    base = f"http://{proxy.listen}"

    async def get_health() -> Any:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/health") as resp:
                return resp.status, await resp.json()

    assert bg_loop.run(get_health()) == (200, {"ok": True})
    blob = bytes(range(256)) * 1000
    assert requests.post(f"{base}/echo", data=blob, timeout=5).content == blob

    proxy.add_toxic(type="latency", attributes={"latency": 200})
    start = time.monotonic()
    assert requests.get(f"{base}/health", timeout=5).json() == {"ok": True}
    assert 0.2 - EARLY <= time.monotonic() - start < 0.2 + LATE
    proxy.destroy_toxic("latency_downstream")

    proxy.add_toxic(type="reset_peer", attributes={"timeout": 0})
    with pytest.raises(aiohttp.ClientConnectionError):
        bg_loop.run(get_health())
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{base}/health", timeout=5)
    proxy.destroy_toxic("reset_peer_downstream")
    with proxy.down(), pytest.raises(requests.ConnectionError):
        requests.get(f"{base}/health", timeout=5)
    assert requests.get(f"{base}/health", timeout=5).status_code == 200


# --- the built-in server itself -------------------------------------------

def test_listens_on_loopback_only(echo: str) -> None:
    url, stop = start_in_thread()
    try:
        client = configure_client(url)
        with pytest.raises(InvalidToxic):
            client.create(upstream=echo, name="wide", listen="0.0.0.0:0")
        with pytest.raises(InvalidToxic):
            client.create(upstream=echo, name="wide", listen=":0")
        assert client.proxies() == {}
    finally:
        stop()
    with pytest.raises(ValueError):
        asyncio.run(ToxiproxyServer().start(host="0.0.0.0"))


def test_stop_closes_listeners_and_connections(echo: str) -> None:
    url, stop = start_in_thread()
    client = configure_client(url)
    proxy = client.create(upstream=echo, name="shut")
    proxy.add_toxic(type="timeout", attributes={"timeout": 0})  # a held connection too
    held = connect(proxy)
    plain = connect(proxy)
    try:
        stop()
        stop()  # idempotent
        assert outcome(held) in ("eof", "reset")
        assert outcome(plain) in ("eof", "reset")
        for addr in (_addr(proxy), ("127.0.0.1", APIConsumer.port)):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(addr, timeout=2).close()
    finally:
        held.close()
        plain.close()


def test_toxiproxy_url_prefers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOXIPROXY_URL", "http://127.0.0.1:1/")
    with toxiproxy_url() as url:
        assert url == "http://127.0.0.1:1"
    monkeypatch.delenv("TOXIPROXY_URL")
    with toxiproxy_url() as url:
        assert requests.get(f"{url}/version", timeout=5).json()["version"]
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/version", timeout=5)


async def test_async_server_on_running_loop(echo: str) -> None:
    server = ToxiproxyServer(seed=7)
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/proxies",
                                    json={"name": "a", "upstream": echo}) as resp:
                assert resp.status == 201
                listen = (await resp.json())["listen"]
        host, port = listen.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"async")
        assert await asyncio.wait_for(reader.readexactly(5), 3) == b"async"
    finally:
        await server.stop()
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()



async def test_a_link_that_closes_its_connection_ends_every_task_of_it(echo: str) -> None:
    # With a timeout toxic, a client's EOF makes the upstream link close the
    # whole connection from inside one of the connection's own tasks. (When
    # the connection's run task gathered its links, that close recursed
    # through two gathers: an error in the loop, and under load a deadlock.)
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    server = ToxiproxyServer(seed=7)
    url = await server.start()

    def connection_tasks() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks()
                if getattr(t.get_coro(), "__qualname__", "").startswith("_Connection.")]

    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/proxies", json={"name": "e", "upstream": echo}) as resp:
                assert resp.status == 201
                host, port = (await resp.json())["listen"].rsplit(":", 1)
            async with session.post(f"{url}/proxies/e/toxics", json={
                    "type": "timeout", "stream": "upstream", "attributes": {"timeout": 0}}) as resp:
                assert resp.status == 200, await resp.text()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 3) == b""
        deadline = time.monotonic() + 5
        while connection_tasks() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not connection_tasks(), f"connection tasks still running: {connection_tasks()}"
        assert not server.proxies["e"].connections
        assert not loop_errors, [ctx.get("exception") or ctx["message"] for ctx in loop_errors]
        writer.close()
    finally:
        await server.stop()
