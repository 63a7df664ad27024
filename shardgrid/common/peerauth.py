"""Intra-cluster authentication: who a request comes from, proven without a clock.

Every meta, worker and gateway process holds the cluster secret (one file,
0600; several lines during a rotation: the first signs, every line
verifies). A process is a *principal*, `role:name` (`worker:w1`,
`gateway:g1`, `meta:m1`), and its key is derived from the secret and that
name, so a MAC made with it says who made it.

A client opens a *session* with each server it talks to (one round trip,
`hello`): it sends its principal and a fresh nonce, MACed with its key; the
server answers with a session id and a nonce of its own, and proves that it
holds the secret too. Both then derive a session key from the two nonces.
Every request afterwards carries `sid.seq.mac`, a MAC over the method, the
path, a per-session sequence number and the body's digest; the server keeps
a sliding window of the sequence numbers it has seen (IPsec's anti-replay
window), so a captured request is refused when replayed, with no clock
involved: the clocks of a cluster may disagree or step (DESIGN §4) and
authentication must not care. A server that restarts or evicts a session
answers `session_unknown`, and the client says hello again.

This module is pure (no sockets, no asyncio): `shardgrid/common/peerauth_http.py`
puts it on aiohttp's server and client middlewares.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

ROLES = ("worker", "gateway", "meta")
HELLO_PATH = "/v1/auth/hello"
HELLO_HEADER = "Shardgrid-Hello"
AUTH_HEADER = "Shardgrid-Auth"
PRINCIPAL_HEADER = "Shardgrid-Principal"  # the server's own principal, in a hello answer

REPLAY_WINDOW = 4096           # sequence numbers; concurrent requests may arrive this far out of order
SESSION_IDLE_S = 600.0         # a session unused this long is forgotten (the client says hello again)
MAX_SESSIONS = 4096            # per server, all principals
MAX_SESSIONS_PER_PRINCIPAL = 64
MAC_BYTES = 16
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")

# Why a request was refused: the `reason` of the 401/403 body and the label of
# shardgrid_peer_auth_refused_total.
REFUSAL_REASONS = ("missing", "malformed", "unknown_credentials", "session_unknown", "replayed",
                   "bad_mac", "revoked", "wrong_role", "wrong_sender")


class PeerAuthError(Exception):
    """A request that does not prove who sent it; `reason` is one of REFUSAL_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Principal:
    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


def parse_principal(text: str) -> Principal:
    role, sep, name = text.partition(":")
    if not sep or role not in ROLES or not 0 < len(name) <= 128 or not set(name) <= _NAME_CHARS:
        raise PeerAuthError("malformed", f"a principal is ROLE:NAME with ROLE one of {', '.join(ROLES)}")
    return Principal(role, name)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


class ClusterKeys:
    """The cluster secret(s). The first signs; all verify, so a secret can be
    rotated without a flag day (runbook/deploy.md)."""

    def __init__(self, cluster_secrets: Sequence[str]) -> None:
        if not cluster_secrets:
            raise ValueError("at least one cluster secret is needed")
        self._secrets = [s.encode("utf-8") for s in cluster_secrets]

    @classmethod
    def from_text(cls, text: str) -> "ClusterKeys":
        """One secret per non-blank line."""
        return cls([line.strip() for line in text.splitlines() if line.strip()])

    def __repr__(self) -> str:  # never the secrets themselves
        return f"ClusterKeys({len(self._secrets)} secret(s))"

    @property
    def count(self) -> int:
        return len(self._secrets)

    @property
    def shortest(self) -> int:
        return min(len(s) for s in self._secrets)

    def node_key(self, who: Principal, index: int = 0) -> bytes:
        return _mac(self._secrets[index], b"shardgrid-node-key/v1", str(who).encode())


# -- the hello ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    principal: Principal
    nonce: str
    mac: str

    def header(self) -> str:
        return f"{self.principal} {self.nonce} {self.mac}"


def make_hello(keys: ClusterKeys, me: Principal) -> Hello:
    nonce = secrets.token_hex(16)
    return Hello(me, nonce, _mac(keys.node_key(me), b"hello", str(me).encode(), nonce.encode()).hex())


