"""The gateway's model routes: inference through a layer-sharded model, weights updates, listing.

`POST /v1/models/{name}/infer` with `{"input": [[d_model numbers], ...]}`
plans a route (`gateway/layer_route.py`), then calls one replica per hop,
handing each hop's float32 activations to the next. The answer is
`{"output", "route", "tried"}` with `x-route` and `x-served-by` headers. A
hop that fails is retried on the next replica of its group, then through
other groups covering the layers left (the route is planned again from the
layer where it stopped); everything within the request's `x-deadline-ms`.
A route that cannot fit the budget is refused at once: 503 `over_budget`
with the estimate.

`POST /v1/models/{name}/weights` writes a new version through each group's
log: `{"seed": N, "version"?: V}` regenerates the weights from a seed, a
body of `application/octet-stream` is a weights file (the format of
`worker/plugins/layers_model.py`, `?version=V` optional) of which each
group is sent its own layers. Without a version the next one is taken (one
more than the highest any group holds). Groups are updated one by one
(there is no transaction across groups): the answer lists each group's
result, and a retry with the same `x-request-id` and version finishes a
partial update without applying anything twice.
"""
from __future__ import annotations

import asyncio
import math
import re
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import orjson
import xxhash
from aiohttp import web

from gateway.forward import AttemptFailed, Trace, WorkerReply
from gateway.layer_route import (
    DEFAULT_MS_PER_LAYER,
    DEFAULT_OVERHEAD_MS,
    Hop,
    OverBudget,
    ReplicaLoad,
    Uncovered,
    plan_hops,
    plan_route,
)
from gateway.router import MIN_ATTEMPT_S, RESPONSE_MARGIN_S, WORKER_MARGIN_S, ModelRoute, RoutingTable, Target
from meta.client import MetaUnreachable
from shardgrid.common.wire import ApiError, error_body, json_response, short_repr
from topology.model import MAX_INFER_ROWS, WEIGHTS_FORMAT

MAX_WEIGHTS_BYTES = 256 << 20
SUSPECT_S = 2.0  # a replica that failed a call is tried last for this long
# The heartbeat reports in a routing table are as old as the table: the
# gateway adopts a new one only when meta's revision changes. Past this age
# they say nothing any more (the gateway's own observations still do).
REPORT_FRESH_S = 5.0
ESTIMATE_HALF_LIFE_S = 0.5
MIN_LOAD_VARIANCE = 0.25  # of the calls in hand: below it the slope is unknown (taken as 0)
EMA_ALPHA = 0.2
_DIGITS = re.compile(r"[0-9]{1,18}")


def _bad(message: str) -> ApiError:
    return ApiError("bad_request", message)


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"malformed JSON: {exc}") from None


def parse_input(body: Any, d_model: int) -> tuple[bytes, int]:
    """`{"input": [[...], ...]}` as float32 bytes and its row count; 400 on anything else."""
    if not isinstance(body, dict) or set(body) != {"input"}:
        raise _bad('the body must be {"input": [[d_model numbers], ...]}')
    rows = body["input"]
    if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_INFER_ROWS:
        raise _bad(f"input must be a list of 1 to {MAX_INFER_ROWS} rows")
    flat: list[float] = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != d_model:
            raise _bad(f"input[{i}] must be a list of {d_model} numbers (the model's d_model)")
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                    (isinstance(v, float) and not math.isfinite(v)):
                raise _bad(f"input[{i}][{j}] must be a finite number")
        flat.extend(row)
    try:
        return struct.pack(f"<{len(flat)}f", *flat), len(rows)
    except (OverflowError, struct.error):
        raise _bad("input has a value outside the float32 range") from None


def output_rows(raw: bytes, rows: int, d_model: int) -> list[list[float]]:
    flat = struct.unpack(f"<{rows * d_model}f", raw)
    return [list(flat[i * d_model:(i + 1) * d_model]) for i in range(rows)]


