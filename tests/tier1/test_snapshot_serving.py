"""Snapshot downloads between workers: the serving side's limits (worker/server.py
with worker/throttle.py) and the downloader's busy retries and progress report
(worker/group.py), over real HTTP in-process."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web
import structlog
from aiohttp.test_utils import TestClient

from tests.support.group_hooks import NullHooks
from worker import replica_msgs as m
from worker.group import GroupSettings, GroupShell
from worker.plugins.base import load_plugin
from worker.process import WorkerConfig, WorkerNode
from worker.server import WorkerApi
from worker.snapshots import SnapshotFile, latest_snapshot, write_snapshot
from worker.throttle import MB, SNAPSHOT_BUSY

SIZE = 1_000_000  # about, plus the archive's header


async def _until(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.005)


@dataclass
class _Replica:
    """A group replica as the snapshot routes see one."""

    gid: int
    snap: SnapshotFile

    def latest_snapshot(self) -> SnapshotFile:
        return self.snap


def _archive(root: Path, seq: int = 7) -> SnapshotFile:
    files = root / "plugin"
    files.mkdir(parents=True)
    (files / "blob").write_bytes(os.urandom(SIZE))
    return write_snapshot(root / "snaps", m.SnapshotMeta(term=2, seq=seq, ts=1), files)


@dataclass
class Source:
    node: WorkerNode
    client: TestClient
    snap: SnapshotFile
    ranges: list[str]  # the Range header of each request for snapshot data

    @property
    def addr(self) -> str:
        return f"{self.client.server.host}:{self.client.server.port}"

    def limits(self, concurrency: int, rate_mb_s: int) -> None:
        self.node.snapshot_serving.configure(concurrency, rate_mb_s, time.monotonic())


@pytest.fixture
async def source(tmp_path: Path, aiohttp_client: Any) -> AsyncIterator[Source]:
    """Worker w1 serving group 0's snapshot (about 1 MB)."""
    node = WorkerNode(WorkerConfig("w1", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path / "w1"),
                      structlog.get_logger())
    snap = _archive(tmp_path / "w1")
    node.groups[0] = _Replica(0, snap)  # type: ignore[assignment]
    ranges: list[str] = []

    @web.middleware
    async def seen(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.endswith(f"/snapshot/{snap.seq}"):
            ranges.append(request.headers.get("Range", ""))
        return await handler(request)

    app = WorkerApi(node).app()
    app.middlewares.insert(0, seen)
    try:
        yield Source(node, await aiohttp_client(app), snap, ranges)
    finally:
        await node.meta.close()
        await node.transport.close()


async def test_the_topology_settings_set_the_limits(source: Source) -> None:
    serving = source.node.snapshot_serving
    assert (serving.concurrency, serving.bucket.rate) == (2, 64 * MB)  # the defaults, before any view
    source.node._apply_view({"topology": {"settings": {"ack": "quorum", "snapshot_concurrency": 1,
                                                       "snapshot_rate_mb_s": 0}}, "groups": {}})
    assert (serving.concurrency, serving.bucket.rate) == (1, 0)
    # A topology stored before these settings existed: the defaults again.
    source.node._apply_view({"topology": {"settings": {"ack": "quorum"}}, "groups": {}})
    assert (serving.concurrency, serving.bucket.rate) == (2, 64 * MB)


async def test_a_download_beyond_the_concurrency_is_answered_busy_until_a_slot_frees(source: Source) -> None:
    source.limits(concurrency=1, rate_mb_s=1)  # ~0.75 s for the whole file: the first holds its slot
    url = f"/v1/groups/0/snapshot/{source.snap.seq}"
    first = await source.client.get(url, headers={"Range": "bytes=0-"})
    assert first.status == 206 and source.node.snapshot_serving.serving == 1
    busy = await source.client.get(url, headers={"Range": "bytes=0-"})
    body = await busy.json()
    assert busy.status == 503, body
    assert body["error"]["code"] == "unavailable" and body["error"]["reason"] == SNAPSHOT_BUSY
    assert body["error"]["limit"] == 1 and "snapshot_concurrency" in body["error"]["message"]
    assert await first.read() == source.snap.path.read_bytes()
    await _until(lambda: source.node.snapshot_serving.serving == 0, "the finished download to free its slot")
    again = await source.client.get(url, headers={"Range": "bytes=100-"})
    assert again.status == 206 and await again.read() == source.snap.path.read_bytes()[100:]


async def test_a_download_whose_client_goes_away_frees_its_slot(source: Source) -> None:
    source.limits(concurrency=1, rate_mb_s=1)
    resp = await source.client.get(f"/v1/groups/0/snapshot/{source.snap.seq}")
    assert resp.status == 200 and source.node.snapshot_serving.serving == 1
    resp.close()
    await _until(lambda: source.node.snapshot_serving.serving == 0, "a dropped download to free its slot")


async def test_the_data_sent_keeps_to_the_rate(source: Source) -> None:
    source.limits(concurrency=2, rate_mb_s=1)
    bucket = source.node.snapshot_serving.bucket
    started = time.monotonic()
    resp = await source.client.get(f"/v1/groups/0/snapshot/{source.snap.seq}")
    data = await resp.read()
    took = time.monotonic() - started
    assert resp.status == 200 and data == source.snap.path.read_bytes()
    # What a full bucket lets through at once goes out at once; the rest at 1 MB/s.
    assert took >= (len(data) - bucket.burst) / MB * 0.95, took


async def test_ranges_and_a_gone_snapshot(source: Source) -> None:
    whole = source.snap.path.read_bytes()
    tail = await source.client.get(f"/v1/groups/0/snapshot/{source.snap.seq}", headers={"Range": "bytes=-10"})
    assert tail.status == 206 and await tail.read() == whole[-10:]
    assert tail.headers["Content-Range"] == f"bytes {len(whole) - 10}-{len(whole) - 1}/{len(whole)}"
    mid = await source.client.get(f"/v1/groups/0/snapshot/{source.snap.seq}", headers={"Range": "bytes=5-9"})
    assert mid.status == 206 and await mid.read() == whole[5:10]
    past = await source.client.get(f"/v1/groups/0/snapshot/{source.snap.seq}",
                                   headers={"Range": f"bytes={len(whole)}-"})
    assert past.status == 400 and (await past.json())["error"]["code"] == "bad_request"
    gone = await source.client.get("/v1/groups/0/snapshot/6")
    assert gone.status == 404
    assert source.node.snapshot_serving.serving == 0


# -- the downloader -------------------------------------------------------------------


class _Transport:
    scheme = "http"

    def connector(self) -> aiohttp.TCPConnector:
        return aiohttp.TCPConnector()


def _learner(tmp_path: Path, source: Source) -> GroupShell:
    """w4's new replica of group 0 (opened, its loop not running: the restore is not under test)."""
    g = GroupShell("w4", 0, tmp_path / "w4", load_plugin("entities"), GroupSettings(fsync="batch"),
                   _Transport(), NullHooks(source.addr), structlog.get_logger())  # type: ignore[arg-type]
    g.open()
    return g


def _progress(g: GroupShell) -> tuple[Any, Any, Any]:
    rep = g.report()
    return rep["snapshot_bytes"], rep["snapshot_total"], rep["snapshot_waiting"]


async def test_a_learner_waits_for_a_busy_source_and_reports_its_progress(tmp_path: Path, source: Source) -> None:
    source.limits(concurrency=1, rate_mb_s=1)
    total = source.snap.size
    learner = _learner(tmp_path, source)
    try:
        assert _progress(learner) == (None, None, False)
        assert source.node.snapshot_serving.try_start()  # another learner's download holds the only slot
        learner._start_download(m.DownloadSnapshot("w1", 2, source.snap.seq))
        await _until(lambda: _progress(learner)[2], "the learner to report that it waits for a slot")
        assert _progress(learner) == (0, total, True)
        source.node.snapshot_serving.finish()
        # Its turn: at 1 MB/s the bytes arrive over most of a second, and the report follows them.
        await _until(lambda: (_progress(learner)[0] or 0) > 0 and _progress(learner)[0] < total,
                     "the report to show part of the snapshot received")
        assert _progress(learner)[1:] == (total, False)
        await _until(lambda: learner.download is None, "the download to end")
        got = latest_snapshot(learner.snap_dir)
        assert got is not None and got.digest == source.snap.digest and got.seq == source.snap.seq
        assert _progress(learner) == (None, None, False)
        assert learner.download is None and not list(learner.snap_dir.glob(".download-*"))
    finally:
        await learner.close()


async def test_an_interrupted_download_resumes_from_what_it_has(tmp_path: Path, source: Source) -> None:
    source.limits(concurrency=2, rate_mb_s=0)
    learner = _learner(tmp_path, source)
    whole = source.snap.path.read_bytes()
    learner.snap_dir.mkdir(parents=True)
    partial = learner.snap_dir / f".download-{source.snap.seq}-{source.snap.term}.partial"
    partial.write_bytes(whole[:300_000])  # what arrived before the connection broke
    stale = learner.snap_dir / ".download-3-1.partial"  # an older snapshot's, broken off
    stale.write_bytes(b"old")
    try:
        learner._start_download(m.DownloadSnapshot("w1", 2, source.snap.seq))
        await _until(lambda: learner.download is None and latest_snapshot(learner.snap_dir) is not None,
                     "the download to finish")
        assert source.ranges == ["bytes=300000-"] and not stale.exists()
        assert latest_snapshot(learner.snap_dir).digest == source.snap.digest  # type: ignore[union-attr]
    finally:
        await learner.close()