def parse_hello(header: str | None) -> Hello:
    if header is None:
        raise PeerAuthError("missing", f"a hello needs the {HELLO_HEADER} header")
    parts = header.split(" ")
    if len(parts) != 3 or not _is_hex(parts[1], 32) or not _is_hex(parts[2], 64):
        raise PeerAuthError("malformed", f"{HELLO_HEADER} must be `ROLE:NAME NONCE MAC`")
    return Hello(parse_principal(parts[0]), parts[1], parts[2])


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True, slots=True)
class Welcome:
    """The server's answer to a hello."""

    sid: str
    nonce: str
    server: Principal
    proof: str

    def header(self) -> str:
        return f"{self.sid} {self.nonce} {self.server} {self.proof}"


def parse_welcome(header: str | None) -> Welcome:
    parts = (header or "").split(" ")
    if len(parts) != 4 or not _is_hex(parts[0], 32) or not _is_hex(parts[1], 32) or not _is_hex(parts[3], 64):
        raise PeerAuthError("malformed", "the server's hello answer is not `SID NONCE ROLE:NAME PROOF`")
    return Welcome(parts[0], parts[1], parse_principal(parts[2]), parts[3])


def session_key(node_key: bytes, sid: str, client_nonce: str, server_nonce: str) -> bytes:
    return _mac(node_key, b"session", sid.encode(), client_nonce.encode(), server_nonce.encode())


def _proof(server_key: bytes, hello: Hello, sid: str, server_nonce: str) -> str:
    return _mac(server_key, b"welcome", str(hello.principal).encode(), hello.nonce.encode(),
                sid.encode(), server_nonce.encode()).hex()


def open_client_session(keys: ClusterKeys, hello: Hello, welcome: Welcome) -> bytes:
    """Check the server's proof (it holds the secret too) and derive the session key."""
    for i in range(keys.count):
        if hmac.compare_digest(_proof(keys.node_key(welcome.server, i), hello, welcome.sid, welcome.nonce),
                               welcome.proof):
            return session_key(keys.node_key(hello.principal), welcome.sid, hello.nonce, welcome.nonce)
    raise PeerAuthError("unknown_credentials", f"the server {welcome.server} does not hold this cluster's secret")


# -- requests ----------------------------------------------------------------------------


def body_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def request_mac(key: bytes, method: str, path_qs: str, seq: int, digest: bytes) -> str:
    return _mac(key, method.upper().encode(), path_qs.encode("utf-8", "surrogateescape"),
                str(seq).encode(), digest)[:MAC_BYTES].hex()


def auth_header(sid: str, seq: int, mac: str) -> str:
    return f"{sid}.{seq}.{mac}"


def parse_auth(header: str) -> tuple[str, int, str]:
    parts = header.split(".")
    # isascii: str.isdigit() is true for "²", which int() refuses.
    if (len(parts) != 3 or not _is_hex(parts[0], 32) or not (parts[1].isascii() and parts[1].isdigit())
            or len(parts[1]) > 19 or not _is_hex(parts[2], 2 * MAC_BYTES)):
        raise PeerAuthError("malformed", f"{AUTH_HEADER} must be `SID.SEQ.MAC`")
    return parts[0], int(parts[1]), parts[2]


@dataclass(slots=True)
class _Session:
    principal: Principal
    key: bytes
    used_s: float
    top: int = 0      # the highest sequence number seen
    seen: int = 0     # bit i: top - i was seen (i < REPLAY_WINDOW)
    # A request has proven the client holds the session key. Until then the
    # session may be a replayed hello (an eavesdropper's copy): those are
    # the ones evicted first, so replayed hellos cannot push out live sessions.
    confirmed: bool = False

    def accept(self, seq: int) -> bool:
        """Record `seq`; False when it was seen before or is older than the window."""
        if seq > self.top:
            shift = seq - self.top
            self.seen = ((self.seen << shift) | 1) & _WINDOW_MASK if shift < REPLAY_WINDOW else 1
            self.top = seq
            return True
        back = self.top - seq
        if back >= REPLAY_WINDOW or (self.seen >> back) & 1:
            return False
        self.seen |= 1 << back
        return True


