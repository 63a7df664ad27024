"""Replica-to-replica messages: one WebSocket stream per peer, fire-and-forget.

Messages need no answer (the replication core retransmits what gets lost),
so a sender never blocks the group loop: `send` enqueues, and the peer's
task writes everything queued as binary frames (`shardgrid.common.wire.pack_frames`:
encoded messages back to back, about 1 MiB at most per frame) on a
persistent WebSocket to the peer's `/v1/raft/stream`. Under
load that is the natural batching of the write path: while one frame is being
written, the next gathers. A frame is one socket write with no reply, where
an HTTP POST per batch cost four socket operations and aiohttp's client
machinery; on this 2-core machine that was most of a worker's CPU.

A dead or partitioned peer is noticed by WebSocket ping/pong (`HEARTBEAT_S`):
the stream closes, what was queued is dropped, and the task reconnects with
a backoff once there is something to send. `POST /v1/raft` (a msgpack list
of messages, one request) stays for tools.

All workers of a cluster must run the same version: an older worker has
neither the stream endpoint nor the "ops" entries it carries.
"""
from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from shardgrid.common.protocol import HEARTBEAT_S, STREAM_PATH
from shardgrid.common.tls import connector_ssl, scheme
from shardgrid.common.wire import pack_frames
from worker.codec import encode_message
from worker.replica_msgs import Message

MAX_BATCH = 4096
MAX_QUEUE = 100_000
CONNECT_TIMEOUT_S = 1.0
# Ping every HEARTBEAT_S; no pong within half of it closes the stream: a
# partition is noticed in seconds, not TCP's minutes, while a loop that
# stalls for a second (a slow disk, a snapshot) does not tear streams down.


@dataclass
class SendStats:
    """What the peer streams of one worker wrote: messages, and the frames that carried them."""

    messages: int = 0
    frames: int = 0
    unpackable: int = 0  # messages msgpack could not pack, dropped (a bug; see peer_message_unpackable)


class _Peer:
    def __init__(self, addr: str, session: aiohttp.ClientSession, log: Any, stats: SendStats,
                 url_scheme: str = "http") -> None:
        self.addr = addr
        self.stats = stats
        self.url = f"{url_scheme}://{addr}{STREAM_PATH}"
        self.queue: deque[list[Any]] = deque()
        self.wake = asyncio.Event()
        self.session = session
        self.log = log
        self.failures = 0
        self.task = asyncio.create_task(self._run(), name=f"peer-{addr}")

    def send(self, encoded: list[Any]) -> None:
        if len(self.queue) >= MAX_QUEUE:
            self.queue.popleft()  # a dead peer must not grow memory; the core retransmits
        self.queue.append(encoded)
        self.wake.set()

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            try:
                ws = await self.session.ws_connect(self.url, heartbeat=HEARTBEAT_S, autoping=True,
                                                   timeout=aiohttp.ClientWSTimeout(ws_close=1.0),
                                                   max_msg_size=0)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                await self._failed(exc)
                continue
            try:
                await self._stream(ws)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ConnectionError) as exc:
                await self._failed(exc)
            finally:
                await ws.close()

    async def _stream(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        # The reader consumes pongs (and anything else); its end is the stream's end.
        # The reader's end wakes the sender too: one Event to wait on, rather
        # than a task and asyncio.wait per wake-up (one per replication round).
        reader = asyncio.create_task(_drain(ws))
        reader.add_done_callback(lambda _: self.wake.set())
        try:
            while True:
                while self.queue:
                    n = min(len(self.queue), MAX_BATCH)
                    batch = [self.queue.popleft() for _ in range(n)]
                    dropped = self.stats.unpackable
                    for frame in pack_frames(batch, on_error=self._unpackable):
                        if ws.closed:
                            raise ConnectionResetError("stream closed")
                        await ws.send_bytes(frame)
                        self.stats.frames += 1
                    self.stats.messages += n - (self.stats.unpackable - dropped)
                    self.failures = 0
                self.wake.clear()
                if reader.done():
                    raise ConnectionResetError(f"stream closed ({ws.close_code})")
                await self.wake.wait()
        finally:
            reader.cancel()

    def _unpackable(self, encoded: Any, exc: Exception) -> None:
        """Drop a message msgpack cannot pack: raising would end the stream and
        drop everything queued behind it, again at every retransmission,
        stalling the peer's groups. Dropped, it is one lost message, which
        the core already tolerates."""
        self.stats.unpackable += 1
        self.log.error("peer_message_unpackable", peer=self.addr, error=f"{type(exc).__name__}: {exc}",
                       kind=type(encoded).__name__, unpackable=self.stats.unpackable)
        return None

    async def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        if self.failures in (1, 10) or self.failures % 100 == 0:
            self.log.warning("peer_send_failed", peer=self.addr, error=type(exc).__name__,
                             failures=self.failures, dropped=len(self.queue))
        # Drop what is queued (the core retransmits) and back off so a dead
        # peer costs nothing; redial when there is something new to send.
        self.queue.clear()
        await asyncio.sleep(min(0.05 * self.failures, 0.5))
        if not self.queue:
            # Set by the old stream's reader ending, not by a send: no redial yet.
            self.wake.clear()

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - closing must go on to the other peers and the session
            self.log.warning("peer_close_failed", peer=self.addr, error=f"{type(exc).__name__}: {exc}")


async def _drain(ws: aiohttp.ClientWebSocketResponse) -> None:
    async for _ in ws:
        pass


class Transport:
    """Routes outgoing messages to peers by worker id, resolved through `resolve`."""

    def __init__(self, resolve: Callable[[str], str | None], log: Any, local_addr: str | None = None,
                 tls: ssl.SSLContext | None = None, middlewares: tuple[Any, ...] = ()) -> None:
        self._resolve = resolve
        # The request signer (shardgrid/common/peerauth_http.py): every session to a peer carries it.
        self.middlewares = middlewares
        self.local_addr = local_addr
        # Peers' streams and snapshot downloads: https/wss verified against its CA when set.
        self.tls = tls
        self.scheme = scheme(tls)
        self._peers: dict[str, _Peer] = {}
        self._session: aiohttp.ClientSession | None = None
        self.log = log
        self.stats = SendStats()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=self.connector(limit=0, limit_per_host=4), middlewares=self.middlewares,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S))
        return self._session

    def connector(self, **kw: Any) -> aiohttp.TCPConnector:
        """Connections from this worker's source address, when one is set, with its TLS."""
        if self.local_addr:
            kw["local_addr"] = (self.local_addr, 0)
        return aiohttp.TCPConnector(ssl=connector_ssl(self.tls), **kw)

    def send(self, msg: Message) -> None:
        addr = self._resolve(msg.dst)
        if addr is None:
            return  # unknown peer (not yet in meta's view): the core retransmits
        peer = self._peers.get(addr)
        if peer is None:
            peer = self._peers[addr] = _Peer(addr, self._sess(), self.log, self.stats, self.scheme)
        peer.send(encode_message(msg))

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
