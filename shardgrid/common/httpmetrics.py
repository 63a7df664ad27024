"""Prometheus metrics for an aiohttp app, on a registry of its own (no globals)."""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


class HttpMetrics:
    def __init__(self, process: str) -> None:
        self.registry = CollectorRegistry()
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