@dataclass
class SessionTable:
    """A server's sessions. `now` is a monotonic clock in seconds (injected: tests and the simulation own time)."""

    keys: ClusterKeys
    me: Principal
    now: Callable[[], float]
    revoked: Callable[[Principal], bool] = lambda _p: False
    _sessions: "OrderedDict[str, _Session]" = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._sessions)

    def welcome(self, hello: Hello) -> Welcome:
        """Check a hello and open a session for it."""
        index = self._verify_hello(hello)
        if self.revoked(hello.principal):
            raise PeerAuthError("revoked", f"{hello.principal} was revoked (topoctl worker admit brings it back)")
        sid, nonce = secrets.token_hex(16), secrets.token_hex(16)
        key = session_key(self.keys.node_key(hello.principal, index), sid, hello.nonce, nonce)
        self._evict(hello.principal)
        self._sessions[sid] = _Session(hello.principal, key, self.now())
        return Welcome(sid, nonce, self.me, _proof(self.keys.node_key(self.me, index), hello, sid, nonce))

    def _verify_hello(self, hello: Hello) -> int:
        msg = (b"hello", str(hello.principal).encode(), hello.nonce.encode())
        for i in range(self.keys.count):
            if hmac.compare_digest(_mac(self.keys.node_key(hello.principal, i), *msg).hex(), hello.mac):
                return i
        raise PeerAuthError("unknown_credentials", "the hello is not signed with this cluster's secret")

    def _evict(self, principal: Principal) -> None:
        """Make room for one more session of `principal`: idle ones go, then the
        oldest unconfirmed ones, and only then the oldest confirmed ones."""
        now = self.now()
        for sid in [s for s, sess in self._sessions.items() if now - sess.used_s > SESSION_IDLE_S]:
            del self._sessions[sid]
        mine = [s for s, sess in self._sessions.items() if sess.principal == principal]
        self._drop_oldest(mine, len(mine) - MAX_SESSIONS_PER_PRINCIPAL + 1)
        self._drop_oldest(list(self._sessions), len(self._sessions) - MAX_SESSIONS + 1)

    def _drop_oldest(self, sids: list[str], n: int) -> None:
        if n <= 0:
            return
        # Oldest first (the table is in least-recently-used order), unconfirmed before confirmed.
        for sid in sorted(sids, key=lambda s: self._sessions[s].confirmed)[:n]:
            del self._sessions[sid]

    def precheck(self, header: str | None) -> Principal:
        """What can be checked before the body is read: the header's shape and
        a live session of a principal not revoked (a stranger's body is never
        read, nor hashed)."""
        if header is None:
            raise PeerAuthError("missing", f"intra-cluster requests need the {AUTH_HEADER} header")
        sid, _, _ = parse_auth(header)
        sess = self._sessions.get(sid)
        if sess is None or self.now() - sess.used_s > SESSION_IDLE_S:
            self._sessions.pop(sid, None)
            raise PeerAuthError("session_unknown", "no such session here (say hello again)")
        if self.revoked(sess.principal):
            del self._sessions[sid]
            raise PeerAuthError("revoked", f"{sess.principal} was revoked")
        return sess.principal

    def verify(self, header: str | None, method: str, path_qs: str, body: bytes) -> Principal:
        """Who sent this request; raise PeerAuthError when it proves nothing."""
        if header is None:
            raise PeerAuthError("missing", f"intra-cluster requests need the {AUTH_HEADER} header")
        sid, seq, mac = parse_auth(header)
        sess = self._sessions.get(sid)
        now = self.now()
        if sess is None or now - sess.used_s > SESSION_IDLE_S:
            self._sessions.pop(sid, None)
            raise PeerAuthError("session_unknown", "no such session here (say hello again)")
        if not hmac.compare_digest(request_mac(sess.key, method, path_qs, seq, body_digest(body)), mac):
            raise PeerAuthError("bad_mac", "the request's MAC does not match its session")
        if self.revoked(sess.principal):
            del self._sessions[sid]
            raise PeerAuthError("revoked", f"{sess.principal} was revoked")
        # Only a request with a good MAC moves the window: a forger cannot burn sequence numbers.
        if not sess.accept(seq):
            raise PeerAuthError("replayed", f"sequence number {seq} of this session was seen before or is too old")
        sess.used_s = now
        sess.confirmed = True
        self._sessions.move_to_end(sid)
        return sess.principal

    def drop(self, principal: Principal) -> int:
        """Forget every session of `principal` (it was revoked)."""
        gone = [s for s, sess in self._sessions.items() if sess.principal == principal]
        for sid in gone:
            del self._sessions[sid]
        return len(gone)


@dataclass
class ClientSession:
    """One client's session with one server."""

    sid: str
    key: bytes
    server: Principal
    seq: int = 0

    def sign(self, method: str, path_qs: str, body: bytes) -> str:
        self.seq += 1
        return auth_header(self.sid, self.seq, request_mac(self.key, method, path_qs, self.seq, body_digest(body)))
