"""Intra-cluster authentication (shardgrid/common/peerauth.py, shardgrid/common/peerauth_http.py)."""
from __future__ import annotations

from typing import Any, AsyncIterator

import aiohttp
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestServer

from shardgrid.common.peerauth import (AUTH_HEADER, REPLAY_WINDOW, ClusterKeys, PeerAuthError, Principal, SessionTable,
                                _Session, make_hello, parse_principal)
from shardgrid.common.peerauth_http import REFUSED_HEADER, PeerGuard, PeerSigner, peer_of, require_sender
from shardgrid.common.wire import error_middleware, json_response

W1, W2, G1, META = Principal("worker", "w1"), Principal("worker", "w2"), Principal("gateway", "g1"), \
    Principal("meta", "m1")
KEYS = ClusterKeys(["s3cret"])
STORED: web.AppKey[list[Any]] = web.AppKey("stored", list)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_app(table: SessionTable | None, revoked: set[Principal] | None = None) -> tuple[web.Application, PeerGuard]:
    guard = PeerGuard(table, {"/v1/raft": frozenset({"worker"}), "/v1/write": frozenset({"worker", "gateway"}),
                              "/v1/ws": frozenset({"worker"}), "/v1/workers/{wid}/heartbeat": frozenset({"worker"})},
                      structlog.get_logger(), registry=None)
    stored: list[Any] = []

    async def raft(request: web.Request) -> web.Response:
        stored.append(await request.read())
        return json_response({"ok": True, "peer": str(peer_of(request))})

    async def heartbeat(request: web.Request) -> web.Response:
        require_sender(request, "worker", request.match_info["wid"], "a heartbeat")
        stored.append(request.match_info["wid"])
        return json_response({"ok": True})

    async def ws(request: web.Request) -> web.WebSocketResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        await sock.send_str(str(peer_of(request)))
        await sock.close()
        return sock

    async def status(_request: web.Request) -> web.Response:
        return json_response({"ok": True})

    app = web.Application(middlewares=[error_middleware, guard.middleware])
    app.router.add_post("/v1/raft", raft)
    app.router.add_post("/v1/write", raft)
    app.router.add_post("/v1/workers/{wid}/heartbeat", heartbeat)
    app.router.add_get("/v1/ws", ws)
    app.router.add_get("/v1/status", status)
    app[STORED] = stored
    return app, guard


@pytest.fixture
async def server() -> AsyncIterator[tuple[TestServer, SessionTable, Clock, set[Principal]]]:
    clock, revoked = Clock(), set()
    table = SessionTable(KEYS, META, clock, revoked=lambda p: p in revoked)
    app, _ = make_app(table)
    srv = TestServer(app)
    await srv.start_server()
    yield srv, table, clock, revoked
    await srv.close()


def client(keys: ClusterKeys = KEYS, me: Principal = W1) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(middlewares=(PeerSigner(keys, me),))


async def test_a_signed_request_names_its_sender(server: Any) -> None:
    srv, table, _, _ = server
    async with client() as s:
        for _ in range(3):
            async with s.post(srv.make_url("/v1/raft"), data=b"\x93\x01\x02\x03") as r:
                assert r.status == 200 and (await r.json())["peer"] == "worker:w1"
    assert len(table) == 1  # one hello, then the session is reused
    assert srv.app[STORED] == [b"\x93\x01\x02\x03"] * 3


async def test_an_unsigned_request_changes_nothing(server: Any) -> None:
    srv, *_ = server
    async with aiohttp.ClientSession() as s:
        async with s.post(srv.make_url("/v1/raft"), data=b"forged") as r:
            body = await r.json()
            assert r.status == 401 and body["error"]["reason"] == "missing" and r.headers[REFUSED_HEADER] == "missing"
        async with s.get(srv.make_url("/v1/status")) as r:  # an open route stays open
            assert r.status == 200
    assert srv.app[STORED] == []


async def test_the_wrong_secret_is_refused_at_hello(server: Any) -> None:
    srv, *_ = server
    async with client(ClusterKeys(["guess"])) as s:
        async with s.post(srv.make_url("/v1/raft"), data=b"x") as r:  # the hello's refusal is the answer
            assert r.status == 401 and (await r.json())["error"]["reason"] == "unknown_credentials"
        async with s.post(srv.make_url("/v1/raft"), json={"x": 1}) as r:  # read() too, as MetaClient does
            assert r.status == 401 and b"unknown_credentials" in await r.read()
    assert srv.app[STORED] == []


