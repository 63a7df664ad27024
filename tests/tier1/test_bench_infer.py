"""`shardgrid bench`'s infer workload without a real cluster: option checks, the request bodies,
the answers' classification, the topology moved onto free ports, the in-process baseline's
batching, and a short end-to-end run against a fake gateway."""
from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web

from shardgrid.bench.run import BenchUsageError, format_report, main_from_args, options_from_args, run_bench
from shardgrid.bench.load import (INFER_POOL, KINDS, LoadConfig, MixError, ShardgridTarget, check_mix_for_target,
                                  classify_infer, infer_body, infer_inputs)
from shardgrid.cli import build_parser
from shardgrid.devcluster import LocalCluster, relocated_topology
from topology.loader import load_topology

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "layers.yaml"
TOPO = str(EXAMPLE)


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["bench", *argv])


def _opts(*argv: str) -> Any:
    return options_from_args(_args(*argv), list(argv))


# -- options -------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--mix", "infer=100"], "--mix infer needs --topology FILE declaring model 'tiny'"),
    (["--cluster", "local", "--mix", "infer=100"], "--mix infer needs --topology FILE"),
    (["--mix", "infer=100", "--topology", TOPO, "--model", "huge"], "no model 'huge' in .*layers.yaml .models: tiny"),
    (["--mix", "infer=1", "--topology", "/nonexistent/topo.yaml"], "--topology /nonexistent/topo.yaml: "),
    (["--target", "inproc", "--topology", TOPO, "--mix", "infer=50,put=50"], "supports only --mix infer=100"),
    (["--target", "inproc", "--topology", TOPO], "supports only --mix infer=100; got put"),
    (["--target", "inproc", "--mix", "infer=100"], "needs --topology"),
    (["--target", "inproc", "--topology", TOPO, "--mix", "infer=1", "--cluster", "local"], "starts no cluster"),
    (["--target", "inproc", "--topology", TOPO, "--mix", "infer=1", "--gateway", "http://127.0.0.1:1"],
     "takes no --gateway"),
    (["--target", "inproc", "--topology", TOPO, "--mix", "infer=1", "--procs", "2"], "--procs must be 1"),
    (["--target", "inproc", "--topology", TOPO, "--mix", "infer=1", "--deadline-ms", "20"],
     "--deadline-ms has no meaning for --target inproc"),
    (["--target", "inproc", "--topology", TOPO, "--mix", "infer=1", "--infer-max-wait-ms", "1"],
     "--infer-max-wait-ms has no meaning"),
    (["--cluster", "local", "--topology", TOPO, "--workers", "5"], "--workers shape a generated topology"),
    (["--cluster", "local", "--topology", TOPO, "--fsync", "none", "--rf", "1"], "--rf, --fsync shape a generated"),
    (["--mix", "infer=1", "--topology", TOPO, "--infer-rows", "0"], "--infer-rows must be between 1 and 1024"),
    (["--mix", "infer=1", "--topology", TOPO, "--infer-rows", "1025"], "--infer-rows must be between 1 and 1024"),
    (["--mix", "put=1", "--infer-rows", "2"], "--infer-rows sizes infer requests, and --mix has none"),
    (["--cluster", "local", "--infer-max-rows", "0"], "--infer-max-rows must be >= 1"),
    (["--cluster", "local", "--infer-max-wait-ms", "-1"], "--infer-max-wait-ms must be between 0 and 1000"),
    (["--mix", "infer=1", "--topology", TOPO, "--infer-max-rows", "1"], "--cluster local passes them"),
    (["--target", "etcd", "--topology", TOPO], "--target etcd has none"),
    (["--cluster", "local", "--target", "etcd", "--infer-max-rows", "1"], "are shardgrid worker flags"),
    (["--topology", TOPO], "this run has neither"),
])
def test_infer_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(BenchUsageError, match=message):
        _opts(*argv)


