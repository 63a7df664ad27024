"""`shardgrid dev`: a whole local cluster as child processes on loopback.

`LocalCluster` starts every meta node, waits until they elect a leader,
applies the topology, starts the workers it declares and the gateways, and
waits until every group has a ready leader. `shardgrid dev` prints where
things are and, on Ctrl-C / SIGTERM, stops every child (TERM, then KILL)
before exiting; the benchmark reuses `LocalCluster` for `--cluster local`.
Logs of each child go to DATA/logs/NAME.log.

`shardgrid dev` is where a user first meets failures, so a child that exits
does not stop the cluster: it says so (`w1 exited: signal 9 (SIGKILL)`) and
goes on. From a second shell, `shardgrid dev ps|kill|start|add-worker`
(shardgrid/devcontrol.py) lists the children, signals one, restarts one
with its data, or adds a worker the topology does not declare (it registers
as `available`).

Without `--workers/--shards/--gateways` it runs `examples/topology.yaml`;
with them it generates a topology on consecutive loopback ports
(meta 7001-7003/7101-7103, workers from 7201, gateways from 8080).

With `--tls` it makes a throwaway CA and a certificate for 127.0.0.1 and
localhost under DATA/tls, and every listener serves HTTPS and every
intra-cluster call verifies against that CA (runbook/deploy.md, "TLS").
An admin token in SHARDGRID_ADMIN_TOKEN reaches every child (they inherit
the environment) and is used for applying the topology.
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import aiohttp

from meta.client import MetaClient, MetaError, MetaUnreachable
from shardgrid.common.auth import read_secret, write_secret
from shardgrid.devcontrol import DevActions, DevControl, DevControlError, exit_text
from shardgrid.procs import Child, stop_all
from shardgrid.common.tls import DevPki, base_url, client_context, connector_ssl, dev_pki
from topology.loader import load_topology
from topology.model import Topology

DEFAULT_DATA = "data/dev"
ZONES = ("a", "b", "c")


def default_topology_path() -> Path:
    return Path(__file__).resolve().parent.parent / "examples" / "topology.yaml"


def generated_topology(workers: int, shards: int, rf: int | None = None, meta_base: int = 7001,
                       worker_base: int = 7201, settings: str = "{ack: quorum, fsync: batch}") -> str:
    """A topology on loopback with automatic placement (no `groups:`)."""
    rf = rf if rf is not None else min(3, workers)
    lines = ["cluster: dev", f"shards: {shards}", f"replication_factor: {rf}", "plugin: entities", "meta:"]
    lines += [f"  - {{id: m{i + 1}, raft: 127.0.0.1:{meta_base + i}, http: 127.0.0.1:{meta_base + 100 + i}}}"
              for i in range(3)]
    lines.append("workers:")
    lines += [f"  - {{id: w{i + 1}, http: 127.0.0.1:{worker_base + i}, zone: {ZONES[i % len(ZONES)]}}}"
              for i in range(workers)]
    lines.append(f"settings: {settings}")
    return "\n".join(lines) + "\n"


def relocated_topology(text: str, meta_base: int, worker_base: int, host: str = "127.0.0.1") -> str:
    """`text` with its meta nodes on host:meta_base+i (raft) and host:meta_base+100+i (http) and its
    workers on host:worker_base+i, in the file's order; everything else (models, groups, settings) kept.

    The result is YAML again (the file's comments are lost); callers validate it with load_topology.
    """
    import yaml

    doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ValueError("a topology is a mapping")
    for i, m in enumerate(doc.get("meta") or ()):
        m["raft"] = f"{host}:{meta_base + i}"
        m["http"] = f"{host}:{meta_base + 100 + i}"
    for i, w in enumerate(doc.get("workers") or ()):
        w["http"] = f"{host}:{worker_base + i}"
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def ensure_secret(path: Path) -> Path:
    if not path.exists():
        write_secret(path, secrets.token_hex(32))
    elif path.stat().st_mode & 0o077:
        # Dev generated this file itself (an older version wrote it, then
        # chmod'ed it): tighten it rather than have meta refuse it.
        path.chmod(0o600)
    return path


async def wait_meta_ready(addrs: list[str], deadline_s: float, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Until a meta node answers with a known Raft leader."""
    deadline = time.monotonic() + deadline_s
    async with MetaClient(addrs, tls=tls) as client:
        while True:
            try:
                status, body, _ = await client.request("GET", "/healthz", deadline_s=1.0)
                if status == 200 and isinstance(body, dict) and body.get("leader"):
                    return body
            except MetaUnreachable:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"meta nodes {addrs} elected no leader within {deadline_s:.0f} s")
            await asyncio.sleep(0.1)


