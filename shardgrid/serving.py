"""The HTTP listeners of meta, workers and gateways: one set of aiohttp server limits for all three.

aiohttp's defaults hold an idle connection for an hour (keepalive_timeout
3630 s), and a header-size limit that an aiohttp upgrade may change. Set
here, they are the same on every listener and written down once
(runbook/deploy.md, "Limits on what a worker accepts").

What aiohttp (3.14) cannot do, and so is not here: a cap on open
connections (it has no such option; the listen backlog only bounds the
accept queue), and a timeout on reading a request's body (a slow body
holds its handler until the body ends or reaches the app's
client_max_size).
"""
from __future__ import annotations

from aiohttp import web

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
