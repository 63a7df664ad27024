"""The shared aiohttp server limits (shardgrid/serving.py), on a real socket."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import pytest
from aiohttp import web

from shardgrid.serving import MAX_FIELD_BYTES, app_runner

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