def slice_weights(raw: bytes, first: int, last: int) -> bytes:
    """The weights file for layers first..last out of one covering them (no torch here)."""
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise _bad(f"the weights file is not msgpack: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != WEIGHTS_FORMAT or not isinstance(doc.get("layers"), dict):
        raise _bad(f"the weights file must be a {WEIGHTS_FORMAT!r} msgpack map with a 'layers' map")
    layers = doc["layers"]
    missing = [i for i in range(first, last + 1) if str(i) not in layers]
    if missing:
        raise _bad(f"the weights file lacks layers {', '.join(map(str, missing[:10]))}")
    return msgpack.packb({"format": WEIGHTS_FORMAT, "d_model": doc.get("d_model"), "d_hidden": doc.get("d_hidden"),
                          "layers": {str(i): layers[str(i)] for i in range(first, last + 1)}})


@dataclass
class _Seen:
    """The gateway's load model of one worker: how long a hop takes there per
    layer (from sending to the answer: queueing, batching, network, compute:
    what a caller waits) against the number of this gateway's calls the worker
    had in hand when it was sent. A line fitted with exponential forgetting:
    the intercept is what a lone call costs, the slope what each call in hand
    adds (small where batching shares passes, large where it does not). Until
    calls were seen at several loads the slope is taken as zero, so admitted
    load can grow and be measured; a residual deviation keeps it pessimistic,
    and while nothing is measured it drifts back to the default (a model that
    made the gateway refuse every call would otherwise never be corrected)."""

    mean_x: float = 1.0
    mean_y: float = DEFAULT_MS_PER_LAYER
    var_x: float = 0.0
    cov_xy: float = 0.0
    dev: float = 0.0
    measured_at: float | None = None  # monotonic s of the last answer measured
    failed_at: dict[int, float] = field(default_factory=dict)  # group -> when a call there failed

    def observe(self, in_hand: int, ms_per_layer: float, now: float) -> None:
        x, y = float(in_hand), ms_per_layer
        if self.measured_at is None:
            self.mean_x, self.mean_y = x, y
        else:
            a = EMA_ALPHA
            dx, dy = x - self.mean_x, y - self.mean_y
            self.dev += a * (abs(y - self.predict(x)) - self.dev)
            self.mean_x += a * dx
            self.mean_y += a * dy
            self.var_x = (1 - a) * (self.var_x + a * dx * dx)
            self.cov_xy = (1 - a) * (self.cov_xy + a * dx * dy)
        self.measured_at = now

    def predict(self, in_hand: float) -> float:
        slope = max(0.0, self.cov_xy / self.var_x) if self.var_x > MIN_LOAD_VARIANCE else 0.0
        return max(0.0, self.mean_y + slope * (in_hand - self.mean_x))

    def ms_per_layer(self, in_hand: int, now: float) -> float:
        assert self.measured_at is not None
        fade = 0.5 ** (max(0.0, now - self.measured_at) / ESTIMATE_HALF_LIFE_S)
        return DEFAULT_MS_PER_LAYER + (self.predict(in_hand) + self.dev - DEFAULT_MS_PER_LAYER) * fade


class ModelLoads:
    """What this gateway knows of the model workers' load: its own calls in
    flight, the time its calls took, and the workers' heartbeat reports."""

    def __init__(self) -> None:
        self._table_at: tuple[int, float] = (-1, 0.0)  # (revision, when this gateway first used it)
        self.seen: dict[str, _Seen] = {}
        self.inflight: Counter[str] = Counter()  # worker -> this gateway's infer calls to it
        self.forming: Counter[tuple[str, int, int]] = Counter()

    def loads(self, table: RoutingTable, gid: int, start: int, now: float) -> list[ReplicaLoad]:
        g = table.groups.get(gid)
        if g is None:
            return []
        if self._table_at[0] != table.revision:
            self._table_at = (table.revision, now)
        fresh = now - self._table_at[1] <= REPORT_FRESH_S
        out = []
        for wid in (*g.voters, *g.learners):
            w = table.workers.get(wid)
            if w is None or not w.addr or w.live is False:
                continue
            report = _infer_report(table.view, wid, gid) if fresh else {}
            seen = self.seen.get(wid)
            failed_at = seen.failed_at.get(gid, -math.inf) if seen is not None else -math.inf
            warm = report.get("warm", True) is not False and now - failed_at > SUSPECT_S
            # Only the gateway's own count is current (a worker's `queued` is as old as
            # its last answer or heartbeat); other gateways' calls there show in the
            # times measured.
            in_hand = self.inflight[wid] + 1
            if seen is not None and seen.measured_at is not None:
                per_layer, overhead = seen.ms_per_layer(in_hand, now), 0.0
            else:
                # Never measured here: the worker's own compute time per layer, if it said.
                reported = report.get("ms_per_layer")
                per_layer = float(reported) if isinstance(reported, (int, float)) and reported > 0 \
                    else DEFAULT_MS_PER_LAYER
                overhead = DEFAULT_OVERHEAD_MS
            out.append(ReplicaLoad(wid, warm, per_layer, overhead, self.forming[(wid, gid, start)] > 0))
        return out

    def observe(self, wid: str, hop: Hop, elapsed_ms: float, in_hand: int, now: float) -> None:
        """A hop answered after `elapsed_ms`, sent when the worker had `in_hand` calls of ours (with it)."""
        self.seen.setdefault(wid, _Seen()).observe(in_hand, elapsed_ms / max(1, hop.layers), now)

    def failed(self, wid: str, gid: int, now: float) -> None:
        self.seen.setdefault(wid, _Seen()).failed_at[gid] = now


def _infer_report(view: dict[str, Any], wid: str, gid: int) -> dict[str, Any]:
    w = (view.get("workers") or {}).get(wid)
    groups = ((w or {}).get("report") or {}).get("groups") if isinstance(w, dict) else None
    rep = groups.get(str(gid)) if isinstance(groups, dict) else None
    infer = rep.get("infer") if isinstance(rep, dict) else None
    return infer if isinstance(infer, dict) else {}


CallWorker = Callable[[Target, str, int, dict[str, Any], float], Awaitable[WorkerReply]]


class ModelApi:
    def __init__(self, gateway: Any, call: CallWorker | None = None) -> None:
        # The Gateway (gateway/routes.py): its request options, routing table and forwarder.
        self.gw = gateway
        self.loads = ModelLoads()
        self._call = call  # None: the gateway's worker call streams

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/v1/models", self.list_models)
        r.add_get("/v1/models/{name}", self.get_model)
        r.add_post("/v1/models/{name}/infer", self.infer)
        r.add_post("/v1/models/{name}/weights", self.weights)

    async def _model(self, request: web.Request) -> tuple[Any, Trace, RoutingTable, float, ModelRoute]:
        opts, trace = self.gw._begin(request)
        table, deadline = await self.gw._table(opts)
        name = request.match_info["name"]
        model = table.models.get(name)
        if model is None:
            known = ", ".join(sorted(table.models)) or "none"
            raise ApiError("not_found", f"no model {name!r} in the topology (models: {known})")
        return opts, trace, table, deadline, model

    # -- listing

    async def _fresh_view(self, table: RoutingTable) -> dict[str, Any]:
        """Meta's view now (its heartbeat reports are current), else the table's."""
        meta = self.gw.rt.meta
        for _ in range(2):
            try:
                status, body, _ = await meta.request("GET", "/v1/cluster", deadline_s=2.0, attempt_timeout_s=1.0)
            except MetaUnreachable:
                return table.view
            if status != 200 or not isinstance(body, dict):
                return table.view
            leader = body.get("meta_leader")
            if leader is None or body.get("served_by") == leader:
                return body
            # Heartbeat reports live on the meta leader only: ask it.
            http = next((m.get("http") for m in body.get("meta") or () if m.get("id") == leader), None)
            if not http:
                return body
            meta.prefer(http)
        return body

    def _describe(self, table: RoutingTable, view: dict[str, Any], model: ModelRoute) -> dict[str, Any]:
        groups = []
        for g in model.groups:
            route = table.groups.get(g.gid)
            replicas = []
            for wid in (*(route.voters if route else ()), *(route.learners if route else ())):
                rep = _infer_report(view, wid, g.gid)
                w = (view.get("workers") or {}).get(wid)
                replicas.append({"worker": wid, "live": w.get("live") if isinstance(w, dict) else None,
                                 "warm": rep.get("warm"),
                                 "version": rep.get("version"), "queued": rep.get("queued"),
                                 "ms_per_layer": rep.get("ms_per_layer")})
            groups.append({"id": g.gid, "first": g.first, "last": g.last,
                           "leader": route.leader if route else None, "replicas": replicas})
        return {"name": model.name, "layers": model.layers, "d_model": model.d_model, "groups": groups}

    async def list_models(self, request: web.Request) -> web.Response:
        opts, _ = self.gw._begin(request)
        table, _ = await self.gw._table(opts)
        view = await self._fresh_view(table)
        return json_response({"models": [self._describe(table, view, m) for _, m in sorted(table.models.items())]})

    async def get_model(self, request: web.Request) -> web.Response:
        _, _, table, _, model = await self._model(request)
        return json_response(self._describe(table, await self._fresh_view(table), model))

    # -- inference

    async def infer(self, request: web.Request) -> web.Response:
        opts, trace, table, deadline, model = await self._model(request)
        x, rows = parse_input(_json(await request.read()), model.d_model)
        x, route, tried = await self.run_route(table, model, x, rows, deadline, trace)
        trace.outcome = "ok"
        headers = {"x-route": ",".join(f"{e['group']}@{e['worker']}:{e['start_layer']}-{e['end_layer']}"
                                       for e in route),
                   "x-served-by": ",".join(e["worker"] for e in route)}
        return json_response({"output": output_rows(x, rows, model.d_model), "route": route, "tried": tried},
                             headers=headers)

    async def run_route(self, table: RoutingTable, model: ModelRoute, x: bytes, rows: int, deadline: float,
                        trace: Trace) -> tuple[bytes, list[dict[str, Any]], list[dict[str, Any]]]:
        """(the last hop's activations, the route taken, every attempt) by loop-time `deadline`."""
        loop = asyncio.get_running_loop()
        budget_ms = (deadline - loop.time() - RESPONSE_MARGIN_S) * 1000
        avoid: set[int] = set()
        while True:
            hops = self._plan(model, 0, avoid)
            planned = plan_hops(hops, lambda gid, start: self.loads.loads(table, gid, start, time.monotonic()),
                                budget_ms)
            steps = planned.hops if isinstance(planned, OverBudget) else planned
            empty = {p.hop.gid for p in steps if not p.choices}
            if not empty:
                break
            avoid |= empty  # no live replica: route around those groups from the start
        if isinstance(planned, OverBudget):
            trace.outcome = "over_budget"
            raise ApiError("over_budget", f"no route through model {model.name!r} fits the budget: about "
                           f"{planned.estimate_ms:.1f} ms for {len(hops)} hops, {max(0.0, budget_ms):.1f} ms left",
                           estimate_ms=round(planned.estimate_ms, 3), budget_ms=round(max(0.0, budget_ms), 3),
                           hops=[{"group": p.hop.gid, "start_layer": p.hop.start, "end_layer": p.hop.end,
                                  "worker": p.choices[0].worker if p.choices else None,
                                  "estimate_ms": round(p.estimate_ms, 3)} for p in planned.hops])
        route: list[dict[str, Any]] = []
        tried: list[dict[str, Any]] = []
        pos = 0
        queue = list(planned)
        while pos < model.layers:
            if not queue:
                hops = self._plan(model, pos, avoid, tried)
                queue = list(plan_hops(hops, lambda gid, start: self.loads.loads(table, gid, start, time.monotonic()),
                                       math.inf))
            step = queue.pop(0)
            if not step.choices:
                avoid.add(step.hop.gid)
                queue = []
                continue
            out = await self._hop(table, step.hop, [c.worker for c in step.choices], x, rows, deadline, trace, tried)
            if out is None:
                # Every replica of this group failed: go round it from here.
                avoid.add(step.hop.gid)
                queue = []
                continue
            x, entry = out
            route.append(entry)
            pos = step.hop.end + 1
        return x, route, tried

    def _plan(self, model: ModelRoute, pos: int, avoid: set[int],
              tried: list[dict[str, Any]] | None = None) -> list[Hop]:
        try:
            return plan_route(model.name, model.groups, model.layers, pos, avoid)
        except Uncovered as exc:
            errors = [t.get("error", "") for t in tried or () if not t["ok"]]
            if errors and all(e.startswith(("over_budget", "timeout")) for e in errors):
                # Not down: too busy for what was left of the budget.
                raise ApiError("over_budget", f"{exc}: the replicas tried could not answer within the budget "
                               "left", tried=tried) from None
            raise ApiError("unavailable", f"{exc}: every replica tried failed", tried=tried or None) from None

    async def _hop(self, table: RoutingTable, hop: Hop, workers: list[str], x: bytes, rows: int, deadline: float,
                   trace: Trace, tried: list[dict[str, Any]]) -> tuple[bytes, dict[str, Any]] | None:
        """Run one hop on the first replica that answers; None when none did."""
        loop = asyncio.get_running_loop()
        for wid in workers:
            remaining = deadline - loop.time() - RESPONSE_MARGIN_S
            if remaining < MIN_ATTEMPT_S:
                raise ApiError("deadline_exceeded", f"the budget ran out at layer {hop.start} (group {hop.gid})",
                               tried=tried)
            target = table.target(wid)
            if target is None:
                continue
            trace.attempts += 1
            trace.leader = wid
            form = (wid, hop.gid, hop.start)
            self.loads.inflight[wid] += 1
            in_hand = self.loads.inflight[wid]
            self.loads.forming[form] += 1
            t0 = time.monotonic()
            body = {"start": hop.start, "end": hop.end, "rows": rows, "x": x,
                    "deadline_ms": max(1.0, (remaining - WORKER_MARGIN_S) * 1000)}
            try:
                call = self._call if self._call is not None else self.gw.rt.fwd.calls.call
                reply: WorkerReply | None = await call(target, "infer", hop.gid, body, remaining)
                problem = None if reply.ok else f"{reply.code}: {reply.error.get('message', '')}"
            except AttemptFailed as exc:
                reply, problem = None, str(exc)
            finally:
                _decrement(self.loads.inflight, wid)
                _decrement(self.loads.forming, form)
            elapsed_ms = (time.monotonic() - t0) * 1000
            if reply is not None and reply.ok and isinstance(reply.body.get("y"), bytes):
                self.loads.observe(wid, hop, elapsed_ms, in_hand, time.monotonic())
                tried.append({"group": hop.gid, "worker": wid, "ok": True})
                b = reply.body
                return b["y"], {"group": hop.gid, "worker": wid, "start_layer": hop.start, "end_layer": hop.end,
                                "version": b.get("version"), "batch": b.get("batch"),
                                "queue_ms": b.get("queue_ms"), "compute_ms": b.get("compute_ms")}
            if reply is not None and reply.code == "bad_request":
                raise ApiError("internal", f"worker {wid} refused hop {hop.start}-{hop.end} of group {hop.gid}: "
                               f"{problem}")
            self.loads.failed(wid, hop.gid, time.monotonic())
            tried.append({"group": hop.gid, "worker": wid, "ok": False, "error": problem or "malformed answer"})
        return None

    # -- weights

    async def weights(self, request: web.Request) -> web.Response:
        opts, trace, table, deadline, model = await self._model(request)
        raw = await request.read()
        version: Any = request.query.get("version")
        seed: int | None = None
        upload: bytes | None = None
        if request.content_type == "application/octet-stream":
            upload = raw
            if version is not None:
                if not _DIGITS.fullmatch(version):
                    raise _bad(f"version must be a positive integer, got {short_repr(version)}")
                version = int(version)
        else:
            body = _json(raw)
            if not isinstance(body, dict) or not set(body) <= {"seed", "version"} or "seed" not in body:
                raise _bad('the body must be {"seed": N, "version"?: V}, or a weights file sent as '
                           "application/octet-stream")
            seed, version = body["seed"], body.get("version")
            if type(seed) is not int or not 0 <= seed < 2**63:
                raise _bad("seed must be an integer in 0..2**63-1")
        if version is not None and (type(version) is not int or not 1 <= version < 2**63):
            raise _bad("version must be an integer >= 1")
        parts = {g.gid: slice_weights(upload, g.first, g.last) for g in model.groups} if upload is not None else {}
        if version is None:
            version = await self._next_version(model, deadline, trace)
        results = []
        failed = 0
        for g in model.groups:
            op: dict[str, Any] = {"kind": "set_weights", "version": version}
            if upload is not None:
                op["weights"] = parts[g.gid]
            else:
                op["seed"] = seed
            # The write id names the update itself (version and weights), not only
            # the request: a retry of the same update is deduplicated, while another
            # update under a reused request id is a new write that the version rule judges.
            source = str(seed) if upload is None else xxhash.xxh3_64_hexdigest(parts[g.gid])
            rid = f"{opts.request_id}#g{g.gid}v{version}s{source}"
            reply = await self.gw.rt.fwd.write(g.gid, op, rid, "quorum", deadline, trace, len(parts.get(g.gid, b"")))
            if reply.ok and not _took(reply, version):
                # Answered from the dedup table (no result): confirm what the group holds.
                reply = await self._confirm(g.gid, version, deadline, trace)
            if reply.ok:
                results.append({"group": g.gid, "version": version, "seq": reply.seq})
            else:
                failed += 1
                results.append({"group": g.gid, **reply.body})
        body = {"model": model.name, "version": version, "groups": results}
        if failed:
            status = 409 if all(r.get("error", {}).get("code") == "bad_request" for r in results if "error" in r) \
                else 503
            rest = "none did" if failed == len(results) else \
                "the others did: retry with the same x-request-id and version to finish"
            body["error"] = {"code": "conflict" if status == 409 else "unavailable",
                             "message": f"{failed} of {len(results)} groups did not take version {version}; {rest}"}
            return json_response(body, status=status)
        return json_response(body)

    async def _confirm(self, gid: int, version: int, deadline: float, trace: Trace) -> WorkerReply:
        reply = await self.gw.rt.fwd.read(gid, {"kind": "info"}, "strong", 0, deadline, trace)
        if reply.ok and (reply.result or {}).get("version") != version:
            held = (reply.result or {}).get("version")
            return WorkerReply(409, "bad_request", error_body(
                "bad_request", f"group {gid} holds version {held}, not {version}: an earlier attempt with this "
                "request id was refused", shard=gid), reply.served_by, gid, reply.term, reply.seq)
        return reply

    async def _next_version(self, model: ModelRoute, deadline: float, trace: Trace) -> int:
        highest = 0
        for g in model.groups:
            reply = await self.gw.rt.fwd.read(g.gid, {"kind": "info"}, "strong", 0, deadline, trace)
            if not reply.ok:
                raise ApiError(reply.code or "unavailable", f"could not read group {g.gid}'s weights version: "
                               f"{reply.error.get('message')}")
            highest = max(highest, int((reply.result or {}).get("version") or 0))
        return highest + 1


def _took(reply: WorkerReply, version: int) -> bool:
    result = reply.result
    return isinstance(result, dict) and result.get("version") == version


def _decrement(counter: Counter[Any], key: Any) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
