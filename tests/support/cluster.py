"""Real-process cluster harness for tier3 tests (and anything else that needs one).

Every process runs in its own process group with PR_SET_PDEATHSIG (see
`shardgrid.procs`), and `Cluster.close()` reaps them all; fixtures call it in
a `finally`, so a failing or timed-out test leaves nothing behind.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import orjson

from shardgrid.common.auth import write_secret
from shardgrid.common.peerauth import (AUTH_HEADER, HELLO_HEADER, HELLO_PATH, ClusterKeys, open_client_session,
                                parse_principal, parse_welcome, make_hello)
from shardgrid.common.peerauth import ClientSession as PeerClientSession
from shardgrid.common.peerauth_http import WELCOME_HEADER
from shardgrid.procs import Child, stop_all


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `cond` until it returns a truthy value; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except (OSError, ValueError, KeyError, aiohttp.ClientError, asyncio.TimeoutError, AssertionError) as exc:
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}" +
                         (f" (last error: {last_exc!r})" if last_exc else ""))


def http_json(method: str, url: str, body: Any = None, timeout: float = 2.0,
              headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    """A blocking JSON call (usable from sync code and from inside an event loop alike);
    `context` verifies an https server."""
    data = orjson.dumps(body) if body is not None and not isinstance(body, (bytes, str)) else body
    if isinstance(data, str):
        data = data.encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return status, raw.decode()


class MemberHttp:
    """Blocking calls signed as a cluster member (shardgrid/common/peerauth.py): what tests
    need to call worker routes directly, from any thread."""

    def __init__(self, secret_path: Path, me: str = "gateway:tests") -> None:
        self.keys = ClusterKeys.from_text(secret_path.read_text())
        self.me = parse_principal(me)
        self._sessions: dict[str, PeerClientSession] = {}
        self._lock = threading.Lock()

    def _session(self, origin: str, timeout: float) -> PeerClientSession:
        with self._lock:
            sess = self._sessions.get(origin)
        if sess is not None:
            return sess
        hello = make_hello(self.keys, self.me)
        req = urllib.request.Request(origin + HELLO_PATH, data=b"", method="POST",
                                     headers={HELLO_HEADER: hello.header()})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            welcome = parse_welcome(r.headers.get(WELCOME_HEADER))
        sess = PeerClientSession(welcome.sid, open_client_session(self.keys, hello, welcome), welcome.server)
        with self._lock:
            return self._sessions.setdefault(origin, sess)

    def json(self, method: str, url: str, body: Any = None, timeout: float = 2.0) -> tuple[int, Any]:
        parts = urllib.parse.urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        path_qs = parts.path + (f"?{parts.query}" if parts.query else "")
        data = orjson.dumps(body) if body is not None else b""
        for _ in range(2):
            sess = self._session(origin, timeout)
            with self._lock:
                auth = sess.sign(method, path_qs, data)
            code, answer = http_json(method, url, data if body is not None else None, timeout,
                                     headers={AUTH_HEADER: auth, "Content-Type": "application/json"})
            if code == 401 and isinstance(answer, dict) and answer.get("error", {}).get("reason") == "session_unknown":
                with self._lock:
                    self._sessions.pop(origin, None)
                continue
            return code, answer
        return code, answer


@dataclass
class MetaSpec:
    id: str
    raft: str
    http: str


@dataclass
class Cluster:
    root: Path
    meta: list[MetaSpec]
    workers: list[tuple[str, str, str]]  # (id, http, zone) declared in the topology
    gateways: list[str] = field(default_factory=list)
    children: dict[str, Child] = field(default_factory=dict)
    # Worker id -> the address peers dial instead of its listen address (a proxy).
    advertise: dict[str, str] = field(default_factory=dict)
    # Worker id -> source IP of its outgoing connections (for address-based partitions).
    source: dict[str, str] = field(default_factory=dict)
    # Worker id -> environment variables added to its own (e.g. LD_PRELOAD and
    # FAKETIME for a skewed clock); every start and restart of it gets them.
    worker_env: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def create(cls, root: Path, n_meta: int = 3, n_workers: int = 3, n_gateways: int = 0) -> "Cluster":
        ports = free_ports(2 * n_meta + n_workers + n_gateways)
        meta = [MetaSpec(f"m{i + 1}", f"127.0.0.1:{ports[2 * i]}", f"127.0.0.1:{ports[2 * i + 1]}")
                for i in range(n_meta)]
        zones = "abc"
        workers = [(f"w{i + 1}", f"127.0.0.1:{ports[2 * n_meta + i]}", zones[i % 3]) for i in range(n_workers)]
        gateways = [f"127.0.0.1:{p}" for p in ports[2 * n_meta + n_workers:]]
        root.mkdir(parents=True, exist_ok=True)
        write_secret(root / "cluster.secret", "tier3-test-secret")
        return cls(root, meta, workers, gateways=gateways)

    @property
    def secret_path(self) -> Path:
        return self.root / "cluster.secret"

    def member(self) -> MemberHttp:
        """A signed client (principal gateway:tests) for calling worker routes directly."""
        return MemberHttp(self.secret_path)

    # -- topology ------------------------------------------------------------------

    def topology_yaml(self, shards: int = 3, rf: int = 3, lease_ms: int = 1500, cluster: str = "tier3",
                      snapshot_every: int = 10000, groups: list[tuple[int, str, list[str]]] | None = None,
                      declared: int | None = None, settings: str = "") -> str:
        """`declared`: only the first N workers go in the file (the rest join as
        `available`); `settings`: more `key: value` pairs for `settings:`."""
        lines = [f"cluster: {cluster}", f"shards: {shards}", f"replication_factor: {rf}", "plugin: entities",
                 "meta:"]
        lines += [f"  - {{id: {m.id}, raft: '{m.raft}', http: '{m.http}'}}" for m in self.meta]
        lines.append("workers:")
        lines += [f"  - {{id: {w}, http: '{h}', zone: {z}}}" for w, h, z in self.workers[:declared]]
        if groups:
            lines.append("groups:")
            lines += [f"  - {{id: {gid}, leader: {leader}, replicas: [{', '.join(reps)}]}}" for gid, leader, reps in groups]
        lines.append(f"settings: {{ack: quorum, quorum_timeout_ms: 2000, lease_ms: {lease_ms}, fsync: batch, "
                     f"snapshot_every: {snapshot_every}{', ' + settings if settings else ''}}}")
        return "\n".join(lines) + "\n"

    def write_topology(self, text: str, name: str = "topology.yaml") -> Path:
        path = self.root / name
        path.write_text(text)
        return path

    @property
    def meta_addrs(self) -> str:
        return ",".join(m.http for m in self.meta)

    # -- meta processes --------------------------------------------------------------

    def _meta_child(self, m: MetaSpec) -> Child:
        peers = ",".join(f"{p.id}/{p.raft}/{p.http}" for p in self.meta if p.id != m.id)
        raft_secret = self.root / "raft.secret"
        if not raft_secret.exists():
            write_secret(raft_secret, "tier3-raft-secret-" + self.root.name)
        argv = [sys.executable, "-m", "shardgrid.cli", "meta", "--id", m.id, "--raft", m.raft, "--http", m.http,
                "--peers", peers, "--data", str(self.root / "meta" / m.id),
                "--secret-file", str(self.secret_path), "--raft-secret-file", str(raft_secret)]
        return Child(m.id, argv, self.root / "logs" / f"{m.id}.log")

    def start_meta(self, ids: list[str] | None = None) -> None:
        for m in self.meta:
            if ids is None or m.id in ids:
                child = self._meta_child(m)
                child.start()
                self.children[m.id] = child

    def meta_spec(self, mid: str) -> MetaSpec:
        return next(m for m in self.meta if m.id == mid)

    def status(self, mid: str) -> dict[str, Any]:
        code, body = http_json("GET", f"http://{self.meta_spec(mid).http}/v1/status", timeout=1.0)
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    def leader(self, among: list[str] | None = None) -> str | None:
        """The meta leader as every live node in `among` agrees on it, else None."""
        seen = set()
        for m in self.meta:
            if among is not None and m.id not in among:
                continue
            seen.add(self.status(m.id)["leader"])
        return seen.pop() if len(seen) == 1 and None not in seen else None

    def wait_leader(self, among: list[str] | None = None, timeout: float = 15.0) -> str:
        return str(wait_until(lambda: self.leader(among), timeout, "a meta leader everyone agrees on"))

    def boot(self, topology: str, gateways: bool = False) -> None:
        """Meta nodes, the topology applied, workers with ready leaders, then gateways."""
        self.start_meta()
        self.wait_leader()
        # --no-wait: nothing can converge before the workers start.
        res = self.topoctl("apply", str(self.write_topology(topology)), "--no-wait")
        assert res.returncode == 0, res.stderr
        self.start_workers()
        self.wait_groups_ready(timeout=30)
        if gateways:
            self.start_gateways()

    # -- workers ---------------------------------------------------------------------

    def _worker_child(self, wid: str) -> Child:
        _, http, zone = next(w for w in self.workers if w[0] == wid)
        argv = [sys.executable, "-m", "shardgrid.cli", "worker", "--id", wid, "--http", http,
                "--meta", self.meta_addrs, "--data", str(self.root / "workers" / wid), "--zone", zone,
                "--secret-file", str(self.secret_path)]
        if wid in self.advertise:
            argv += ["--advertise", self.advertise[wid]]
        if wid in self.source:
            argv += ["--source-addr", self.source[wid]]
        return Child(wid, argv, self.root / "logs" / f"{wid}.log")

    def start_workers(self, ids: list[str] | None = None) -> None:
        for wid, _, _ in self.workers:
            if ids is None or wid in ids:
                child = self._worker_child(wid)
                extra = self.worker_env.get(wid)
                child.start({**os.environ, **extra} if extra else None)
                self.children[wid] = child

    def start_gateways(self) -> None:
        for i, addr in enumerate(self.gateways):
            name = f"g{i + 1}"
            child = Child(name, [sys.executable, "-m", "shardgrid.cli", "gateway", "--http", addr,
                                 "--meta", self.meta_addrs, "--id", name, "--secret-file", str(self.secret_path)],
                          self.root / "logs" / f"{name}.log")
            child.start()
            self.children[name] = child
        for addr in self.gateways:
            wait_until(lambda: http_json("GET", f"http://{addr}/healthz", timeout=1.0)[0] == 200, 20.0,
                       f"gateway {addr} to answer")

    def worker_addr(self, wid: str) -> str:
        return next(h for w, h, _ in self.workers if w == wid)

    def view(self) -> dict[str, Any]:
        """The cluster view, from the meta leader when one is known (followers may lag)."""
        alive = [m for m in self.meta if m.id in self.children and self.children[m.id].alive()]
        order = list(alive)
        for m in alive:
            try:
                leader = self.status(m.id)["leader"]
            except (OSError, AssertionError):
                continue
            order = sorted(alive, key=lambda x: x.id != leader)
            break
        for m in order:
            try:
                code, body = http_json("GET", f"http://{m.http}/v1/cluster", timeout=2.0)
            except OSError:
                continue
            if code == 200:
                return body  # type: ignore[no-any-return]
        raise AssertionError("no meta node answered /v1/cluster")

    def wait_groups_ready(self, timeout: float = 20.0, exclude_leader: str | None = None) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            v = self.view()
            gs = v["groups"]
            if gs and all(g["ready"] and g["leader"] != exclude_leader for g in gs.values()):
                return v
            return None
        return wait_until(ready, timeout, "every group to have a ready leader", interval=0.1)  # type: ignore[no-any-return]

    def worker_status(self, wid: str) -> dict[str, Any]:
        code, body = http_json("GET", f"http://{self.worker_addr(wid)}/v1/status", timeout=2.0)
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    def kill(self, name: str) -> None:
        self.children[name].kill()

    def close(self) -> None:
        stop_all(list(self.children.values()))

    # -- CLI -----------------------------------------------------------------------------

    def topoctl(self, *args: str, timeout: float = 30.0, meta: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shardgrid.topoctl", "--meta", meta or self.meta_addrs,
                               "--timeout", str(max(1.0, timeout - 1.0)), *args],
                              capture_output=True, text=True, timeout=timeout + 10)


class DevRun:
    """`shardgrid dev ARGS` as a child in its own process group, its output collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "shardgrid.cli", "dev", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_up(self, timeout: float) -> str:
        """Wait for the banner (or an exit); return the output so far."""
        wait_until(lambda: any("Ctrl-C stops everything" in ln for ln in self.lines) or self.proc.poll() is not None,
                   timeout, "shardgrid dev to be up", interval=0.2)
        assert self.proc.poll() is None, self.output
        return self.output

    def kill(self) -> None:
        """SIGKILL the whole group (its children too), if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
