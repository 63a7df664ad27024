"""The gateway's call stream to a worker (gateway/calls.py) against a real WebSocket endpoint."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import structlog
from aiohttp import WSMsgType, web

from gateway.calls import WorkerCalls
from shardgrid.common.protocol import CALLS_PATH
from gateway.router import Target
from shardgrid.common.wire import pack_frames, unpack_frame


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


async def _held_worker(aiohttp_server: Any, answer: asyncio.Event,
                       seen: list[Any]) -> str:
    """A worker's call stream that answers each call only once `answer` is set."""

    async def calls(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                batch = unpack_frame(msg.data)
                seen.extend(batch)

                async def later(batch: list[Any] = batch) -> None:
                    await answer.wait()
                    for frame in pack_frames([[cid, 200, {"seq": 1, "term": 1}] for cid, *_ in batch]):
                        await ws.send_bytes(frame)

                asyncio.ensure_future(later())
        return ws

    app = web.Application()
    app.router.add_get(CALLS_PATH, calls)
    server = await aiohttp_server(app)
    return f"http://127.0.0.1:{server.port}"


async def test_a_full_stream_answers_new_calls_503_overloaded_at_once(aiohttp_server: Any, monkeypatch: Any) -> None:
    import gateway.calls

    monkeypatch.setattr(gateway.calls, "MAX_STREAM_CALLS", 2)
    answer = asyncio.Event()
    seen: list[Any] = []
    base = await _held_worker(aiohttp_server, answer, seen)
    refused: list[int] = []
    async with aiohttp.ClientSession() as session:
        wc = WorkerCalls(session, structlog.get_logger(), on_overloaded=lambda: refused.append(1))
        target = Target("w1", base)
        try:
            held = [asyncio.ensure_future(wc.call(target, "write", 0, {"n": i}, 5.0)) for i in range(2)]
            loop = asyncio.get_running_loop()
            end = loop.time() + 5
            while len(seen) < 2:
                assert loop.time() < end, "the held calls never reached the worker"
                await asyncio.sleep(0.005)
            t0 = loop.time()
            full = await wc.call(target, "write", 0, {"n": 2}, 5.0)
            assert loop.time() - t0 < 0.1
            assert full.status == 503 and full.code == "overloaded" and full.error["retry_elsewhere"] is True
            assert refused == [1] and len(seen) == 2  # nothing was sent for it
            answer.set()
            assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
            assert (await wc.call(target, "write", 0, {"n": 3}, 5.0)).status == 200  # room again
        finally:
            answer.set()
            await wc.close()


async def test_a_stream_with_too_many_unsent_bytes_takes_no_new_call(aiohttp_server: Any) -> None:
    import gateway.calls

    answer = asyncio.Event()
    answer.set()
    base = await _held_worker(aiohttp_server, answer, [])
    async with aiohttp.ClientSession() as session:
        wc = WorkerCalls(session, structlog.get_logger())
        target = Target("w1", base)
        try:
            assert (await wc.call(target, "write", 0, {"n": 0}, 5.0)).status == 200
            st = wc._links[base].live()
            assert st is not None and st.unsent == 0  # every frame written is counted back out
            st.unsent = gateway.calls.MAX_UNSENT_BYTES  # a worker that stopped reading
            assert (await wc.call(target, "write", 0, {"n": 1}, 5.0)).code == "overloaded"
            st.unsent = 0
            assert (await wc.call(target, "write", 0, {"n": 2}, 5.0)).status == 200
        finally:
            await wc.close()


async def test_a_call_too_large_for_the_stream_fails_alone(aiohttp_server: Any, monkeypatch: Any) -> None:
    # The worker would close a stream carrying a message over its limit, and
    # every call in flight on it would fail: the call is refused on its own.
    import gateway.calls

    monkeypatch.setattr(gateway.calls, "MAX_FRAME", 4096)
    answer = asyncio.Event()
    answer.set()
    seen: list[Any] = []
    base = await _held_worker(aiohttp_server, answer, seen)
    async with aiohttp.ClientSession() as session:
        wc = WorkerCalls(session, structlog.get_logger())
        target = Target("w1", base)
        try:
            await wc.call(target, "write", 0, {"n": 0}, 5.0)
            replies = await asyncio.gather(*(wc.call(target, "write", 0, body, 5.0)
                                             for body in ({"n": 1}, {"n": "x" * 5000}, {"n": 3})))
            assert [r.status for r in replies] == [200, 413, 200]
            assert replies[1].code == "payload_too_large" and replies[1].error["limit"] == 4096
            assert [body["n"] for *_, body in seen] == [0, 1, 3]
        finally:
            await wc.close()