def test_a_broken_topology_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: x\nshards: [\n")
    with pytest.raises(BenchUsageError, match=f"--topology {bad}: .*invalid YAML"):
        _opts("--cluster", "local", "--topology", str(bad))


def test_usage_errors_exit_2_with_one_line_and_no_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_from_args(_args("--target", "inproc", "--mix", "put=100")) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardgrid bench: ") and "Traceback" not in err and err.count("\n") == 1


def test_infer_options_resolve_the_model_and_the_worker_flags() -> None:
    opts = _opts("--cluster", "local", "--topology", TOPO, "--mix", "infer=100", "--infer-rows", "4",
                 "--infer-max-rows", "1", "--infer-max-wait-ms", "0.5", "--deadline-ms", "20")
    assert opts.topology_text == EXAMPLE.read_text() and opts.topology_path == TOPO
    assert opts.worker_args == ["--infer-max-rows", "1", "--infer-max-wait-ms", "0.5"]
    assert opts.load.model == "tiny" and opts.load.model_dim == 64 and opts.load.infer_rows == 4
    assert opts.load.deadline_ms == 20 and opts.load.model_spec is None  # the spec travels for inproc only
    # A topology without infer in the mix: the cluster starts from it, a plain put load.
    assert _opts("--cluster", "local", "--topology", TOPO).topology_text is not None
    # A running cluster: the file only names the model's shape.
    attached = _opts("--mix", "infer=1", "--topology", TOPO)
    assert attached.load.urls == ("http://127.0.0.1:8080",) and attached.worker_args == []
    inproc = _opts("--target", "inproc", "--topology", TOPO, "--mix", "infer=100", "--infer-max-rows", "8")
    spec = orjson.loads(inproc.load.model_spec)
    assert (spec["name"], spec["layers"], spec["d_model"]) == ("tiny", 24, 64)
    assert inproc.load.infer_max_rows == 8 and inproc.load.urls == ()
    assert _opts("--target", "inproc", "--topology", TOPO, "--mix", "infer=1").load.infer_max_rows == 64


def test_infer_is_a_shardgrid_kind_and_inproc_takes_nothing_else() -> None:
    assert KINDS["infer"] == "POST /v1/models/{model}/infer"
    check_mix_for_target({"infer": 1, "put": 1}, "shardgrid")
    check_mix_for_target({"infer": 1}, "inproc")
    with pytest.raises(MixError, match="supports only put, get, delete"):
        check_mix_for_target({"infer": 1}, "etcd")


# -- request bodies and answers ------------------------------------------------------------------


def test_infer_inputs_are_deterministic_from_the_seed_and_shaped() -> None:
    a = infer_inputs(3, 64, seed=5)
    assert a == infer_inputs(3, 64, seed=5) and a != infer_inputs(3, 64, seed=6)
    assert len(a) == INFER_POOL and all(len(x) == 3 and all(len(r) == 64 for r in x) for x in a)
    assert all(-1.0 <= v <= 1.0 for x in a for r in x for v in r)
    assert len({orjson.dumps(x) for x in a}) == INFER_POOL  # distinct inputs
    assert orjson.loads(infer_body(a[0])) == {"input": a[0]}


def test_shardgrid_target_prepares_infer_requests() -> None:
    import random

    cfg = LoadConfig(mix=(("infer", 1.0),), model="tiny", infer_rows=2, model_dim=8, deadline_ms=20, seed=3,
                     urls=("http://127.0.0.1:9",))
    target = ShardgridTarget(cfg, random.Random(1))
    method, url, body, headers, n = target.prepare("infer")()
    assert (method, str(url), n) == ("POST", "http://127.0.0.1:9/v1/models/tiny/infer", 2)
    assert headers["x-deadline-ms"] == "20" and headers["content-type"] == "application/json"
    assert body is not None and orjson.loads(body)["input"] in infer_inputs(2, 8, seed=3)
    # The model name is a path segment: quoted.
    odd = ShardgridTarget(LoadConfig(mix=(("infer", 1.0),), model="a/b c", model_dim=4), random.Random(1))
    assert str(odd.prepare("infer")()[1]).endswith("/v1/models/a%2Fb%20c/infer")
    assert target.classify("infer") is classify_infer


def test_infer_answers_are_classified_by_status_and_error_code() -> None:
    assert classify_infer(200, b'{"output": [[0.5]]}', 3) == (True, None, 3, None, False)
    over = orjson.dumps({"error": {"code": "over_budget", "estimate_ms": 9.0, "budget_ms": 1}})
    assert classify_infer(503, over, 1) == (False, "over_budget", 0, None, False)
    assert classify_infer(404, b'{"error": {"code": "not_found"}}', 1)[1] == "not_found"
    assert classify_infer(502, b"<html>bad gateway</html>", 1)[1] == "http_502"
    assert classify_infer(201, b"{}", 1)[0] is False  # only 200 is an answer


# -- the local cluster from a file ---------------------------------------------------------------


def test_relocated_topology_moves_every_address_and_keeps_the_rest() -> None:
    text = relocated_topology(EXAMPLE.read_text(), meta_base=21000, worker_base=21200)
    topo, orig = load_topology(text), load_topology(EXAMPLE.read_text())
    assert [(m.id, m.raft, m.http) for m in topo.meta] == [
        ("m1", "127.0.0.1:21000", "127.0.0.1:21100"), ("m2", "127.0.0.1:21001", "127.0.0.1:21101"),
        ("m3", "127.0.0.1:21002", "127.0.0.1:21102")]
    assert [(w.id, w.http, w.zone) for w in topo.workers] == [
        ("w1", "127.0.0.1:21200", "a"), ("w2", "127.0.0.1:21201", "b"), ("w3", "127.0.0.1:21202", "c")]
    assert topo.models == orig.models and topo.settings == orig.settings and topo.groups == orig.groups
    assert topo.shards == orig.shards and topo.cluster == orig.cluster
    with pytest.raises(ValueError):
        relocated_topology("- a list\n", 1, 2)


def test_local_cluster_passes_worker_args_to_every_worker(tmp_path: Path) -> None:
    text = relocated_topology(EXAMPLE.read_text(), meta_base=21000, worker_base=21200)
    cluster = LocalCluster(text, tmp_path, worker_args=["--infer-max-rows", "1"])
    argv = cluster._worker_args("w1", "127.0.0.1:21200", "a")
    assert argv[-2:] == ["--infer-max-rows", "1"] and argv[0] == "worker"
    assert LocalCluster(text, tmp_path)._worker_args("w1", "127.0.0.1:21200", "a")[-1] != "1"


# -- the in-process baseline ---------------------------------------------------------------------


async def test_inproc_sender_computes_the_model_and_batches_queued_requests() -> None:
    from shardgrid.bench.inproc import InprocSender, compute_description

    spec = load_topology(EXAMPLE.read_text()).model("tiny")
    assert spec is not None
    cfg = LoadConfig(target="inproc", mix=(("infer", 1.0),), urls=(), infer_rows=2, model_dim=64, seed=4,
                     model_spec=orjson.dumps(spec.to_dict()).decode(), infer_max_rows=8)
    send = await InprocSender.create(cfg)
    try:
        outs = await asyncio.gather(*(send(0) for _ in range(12)))
        assert outs == [(True, None, 2, None, False)] * 12
        st = send.stats
        assert st.requests == 12 and st.rows == 24
        # All 12 queue before the first pass starts: 4 requests (8 rows) per pass.
        assert st.passes == 3
        from worker.plugins.layers_model import ModelConfig, rows_to_tensor, run_model

        x = rows_to_tensor(infer_inputs(2, 64, seed=4)[0], 64)
        y = send.weights.forward(x, 0, 23)
        assert y.tolist() == run_model(ModelConfig.from_dict(spec.to_dict()), x).tolist()
    finally:
        await send.close()
    assert "up to 8 rows" in compute_description(8) and "one request per forward pass" in compute_description(1)


# -- end to end against a fake gateway -----------------------------------------------------------


class FakeModelGateway:
    """Answers infer with zeros, or refuses with over_budget when the budget is under 5 ms."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/models/{name}/infer", self.infer)
        return app

    async def infer(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        budget = int(request.headers.get("x-deadline-ms", "5000"))
        if budget < 5:
            return web.json_response({"error": {"code": "over_budget", "estimate_ms": 5.0, "budget_ms": budget}},
                                     status=503)
        if request.match_info["name"] != "tiny":
            return web.json_response({"error": {"code": "not_found", "message": "no model"}}, status=404)
        return web.json_response({"output": [[0.0] * 64 for _ in body["input"]], "route": [], "tried": []})


async def _run(argv: list[str]) -> dict[str, Any]:
    opts = options_from_args(_args(*argv), argv)
    return await asyncio.to_thread(run_bench, opts, io.StringIO())


async def test_end_to_end_infer_counts_inferences_rows_and_refusals(aiohttp_server: Any) -> None:
    fake = FakeModelGateway()
    server = await aiohttp_server(fake.app())
    url = f"http://127.0.0.1:{server.port}"
    r = await _run(["--gateway", url, "--topology", TOPO, "--mix", "infer=100", "--infer-rows", "3",
                    "--concurrency", "4", "--duration", "0.5", "--seed", "9"])
    inf = r["infer"]
    assert r["ops"] > 10 and r["errors"]["total"] == 0 and inf["inferences"] == r["ops"]
    assert inf["rows"] == 3 * r["ops"] and inf["rows_per_s"] == pytest.approx(3 * inf["inferences_per_s"], rel=0.01)
    assert r["config"]["model"] == "tiny" and r["config"]["infer_rows"] == 3
    assert r["latency_ms"]["count"] == r["ops"]
    pool = [orjson.dumps(x) for x in infer_inputs(3, 64, seed=9)]
    assert all(orjson.dumps(b["input"]) in pool for b in fake.bodies)
    text = format_report(r)
    assert "inferences/s" in text and "rows/s (3 rows each)" in text and "model tiny, 3 row(s) per request" in text
    refused = await _run(["--gateway", url, "--topology", TOPO, "--mix", "infer=100", "--concurrency", "2",
                          "--duration", "0.3", "--deadline-ms", "1"])
    assert refused["ops"] == 0 and set(refused["errors"]["by_code"]) == {"over_budget"}
    assert refused["errors"]["total"] > 0 and "over_budget" in format_report(refused)


def test_example_topology_is_what_the_tests_assume() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert [m["name"] for m in doc["models"]] == ["tiny"] and doc["models"][0]["d_model"] == 64
