"""The HTTP listeners of meta, workers and gateways: one set of aiohttp server limits for all three.

aiohttp's defaults hold an idle connection for an hour (keepalive_timeout
3630 s), and a header-size limit that an aiohttp upgrade may change. Set
here, they are the same on every listener and written down once
(runbook/deploy.md, "Limits on what a worker accepts").

aiohttp (3.14) has no cap on open connections (the listen backlog only
bounds the accept queue): `cap_connections` adds one. Nor a timeout on
reading a request's body: `body_deadline` adds one (a body that has not
arrived whole within BODY_READ_S is a 408, and its handler never runs).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from shardgrid.common.wire import ApiError

# An idle keep-alive connection is closed after this, and the timer starts
# when a connection opens or an answer is sent: a client that connects and
# sends nothing, or trickles a request's headers, is cut off within it. It
# must stay above every client pool's own idle time (aiohttp's 15 s, the
# gateway's 30 s), or a pool would reuse a connection the server is closing.
KEEPALIVE_S = 75.0
# Request line and header field lengths, and the number of header fields
# (aiohttp's defaults, pinned): a larger request is a 400 before any handler runs.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128
# Open connections one listener holds at most; one more is closed as it is
# accepted. Above what a cluster uses (a gateway pools 4096 connections to
# all workers together, a worker holds one stream per peer and gateway), far
# below the file descriptors of a default systemd unit (deploy.md: 65536).
MAX_CONNECTIONS = 16_384
# A request's whole body must arrive within this (a 64 MiB write_batch at
# 2.2 MB/s): a client that trickles one holds a handler and its buffer no longer.
BODY_READ_S = 30.0
_REFUSED_LOG_EVERY_S = 10.0


def cap_connections(server: web.Server | None, log: Any, limit: int = MAX_CONNECTIONS) -> None:
    """Close each connection accepted beyond `limit` open ones (a flood of idle
    connections must not exhaust file descriptors or memory)."""
    assert server is not None, "call after runner.setup()"
    accept = server.connection_made
    refused = 0
    logged_at = -_REFUSED_LOG_EVERY_S

    def connection_made(handler: RequestHandler, transport: Any) -> None:
        nonlocal refused, logged_at
        if len(server._connections) >= limit:  # noqa: SLF001 - `connections` copies the whole list
            refused += 1
            now = time.monotonic()
            if now - logged_at >= _REFUSED_LOG_EVERY_S:
                logged_at = now
                log.warning("connection_limit_reached", limit=limit, refused_total=refused,
                            peer=transport.get_extra_info("peername"))
            transport.abort()
            return
        accept(handler, transport)

    server.connection_made = connection_made  # type: ignore[method-assign]


def app_runner(app: web.Application, shutdown_timeout: float, keepalive_s: float = KEEPALIVE_S) -> web.AppRunner:
    """A runner for `app` with the shared limits.

    handler_cancellation stays off: a handler whose client went away runs
    on to its end, because a write already queued to a group, a meta
    change half-way through its raft apply or a snapshot download's slot
    must be finished or released by the handler itself. What a handler may
    wait is bounded on its own (a worker's MAX_WAIT_S, meta's watch limit,
    the gateway's request deadline).
    """
    # access_log=None: aiohttp's access log is off; the gateway writes its own.
    return web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout,
                         keepalive_timeout=keepalive_s, handler_cancellation=False,
                         max_line_size=MAX_LINE_BYTES, max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS)


async def read_body(request: web.Request) -> bytes:
    """The request's whole body, if it arrives within BODY_READ_S (later reads
    return it at once); 408 `request_timeout` otherwise."""
    if not request.body_exists:
        return b""
    try:
        async with asyncio.timeout(BODY_READ_S):  # no task per request, as wait_for would make
            return await request.read()
    except TimeoutError:
        raise ApiError("request_timeout", f"the request body did not arrive within {BODY_READ_S:g} s") from None


@web.middleware
async def body_deadline(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Read a request's body (`read_body`) before its handler runs."""
    if request.body_exists and request.can_read_body:
        await read_body(request)
    return await handler(request)
