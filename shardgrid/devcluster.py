"""`shardgrid dev`: a whole local cluster as child processes on loopback.

Reads the topology file for the addresses, starts every meta node, waits
until they have elected a leader, applies the topology, starts the workers it
declares, waits until every group has a ready leader, prints where things
are, and on Ctrl-C / SIGTERM stops every child (TERM, then KILL) before
exiting. Logs of each child go to DATA/logs/NAME.log.
"""
from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from meta.client import MetaClient, MetaUnreachable
from shardgrid.procs import Child, stop_all
from topology.loader import load_topology
from topology.model import Topology

DEFAULT_DATA = "data/dev"


def default_topology_path() -> Path:
    return Path(__file__).resolve().parent.parent / "examples" / "topology.yaml"


@dataclass(frozen=True)
class DevOptions:
    data: Path
    fresh: bool
    topology: Path


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def ensure_secret(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32) + "\n", encoding="utf-8")
        path.chmod(0o600)
    return path


def meta_children(topo: Topology, data: Path, secret: Path) -> list[Child]:
    children = []
    for node in topo.meta:
        peers = ",".join(f"{p.id}/{p.raft}/{p.http}" for p in topo.meta if p.id != node.id)
        argv = [sys.executable, "-m", "shardgrid.cli", "meta", "--id", node.id, "--raft", node.raft,
                "--http", node.http, "--peers", peers, "--data", str(data / "meta" / node.id),
                "--secret-file", str(secret)]
        children.append(Child(node.id, argv, data / "logs" / f"{node.id}.log"))
    return children


def worker_children(topo: Topology, data: Path) -> list[Child]:
    meta = ",".join(m.http for m in topo.meta)
    return [Child(w.id, [sys.executable, "-m", "shardgrid.cli", "worker", "--id", w.id, "--http", w.http,
                         "--meta", meta, "--data", str(data / "workers" / w.id), "--zone", w.zone],
                  data / "logs" / f"{w.id}.log")
            for w in topo.workers]


async def wait_groups_ready(addrs: list[str], deadline_s: float) -> dict[str, Any]:
    """Until every group has a leader that finished its start-of-term protocol."""
    deadline = time.monotonic() + deadline_s
    async with MetaClient(addrs) as client:
        while True:
            view = await client.cluster()
            groups = view["groups"]
            if groups and all(g["ready"] for g in groups.values()):
                return view
            if time.monotonic() > deadline:
                waiting = sorted(k for k, g in groups.items() if not g["ready"])
                raise TimeoutError(f"groups {', '.join(waiting)} have no ready leader after {deadline_s:.0f} s")
            await asyncio.sleep(0.1)


async def wait_meta_ready(addrs: list[str], deadline_s: float) -> dict[str, object]:
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


async def apply_topology(addrs: list[str], text: str) -> dict[str, object]:
    async with MetaClient(addrs) as client:
        preview = await client.put_topology(text, dry_run=True)
        if not preview["changed"]:
            return preview
        return await client.put_topology(text, expect_revision=preview["topology_revision"])


def run_dev(opts: DevOptions) -> int:
    topo_text = opts.topology.read_text(encoding="utf-8")
    topo = load_topology(topo_text)
    if opts.fresh and opts.data.exists():
        shutil.rmtree(opts.data)
    opts.data.mkdir(parents=True, exist_ok=True)
    secret = ensure_secret(opts.data / "cluster.secret")
    children = meta_children(topo, opts.data, secret)
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    meta_addrs = [m.http for m in topo.meta]
    try:
        for child in children:
            child.start()
            _say(f"started {child.name} (pid {child.pid}), log {child.log_path}")
        _say("waiting for the meta nodes to elect a leader ...")
        health = asyncio.run(wait_meta_ready(meta_addrs, 30.0))
        _say(f"meta leader: {health['leader']}")
        result = asyncio.run(apply_topology(meta_addrs, topo_text))
        _say(f"topology {opts.topology} applied (topology revision {result['topology_revision']})")
        workers = worker_children(topo, opts.data)
        children.extend(workers)
        for child in workers:
            child.start()
            _say(f"started {child.name} (pid {child.pid}), log {child.log_path}")
        _say("waiting for every group to have a ready leader ...")
        view = asyncio.run(wait_groups_ready(meta_addrs, 60.0))
        for gid, g in sorted(view["groups"].items(), key=lambda kv: int(kv[0])):
            _say(f"  group {gid}: leader {g['leader']} term {g['term']}")
        _say("")
        _say(f"cluster '{topo.cluster}' is up. data: {opts.data}")
        _say(f"  meta:     {', '.join('http://' + a for a in meta_addrs)}")
        _say(f"  workers:  {', '.join('http://' + w.http for w in topo.workers)}")
        _say(f"  try:      topoctl --meta {','.join(meta_addrs)} status")
        _say(f"            curl -s http://{meta_addrs[0]}/v1/cluster")
        _say(f"            curl -s http://{meta_addrs[0]}/v1/topology")
        _say("Ctrl-C stops everything.")
        while not stopping:
            for child in children:
                if not child.alive():
                    _say(f"{child.name} exited with {child.proc.returncode if child.proc else '?'}; "
                         f"see {child.log_path}; stopping")
                    stopping = True
            time.sleep(0.2)
        return 0
    except (TimeoutError, MetaUnreachable) as exc:
        _say(f"shardgrid dev: {exc}")
        return 1
    finally:
        _say("stopping ...")
        codes = stop_all(children)
        _say("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()))
