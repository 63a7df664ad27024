"""The generator's lean HTTP/1.1 client (shardgrid/bench/http_client.py) against real
servers: an aiohttp app for what the gateway and etcd's JSON gateway send, and
raw asyncio servers for what they never should."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from aiohttp import web
from yarl import URL

from shardgrid.bench.http_client import RawHttpSender

Prepared = tuple[str, URL, bytes | None, dict[str, str], int]


def _classify(status: int, raw: bytes, n: int) -> Any:
    return (status, raw, n)


def _sender(base: str, paths: list[tuple[str, str, bytes | None]], timeout_s: float = 2.0) -> RawHttpSender:
    def prep(method: str, path: str, body: bytes | None) -> Callable[[], Prepared]:
        return lambda: (method, URL(base + path, encoded=True), body, {"x-request-id": "r1", "content-type": "a/b"}, 1)
    return RawHttpSender([prep(*p) for p in paths], [_classify] * len(paths), timeout_s)


def _app(seen: list[tuple[str, str, bytes, dict[str, str], int]]) -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        peer = request.transport.get_extra_info("peername")[1] if request.transport else 0
        seen.append((request.method, request.path_qs, body, request.headers.copy(), peer))
        if request.path == "/missing":
            return web.json_response({"error": {"code": "not_found"}}, status=404)
        if request.path == "/empty":
            return web.Response(status=204)
        if request.path == "/chunked":
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for part in (b'{"a":', b'"' + b"x" * 5000 + b'"', b"}"):
                await resp.write(part)
            await resp.write_eof()
            return resp
        if request.path == "/close":
            return web.Response(body=b"bye", headers={"Connection": "close"})
        if request.path == "/slow":
            await asyncio.sleep(5)
        return web.Response(body=b"got " + body)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def test_requests_answers_and_keepalive(aiohttp_server: Any) -> None:
    seen: list[Any] = []
    server = await aiohttp_server(_app(seen))
    base = f"http://127.0.0.1:{server.port}"
    send = _sender(base, [("PUT", "/items/a%2Fb?x=1", b'{"v":1}'), ("GET", "/missing", None),
                          ("DELETE", "/empty", None), ("POST", "/chunked", b"")])
    try:
        assert await send(0) == (200, b'got {"v":1}', 1)
        assert await send(1) == (404, b'{"error": {"code": "not_found"}}', 1)
        assert await send(2) == (204, b"", 1)
        status, raw, _ = await send(3)
        assert status == 200 and raw == b'{"a":"' + b"x" * 5000 + b'"}'
        assert await send(0) == (200, b'got {"v":1}', 1)  # still in step after a chunked answer
        method, path, body, headers, _ = seen[0]
        assert (method, path, body) == ("PUT", "/items/a%2Fb?x=1", b'{"v":1}')
        assert headers["x-request-id"] == "r1" and headers["Content-Type"] == "a/b"
        assert headers["Host"] == f"127.0.0.1:{server.port}"
        assert len({peer for *_, peer in seen}) == 1  # one connection, kept alive
        # Concurrent requests each get a connection of their own (no pipelining).
        got = await asyncio.gather(*(send(0) for _ in range(5)))
        assert all(g == (200, b'got {"v":1}', 1) for g in got)
        assert len({peer for *_, peer in seen[-5:]}) == 5
    finally:
        await send.close()


async def test_connection_close_is_honoured(aiohttp_server: Any) -> None:
    seen: list[Any] = []
    server = await aiohttp_server(_app(seen))
    send = _sender(f"http://127.0.0.1:{server.port}", [("GET", "/close", None)])
    try:
        assert await send(0) == (200, b"bye", 1)
        assert await send(0) == (200, b"bye", 1)
        assert seen[0][4] != seen[1][4]  # the second request went on a new connection
    finally:
        await send.close()


async def test_timeout_refused_and_unreadable_answers(aiohttp_server: Any, unused_tcp_port: int) -> None:
    seen: list[Any] = []
    server = await aiohttp_server(_app(seen))
    base = f"http://127.0.0.1:{server.port}"
    send = _sender(base, [("GET", "/slow", None), ("GET", "/fast", None)], timeout_s=0.3)
    try:
        assert await send(0) == (False, "timeout", 0, None, False)
        assert await send(1) == (200, b"got ", 1)  # the timed-out connection was not reused
    finally:
        await send.close()
    refused = _sender(f"http://127.0.0.1:{unused_tcp_port}", [("GET", "/", None)])
    assert await refused(0) == (False, "connection_error", 0, None, False)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def no_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\nbody")
        await writer.drain()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
        await writer.drain()
        writer.close()

    for handler, want in ((garbage, "bad_response"), (no_length, "bad_response"), (hang_up, "connection_error")):
        await _against(handler, want)


async def _against(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                   want: str) -> None:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    send = _sender(f"http://127.0.0.1:{port}", [("GET", "/", None)])
    try:
        assert await send(0) == (False, want, 0, None, False)
    finally:
        await send.close()
        srv.close()
        await srv.wait_closed()
