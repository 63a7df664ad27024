"""`shardgrid meta`: one metadata-service node (PySyncObj + the HTTP API)."""
from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from pathlib import Path

import uvloop
from aiohttp import web

from meta.raft import MetaRaft, RaftPeer
from meta.server import MetaServer, MetaServerConfig
from shardgrid.common.peerauth import ClusterKeys
from shardgrid.common.gctune import start_gc_policy
from shardgrid.common.log import setup_logging
from shardgrid.common.serving import app_runner, cap_connections
from shardgrid.common.tls import NO_TLS, Tls


@dataclass(frozen=True)
class MetaProcessConfig:
    me: RaftPeer
    peers: list[RaftPeer]
    data_dir: Path
    # Never in a repr: a config that reaches a log line or a traceback must not carry them.
    password: str = field(repr=False)  # the cluster secret (every line verifies peers)
    admin_token: str | None = field(repr=False)
    # PySyncObj's password (None: the cluster secret's first line, with a warning).
    raft_password: str | None = field(default=None, repr=False)
    tls: Tls = field(default=NO_TLS)


def parse_peers(spec: str) -> list[RaftPeer]:
    """`m2/127.0.0.1:7002/127.0.0.1:7102,m3/...` -> peers (id/raft/http)."""
    peers = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split("/")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"bad peer {item!r}: expected ID/RAFT_HOST:PORT/HTTP_HOST:PORT")
        peers.append(RaftPeer(*parts))
    return peers


def _split_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def serve(cfg: MetaProcessConfig) -> None:
    log = setup_logging("meta", cfg.me.id)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if cfg.raft_password is None:
        log.warning("raft_password_shared", message="PySyncObj's password is the cluster secret's first line, which "
                    "workers and gateways hold too: any of them that reaches the raft port can run code on meta; "
                    "give meta nodes --raft-secret-file")
    raft_password = cfg.raft_password or cfg.password.splitlines()[0].strip()
    raft = MetaRaft(cfg.me, cfg.peers, cfg.data_dir, raft_password, loop)
    server = MetaServer(raft, MetaServerConfig(admin_token=cfg.admin_token, client_tls=cfg.tls.client,
                                               node_id=cfg.me.id, cluster_keys=ClusterKeys.from_text(cfg.password)),
                        log)
    # Long-poll watches would hold a graceful shutdown for their whole timeout.
    runner = app_runner(server.app(), shutdown_timeout=1.0)
    await runner.setup()
    cap_connections(runner.server, log)
    host, port = _split_hostport(cfg.me.http)
    await web.TCPSite(runner, host, port, reuse_address=True, ssl_context=cfg.tls.server).start()
    gc_policy = start_gc_policy(log)
    log.info("meta_started", raft=cfg.me.raft, http=cfg.me.http, peers=[p.id for p in cfg.peers],
             data=str(cfg.data_dir), https=cfg.tls.server is not None, workers_tls=cfg.tls.client is not None)
    await stop.wait()
    log.info("meta_stopping")
    gc_policy.cancel()
    await runner.cleanup()
    raft.close()
    log.info("meta_stopped")


def main(cfg: MetaProcessConfig) -> int:
    uvloop.run(serve(cfg))
    return 0
