"""Where a replica downloads a snapshot from: the `SnapshotSource` protocol
and its HTTP implementation (a peer worker's `/v1/groups/{gid}/snapshot`).

The group shell (worker/group.py) owns the download's logic: what to ask
for, what it must match (the (term, seq), size and digest the source
published in the replication message), the partial file, resuming and
pacing. A source only moves bytes, so that the deterministic simulator can
put its own network (losses, cut answers, flipped bytes, a busy source)
under the same logic. Whatever a source returns is checked, never trusted.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import aiohttp
import orjson

from worker.throttle import SNAPSHOT_BUSY
from worker.transport import Transport

MAX_MANIFEST_BYTES = 4096  # a snapshot manifest is four fields
DOWNLOAD_CHUNK = 1 << 20


class FetchFailed(Exception):
    """The source could not be reached or broke off: a retry may resume."""


class SourceBusy(Exception):
    """The source serves its limit of snapshot downloads (worker/throttle.py): ask again later."""


class SourceOverran(Exception):
    """A snapshot source sent other bytes than those asked for (past the
    published size, or from another offset)."""


@dataclass
class RangeBody:
    """An answer to "the bytes of snapshot `seq` from `start` on": `start`
    is where its bytes begin (0 when the source sent the whole file instead)."""

    start: int
    chunks: AsyncIterator[bytes]


class SnapshotSource(Protocol):
    async def manifest(self, source: str, seq: int) -> Any:
        """The source's snapshot at `seq` as it describes it (a JSON-like
        value, to be checked), or None when `source` is unknown here.
        Raises FetchFailed, or ValueError for an answer that is not a manifest."""
        ...

    def fetch(self, source: str, seq: int, start: int, total: int) -> contextlib.AbstractAsyncContextManager[RangeBody]:
        """The bytes of snapshot `seq` of `total` bytes from `start` on.
        Raises FetchFailed, SourceBusy, or SourceOverran (bytes from another offset)."""
        ...

    async def close(self) -> None: ...


class HttpSnapshotSource:
    """Downloads from a peer worker over HTTP range requests, through the
    replication transport's connector (TLS and peer authentication)."""

    def __init__(self, gid: int, transport: Transport, peer_addr: Callable[[str], str | None]) -> None:
        self.gid = gid
        self.transport = transport
        self.peer_addr = peer_addr
        self._session: aiohttp.ClientSession | None = None

    def _base(self, source: str) -> str | None:
        addr = self.peer_addr(source)
        if addr is None:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=self.transport.connector(),
                                                  middlewares=self.transport.middlewares)
        return f"{self.transport.scheme}://{addr}/v1/groups/{self.gid}/snapshot"

    async def manifest(self, source: str, seq: int) -> Any:
        base = self._base(source)
        if base is None:
            return None
        assert self._session is not None
        try:
            async with self._session.get(base, params={"seq": str(seq)},
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    raise FetchFailed(f"manifest: HTTP {resp.status}")
                return orjson.loads(await _read_bounded(resp, MAX_MANIFEST_BYTES))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise FetchFailed(f"manifest: {type(exc).__name__}: {exc}") from exc

    @contextlib.asynccontextmanager
    async def fetch(self, source: str, seq: int, start: int, total: int) -> AsyncIterator[RangeBody]:
        base = self._base(source)
        if base is None:
            raise FetchFailed(f"no address for {source}")
        assert self._session is not None
        try:
            async with self._session.get(f"{base}/{seq}", headers={"Range": f"bytes={start}-"},
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=10)) as resp:
                if resp.status == 503 and await _busy(resp):
                    raise SourceBusy(source)
                if resp.status not in (200, 206):
                    raise FetchFailed(f"HTTP {resp.status}")
                if resp.status == 206 and not _range_starts_at(resp.headers.get("Content-Range"), start, total):
                    raise SourceOverran(f"asked for bytes {start}- of {total}, got "
                                        f"{str(resp.headers.get('Content-Range'))[:80]!r}")
                yield RangeBody(start if resp.status == 206 else 0, _chunks(resp))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise FetchFailed(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    async for chunk in resp.content.iter_chunked(DOWNLOAD_CHUNK):
        yield chunk


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of `resp`, or ValueError once it is past `limit` bytes (read no further)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise ValueError(f"a body of {resp.content_length} bytes, over {limit}")
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(limit + 1):
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"a body over {limit} bytes")
    return bytes(buf)


def _range_starts_at(header: str | None, start: int, total: int) -> bool:
    """Does a 206's `Content-Range: bytes START-END/TOTAL` start where asked, within the published size?"""
    if header is None or not header.startswith("bytes "):
        return False
    span, _, whole = header[6:].partition("/")
    first, _, last = span.partition("-")
    return first.isdigit() and last.isdigit() and int(first) == start and int(last) < total \
        and (whole == "*" or (whole.isdigit() and int(whole) == total))


async def _busy(resp: aiohttp.ClientResponse) -> bool:
    """Is this 503 the source's "serving its limit of snapshot downloads" (worker/server.py)?"""
    try:
        body = await resp.json(content_type=None)
    except (aiohttp.ClientError, ValueError):
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and err.get("reason") == SNAPSHOT_BUSY
