"""The gateway's call stream to a worker (gateway/calls.py) against a real WebSocket endpoint."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import structlog
from aiohttp import WSMsgType, web

from gateway.calls import CALLS_PATH, WorkerCalls
from gateway.router import Target
from shardgrid.wire import pack_frames, unpack_frame


async def test_a_call_that_cannot_be_encoded_fails_alone_and_its_neighbours_are_served(aiohttp_server: Any) -> None:
    frames: list[list[Any]] = []

    async def calls(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                batch = unpack_frame(msg.data)
                frames.append(batch)
                for frame in pack_frames([[cid, 200, {"seq": 1, "term": 1, "echo": body}]
                                          for cid, _, _, body in batch]):
                    await ws.send_bytes(frame)
        return ws

    app = web.Application()
    app.router.add_get(CALLS_PATH, calls)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        wc = WorkerCalls(session, structlog.get_logger())
        target = Target("w1", f"http://127.0.0.1:{server.port}")
        try:
            await wc.call(target, "write", 0, {"n": 0}, 5.0)  # opens the stream
            # Three calls in one flush, the middle one unpackable (a set).
            replies = await asyncio.gather(*(wc.call(target, "write", 0, body, 5.0)
                                             for body in ({"n": 1}, {"n": {2}}, {"n": 3})))
            assert [r.status for r in replies] == [200, 500, 200]
            assert replies[1].code == "internal"
            assert [r.body["echo"]["n"] for r in (replies[0], replies[2])] == [1, 3]
            assert [[body["n"] for *_, body in f] for f in frames] == [[0], [1, 3]]
            after = await wc.call(target, "write", 0, {"n": 4}, 5.0)
            assert after.status == 200
        finally:
            await wc.close()
