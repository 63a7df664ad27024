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

    def snapshot(self, seq: int | None = None) -> SnapshotFile | None:
        return self.snap if seq is None or seq == self.snap.seq else None


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
    middlewares = ()
    scheme = "http"

    def connector(self) -> aiohttp.TCPConnector:
        return aiohttp.TCPConnector()


def _learner(tmp_path: Path, source: Source) -> GroupShell:
    """w4's new replica of group 0 (opened, its loop not running: the restore is not under test)."""
    g = GroupShell("w4", 0, tmp_path / "w4", load_plugin("entities"), GroupSettings(fsync="batch"),
                   _Transport(), NullHooks(source.addr), structlog.get_logger())  # type: ignore[arg-type]
    g.open()
    return g


def _request(snap: SnapshotFile, source: str = "w1") -> m.DownloadSnapshot:
    """The core's request to download `snap`, as its source published it (SnapshotNeeded)."""
    return m.DownloadSnapshot(source, 2, snap.seq, snap.term, snap.digest, snap.size)


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
        learner._start_download(_request(source.snap))
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
        learner._start_download(_request(source.snap))
        await _until(lambda: learner.download is None and latest_snapshot(learner.snap_dir) is not None,
                     "the download to finish")
        assert source.ranges == ["bytes=300000-"] and not stale.exists()
        assert latest_snapshot(learner.snap_dir).digest == source.snap.digest  # type: ignore[union-attr]
    finally:
        await learner.close()


class _Hooks(NullHooks):
    """w1 is the good source; `bad` a hostile one."""

    def __init__(self, good: str, bad: str) -> None:
        super().__init__(good)
        self.bad = bad

    def peer_addr(self, worker_id: str) -> str | None:
        return self.bad if worker_id == "bad" else super().peer_addr(worker_id)


@dataclass
class _Hostile:
    """A source that answers what a test tells it to: a manifest, and bytes for any snapshot."""

    manifest: Any
    data: bytes
    data_requests: int = 0


async def _hostile_source(aiohttp_server: Any, hostile: _Hostile) -> str:
    async def manifest(request: web.Request) -> web.Response:
        if isinstance(hostile.manifest, bytes):
            return web.Response(body=hostile.manifest, content_type="application/json")
        return web.json_response(hostile.manifest)

    async def data(request: web.Request) -> web.Response:
        hostile.data_requests += 1
        return web.Response(body=hostile.data, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/v1/groups/0/snapshot", manifest)
    app.router.add_get("/v1/groups/0/snapshot/{seq}", data)
    server = await aiohttp_server(app)
    return f"127.0.0.1:{server.port}"


def _published_manifest(snap: SnapshotFile) -> dict[str, Any]:
    return {"seq": snap.seq, "term": snap.term, "size": snap.size, "digest": snap.digest}


HOSTILE = {
    # The manifest names another snapshot than the one published in the request.
    "other_digest": lambda s, whole: (_published_manifest(s) | {"digest": "0" * 32}, whole),
    "bigger_size": lambda s, whole: (_published_manifest(s) | {"size": s.size * 100}, whole),
    "negative_seq": lambda s, whole: (_published_manifest(s) | {"seq": -s.seq}, whole),
    "not_a_manifest": lambda s, whole: ([1, 2, 3], whole),
    "huge_manifest": lambda s, whole: (b'{"pad": "' + b"x" * 100_000 + b'"}', whole),
    # The manifest is right, the bytes are not.
    "more_bytes_than_published": lambda s, whole: (_published_manifest(s), whole + os.urandom(500_000)),
    "same_size_other_bytes": lambda s, whole: (_published_manifest(s), whole[:-10] + b"0123456789"),
    "fewer_bytes": lambda s, whole: (_published_manifest(s), whole[:1000]),
}


@pytest.mark.parametrize("how", sorted(HOSTILE))
async def test_a_download_that_is_not_what_its_source_published_is_refused_and_a_good_source_serves_it(
        tmp_path: Path, source: Source, aiohttp_server: Any, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.group

    monkeypatch.setattr(worker.group, "DOWNLOAD_ATTEMPTS", 2)  # a source that keeps answering short: give up soon
    source.limits(concurrency=2, rate_mb_s=0)
    whole = source.snap.path.read_bytes()
    hostile = _Hostile(*HOSTILE[how](source.snap, whole))
    bad = await _hostile_source(aiohttp_server, hostile)
    learner = GroupShell("w4", 0, tmp_path / "w4", load_plugin("entities"), GroupSettings(fsync="batch"),
                         _Transport(), _Hooks(source.addr, bad), structlog.get_logger())  # type: ignore[arg-type]
    learner.open()
    try:
        # The bad replica publishes (in its SnapshotNeeded) the real snapshot's
        # term, seq, size and digest, then serves something else.
        learner._start_download(_request(source.snap, "bad"))
        await _until(lambda: learner._download is not None and learner._download.done(), "the bad download to end")
        assert latest_snapshot(learner.snap_dir) is None
        if how != "fewer_bytes":  # a short answer is an interruption: kept, resumed from a source
            assert learner.snapshot_refused == 1 and learner.report()["snapshot_refused"] == 1
            assert not list(learner.snap_dir.glob(".download-*")) if learner.snap_dir.exists() else True
        for p in learner.snap_dir.glob(".download-*") if learner.snap_dir.exists() else ():
            assert p.stat().st_size <= source.snap.size  # never a byte past the published size on disk
        learner._start_download(_request(source.snap, "w1"))  # the core asks again: the leader this time
        await _until(lambda: learner._download is not None and learner._download.done(), "the good download")
        got = latest_snapshot(learner.snap_dir)
        assert got is not None and got.digest == source.snap.digest and got.path.read_bytes() == whole
    finally:
        await learner.close()


async def test_a_request_without_what_the_source_published_downloads_nothing(tmp_path: Path, source: Source) -> None:
    learner = _learner(tmp_path, source)
    try:
        for d in (m.DownloadSnapshot("w1", 2, source.snap.seq),  # an older peer's request: no digest, no size
                  m.DownloadSnapshot("w1", 2, source.snap.seq, source.snap.term, "not-a-digest", source.snap.size),
                  m.DownloadSnapshot("w1", 2, source.snap.seq, source.snap.term, source.snap.digest, -1)):
            learner._start_download(d)
            await _until(lambda: learner._download is not None and learner._download.done(), "the refusal")
        assert learner.snapshot_refused == 3 and source.ranges == [] and latest_snapshot(learner.snap_dir) is None
    finally:
        await learner.close()


async def test_a_sender_publishes_its_archive_s_size_and_digest_with_the_request(tmp_path: Path,
                                                                                source: Source) -> None:
    sender = _learner(tmp_path, source)
    try:
        snap = write_snapshot(sender.snap_dir, m.SnapshotMeta(term=3, seq=9, ts=1), _plugin_files(tmp_path))
        need = m.SnapshotNeeded(src="w4", dst="w5", group=0, term=3, snap_term=3, snap_seq=9)
        out = sender._publish_snapshot(need)
        assert (out.digest, out.size) == (snap.digest, snap.size)
        # No archive at that point (or at another term): sent as it is; the receiver downloads nothing.
        assert sender._publish_snapshot(m.SnapshotNeeded(src="w4", dst="w5", group=0, term=3, snap_term=2,
                                                         snap_seq=9)).digest is None
    finally:
        await sender.close()


def _plugin_files(root: Path) -> Path:
    files = root / "plugin-files"
    files.mkdir()
    (files / "blob").write_bytes(b"state")
    return files
