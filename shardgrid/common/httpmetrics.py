"""Prometheus metrics for an aiohttp app, on a registry of its own (no globals).

Every process's registry also carries what dashboards built for any
Prometheus exporter expect: `shardgrid_build_info`, and prometheus_client's
process, platform and GC collectors (which the default registry would have
had; these registries are per process object, so they are added here).
"""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, GCCollector, PlatformCollector, ProcessCollector,
                               CollectorRegistry, Counter, Gauge, Histogram, generate_latest)

from shardgrid.common.identity import package_version

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def add_process_collectors(registry: CollectorRegistry, role: str, version: str) -> None:
    """`shardgrid_build_info{version, role}` (always 1) and the process_*, python_info and python_gc_* series."""
    info = Gauge("shardgrid_build_info", "the software this process runs (always 1)", ["version", "role"],
                 registry=registry)
    info.labels(version, role).set(1)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class HttpMetrics:
    def __init__(self, process: str, version: str = "") -> None:
        """`version`: what `shardgrid_build_info` says (empty: the installed package's)."""
        self.registry = CollectorRegistry()
        add_process_collectors(self.registry, process, version or package_version())
        self.requests = Counter("shardgrid_http_requests", "HTTP requests served",
                                ["process", "route", "code"], registry=self.registry)
        self.latency = Histogram("shardgrid_http_request_seconds", "HTTP request latency",
                                 ["process", "route"], registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 30))
        self.process = process
        # `labels()` takes a lock and builds a key per call; routes and codes
        # are few, so their children are looked up once.
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def observe(self, route: str, status: int, seconds: float) -> None:
        pair = self._children.get((route, status))
        if pair is None:
            pair = self._children[(route, status)] = (self.requests.labels(self.process, route, str(status)),
                                                      self.latency.labels(self.process, route))
        pair[0].inc()
        pair[1].observe(seconds)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.observe(route_of(request), status, time.perf_counter() - start)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