async def _signed_headers(srv: TestServer, path: str, data: bytes) -> dict[str, str]:
    """The headers of one signed POST a member sent (as an eavesdropper would capture them)."""
    captured: dict[str, str] = {}

    async def spy(req: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        resp = await handler(req)
        captured.update(req.headers)
        return resp

    async with aiohttp.ClientSession(middlewares=(spy, PeerSigner(KEYS, W1))) as s:
        async with s.post(srv.make_url(path), data=data) as r:
            assert r.status == 200
    return captured


async def test_a_replayed_or_tampered_request_is_refused(server: Any) -> None:
    srv, *_ = server
    captured = await _signed_headers(srv, "/v1/raft", b"one")
    async with aiohttp.ClientSession() as outsider:
        headers = {AUTH_HEADER: captured[AUTH_HEADER]}
        async with outsider.post(srv.make_url("/v1/raft"), data=b"one", headers=headers) as r:
            assert r.status == 401 and (await r.json())["error"]["reason"] == "replayed"
        async with outsider.post(srv.make_url("/v1/raft"), data=b"two", headers=headers) as r:
            assert r.status == 401 and (await r.json())["error"]["reason"] == "bad_mac"
        async with outsider.post(srv.make_url("/v1/raft?x=1"), data=b"one", headers=headers) as r:
            assert r.status == 401 and (await r.json())["error"]["reason"] == "bad_mac"
    assert srv.app[STORED] == [b"one"]


async def test_a_forgotten_session_is_reopened_transparently(server: Any) -> None:
    srv, table, clock, _ = server
    async with client() as s:
        async with s.post(srv.make_url("/v1/raft"), data=b"a") as r:
            assert r.status == 200
        clock.t += 3600  # idle past SESSION_IDLE_S: the server forgets it, as after a restart
        async with s.post(srv.make_url("/v1/raft"), data=b"b") as r:
            assert r.status == 200
    assert srv.app[STORED] == [b"a", b"b"]


async def test_roles_and_senders_are_bound(server: Any) -> None:
    srv, *_ = server
    async with client(me=G1) as s:
        async with s.post(srv.make_url("/v1/raft"), data=b"x") as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "wrong_role"
        async with s.post(srv.make_url("/v1/write"), data=b"x") as r:
            assert r.status == 200
    async with client(me=W2) as s:
        async with s.post(srv.make_url("/v1/workers/w1/heartbeat"), data=b"{}") as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "wrong_sender"
        async with s.post(srv.make_url("/v1/workers/w2/heartbeat"), data=b"{}") as r:
            assert r.status == 200
    assert srv.app[STORED] == [b"x", "w2"]


async def test_a_revoked_principal_is_refused_at_once(server: Any) -> None:
    srv, _, _, revoked = server
    async with client() as s:
        async with s.post(srv.make_url("/v1/raft"), data=b"a") as r:
            assert r.status == 200
        revoked.add(W1)
        async with s.post(srv.make_url("/v1/raft"), data=b"b") as r:
            assert r.status == 403 and (await r.json())["error"]["reason"] == "revoked"
        async with s.post(srv.make_url("/v1/raft"), data=b"c") as r:  # nor open a new session
            assert r.status == 403 and (await r.json())["error"]["reason"] == "revoked"
    assert srv.app[STORED] == [b"a"]


async def test_a_websocket_upgrade_is_signed(server: Any) -> None:
    srv, *_ = server
    async with client() as s:
        async with s.ws_connect(srv.make_url("/v1/ws")) as sock:
            assert await sock.receive_str() == "worker:w1"
    async with aiohttp.ClientSession() as outsider:
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await outsider.ws_connect(srv.make_url("/v1/ws"))
        assert err.value.status == 401


async def test_a_rotated_secret_verifies_old_and_new() -> None:
    # The servers learn the new secret first (second line), then sign with it (first line).
    clock = Clock()
    table = SessionTable(ClusterKeys(["new", "old"]), META, clock)
    app, _ = make_app(table)
    srv = TestServer(app)
    await srv.start_server()
    try:
        for keys in (ClusterKeys(["old"]), ClusterKeys(["new"]), ClusterKeys(["new", "old"])):
            async with client(keys) as s:
                async with s.post(srv.make_url("/v1/raft"), data=b"x") as r:
                    assert r.status == 200
    finally:
        await srv.close()


async def test_without_a_secret_every_route_is_open() -> None:
    srv = TestServer(make_app(None)[0])
    await srv.start_server()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(srv.make_url("/v1/workers/w1/heartbeat"), data=b"{}") as r:
                assert r.status == 200
            async with s.post(srv.make_url("/v1/write"), data=b"{}") as r:
                assert r.status == 200 and (await r.json())["peer"] == "None"
    finally:
        await srv.close()


def test_the_replay_window_accepts_reordering_and_refuses_repeats() -> None:
    sess = _Session(W1, b"k", 0.0)
    assert sess.accept(5) and sess.accept(3) and sess.accept(4) and not sess.accept(4) and not sess.accept(5)
    assert sess.accept(5 + REPLAY_WINDOW - 1) and sess.accept(6) and not sess.accept(5)
    assert sess.accept(10 * REPLAY_WINDOW) and not sess.accept(10 * REPLAY_WINDOW - REPLAY_WINDOW)
    assert sess.accept(10 * REPLAY_WINDOW - REPLAY_WINDOW + 1)


def test_principals_and_hellos_are_checked() -> None:
    assert parse_principal("worker:w-1.a") == Principal("worker", "w-1.a")
    for bad in ("w1", "root:w1", "worker:", "worker:" + "x" * 200, "worker:a b", "worker:\udcff"):
        with pytest.raises(PeerAuthError):
            parse_principal(bad)
    table = SessionTable(KEYS, META, Clock())
    hello = make_hello(KEYS, W1)
    forged = make_hello(ClusterKeys(["other"]), W1)
    assert table.welcome(hello).server == META
    with pytest.raises(PeerAuthError) as err:
        table.welcome(forged)
    assert err.value.reason == "unknown_credentials"
    # The MAC binds the principal: a hello re-labelled for another worker fails.
    relabelled = type(hello)(W2, hello.nonce, hello.mac)
    with pytest.raises(PeerAuthError):
        table.welcome(relabelled)


def test_sessions_are_bounded_per_principal() -> None:
    from shardgrid.common.peerauth import MAX_SESSIONS_PER_PRINCIPAL
    table = SessionTable(KEYS, META, Clock())
    for _ in range(3 * MAX_SESSIONS_PER_PRINCIPAL):
        table.welcome(make_hello(KEYS, W1))
    table.welcome(make_hello(KEYS, W2))
    assert len(table) == MAX_SESSIONS_PER_PRINCIPAL + 1
    assert table.drop(W1) == MAX_SESSIONS_PER_PRINCIPAL and len(table) == 1


async def test_a_server_without_the_secret_is_not_trusted() -> None:
    # The server must prove it holds the secret too: a client never signs for an impostor.
    table = SessionTable(ClusterKeys(["an-impostor-secret"]), META, Clock())
    impostor = SessionTable(KEYS, META, Clock())
    # The impostor answers hellos with a welcome it signed with the wrong secret.
    table.welcome = lambda hello: _forged_welcome(impostor, hello)  # type: ignore[method-assign]
    srv = TestServer(make_app(table)[0])
    await srv.start_server()
    try:
        async with client() as s:
            with pytest.raises(aiohttp.ClientResponseError) as err:
                await s.post(srv.make_url("/v1/raft"), data=b"x")
        assert "does not hold this cluster's secret" in err.value.message
        assert srv.app[STORED] == []
    finally:
        await srv.close()


def _forged_welcome(real: SessionTable, hello: Any) -> Any:
    w = real.welcome(hello)
    return type(w)(w.sid, w.nonce, w.server, "0" * 64)


async def test_the_method_is_bound(server: Any) -> None:
    srv, *_ = server
    captured = await _signed_headers(srv, "/v1/write", b"")
    async with aiohttp.ClientSession() as outsider:
        # The same signature on another method of a path that takes both.
        async with outsider.get(srv.make_url("/v1/ws"), headers={AUTH_HEADER: captured[AUTH_HEADER]}) as r:
            assert r.status == 401 and (await r.json())["error"]["reason"] in ("bad_mac", "replayed")


async def test_a_forgotten_session_says_hello_again(server: Any) -> None:
    srv, table, clock, _ = server
    hellos: list[str] = []
    welcome = table.welcome
    table.welcome = lambda h: (hellos.append(str(h.principal)), welcome(h))[1]  # type: ignore[method-assign]
    async with client() as s:
        async with s.post(srv.make_url("/v1/raft"), data=b"a") as r:
            assert r.status == 200
        clock.t += 3600
        async with s.post(srv.make_url("/v1/raft"), data=b"b") as r:
            assert r.status == 200
    assert hellos == ["worker:w1", "worker:w1"]


def test_replayed_hellos_never_push_out_a_confirmed_session() -> None:
    from shardgrid.common.peerauth import MAX_SESSIONS, MAX_SESSIONS_PER_PRINCIPAL, request_mac, body_digest, auth_header

    clock = Clock()
    table = SessionTable(KEYS, META, clock)
    hello = make_hello(KEYS, W1)
    welcome = table.welcome(hello)
    from shardgrid.common.peerauth import open_client_session
    key = open_client_session(KEYS, hello, welcome)
    header = auth_header(welcome.sid, 1, request_mac(key, "POST", "/x", 1, body_digest(b"")))
    assert table.verify(header, "POST", "/x", b"") == W1  # confirmed
    for _ in range(3 * MAX_SESSIONS_PER_PRINCIPAL):  # an eavesdropper replays the captured hello
        clock.t += 1
        table.welcome(hello)
    header = auth_header(welcome.sid, 2, request_mac(key, "POST", "/x", 2, body_digest(b"")))
    assert table.verify(header, "POST", "/x", b"") == W1
    for i in range(MAX_SESSIONS + 10):  # a flood of principals fills the whole table
        table.welcome(make_hello(KEYS, Principal("gateway", f"g{i}")))
    assert len(table) <= MAX_SESSIONS
    header = auth_header(welcome.sid, 3, request_mac(key, "POST", "/x", 3, body_digest(b"")))
    assert table.verify(header, "POST", "/x", b"") == W1


async def test_a_non_ascii_digit_sequence_is_malformed_not_a_500(server: Any) -> None:
    srv, *_ = server
    async with aiohttp.ClientSession() as outsider:
        async with outsider.post(srv.make_url("/v1/raft"), data=b"x",
                                 headers={AUTH_HEADER: "0" * 32 + ".\u00b2." + "0" * 32}) as r:
            assert r.status == 401 and (await r.json())["error"]["reason"] == "malformed"
