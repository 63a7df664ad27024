"""`shardgrid dev`: a whole local cluster as child processes on loopback.

`LocalCluster` starts every meta node, waits until they elect a leader,
applies the topology, starts the workers it declares and the gateways, and
waits until every group has a ready leader. `shardgrid dev` prints where
things are and, on Ctrl-C / SIGTERM, stops every child (TERM, then KILL)
before exiting; the benchmark reuses `LocalCluster` for `--cluster local`.
Logs of each child go to DATA/logs/NAME.log.

Without `--workers/--shards/--gateways` it runs `examples/topology.yaml`;
with them it generates a topology on consecutive loopback ports
(meta 7001-7003/7101-7103, workers from 7201, gateways from 8080).
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import aiohttp

from meta.client import MetaClient, MetaUnreachable
from shardgrid.procs import Child, stop_all
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


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def ensure_secret(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32) + "\n", encoding="utf-8")
        path.chmod(0o600)
    return path


async def wait_meta_ready(addrs: list[str], deadline_s: float) -> dict[str, Any]:
    """Until a meta node answers with a known Raft leader."""
    deadline = time.monotonic() + deadline_s
    async with MetaClient(addrs) as client:
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


async def apply_topology(addrs: list[str], text: str) -> dict[str, Any]:
    async with MetaClient(addrs) as client:
        preview = await client.put_topology(text, dry_run=True)
        if not preview["changed"]:
            return preview
        return await client.put_topology(text, expect_revision=preview["topology_revision"])


async def wait_groups_ready(addrs: list[str], deadline_s: float, balanced: bool = False) -> dict[str, Any]:
    """Until every group has a leader that finished its start-of-term protocol.

    With `balanced`, also until that leader is the group's preferred one: a
    worker slow to start (importing torch) loses its first leadership to a
    failover, and meta's leader balance hands it back some seconds later.
    A measurement must not start before that move, or it measures the move.
    """
    deadline = time.monotonic() + deadline_s
    async with MetaClient(addrs) as client:
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


async def wait_http_ok(urls: list[str], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
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

    def __post_init__(self) -> None:
        self.topo: Topology = load_topology(self.topology_text)

    @property
    def meta_addrs(self) -> list[str]:
        return [m.http for m in self.topo.meta]

    def _child(self, name: str, args: list[str]) -> Child:
        child = Child(name, [sys.executable, "-m", "shardgrid.cli", *args], self.data / "logs" / f"{name}.log")
        child.start(self.extra_env)
        self.children.append(child)
        self.say(f"started {name} (pid {child.pid}), log {child.log_path}")
        return child

    def addresses(self) -> list[str]:
        topo = self.topo
        return [*(m.raft for m in topo.meta), *(m.http for m in topo.meta), *(w.http for w in topo.workers),
                *self.gateways]

    def check_ports_free(self) -> None:
        """Fail fast, by name, when another process holds one of our ports."""
        busy = []
        for addr in self.addresses():
            host, _, port = addr.rpartition(":")
            with socket.socket() as sock:
                # SO_REUSEADDR: a port in TIME_WAIT from a stopped cluster is free to use.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((host, int(port)))
                except OSError:
                    busy.append(addr)
        if busy:
            raise PortsBusy(f"in use already (another cluster running?): {', '.join(busy)}")

    def start(self, timeout_s: float = 60.0) -> dict[str, Any]:
        self.check_ports_free()
        self.data.mkdir(parents=True, exist_ok=True)
        secret = ensure_secret(self.data / "cluster.secret")
        topo = self.topo
        for node in topo.meta:
            peers = ",".join(f"{p.id}/{p.raft}/{p.http}" for p in topo.meta if p.id != node.id)
            self._child(node.id, ["meta", "--id", node.id, "--raft", node.raft, "--http", node.http,
                                  "--peers", peers, "--data", str(self.data / "meta" / node.id),
                                  "--secret-file", str(secret)])
        self.say("waiting for the meta nodes to elect a leader ...")
        health = asyncio.run(wait_meta_ready(self.meta_addrs, timeout_s))
        self.say(f"meta leader: {health['leader']}")
        result = asyncio.run(apply_topology(self.meta_addrs, self.topology_text))
        self.say(f"topology applied (topology revision {result['topology_revision']})")
        meta = ",".join(self.meta_addrs)
        for w in topo.workers:
            self._child(w.id, ["worker", "--id", w.id, "--http", w.http, "--meta", meta,
                               "--data", str(self.data / "workers" / w.id), "--zone", w.zone])
        for i, gw in enumerate(self.gateways):
            self._child(f"g{i + 1}", ["gateway", "--http", gw, "--meta", meta, *self.gateway_args])
        self.say("waiting for every group to have a ready leader ...")
        view = asyncio.run(wait_groups_ready(self.meta_addrs, timeout_s))
        asyncio.run(wait_http_ok([f"http://{g}/healthz" for g in self.gateways], timeout_s))
        return view

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]

    def stop(self) -> dict[str, int | None]:
        return stop_all(self.children)


@dataclass(frozen=True)
class DevOptions:
    data: Path
    fresh: bool
    topology: Path
    workers: int | None = None
    shards: int | None = None
    gateways: int = 1


def run_dev(opts: DevOptions) -> int:
    if opts.workers is not None or opts.shards is not None:
        text = generated_topology(opts.workers or 3, opts.shards or 3)
    else:
        text = opts.topology.read_text(encoding="utf-8")
    if opts.fresh and opts.data.exists():
        shutil.rmtree(opts.data)
    cluster = LocalCluster(text, opts.data, gateways=[f"127.0.0.1:{8080 + i}" for i in range(opts.gateways)])
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        view = cluster.start()
        for gid, g in sorted(view["groups"].items(), key=lambda kv: int(kv[0])):
            _say(f"  group {gid}: leader {g['leader']} term {g['term']} voters {','.join(g['voters'])}")
        gw = cluster.gateways[0]
        dim = cluster.topo.settings.embedding_dim
        _say("")
        _say(f"cluster '{cluster.topo.cluster}' is up. data: {opts.data}")
        _say(f"  gateway:  http://{gw}" + "".join(f", http://{g}" for g in cluster.gateways[1:]))
        _say(f"  meta:     {', '.join('http://' + a for a in cluster.meta_addrs)}")
        _say(f"  workers:  {', '.join('http://' + w.http for w in cluster.topo.workers)}")
        _say("  try:")
        _say(f"    curl -s -XPUT http://{gw}/items/hello -d '{{\"greeting\": \"hi\"}}'")
        _say(f"    curl -s http://{gw}/items/hello")
        _say(f"    curl -s -XPUT http://{gw}/embeddings/e1 -d \"{{\\\"vector\\\": $(python3 -c 'print([0.5]*{dim})')}}\""
             f" && curl -s -XPOST http://{gw}/search -d \"{{\\\"vector\\\": $(python3 -c 'print([0.5]*{dim})'), "
             f"\\\"k\\\": 3}}\"")
        _say(f"    .venv/bin/topoctl --meta {','.join(cluster.meta_addrs)} status")
        _say("Ctrl-C stops everything.")
        while not stopping:
            dead = cluster.dead_children()
            if dead:
                _say(f"{dead[0].name} exited with {dead[0].proc.returncode if dead[0].proc else '?'}; "
                     f"see {dead[0].log_path}; stopping")
                break
            time.sleep(0.2)
        return 0 if not cluster.dead_children() else 1
    except (TimeoutError, MetaUnreachable, PortsBusy) as exc:
        _say(f"shardgrid dev: {exc}")
        return 1
    finally:
        _say("stopping ...")
        codes = cluster.stop()
        _say("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()))
