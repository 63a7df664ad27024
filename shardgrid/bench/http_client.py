"""A lean HTTP/1.1 client for the load generator (`shardgrid bench --client raw`).

The generator's own CPU is CPU the cluster under test cannot use on a small
machine. aiohttp's client costs about 200 µs per request here (request and
response objects, header multidicts, cookie and redirect machinery), so
driving a cluster with it measures the generator as much as the cluster. This
client does only what a load generator needs, like wrk does:

- persistent connections (one per outstanding request, reused; never two
  requests in flight on one connection, so no pipelining);
- requests written as one buffer: request line, Host, the target's headers,
  Content-Length, body;
- responses parsed just enough to count them: status, Content-Length or
  chunked transfer encoding, `Connection: close`. Headers are not decoded.

It is not a general HTTP client (no redirects, TLS, proxies, 1xx, or
compression) and is used only against the gateway and etcd's JSON gateway,
whose answers it handles. A response it cannot parse closes the connection
and counts as `bad_response`.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from yarl import URL

if TYPE_CHECKING:
    from shardgrid.bench.config import Outcome, Prepared

Classify = Callable[[int, bytes, int], "Outcome"]

MAX_HEAD = 64 << 10
NO_BODY = frozenset((204, 304))


class ResponseError(Exception):
    """The server's answer was not HTTP/1.1 this client can read."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.fut: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.keep = True
        # the response being read: its status, where its body starts, its length (-1: chunked)
        self.status = 0
        self.body_at = -1
        self.length = 0

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.fut is None or self.fut.done():
            return
        try:
            answer = self._parse()
        except (ResponseError, ValueError) as exc:
            self._fail(ResponseError(str(exc)))
            return
        if answer is not None:
            fut, self.fut = self.fut, None
            fut.set_result(answer)
            if not self.keep:
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionResetError("the server closed the connection"))

    # -- use

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None and self.fut is None
        self.buf.clear()
        self.body_at = -1
        self.fut = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.fut

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        fut, self.fut = self.fut, None
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        if not self.closed:
            self.close()

    def _parse(self) -> tuple[int, bytes] | None:
        buf = self.buf
        if self.body_at < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise ResponseError("response head too large")
                return None
            if not buf.startswith(b"HTTP/1."):
                raise ResponseError(f"not an HTTP/1.x response: {bytes(buf[:20])!r}")
            self.status = int(buf[9:12])
            head = bytes(buf[:end]).lower()
            self.body_at = end + 4
            self.keep = b"\r\nconnection: close" not in head and not head.startswith(b"http/1.0")
            if self.status in NO_BODY:
                self.length = 0
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.length = -1
            else:
                at = head.find(b"\r\ncontent-length:")
                if at < 0:
                    raise ResponseError("a response with neither Content-Length nor chunked encoding")
                eol = head.find(b"\r\n", at + 2)
                self.length = int(head[at + 17:eol if eol >= 0 else len(head)])
        if self.length >= 0:
            if len(buf) - self.body_at < self.length:
                return None
            return self.status, bytes(buf[self.body_at:self.body_at + self.length])
        return self._chunked()

    def _chunked(self) -> tuple[int, bytes] | None:
        buf, at, parts = self.buf, self.body_at, []
        while True:
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                return None
            size = int(bytes(buf[at:eol]).split(b";", 1)[0], 16)
            at = eol + 2
            if size == 0:
                # trailers (none expected) end with an empty line
                end = buf.find(b"\r\n", at)
                if end < 0:
                    return None
                return self.status, b"".join(parts)
            if len(buf) < at + size + 2:
                return None
            parts.append(bytes(buf[at:at + size]))
            at += size + 2


class RawHttpSender:
    """send(kind index) -> Outcome, like load.HttpSender, on `_Conn`s; never raises."""

    def __init__(self, prepare: list[Callable[[], "Prepared"]], classify: list[Classify], timeout_s: float) -> None:
        self.prepare = prepare
        self.classify = classify
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._all: set[_Conn] = set()

    async def __call__(self, kind: int) -> "Outcome":
        method, url, body, headers, n = self.prepare[kind]()
        host, port = url.raw_host or "127.0.0.1", url.port or 80
        data = _request_bytes(method, url, host, port, body, headers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            conn = await self._acquire(host, port, deadline)
        except (OSError, asyncio.TimeoutError):
            return (False, "connection_error", 0, None, False)
        fut = conn.request(data)
        timer = loop.call_at(deadline, conn.abort)
        try:
            status, raw = await fut
        except ResponseError:
            return (False, "bad_response", 0, None, False)
        except ConnectionError:
            return (False, "timeout" if loop.time() >= deadline else "connection_error", 0, None, False)
        finally:
            timer.cancel()
            self._release(host, port, conn)
        return self.classify[kind](status, raw, n)

    async def _acquire(self, host: str, port: int, deadline: float) -> _Conn:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
            self._all.discard(conn)  # the server closed it while idle
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(_Conn, host, port),
                                         max(0.001, deadline - loop.time()))
        self._all.add(conn)
        return conn

    def _release(self, host: str, port: int, conn: _Conn) -> None:
        if conn.closed or conn.fut is not None:
            conn.abort()  # an answer never read (timeout, cancel) would be taken for the next one
            self._all.discard(conn)
            return
        self._idle.setdefault((host, port), deque()).append(conn)

    async def close(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._idle.clear()


def _request_bytes(method: str, url: URL, host: str, port: int, body: bytes | None, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {url.raw_path_qs} HTTP/1.1\r\nHost: {host}:{port}\r\n"]
    lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
    lines.append(f"Content-Length: {len(body) if body else 0}\r\n\r\n")
    head = "".join(lines).encode("latin-1")
    return head + body if body else head


def make_raw_sender(target: Any) -> RawHttpSender:
    """The raw sender for a bench target (its prepare/classify per operation kind)."""
    kinds = target.cfg.kinds
    return RawHttpSender([target.prepare(k) for k in kinds], [target.classify(k) for k in kinds], target.cfg.timeout_s)
