"""`shardgrid gateway`: the stateless public entry point.

Serves the public API of `gateway/routes.py` on `--http`, keeps its routing
table by watching meta (`--meta`, any number of nodes: MetaClient fails over
and follows the meta leader), and shuts down cleanly on SIGTERM/SIGINT:
stop accepting, let in-flight requests finish (each is bounded by its own
deadline), then stop the watch and close the connection pool.
"""
from __future__ import annotations

import asyncio
import signal

import uvloop
from aiohttp import web

from gateway.routes import Gateway, GatewayConfig
from shardgrid.common.gctune import GATEWAY_YOUNG, start_gc_policy
from shardgrid.common.log import setup_logging
from shardgrid.common.serving import app_runner, cap_connections

__all__ = ["GatewayConfig", "main", "serve"]

SHUTDOWN_GRACE_S = 10.0  # longer than the default request deadline (5 s)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


async def serve(cfg: GatewayConfig) -> None:
    log = setup_logging("gateway")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    gateway = Gateway(cfg, log)
    # aiohttp's own access log is off: ours (--access-log) carries shard, leader and attempts.
    runner = app_runner(gateway.app(), shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    cap_connections(runner.server, log)
    host, port = _split(cfg.listen)
    await web.TCPSite(runner, host, port, reuse_address=True, backlog=4096, ssl_context=cfg.tls.server).start()
    gc_policy = start_gc_policy(log, young=GATEWAY_YOUNG)
    log.info("gateway_started", listen=cfg.listen, meta=list(cfg.meta), access_log=cfg.access_log,
             admin_token=cfg.admin_token is not None, https=cfg.tls.server is not None,
             cluster_tls=cfg.tls.client is not None)
    await stop.wait()
    log.info("gateway_stopping")
    gc_policy.cancel()
    await runner.cleanup()  # shutdown (drain) then on_cleanup (watch, pool)
    log.info("gateway_stopped")


def main(cfg: GatewayConfig) -> int:
    uvloop.run(serve(cfg))
    return 0
