"""A worker's answer when meta assigns it a replica (worker/capacity.py, POST /v1/assignments)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import structlog
from aiohttp.test_utils import TestClient, TestServer

from worker.capacity import HEADROOM, MIN_FREE_BYTES, Capacity, free_bytes, refusal, tree_bytes
from worker.process import WorkerConfig, WorkerNode
from worker.server import WorkerApi

GB = 1 << 30
ROOMY = Capacity("available", disk_budget=10 * GB, disk_used=GB, disk_free=100 * GB, ram_budget=8 * GB,
                 ram_used=GB)


def test_room_everywhere_accepts() -> None:
    assert refusal(ROOMY, GB) is None
    assert refusal(dataclasses.replace(ROOMY, disk_budget=0, ram_budget=0), GB) is None  # nothing advertised


def test_each_shortage_is_refused_with_its_reason() -> None:
    r = refusal(dataclasses.replace(ROOMY, disk_used=9 * GB), GB)
    assert r is not None and r.reason == "insufficient_disk" and "advertised" in r.message
    # The filesystem itself, whatever was advertised; MIN_FREE_BYTES always stays free.
    need = int(GB * HEADROOM)
    r = refusal(dataclasses.replace(ROOMY, disk_free=need + MIN_FREE_BYTES - 1), GB)
    assert r is not None and r.reason == "insufficient_disk" and "filesystem" in r.message
    assert refusal(dataclasses.replace(ROOMY, disk_free=need + MIN_FREE_BYTES), GB) is None
    r = refusal(dataclasses.replace(ROOMY, ram_used=7 * GB), GB)
    assert r is not None and r.reason == "insufficient_ram"
    for state in ("draining", "drained", "removed"):
        r = refusal(dataclasses.replace(ROOMY, state=state), 0)
        assert r is not None and r.reason == "draining" and state in r.message


def test_tree_bytes_counts_files_below(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "x").write_bytes(b"1" * 10)
    (tmp_path / "a" / "b" / "y").write_bytes(b"1" * 5)
    assert tree_bytes(tmp_path) == 15 and tree_bytes(tmp_path / "missing") == 0


async def test_the_endpoint_answers_409_with_the_reason_or_200(tmp_path: Path) -> None:
    # A worker that hosts nothing yet has not made its data directory.
    node = WorkerNode(WorkerConfig("w4", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path / "w4-data",
                                   available_disk=1 << 20), structlog.get_logger())
    client = TestClient(TestServer(WorkerApi(node).app()))
    await client.start_server()
    try:
        resp = await client.post("/v1/assignments", json={"group": 3, "bytes": 0})
        assert resp.status == 200 and (await resp.json())["accepted"] is True
        resp = await client.post("/v1/assignments", json={"group": 3, "bytes": 1 << 20})
        body = await resp.json()
        assert resp.status == 409 and body["error"]["reason"] == "insufficient_disk", body
        assert body["error"]["code"] == "conflict" and "w4 cannot take a replica of group 3" in body["error"]["message"]
        node.view = {"workers": {"w4": {"state": "draining"}}}
        resp = await client.post("/v1/assignments", json={"group": 3, "bytes": 0})
        assert (await resp.json())["error"]["reason"] == "draining"
        for bad in ({"group": "3"}, {"group": 3, "bytes": -1}, {"group": True}, []):
            resp = await client.post("/v1/assignments", json=bad)
            assert resp.status == 400, bad
    finally:
        await client.close()
        await node.meta.close()
        await node.transport.close()


def test_free_bytes_of_a_directory_not_made_yet_is_its_parents(tmp_path: Path) -> None:
    assert free_bytes(tmp_path / "data" / "groups") == free_bytes(tmp_path) > 0