APPLY_ATTEMPTS = 5


async def apply_topology(addrs: list[str], text: str, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Apply `text` (a no-op when it is what meta holds). Another apply may land
    between the preview and ours (a `topoctl apply` while the cluster starts):
    the compare-and-set then fails, and the plan is made again from what meta
    holds now."""
    token = read_secret(None, "SHARDGRID_ADMIN_TOKEN")
    async with MetaClient(addrs, admin_token=token, tls=tls) as client:
        for attempt in range(APPLY_ATTEMPTS):
            preview = await client.put_topology(text, dry_run=True)
            if not preview["changed"]:
                return preview
            try:
                return await client.put_topology(text, expect_revision=preview["topology_revision"])
            except MetaError as exc:
                if exc.code != "conflict" or attempt == APPLY_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")


async def wait_groups_ready(addrs: list[str], deadline_s: float, balanced: bool = False,
                            tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Until every group has a leader that finished its start-of-term protocol.

    With `balanced`, also until that leader is the group's preferred one: a
    worker slow to start (importing torch) loses its first leadership to a
    failover, and meta's leader balance hands it back some seconds later.
    A measurement must not start before that move, or it measures the move.
    """
    deadline = time.monotonic() + deadline_s
    async with MetaClient(addrs, tls=tls) as client:
        while True:
            view = await client.cluster()
            groups = view["groups"]
            waiting = sorted(k for k, g in groups.items() if not _settled(g, balanced))
            if groups and not waiting:
                return view
            if time.monotonic() > deadline:
                what = "no ready preferred leader" if balanced else "no ready leader"
                raise TimeoutError(f"groups {', '.join(waiting)} have {what} after {deadline_s:.0f} s")
            await asyncio.sleep(0.1)


def _settled(group: dict[str, Any], balanced: bool) -> bool:
    if not group["ready"]:
        return False
    preferred = group.get("preferred_leader")
    return not balanced or preferred is None or group["leader"] == preferred


async def wait_http_ok(urls: list[str], deadline_s: float, tls: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=connector_ssl(tls))) as s:
        for url in urls:
            while True:
                try:
                    async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not answer within {deadline_s:.0f} s")
                await asyncio.sleep(0.1)


class PortsBusy(Exception):
    pass


