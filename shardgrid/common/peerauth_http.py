"""`shardgrid/common/peerauth.py` on aiohttp: the server's guard and the client's signer.

The guard is a server middleware. It answers hellos itself, and for every
route its policy names it checks the request's session MAC and the sender's
role before the handler runs; the handler finds the sender in
`peer_of(request)` to bind what the body claims (a message's `src`, a
heartbeat's worker id) to it. A refusal is a 401 (who are you?) or a 403
(not you, not this), with the reason in the error body and in a
`Shardgrid-Refused` header, one log line with the peer's address (at most
one a second per address, so a flood does not fill the disk) and a count in
`shardgrid_peer_auth_refused_total{reason}`.

The signer is a client middleware: it opens a session with each server on
first use, signs every request, and on `session_unknown` (the server
restarted or forgot the session) says hello again and retries once.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import aiohttp
from aiohttp import ClientRequest, ClientResponse, web
from aiohttp.client_middlewares import ClientHandlerType
from prometheus_client import CollectorRegistry, Counter

from shardgrid.common.auth import read_secret
from shardgrid.common.peerauth import (AUTH_HEADER, HELLO_HEADER, HELLO_PATH, ClientSession, ClusterKeys, PeerAuthError,
                                Principal, SessionTable, make_hello, open_client_session, parse_hello,
                                parse_welcome)
from shardgrid.common.serving import read_body
from shardgrid.common.wire import ApiError, error_response, json_response

REFUSED_HEADER = "Shardgrid-Refused"
WELCOME_HEADER = "Shardgrid-Welcome"
ANY_ROLE = frozenset({"worker", "gateway", "meta"})
_LOG_EVERY_S = 1.0
HELLO_TIMEOUT_S = 5.0
# 403: the sender is known but may not do this; the rest are 401 (prove who you are).
_FORBIDDEN = frozenset({"revoked", "wrong_role", "wrong_sender"})

PEER_KEY: web.RequestKey[Principal] = web.RequestKey("shardgrid_peer", Principal)

# A route's policy: the roles that may call it; a route not in the policy is open.
Policy = Mapping[str, frozenset[str]]


def refusal(reason: str, message: str) -> ApiError:
    return ApiError("forbidden" if reason in _FORBIDDEN else "unauthorized", message, reason=reason)


def peer_of(request: web.Request) -> Principal | None:
    """The authenticated sender (None: this server runs without a cluster secret)."""
    return request.get(PEER_KEY)


def require_sender(request: web.Request, role: str, name: str, what: str) -> None:
    """Bind a claim in the body to the authenticated sender: `what` must come from `role:name`."""
    peer = peer_of(request)
    if peer is not None and (peer.role != role or peer.name != name):
        raise refusal("wrong_sender", f"{what} must come from {role}:{name}, not from {peer}")


@dataclass
class PeerGuard:
    """The server side. `table` None: no cluster secret, every route is open (tests, `--insecure`)."""

    table: SessionTable | None
    policy: Policy
    log: Any
    registry: CollectorRegistry | None = None
    # Told of every refusal: (the principal claimed or proven, the peer's address, reason).
    on_refuse: Callable[[str | None, str | None, str], None] | None = None
    _last_log: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refused = Counter("shardgrid_peer_auth_refused", "intra-cluster requests refused, by reason",
                               ["reason"], registry=self.registry)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if self.table is None:
            return await handler(request)
        if request.path == HELLO_PATH:
            return self._hello(request)
        route = request.match_info.route.resource
        roles = self.policy.get(route.canonical) if route is not None else None
        if roles is None:
            return await handler(request)
        header = request.headers.get(AUTH_HEADER)
        try:
            self.table.precheck(header)
            body = await read_body(request)  # only a live session's body is read, and within a deadline
            peer = self.table.verify(header, request.method, request.raw_path, body)
        except PeerAuthError as err:
            return self._refuse(request, err.reason, err.message)
        if peer.role not in roles:
            return self._refuse(request, "wrong_role", f"{peer} may not call {route.canonical}", peer)
        request[PEER_KEY] = peer
        return await handler(request)

    def _hello(self, request: web.Request) -> web.Response:
        assert self.table is not None
        if request.method != "POST":
            return error_response(ApiError("method_not_allowed", f"{HELLO_PATH} takes POST"))
        header = request.headers.get(HELLO_HEADER)
        try:
            welcome = self.table.welcome(parse_hello(header))
        except PeerAuthError as err:
            claimed = (header or "").split(" ")[0][:140] or None
            return self._refuse(request, err.reason, err.message, claimed=claimed)
        return json_response({"ok": True}, headers={WELCOME_HEADER: welcome.header()})

    def _refuse(self, request: web.Request, reason: str, message: str,
                peer: Principal | None = None, claimed: str | None = None) -> web.Response:
        self.refused.labels(reason).inc()
        remote = request.remote or "?"
        if self.on_refuse is not None:
            self.on_refuse(str(peer) if peer else claimed, remote, reason)
        now = time.monotonic()
        # session_unknown is routine (a restart): the client says hello again.
        if reason != "session_unknown" and now - self._last_log.get(remote, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            if len(self._last_log) > 10_000:
                self._last_log.clear()
            self._last_log[remote] = now
            self.log.warning("peer_auth_refused", reason=reason, peer_addr=remote, path=request.path,
                             principal=str(peer) if peer else claimed)
        return error_response(refusal(reason, message), headers={REFUSED_HEADER: reason})

    def revoke(self, who: Principal) -> int:
        """Drop `who`'s sessions at once (its next request says hello and is refused)."""
        return self.table.drop(who) if self.table is not None else 0


