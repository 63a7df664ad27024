"""The shared aiohttp server limits (shardgrid/common/serving.py), on a real socket."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import pytest
from aiohttp import web

from shardgrid.common.serving import MAX_FIELD_BYTES, app_runner

KEEPALIVE_S = 0.3


@pytest.fixture
async def port() -> AsyncIterator[tuple[int, list[str]]]:
    seen: list[str] = []

    async def hello(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = app_runner(app, shutdown_timeout=0.1, keepalive_s=KEEPALIVE_S)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    try:
        yield sock.getsockname()[1], seen
    finally:
        await runner.cleanup()


async def _closed_within(reader: asyncio.StreamReader, limit_s: float) -> float:
    """Seconds until the server closes the connection (reads and discards what it sends)."""
    started = time.monotonic()
    while await asyncio.wait_for(reader.read(65536), limit_s):
        pass
    return time.monotonic() - started


async def test_a_connection_that_trickles_its_headers_is_closed(port: tuple[int, list[str]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port[0])
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:
            while True:
                await asyncio.sleep(KEEPALIVE_S / 6)
                writer.write(b"X-Slow: 1\r\n")

        task = asyncio.create_task(trickle())
        try:
            took = await _closed_within(reader, 10 * KEEPALIVE_S)
        finally:
            task.cancel()
        assert took < 5 * KEEPALIVE_S and port[1] == []
    finally:
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed(port: tuple[int, list[str]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port[0])
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in await asyncio.wait_for(reader.readuntil(b"hi"), 5)
        took = await _closed_within(reader, 10 * KEEPALIVE_S)
        assert took < 5 * KEEPALIVE_S and port[1] == ["/"]
    finally:
        writer.close()


async def test_a_header_over_the_limit_is_refused_before_any_handler(port: tuple[int, list[str]]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port[0])
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_FIELD_BYTES + 1) + b"\r\n\r\n")
        head = await asyncio.wait_for(reader.readline(), 5)
        assert head.split()[1].startswith(b"4"), head
        assert port[1] == []
    finally:
        writer.close()


async def test_connections_beyond_the_cap_are_closed_and_the_others_served() -> None:
    import structlog

    from shardgrid.common.serving import cap_connections
    from tests.support.waiting import until

    async def hi(_request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hi)
    runner = app_runner(app, shutdown_timeout=0.1)
    await runner.setup()
    cap_connections(runner.server, structlog.get_logger(), limit=2)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    opened = []
    try:
        for _ in range(2):  # held open, idle
            opened.append(await asyncio.open_connection("127.0.0.1", port))
        await until(lambda: len(runner.server.connections) == 2, "the server to hold both")  # type: ignore[union-attr]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await _closed_within(reader, 5.0) < 5.0 and b"" == await reader.read()  # closed unanswered
        writer.close()
        r0, w0 = opened[0]
        w0.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r0.readuntil(b"hi"), 5)).startswith(b"HTTP/1.1 200")
        w0.close()
        opened.pop(0)
        await until(lambda: len(runner.server.connections) < 2, "the server to see the close")  # type: ignore[union-attr]
        r, w = await asyncio.open_connection("127.0.0.1", port)  # room again
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"hi"), 5)).startswith(b"HTTP/1.1 200")
        w.close()
    finally:
        for _, w in opened:
            w.close()
        await runner.cleanup()


async def test_a_body_that_trickles_in_is_a_408_and_its_handler_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardgrid.common import serving
    from shardgrid.common.wire import error_middleware

    monkeypatch.setattr(serving, "BODY_READ_S", 0.3)
    ran: list[bytes] = []

    async def take(request: web.Request) -> web.Response:
        ran.append(await request.read())
        return web.Response(text="ok")

    app = web.Application(middlewares=[error_middleware, serving.body_deadline])
    app.router.add_post("/", take)
    runner = app_runner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")  # 3 of 10 bytes
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 408"), head
        writer.close()
        assert ran == []
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        assert (await asyncio.wait_for(reader.readuntil(b"ok"), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
        assert ran == [b"abc"]
    finally:
        await runner.cleanup()