@dataclass
class LocalCluster:
    """Meta nodes, workers and gateways of one topology as child processes."""

    topology_text: str
    data: Path
    gateways: list[str] = field(default_factory=lambda: ["127.0.0.1:8080"])
    say: Callable[[str], None] = _say
    extra_env: dict[str, str] | None = None
    children: list[Child] = field(default_factory=list)
    # Extra arguments for every gateway (the benchmark passes --no-access-log).
    gateway_args: list[str] = field(default_factory=list)
    # Extra arguments for every worker (the benchmark passes --infer-max-rows/--infer-max-wait-ms).
    worker_args: list[str] = field(default_factory=list)
    # TLS on every listener and intra-cluster call (`shardgrid dev --tls`).
    pki: DevPki | None = None

    def __post_init__(self) -> None:
        self.topo: Topology = load_topology(self.topology_text)
        self.client_tls: ssl.SSLContext | None = client_context(self.pki.ca) if self.pki is not None else None

    def tls_args(self) -> list[str]:
        """Every child's TLS flags: it serves HTTPS and verifies its peers against the dev CA."""
        if self.pki is None:
            return []
        return ["--tls-cert", str(self.pki.cert), "--tls-key", str(self.pki.key), "--tls-ca", str(self.pki.ca)]

    def url(self, addr: str) -> str:
        return base_url(addr, self.client_tls)

    @property
    def meta_addrs(self) -> list[str]:
        return [m.http for m in self.topo.meta]

    def _child(self, name: str, args: list[str]) -> Child:
        child = Child(name, [sys.executable, "-m", "shardgrid.cli", *args], self.data / "logs" / f"{name}.log")
        self.children.append(child)
        self.start_child(child)
        return child

    def start_child(self, child: Child) -> None:
        """(Re)start a child with its own arguments (and so its own data)."""
        child.start(self.extra_env)
        self.say(f"started {child.name} (pid {child.pid}), log {child.log_path}")

    def _worker_args(self, wid: str, http: str, zone: str) -> list[str]:
        return ["worker", "--id", wid, "--http", http, "--meta", ",".join(self.meta_addrs),
                "--data", str(self.data / "workers" / wid), "--zone", zone,
                "--secret-file", str(self.data / "cluster.secret"), *self.tls_args(), *self.worker_args]

    def add_worker(self, extra: list[str] | None = None) -> Child:
        """A worker the topology does not declare, on the next free port after
        the workers' ports: it registers with meta as `available`. `extra`:
        more worker arguments (its advertised capacity)."""
        names = {c.name for c in self.children}
        n = len(self.topo.workers) + 1
        while f"w{n}" in names:
            n += 1
        host, port = _host_port(self.topo.workers[-1].http)
        used = {_host_port(a)[1] for a in self.addresses()} | \
            {_host_port(c.argv[c.argv.index("--http") + 1])[1] for c in self.children if "--http" in c.argv}
        candidate = port + 1
        while candidate in used or not _port_free(host, candidate):
            candidate += 1
            if candidate > 65535:
                raise DevControlError("no free port for another worker")
        return self._child(f"w{n}", [*self._worker_args(f"w{n}", f"{host}:{candidate}", ZONES[(n - 1) % len(ZONES)]),
                                     *(extra or [])])

    def addresses(self) -> list[str]:
        topo = self.topo
        return [*(m.raft for m in topo.meta), *(m.http for m in topo.meta), *(w.http for w in topo.workers),
                *self.gateways]

    def check_ports_free(self) -> None:
        """Fail fast, by name, when another process holds one of our ports."""
        busy = [addr for addr in self.addresses() if not _port_free(*_host_port(addr))]
        if busy:
            raise PortsBusy(f"in use already (another cluster running?): {', '.join(busy)}")

    def start(self, timeout_s: float = 60.0) -> dict[str, Any]:
        self.check_ports_free()
        self.data.mkdir(parents=True, exist_ok=True)
        secret = ensure_secret(self.data / "cluster.secret")
        raft_secret = ensure_secret(self.data / "raft.secret")  # meta's alone: workers and gateways never see it
        topo = self.topo
        for node in topo.meta:
            peers = ",".join(f"{p.id}/{p.raft}/{p.http}" for p in topo.meta if p.id != node.id)
            self._child(node.id, ["meta", "--id", node.id, "--raft", node.raft, "--http", node.http,
                                  "--peers", peers, "--data", str(self.data / "meta" / node.id),
                                  "--secret-file", str(secret), "--raft-secret-file", str(raft_secret),
                                  *self.tls_args()])
        self.say("waiting for the meta nodes to elect a leader ...")
        health = asyncio.run(wait_meta_ready(self.meta_addrs, timeout_s, self.client_tls))
        self.say(f"meta leader: {health['leader']}")
        result = asyncio.run(apply_topology(self.meta_addrs, self.topology_text, self.client_tls))
        self.say(f"topology applied (topology revision {result['topology_revision']})")
        meta = ",".join(self.meta_addrs)
        for w in topo.workers:
            self._child(w.id, self._worker_args(w.id, w.http, w.zone))
        for i, gw in enumerate(self.gateways):
            self._child(f"g{i + 1}", ["gateway", "--http", gw, "--meta", meta, "--id", f"g{i + 1}",
                                      "--secret-file", str(secret), *self.tls_args(), *self.gateway_args])
        self.say("waiting for every group to have a ready leader ...")
        view = asyncio.run(wait_groups_ready(self.meta_addrs, timeout_s, tls=self.client_tls))
        asyncio.run(wait_http_ok([self.url(g) + "/healthz" for g in self.gateways], timeout_s, self.client_tls))
        return view

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]

    def stop(self) -> dict[str, int | None]:
        return stop_all(self.children)


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # SO_REUSEADDR: a port in TIME_WAIT from a stopped cluster is free to use.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class DevOptions:
    data: Path
    fresh: bool
    topology: Path
    workers: int | None = None
    shards: int | None = None
    gateways: int = 1
    gateway_port: int = 8080
    tls: bool = False