class PeerSigner:
    """The client side: an aiohttp client middleware (`ClientSession(middlewares=(signer,))`)."""

    def __init__(self, keys: ClusterKeys, me: Principal) -> None:
        self.keys = keys
        self.me = me
        self._sessions: dict[str, ClientSession] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def __call__(self, req: ClientRequest, handler: ClientHandlerType) -> ClientResponse:
        if req.url.path == HELLO_PATH:
            return await handler(req)
        origin = str(req.url.origin())
        body = b"" if req.body == b"" else await req.body.as_bytes()  # type: ignore[union-attr]
        path_qs = req.url.raw_path_qs
        for attempt in range(2):
            sess = await self._session(req, origin)
            if isinstance(sess, ClientResponse):
                return sess  # the server refused the hello: its 401/403 is the answer
            req.headers[AUTH_HEADER] = sess.sign(req.method, path_qs, body)
            resp = await handler(req)
            if attempt == 0 and resp.status == 401 and resp.headers.get(REFUSED_HEADER) == "session_unknown":
                resp.release()
                if self._sessions.get(origin) is sess:
                    del self._sessions[origin]
                continue
            return resp
        raise AssertionError("unreachable")

    async def _session(self, req: ClientRequest, origin: str) -> ClientSession | ClientResponse:
        sess = self._sessions.get(origin)
        if sess is not None:
            return sess
        lock = self._locks.setdefault(origin, asyncio.Lock())
        async with lock:
            sess = self._sessions.get(origin)
            if sess is not None:
                return sess
            opened = await self._hello(req, origin)
            if isinstance(opened, ClientSession):
                self._sessions[origin] = opened
            return opened

    async def _hello(self, req: ClientRequest, origin: str) -> ClientSession | ClientResponse:
        hello = make_hello(self.keys, self.me)
        resp = await req.session.post(origin + HELLO_PATH, headers={HELLO_HEADER: hello.header()},
                                      middlewares=(), ssl=req.ssl,
                                      timeout=aiohttp.ClientTimeout(total=HELLO_TIMEOUT_S))
        await resp.read()  # the body is kept (and the connection freed): a refusal is handed on as the answer
        if resp.status != 200:
            return resp
        try:
            welcome = parse_welcome(resp.headers.get(WELCOME_HEADER))
            key = open_client_session(self.keys, hello, welcome)
        except PeerAuthError as err:
            # A server without this cluster's secret: as good as unreachable.
            raise aiohttp.ClientResponseError(resp.request_info, resp.history, status=401,
                                              message=f"{origin}: {err.message}") from None
        return ClientSession(welcome.sid, key, welcome.server)


def load_cluster_keys(path: str | None, env_var: str = "SHARDGRID_CLUSTER_SECRET") -> ClusterKeys | None:
    """The cluster secret(s) from `--cluster-secret-file` or the environment (None: none configured)."""
    text = read_secret(path, env_var)
    return ClusterKeys.from_text(text) if text else None
