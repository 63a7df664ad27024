"""Replica-to-replica messages over HTTP: one batching sender per peer.

Messages are fire-and-forget (the replication core retransmits what gets
lost), so a sender never blocks the group loop: `send` enqueues, and the
peer's task ships everything queued as one msgpack POST to `/v1/raft` over a
persistent connection. Under load that is the natural batching of DESIGN.md
§5: while one POST is in flight, the next batch gathers.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable

import aiohttp

from shardgrid.wire import packb
from worker.codec import encode_message
from worker.replica_msgs import Message

MAX_BATCH = 4096
MAX_QUEUE = 100_000
POST_TIMEOUT_S = 2.0


class _Peer:
    def __init__(self, addr: str, session: aiohttp.ClientSession, log: Any) -> None:
        self.addr = addr
        self.url = f"http://{addr}/v1/raft"
        self.queue: deque[list[Any]] = deque()
        self.wake = asyncio.Event()
        self.session = session
        self.log = log
        self.failures = 0
        self.task = asyncio.create_task(self._run())

    def send(self, encoded: list[Any]) -> None:
        if len(self.queue) >= MAX_QUEUE:
            self.queue.popleft()  # a dead peer must not grow memory; the core retransmits
        self.queue.append(encoded)
        self.wake.set()

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.queue:
                n = min(len(self.queue), MAX_BATCH)
                batch = [self.queue.popleft() for _ in range(n)]
                try:
                    async with self.session.post(self.url, data=packb(batch),
                                                 headers={"Content-Type": "application/msgpack"},
                                                 timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S)) as resp:
                        await resp.read()
                        if resp.status >= 300:
                            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    self.failures = 0
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    self.failures += 1
                    if self.failures in (1, 10) or self.failures % 100 == 0:
                        self.log.warning("peer_send_failed", peer=self.addr, error=type(exc).__name__,
                                         failures=self.failures, dropped=len(batch))
                    # Back off a little so a dead peer costs nothing; drop what is queued.
                    await asyncio.sleep(min(0.05 * self.failures, 0.5))
                    self.queue.clear()

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


class Transport:
    """Routes outgoing messages to peers by worker id, resolved through `resolve`."""

    def __init__(self, resolve: Callable[[str], str | None], log: Any, local_addr: str | None = None) -> None:
        self._resolve = resolve
        self.local_addr = local_addr
        self._peers: dict[str, _Peer] = {}
        self._session: aiohttp.ClientSession | None = None
        self.log = log

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=self.connector(limit=0, limit_per_host=4))
        return self._session

    def connector(self, **kw: Any) -> aiohttp.TCPConnector:
        """Connections from this worker's source address, when one is set."""
        if self.local_addr:
            kw["local_addr"] = (self.local_addr, 0)
        return aiohttp.TCPConnector(**kw)

    def send(self, msg: Message) -> None:
        addr = self._resolve(msg.dst)
        if addr is None:
            return  # unknown peer (not yet in meta's view): the core retransmits
        peer = self._peers.get(addr)
        if peer is None:
            peer = self._peers[addr] = _Peer(addr, self._sess(), self.log)
        peer.send(encode_message(msg))

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
