"""The layers plugin on a real cluster: the example model served across overlapping
ranges, bit-equal to `shardgrid model run`, through a SIGKILL and a weights update."""
from __future__ import annotations

import asyncio
import random
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import orjson
import pytest
import yaml

from tests.support.cluster import Cluster, http_json, wait_until

pytestmark = pytest.mark.tier3

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "layers.yaml"
D_MODEL = 64


def topology(c: Cluster) -> str:
    """The test cluster's addresses with the example's model (24 layers on 0-11, 8-17, 14-23, RF 2)."""
    models = yaml.safe_load(EXAMPLE.read_text())["models"]
    # snapshot_every 2: a few weights updates compact a group's log (a new replica must download the snapshot).
    return c.topology_yaml(shards=1, rf=3, snapshot_every=2) + yaml.safe_dump({"models": models})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster.create(tmp_path_factory.mktemp("models") / "cluster", n_workers=3, n_gateways=1)
    try:
        text = topology(c)
        c.boot(text, gateways=True)
        c.write_topology(text, "models.yaml")
        yield c
    finally:
        c.close()


def rows(n: int, seed: int) -> list[list[float]]:
    rnd = random.Random(seed)
    return [[round(rnd.uniform(-2, 2), 5) for _ in range(D_MODEL)] for _ in range(n)]


def f32(out: list[list[float]]) -> bytes:
    return b"".join(struct.pack(f"<{len(r)}f", *r) for r in out)


