"""Requests no well-behaved client sends: header bytes that are not UTF-8."""
from __future__ import annotations

import asyncio


async def raw_status(host: str, port: int, method: str, path: str, headers: list[bytes],
                     body: bytes = b"") -> tuple[int, bytes]:
    """Send one HTTP/1.1 request with `headers` exactly as given; (status, body)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = [f"{method} {path} HTTP/1.1".encode(), b"Host: test", b"Connection: close",
                f"Content-Length: {len(body)}".encode(), *headers]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]