def run_dev(opts: DevOptions) -> int:
    if opts.workers is not None or opts.shards is not None:
        text = generated_topology(opts.workers or 3, opts.shards or 3)
    else:
        text = opts.topology.read_text(encoding="utf-8")
    if opts.fresh and opts.data.exists():
        shutil.rmtree(opts.data)
    # A new CA every run: nothing outlives the cluster that could sign for it.
    pki = dev_pki(opts.data / "tls") if opts.tls else None
    cluster = LocalCluster(text, opts.data, pki=pki,
                           gateways=[f"127.0.0.1:{opts.gateway_port + i}" for i in range(opts.gateways)])
    control = DevControl(opts.data, DevActions(children=lambda: list(cluster.children),
                                               start_child=cluster.start_child, add_worker=cluster.add_worker))
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        opts.data.mkdir(parents=True, exist_ok=True)
        control.open()
        view = cluster.start()
        for gid, g in sorted(view["groups"].items(), key=lambda kv: int(kv[0])):
            _say(f"  group {gid}: leader {g['leader']} term {g['term']} voters {','.join(g['voters'])}")
        gw = cluster.url(cluster.gateways[0])
        dim = cluster.topo.settings.embedding_dim
        curl = "curl -s" if pki is None else f"curl -s --cacert {pki.ca}"
        _say("")
        _say(f"cluster '{cluster.topo.cluster}' is up. data: {opts.data}")
        _say(f"  gateway:  {', '.join(cluster.url(g) for g in cluster.gateways)}")
        _say(f"  meta:     {', '.join(cluster.url(a) for a in cluster.meta_addrs)}")
        _say(f"  workers:  {', '.join(cluster.url(w.http) for w in cluster.topo.workers)}")
        if pki is not None:
            _say(f"  TLS:      every listener serves HTTPS; CA certificate {pki.ca} (made for this run; "
                 f"certificate valid for 127.0.0.1, ::1, localhost)")
        _say("  try:")
        _say(f"    {curl} -XPUT {gw}/items/hello -d '{{\"greeting\": \"hi\"}}'")
        _say(f"    {curl} {gw}/items/hello")
        _say(f"    {curl} -XPUT {gw}/embeddings/e1 -d \"{{\\\"vector\\\": $(python3 -c 'print([0.5]*{dim})')}}\""
             f" && {curl} -XPOST {gw}/search -d \"{{\\\"vector\\\": $(python3 -c 'print([0.5]*{dim})'), "
             f"\\\"k\\\": 3}}\"")
        for model in cluster.topo.models:
            ranges = ", ".join(f"group {g.id}: {g.first}-{g.last}" for g in model.groups)
            _say(f"  model '{model.name}': {model.layers} layers, d_model {model.d_model} ({ranges})")
            _say(f"    {curl} -XPOST {gw}/v1/models/{model.name}/infer -d \"{{\\\"input\\\": "
                 f"[$(python3 -c 'print([0.5]*{model.d_model})')]}}\"")
            _say(f"    {curl} -XPOST {gw}/v1/models/{model.name}/weights -d '{{\"seed\": 42}}'   "
                 "# a new version through every group's log")
        tls_arg = "" if pki is None else f" --tls-ca {pki.ca}"
        _say(f"    .venv/bin/topoctl --meta {','.join(cluster.meta_addrs)}{tls_arg} status")
        data_arg = "" if str(opts.data) == DEFAULT_DATA else f" --data {opts.data}"
        _say("  and failures, from another shell (the cluster goes on when a child exits):")
        _say(f"    .venv/bin/shardgrid dev ps{data_arg}")
        _say(f"    .venv/bin/shardgrid dev kill w1{data_arg}      # SIGKILL; watch the failover in topoctl status")
        _say(f"    .venv/bin/shardgrid dev start w1{data_arg}     # back, with its data")
        _say(f"    .venv/bin/shardgrid dev add-worker{data_arg}   # a worker the topology does not declare")
        _say("Ctrl-C stops everything.")
        reported: set[tuple[str, int]] = set()
        while not stopping:
            control.serve(0.2)
            for child in cluster.children:
                if child.proc is not None and not child.alive() and (child.name, child.pid) not in reported:
                    reported.add((child.name, child.pid))
                    _say(f"{child.name} exited: {exit_text(child.proc.returncode)}; the cluster goes on. "
                         f"Log: {child.log_path}; `shardgrid dev start {child.name}` brings it back")
        return 0
    except (TimeoutError, MetaUnreachable, MetaError, PortsBusy, DevControlError) as exc:
        _say(f"shardgrid dev: {exc}")
        return 1
    finally:
        control.close()
        _say("stopping ...")
        codes = cluster.stop()
        _say("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()))