def reference(c: Cluster, inputs: list[list[float]], seed: int | None = None) -> bytes:
    path = c.root / f"input-{len(inputs)}-{seed}.json"
    path.write_bytes(orjson.dumps({"input": inputs}))
    argv = [sys.executable, "-m", "shardgrid.cli", "model", "run", "--topology", str(c.root / "models.yaml"),
            "--model", "tiny", "--input", str(path)] + (["--seed", str(seed)] if seed is not None else [])
    res = subprocess.run(argv, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    return f32(orjson.loads(res.stdout)["output"])


def references(c: Cluster, inputs: list[list[list[float]]], seed: int | None = None) -> dict[bytes, bytes]:
    """Each distinct input's reference, from one `model run` over all their rows
    (a row's output does not depend on the rows beside it)."""
    distinct = list({orjson.dumps(inp): inp for inp in inputs}.items())
    whole = reference(c, [r for _, inp in distinct for r in inp], seed)
    out, at = {}, 0
    for key, inp in distinct:
        size = len(inp) * D_MODEL * 4
        out[key] = whole[at:at + size]
        at += size
    return out


def infer(c: Cluster, inputs: list[list[float]], deadline_ms: int = 5000) -> tuple[int, Any, float]:
    t0 = time.monotonic()
    code, body = http_json("POST", f"http://{c.gateways[0]}/v1/models/tiny/infer", {"input": inputs},
                           timeout=10.0, headers={"x-deadline-ms": str(deadline_ms)})
    return code, body, time.monotonic() - t0


@dataclass
class Load:
    """Concurrent infer requests from one thread, bounded in count and time."""

    c: Cluster
    clients: int = 8
    deadline_ms: int = 3000
    max_requests: int = 3000
    answers: list[tuple[int, Any, list[list[float]]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    async def _client(self, session: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while not self.stop.is_set() and len(self.answers) < self.max_requests:
            inputs = rows(1 + (i % 3), seed=1000 * k + i % 5)
            i += 1
            async with session.post(f"http://{self.c.gateways[0]}/v1/models/tiny/infer",
                                    data=orjson.dumps({"input": inputs}),
                                    headers={"x-deadline-ms": str(self.deadline_ms)}) as r:
                self.answers.append((r.status, orjson.loads(await r.read()), inputs))

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            await asyncio.wait_for(asyncio.gather(*(self._client(s, k) for k in range(self.clients))), 90)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        t.start()
        return t


def test_outputs_equal_the_one_process_run_bit_for_bit_alone_and_batched(cluster: Cluster) -> None:
    inputs = rows(5, seed=1)
    code, body, _ = infer(cluster, inputs)
    assert code == 200, body
    assert f32(body["output"]) == reference(cluster, inputs)
    # Fewest hops over the overlapping ranges, each layer once.
    assert [(h["group"], h["start_layer"], h["end_layer"]) for h in body["route"]] == [(1, 0, 11), (2, 12, 17),
                                                                                      (3, 18, 23)]
    assert {h["version"] for h in body["route"]} == {1}
    # Concurrent requests are batched with each other; each still gets its own exact rows.
    load = Load(cluster, clients=16, max_requests=300)
    load.start().join(timeout=120)
    assert len(load.answers) >= 300
    refs = references(cluster, [inp for _, _, inp in load.answers])
    batched = 0
    for status, ans, inp in load.answers:
        assert status == 200, ans
        assert f32(ans["output"]) == refs[orjson.dumps(inp)]
        batched += any(h["batch"] > 1 for h in ans["route"])
    assert batched > 0, "no request shared a forward pass with another"


def test_an_impossible_budget_is_refused_at_once(cluster: Cluster) -> None:
    code, body, took = infer(cluster, rows(1, seed=2), deadline_ms=1)
    assert code == 503 and body["error"]["code"] == "over_budget", body
    assert body["error"]["estimate_ms"] > body["error"]["budget_ms"]
    assert took < 0.5


def test_a_weights_update_under_load_never_mixes_versions_in_a_hop_and_reaches_every_replica(
        cluster: Cluster) -> None:
    load = Load(cluster, clients=8, max_requests=2000)
    t = load.start()
    wait_until(lambda: len(load.answers) >= 50, 30, "load to start")
    code, body = http_json("POST", f"http://{cluster.gateways[0]}/v1/models/tiny/weights", {"seed": 99},
                           timeout=15.0, headers={"x-request-id": "weights-v2"})
    assert code == 200, body
    assert body["version"] == 2 and [g["version"] for g in body["groups"]] == [2, 2, 2]
    seen = len(load.answers)
    wait_until(lambda: len(load.answers) >= seen + 100, 30, "load to go on after the update")
    load.stop.set()
    t.join(timeout=30)
    inputs = [inp for _, _, inp in load.answers]
    v1, v2 = references(cluster, inputs), references(cluster, inputs, seed=99)
    new = 0
    for status, ans, inp in load.answers:
        assert status == 200, ans
        versions = [h["version"] for h in ans["route"]]
        assert all(v in (1, 2) for v in versions)
        if versions == [1, 1, 1]:
            want = v1[orjson.dumps(inp)]
        elif versions == [2, 2, 2]:
            want, new = v2[orjson.dumps(inp)], new + 1
        else:
            continue  # hops at different versions while the groups were updated one by one
        # One version per hop, and the whole answer is exactly that version's model.
        assert f32(ans["output"]) == want
    assert new, "no answer came from the new version"

    def every_replica_on_v2() -> bool:
        code, model = http_json("GET", f"http://{cluster.gateways[0]}/v1/models/tiny", timeout=3.0)
        return code == 200 and all(r["version"] == 2 for g in model["groups"] for r in g["replicas"])
    wait_until(every_replica_on_v2, 20, "every replica to report version 2")
    # A retry of the same update is a no-op; an older version is refused.
    code, again = http_json("POST", f"http://{cluster.gateways[0]}/v1/models/tiny/weights",
                            {"seed": 99, "version": 2}, timeout=15.0, headers={"x-request-id": "weights-v2"})
    assert code == 200 and again["version"] == 2
    code, old = http_json("POST", f"http://{cluster.gateways[0]}/v1/models/tiny/weights",
                          {"seed": 5, "version": 1}, timeout=15.0)
    assert code == 409 and old["error"]["code"] == "conflict", old
    # Another update under the same request id is judged on its own, not answered from the dedup table.
    code, reused = http_json("POST", f"http://{cluster.gateways[0]}/v1/models/tiny/weights",
                             {"seed": 6, "version": 2}, timeout=15.0, headers={"x-request-id": "weights-v2"})
    assert code == 409, reused
    raw = "http://{}/v1/models/tiny/weights?version=%C2%B2".format(cluster.gateways[0])
    code, bad = http_json("POST", raw, b"\x81\x91\x01\x02", timeout=5.0,
                          headers={"content-type": "application/octet-stream"})
    assert code == 400 and bad["error"]["code"] == "bad_request", bad


def test_a_replica_added_after_its_log_was_compacted_installs_the_weights_snapshot(cluster: Cluster) -> None:
    gw = f"http://{cluster.gateways[0]}"
    for v in (3, 4, 5):
        code, body = http_json("POST", f"{gw}/v1/models/tiny/weights", {"seed": 100 + v, "version": v}, timeout=15.0)
        assert code == 200, body
    group = cluster.view()["groups"]["1"]  # layers 0-11
    newcomer = next(w for w, _, _ in cluster.workers if w not in group["voters"])
    res = cluster.topoctl("replicas", "1", "--add", newcomer, "--wait", "60", timeout=70)
    assert res.returncode == 0, res.stdout + res.stderr

    last: list[Any] = []

    def everyone_on_v5() -> bool:
        code, model = http_json("GET", f"{gw}/v1/models/tiny", timeout=3.0)
        last[:] = [model]
        reps = {r["worker"]: r for r in model["groups"][0]["replicas"]} if code == 200 else {}
        return newcomer in reps and all(r["version"] == 5 and r["warm"] for r in reps.values())
    try:
        wait_until(everyone_on_v5, 30, f"{newcomer}'s new replica of group 1 to serve version 5")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {last}") from None
    log = (cluster.root / "logs" / f"{newcomer}.log").read_text()
    assert any("snapshot_downloaded" in line and '"group": 1' in line.replace('"group":1', '"group": 1')
               for line in log.splitlines()), "the new replica did not install a snapshot"
    inputs = rows(3, seed=9)
    code, body, _ = infer(cluster, inputs)
    assert code == 200 and f32(body["output"]) == reference(cluster, inputs, seed=105)


def test_sigkill_of_a_hop_worker_under_load_is_routed_around_within_the_budget(cluster: Cluster) -> None:
    load = Load(cluster, clients=8, deadline_ms=3000, max_requests=3000)
    t = load.start()
    wait_until(lambda: len(load.answers) >= 50, 30, "load to start")
    # The worker that served the middle hop most recently.
    victim = load.answers[-1][1]["route"][1]["worker"]
    cluster.kill(victim)
    killed_at = len(load.answers)
    wait_until(lambda: len(load.answers) >= killed_at + 200, 60, "load to go on after the kill")
    load.stop.set()
    t.join(timeout=30)
    failures = [(s, a) for s, a, _ in load.answers if s != 200]
    assert not failures, failures[:3]
    after = [a for _, a, _ in load.answers[killed_at + 20:]]
    assert all(victim not in [h["worker"] for h in a["route"]] for a in after[-50:])
    # Some request met the dead worker and went on elsewhere: the trace names both.
    assert any(any(tr["worker"] == victim and not tr["ok"] for tr in a["tried"]) for _, a, _ in load.answers)
