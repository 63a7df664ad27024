"""Replica-to-replica streams (worker/transport.py) against a real WebSocket endpoint."""
from __future__ import annotations

import asyncio
from typing import Any

import structlog
from aiohttp import WSMsgType, web

from shardgrid.common.wire import unpack_frame
from worker import replica_msgs as m
from worker.codec import decode_message
from shardgrid.common.protocol import STREAM_PATH
from worker.transport import Transport


def beat(commit: int) -> m.Heartbeat:
    return m.Heartbeat(src="a", dst="b", group=0, term=1, commit=commit, round=0)


class _Sink:
    """A peer's stream endpoint that keeps every frame it receives, decoded."""

    def __init__(self) -> None:
        self.frames: list[list[m.Message]] = []

    async def stream(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                self.frames.append([decode_message(raw) for raw in unpack_frame(msg.data)])
        return ws

    async def received(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while sum(map(len, self.frames)) < n:
            assert loop.time() < end, self.frames
            await asyncio.sleep(0.005)

    def commits(self) -> list[list[int]]:
        return [[h.commit for h in f] for f in self.frames]  # type: ignore[attr-defined]


async def _serve(aiohttp_server: Any) -> tuple[_Sink, str]:
    sink = _Sink()
    app = web.Application()
    app.router.add_get(STREAM_PATH, sink.stream)
    server = await aiohttp_server(app)
    return sink, f"127.0.0.1:{server.port}"


async def test_messages_sent_in_one_iteration_share_a_frame_and_are_counted(aiohttp_server: Any) -> None:
    sink, addr = await _serve(aiohttp_server)
    transport = Transport(lambda dst: addr, structlog.get_logger())
    try:
        for i in range(3):
            transport.send(beat(i))
        await sink.received(3)
        transport.send(beat(3))
        await sink.received(4)
        assert sink.commits() == [[0, 1, 2], [3]]
        assert (transport.stats.messages, transport.stats.frames) == (4, 2)
    finally:
        await transport.close()


async def test_a_message_msgpack_cannot_pack_is_dropped_and_counted_and_the_stream_goes_on(
        aiohttp_server: Any) -> None:
    sink, addr = await _serve(aiohttp_server)
    transport = Transport(lambda dst: addr, structlog.get_logger())
    try:
        transport.send(beat(0))
        transport._peers[addr].send(["not", {"a set"}])  # what a codec bug would queue
        transport.send(beat(1))
        await sink.received(2)
        transport.send(beat(2))
        await sink.received(3)
        assert sink.commits() == [[0, 1], [2]]
        assert (transport.stats.messages, transport.stats.unpackable) == (3, 1)
    finally:
        await transport.close()


async def test_a_full_peer_queue_drops_its_oldest_messages_and_sends_the_newest(aiohttp_server: Any,
                                                                                monkeypatch: Any) -> None:
    # The queue to one peer is bounded: what a dead or slow peer would pile up
    # is dropped oldest first (the core retransmits what a follower lacks).
    import worker.transport

    monkeypatch.setattr(worker.transport, "MAX_QUEUE", 3)
    sink, addr = await _serve(aiohttp_server)
    transport = Transport(lambda dst: addr, structlog.get_logger())
    try:
        for i in range(5):  # in one loop iteration: the stream has not taken any yet
            transport.send(beat(i))
        assert len(transport._peers[addr].queue) == 3
        await sink.received(3)
        transport.send(beat(5))
        await sink.received(4)
        assert [c for f in sink.commits() for c in f] == [2, 3, 4, 5]
    finally:
        await transport.close()
