"""The metrics registry of each server process, built in-process as the process builds it.

For checks over every metric family a process exports (naming conventions,
the names dashboards and alert rules use): a worker (with its HTTP app, whose
peer guard registers on the same registry), a gateway and a meta node (on a
stand-in for its Raft object, which building the metrics never touches).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from gateway.routes import Gateway, GatewayConfig
from meta.server import MetaServer, MetaServerConfig
from worker.process import WorkerConfig, WorkerNode
from worker.server import WorkerApi

# The sample names a family of each type exposes besides its own name
# (prometheus_client's text exposition; `_created` is its creation time).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


class _NoRaft:
    """Stands in for MetaRaft: constructing MetaServer stores it and calls nothing on it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"building meta's metrics used raft.{name}")


@asynccontextmanager
async def process_registries(tmp_path: Path) -> AsyncIterator[dict[str, CollectorRegistry]]:
    """{"worker": ..., "gateway": ..., "meta": ...}; call inside a running event loop."""
    log = structlog.get_logger()
    node = WorkerNode(WorkerConfig("w1", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path), log)
    try:
        WorkerApi(node).app()
        gateway = Gateway(GatewayConfig(meta=("127.0.0.1:2",)), log)
        meta = MetaServer(_NoRaft(), MetaServerConfig(), log)  # type: ignore[arg-type]
        yield {"worker": node.metrics.registry, "gateway": gateway.metrics.http.registry,
               "meta": meta.metrics.registry}
    finally:
        await node.meta.close()
        await node.transport.close()


def families(registry: CollectorRegistry) -> list[Metric]:
    return list(registry.collect())


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry can expose, whether or not a labelled family has a series yet."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def histogram_names(registry: CollectorRegistry) -> set[str]:
    """The histograms' own names, which prose (not a query) names them by."""
    return {family.name for family in registry.collect() if family.type == "histogram"}
