"""Requests no well-behaved client sends: header bytes that are not UTF-8."""
from __future__ import annotations

import asyncio


async def raw_status(host: str, port: int, method: str, path: str, headers: list[bytes],
                     body: bytes = b"") -> tuple[int, bytes]:
    """Send one HTTP/1.1 request with `headers` exactly as given; (status, body)."""
    status, _, answer = await raw_request(host, port, method, path.encode(), headers, body)
    return status, answer


async def raw_request(host: str, port: int, method: str, target: bytes, headers: list[bytes],
                      body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Like `raw_status`, with the request target as bytes (any path, even one no URL
    library would build) and the answer's headers (lower-cased names)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: test", b"Connection: close",
                f"Content-Length: {len(body)}".encode(), *headers]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head_raw, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *lines = head_raw.split(b"\r\n")
    answer_headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(b":")
        answer_headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(status_line.split()[1]), answer_headers, rest
