"""The gateway's OpenAPI document (gateway/openapi.py) against the code it describes.

Routes both ways (a route without docs, or docs of a route that is gone,
fail), the document's structure (OpenAPI 3.1, checked here by hand:
openapi-spec-validator is not a dependency), its error codes against
shardgrid/common/wire.py and the codes the gateway's source raises, the
headers the gateway reads and writes, runbook/api.md against the renderer,
and `GET /openapi.json` on a running gateway.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
from aiohttp import web

from gateway import routes
from gateway.limits import MAX_BODY_BYTES
from gateway.openapi import MARKDOWN_PATH, REGENERATE, build_document, main, operations, render_markdown
from gateway.routes import Gateway, GatewayConfig
from shardgrid.common.wire import STATUS_FOR_CODE
from tests.tier1.test_gateway_fakes import make_fakes, start_gateway

ROOT = Path(__file__).resolve().parents[2]
# (METHOD, path) of routes the gateway serves that the document leaves out on
# purpose, each with the reason. None today: every route of the gateway is public.
UNDOCUMENTED: dict[tuple[str, str], str] = {}
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_document()


def _app() -> web.Application:
    # The router is complete once app() returns: nothing is started, no meta is called.
    return Gateway(GatewayConfig(meta=("127.0.0.1:1",)), structlog.get_logger()).app()


def served_routes(app: web.Application) -> set[tuple[str, str]]:
    routes = {(route.method, resource.canonical) for resource in app.router.resources() for route in resource}
    # aiohttp adds a HEAD for every GET (add_get's allow_head), answered as the GET without a body: left
    # out, as the document does. A HEAD on a path without a GET was added on purpose and must be documented.
    return {(method, path) for method, path in routes if method != "HEAD" or ("GET", path) not in routes}


def route_mismatches(app: web.Application, doc: dict[str, Any]) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """(routes the document lacks, documented routes the gateway does not serve)."""
    served = served_routes(app) - set(UNDOCUMENTED)
    documented = {(method, path) for method, path, _ in operations(doc)}
    return served - documented, documented - served


# -- routes ----------------------------------------------------------------------------------------


def test_every_route_is_documented_and_every_documented_route_exists(doc: dict[str, Any]) -> None:
    undocumented, missing = route_mismatches(_app(), doc)
    assert not undocumented, f"routes without docs in gateway/openapi.py: {sorted(undocumented)}"
    assert not missing, f"documented routes the gateway does not serve: {sorted(missing)}"


def test_the_check_catches_a_new_route_and_a_stale_document(doc: dict[str, Any]) -> None:
    app = _app()

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_post("/items/{id}/touch", handler)
    assert route_mismatches(app, doc) == ({("POST", "/items/{id}/touch")}, set())
    head_only = _app()
    head_only.router.add_head("/only-head", handler)
    assert route_mismatches(head_only, doc) == ({("HEAD", "/only-head")}, set())
    stale = build_document()
    stale["paths"]["/gone"] = {"get": stale["paths"]["/healthz"]["get"]}
    assert route_mismatches(_app(), stale) == (set(), {("GET", "/gone")})


def test_undocumented_routes_still_exist() -> None:
    served = {(route.method, resource.canonical) for resource in _app().router.resources() for route in resource}
    assert set(UNDOCUMENTED) <= served, "an exception for a route the gateway no longer has"
    assert all(reason for reason in UNDOCUMENTED.values())


# -- structure -------------------------------------------------------------------------------------


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"only local refs: {ref}"
    node: Any = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"unresolved $ref {ref}"
        node = node[part]
    return node


def _param(doc: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    return _resolve(doc, p["$ref"]) if "$ref" in p else p


def test_document_structure(doc: dict[str, Any]) -> None:
    assert re.fullmatch(r"3\.1\.\d+", doc["openapi"])
    assert isinstance(doc["info"]["title"], str) and doc["info"]["title"]
    assert isinstance(doc["info"]["version"], str) and doc["info"]["version"]
    assert orjson.loads(orjson.dumps(doc)) == doc, "the document is plain JSON"
    for ref in _refs(doc):
        _resolve(doc, ref)
    tags = {t["name"] for t in doc["tags"]}
    ids: list[str] = []
    for path, item in doc["paths"].items():
        assert path.startswith("/") and not path.endswith("/") or path == "/", path
        assert set(item) <= {*_METHODS, "parameters", "summary", "description"}, (path, set(item))
        templated = set(re.findall(r"{([^}]+)}", path))
        for method, op in item.items():
            if method not in _METHODS:
                continue
            where = f"{method.upper()} {path}"
            ids.append(op["operationId"])
            assert op["tags"] and set(op["tags"]) <= tags, where
            assert op["summary"] and op["description"], where
            params = [_param(doc, p) for p in (*item.get("parameters", ()), *op.get("parameters", ()))]
            keys = [(p["name"].lower(), p["in"]) for p in params]
            assert len(keys) == len(set(keys)), f"{where}: a parameter twice"
            for p in params:
                assert p["in"] in ("path", "query", "header", "cookie") and "schema" in p, (where, p)
                if p["in"] == "header":
                    assert p["name"] == p["name"].lower(), "headers in lower case, as the gateway reads them"
            declared = {p["name"] for p in params if p["in"] == "path"}
            assert declared == templated, f"{where}: path parameters {declared} vs template {templated}"
            assert all(p["required"] is True for p in params if p["in"] == "path"), where
            responses = op["responses"]
            assert responses, where
            assert any(code.startswith("2") for code in responses), f"{where}: no success response"
            for code, resp in responses.items():
                assert re.fullmatch(r"[1-5]\d\d", code), (where, code)
                assert resp["description"], (where, code)
                for media in resp.get("content", {}).values():
                    assert "schema" in media, (where, code)
            body = op.get("requestBody")
            if body is not None:
                assert body["content"] and all("schema" in m for m in body["content"].values()), where
            for requirement in op.get("security", ()):
                assert set(requirement) <= set(doc["components"]["securitySchemes"]), where
    assert len(ids) == len(set(ids)), "operationIds must be unique"
    for name, scheme in doc["components"]["securitySchemes"].items():
        assert scheme["type"] in ("apiKey", "http", "oauth2", "openIdConnect", "mutualTLS"), name
    for name, header in doc["components"]["headers"].items():
        assert "schema" in header and header["description"], name


def test_each_document_is_its_own() -> None:
    first = build_document()
    first["components"]["schemas"]["PutResult"]["properties"]["id"]["minLength"] = 99
    first["components"]["parameters"]["XAck"]["schema"]["enum"].append("none")
    assert build_document() == orjson.loads(orjson.dumps(build_document())) != first


# -- error codes -----------------------------------------------------------------------------------


def _documented_codes(doc: dict[str, Any]) -> dict[str, int]:
    return {code: c["status"] for code, c in doc["components"]["x-error-codes"].items()}


def test_error_codes_match_the_shared_table(doc: dict[str, Any]) -> None:
    documented = _documented_codes(doc)
    not_answered = doc["components"]["x-codes-not-answered"]
    for code, status in documented.items():
        assert STATUS_FOR_CODE.get(code) == status, f"{code}: documented {status}, wire.py {STATUS_FOR_CODE.get(code)}"
    assert not set(documented) & set(not_answered)
    assert set(documented) | set(not_answered) == set(STATUS_FOR_CODE), \
        "a code of wire.STATUS_FOR_CODE is neither documented nor listed as never answered by the gateway"
    enum = doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["enum"]
    assert set(enum) == set(documented)
    for code, c in doc["components"]["x-error-codes"].items():
        assert c["retry"] in ("no", "yes", "same request id", "depends") and c["description"], code


def test_each_operation_lists_codes_under_their_status(doc: dict[str, Any]) -> None:
    documented = _documented_codes(doc)
    used: set[str] = set()
    for method, path, op in operations(doc):
        for status, resp in op["responses"].items():
            for code in resp.get("x-error-codes", ()):
                assert documented.get(code) == int(status), f"{method} {path}: {code} under {status}"
                used.add(code)
    # 405 belongs to no operation: it answers a method the path does not have.
    assert used | {"method_not_allowed"} == set(documented), \
        f"documented codes no operation answers: {set(documented) - used}"


_RAISED = re.compile(r"""(?:ApiError|error_body)\(\s*"(\w+)"|"code":\s*"(\w+)"|\(\s*"(\w+)"\s+if\b""")
# What the gateway's requests run through besides gateway/: the error shape
# (wire.error_for), the body deadline (serving) and bearer checks (auth).
_SOURCES = ("gateway/*.py", "shardgrid/common/wire.py", "shardgrid/common/serving.py",
            "shardgrid/common/auth.py")


def test_every_code_the_gateway_raises_is_documented(doc: dict[str, Any]) -> None:
    raised: dict[str, str] = {}
    for pattern in _SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            for m in _RAISED.finditer(path.read_text()):
                code = next(g for g in m.groups() if g)
                if code in STATUS_FOR_CODE:
                    raised.setdefault(code, str(path.relative_to(ROOT)))
    # wire.error_for maps aiohttp's own HTTP errors (404, 405, 413 ...) to these.
    raised.update({code: "shardgrid/common/wire.py error_for" for code in
                   ("bad_request", "unauthorized", "not_found", "method_not_allowed", "payload_too_large",
                    "internal")})
    undocumented = {code: where for code, where in raised.items() if code not in _documented_codes(doc)}
    assert not undocumented, f"codes raised but not documented: {undocumented}"
    assert {"unavailable", "overloaded", "over_budget", "quorum_timeout", "deadline_exceeded",
            "request_timeout", "conflict"} <= set(raised), "the source scan found too little: fix _RAISED"


# -- headers ---------------------------------------------------------------------------------------

_READS = re.compile(r"""headers\.get\("([\w-]+)"|_header_int\([^,]+,\s*"([\w-]+)\"""")
_WRITES = re.compile(r"""headers\["([\w-]+)"\]\s*=|"(x-[\w-]+)":\s""")


def _scan(regex: re.Pattern[str], files: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    for name in files:
        for m in regex.finditer((ROOT / name).read_text()):
            found.add(next(g for g in m.groups() if g).lower())
    return found


def test_the_headers_the_gateway_reads_and_writes_are_documented(doc: dict[str, Any]) -> None:
    comp = doc["components"]
    request_headers = {p["name"] for p in comp["parameters"].values() if p["in"] == "header"} | {"authorization"}
    response_headers = {resp_name for op in (o for _, _, o in operations(doc)) for r in op["responses"].values()
                        for resp_name in r.get("headers", {})}
    # gateway/reply.py reads a worker's answer headers, not a client's: left out.
    reads = _scan(_READS, ("gateway/routes.py", "gateway/models.py"))
    writes = _scan(_WRITES, ("gateway/routes.py", "gateway/models.py"))
    assert {"x-ack", "x-consistency", "x-min-seq", "x-deadline-ms", "x-request-id", "authorization"} <= reads
    assert {"x-shard", "x-term", "x-seq", "x-served-by", "x-request-id", "retry-after", "x-route"} <= writes
    assert reads <= request_headers, f"read but not documented: {reads - request_headers}"
    assert request_headers <= reads, f"documented but never read: {request_headers - reads}"
    assert writes <= response_headers, f"written but not documented: {writes - response_headers}"
    assert response_headers <= writes, f"documented but never written: {response_headers - writes}"


def test_limits_are_the_ones_routes_enforces(doc: dict[str, Any]) -> None:
    params = doc["components"]["parameters"]
    assert params["XRequestId"]["schema"]["pattern"] == f"^{routes._RID.pattern}$"
    assert params["XDeadlineMs"]["schema"]["maximum"] == routes.MAX_DEADLINE_MS
    assert params["XAck"]["schema"]["enum"] == list(routes.ACKS)
    assert params["XConsistency"]["schema"]["enum"] == list(routes.CONSISTENCIES)
    schemas = doc["components"]["schemas"]
    assert schemas["SearchRequest"]["properties"]["k"]["maximum"] == routes.MAX_K
    assert schemas["BatchRequest"]["properties"]["writes"]["maxItems"] == routes.MAX_BATCH
    shapes = {v["properties"]["op"]["const"]: v for v in schemas["BatchWrite"]["oneOf"]}
    assert set(shapes) == set(routes._BATCH_SHAPES)
    for op, (required, optional) in routes._BATCH_SHAPES.items():
        assert set(shapes[op]["required"]) == set(required), op
        assert set(shapes[op]["properties"]) == {*required, *optional}, op


# -- runbook/api.md --------------------------------------------------------------------------------


def test_runbook_api_md_is_rendered_from_the_document(doc: dict[str, Any]) -> None:
    on_disk = (ROOT / MARKDOWN_PATH).read_text()
    assert on_disk == render_markdown(doc), f"{MARKDOWN_PATH} is stale: run `{REGENERATE}`"
    assert REGENERATE in on_disk
    assert "(api.md)" in (ROOT / "runbook/README.md").read_text(), "runbook/README.md's index lacks api.md"


def test_the_markdown_names_every_route_header_and_code(doc: dict[str, Any]) -> None:
    text = render_markdown(doc)
    for method, path, _ in operations(doc):
        assert f"### `{method} {path}`" in text
    for code, c in doc["components"]["x-error-codes"].items():
        assert f"| {c['status']} | `{code}` |" in text
    for p in doc["components"]["parameters"].values():
        if p["in"] == "header":
            assert f"| `{p['name']}` |" in text


def test_main_prints_the_document_and_the_markdown(doc: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert orjson.loads(capsys.readouterr().out) == doc
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown(doc)


# -- served ----------------------------------------------------------------------------------------


async def test_get_openapi_json_serves_the_document(aiohttp_server: Any, aiohttp_client: Any) -> None:
    f = await make_fakes(aiohttp_server, shards=1)
    client, gw = await start_gateway(aiohttp_client, [f.meta_addr], admin_token="s3cret")
    resp = await client.get("/openapi.json")
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.json() == build_document()
    # The reference stays readable while meta refuses the gateway (data routes answer 503 then).
    gw.admission.state, gw.admission.reason = "refused", "revoked"
    assert (await client.get("/openapi.json")).status == 200
    assert (await client.get("/items/a")).status == 503


async def test_x_request_id_is_answered_as_documented(aiohttp_server: Any, aiohttp_client: Any) -> None:
    """The document says: on a data route's answers once its headers were validated."""
    f = await make_fakes(aiohttp_server, shards=1)
    client, _ = await start_gateway(aiohttp_client, [f.meta_addr])
    ok = await client.put("/items/a", data=b"{}", headers={"x-request-id": "r-1"})
    assert ok.status == 200 and ok.headers["x-request-id"] == "r-1" and "x-seq" in ok.headers
    bad_body = await client.post("/signals", data=b"{}", headers={"x-request-id": "r-2"})
    assert bad_body.status == 400 and bad_body.headers["x-request-id"] == "r-2"
    bad_header = await client.put("/items/a", data=b"{}", headers={"x-request-id": "r-3", "x-ack": "most"})
    assert bad_header.status == 400 and "x-request-id" not in bad_header.headers
    too_large = await client.put("/items/a", data=b"1" * (MAX_BODY_BYTES + 1), headers={"x-request-id": "r-4"})
    assert too_large.status == 413 and "x-request-id" not in too_large.headers
    assert (await too_large.json())["error"]["code"] == "payload_too_large"
