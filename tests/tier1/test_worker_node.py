"""The worker process's dealings with meta (worker/process.py), against a fake meta client."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import generate_latest

from shardgrid.bench.rounds import COUNTERS, parse_counters
from worker import replica_msgs as m
from worker.process import VIEW_FETCH_GAP_S, WorkerConfig, WorkerNode


class _FakeMeta:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def register(self, wid: str, addr: str, zone: str | None, ram: int = 0, disk: int = 0, **_identity: str) -> dict[str, Any]:
        self.calls.append("register")
        return {"ok": True}

    async def heartbeat(self, wid: str, report: dict[str, Any], deadline_s: float = 1.0) -> dict[str, Any]:
        self.calls.append("heartbeat")
        return {"ok": True}

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        self.calls.append(f"{method} {path}")
        await asyncio.Event().wait()  # the view that would open groups never comes

    async def close(self) -> None:
        pass


def _node(tmp_path: Path) -> WorkerNode:
    return WorkerNode(WorkerConfig("w1", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path),
                      structlog.get_logger())


async def _with_fake_meta(tmp_path: Path) -> tuple[WorkerNode, _FakeMeta]:
    node = _node(tmp_path)
    await node.meta.close()
    fake = _FakeMeta()
    node.meta = fake  # type: ignore[assignment]
    return node, fake


async def test_a_worker_heartbeats_before_it_opens_any_group(tmp_path: Path) -> None:
    """A slow starter used to report its first group ready before its first heartbeat:
    meta took it for silent and failed that group over at once."""
    node, fake = await _with_fake_meta(tmp_path)
    watch = asyncio.create_task(node._watch())
    try:
        for _ in range(200):
            if "GET /v1/cluster" in fake.calls:
                break
            await asyncio.sleep(0.01)
        assert fake.calls[:3] == ["register", "heartbeat", "GET /v1/cluster"], fake.calls
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await node.transport.close()


async def test_the_round_counters_on_metrics_are_the_ones_the_benchmark_reads(tmp_path: Path) -> None:
    node = _node(tmp_path)
    try:
        node.pass_stats.passes, node.pass_stats.events = 7, 19
        node.transport.stats.messages, node.transport.stats.frames = 11, 4
        node._wal_sync.observe(0.001)
        text = generate_latest(node.metrics.registry).decode()
        assert parse_counters(text) == {"passes": 7, "events": 19, "peer_messages": 11, "peer_frames": 4,
                                        "fsyncs": 1}
        assert set(parse_counters(text)) == set(COUNTERS)
        node.transport.stats.unpackable = 2
        assert "shardgrid_worker_peer_unpackable_total 2.0" in generate_latest(node.metrics.registry).decode()
    finally:
        await node.meta.close()
        await node.transport.close()


async def test_a_lost_quorum_is_heartbeated_to_meta_at_once(tmp_path: Path) -> None:
    """Meta fails an isolated leader over on its report: it must not wait a report interval."""
    node, fake = await _with_fake_meta(tmp_path)
    node.registered = True
    beats = asyncio.create_task(node._heartbeat())
    try:
        for _ in range(100):
            if fake.calls.count("heartbeat") == 1:
                break
            await asyncio.sleep(0.005)
        assert fake.calls.count("heartbeat") == 1
        node.report_quorum(0, 3, False)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while fake.calls.count("heartbeat") < 2:
            assert loop.time() - t0 < 0.1, "the report waited for the next interval (0.3 s)"
            await asyncio.sleep(0.005)
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        await node.transport.close()


async def test_check_quorum_gauges(tmp_path: Path) -> None:
    node = _node(tmp_path)

    class _Shell:
        def __init__(self, **rep: Any) -> None:
            self.rep = {"term": 3, "last_seq": 9, "commit": 9, "applied": 9, "lag": 0, "in_flight": 0, "ready": False,
                        "latency_p99_ms": 0.0, **rep}

        def report(self) -> dict[str, Any]:
            return self.rep

    try:
        node.groups = {0: _Shell(ready=True, quorum=False, leader_silence_ms=None),  # type: ignore[dict-item]
                       1: _Shell(quorum=True, leader_silence_ms=2750)}
        node.update_gauges()
        text = generate_latest(node.metrics.registry).decode()
        assert 'shardgrid_group_has_quorum{group="0"} 0.0' in text
        assert 'shardgrid_group_has_quorum{group="1"} 1.0' in text
        assert 'shardgrid_group_leader_silence_seconds{group="1"} 2.75' in text
        assert 'shardgrid_group_leader_silence_seconds{group="0"} 0.0' in text
    finally:
        await node.meta.close()
        await node.transport.close()


class _ClosingShell:
    """What `_drop_group` needs of a group shell, and its report for the gauges."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)
        self.closed = False

    def report(self) -> dict[str, Any]:
        return {"term": 2, "last_seq": 5, "commit": 5, "applied": 5, "lag": 0, "in_flight": 0, "ready": True,
                "quorum": True, "leader_silence_ms": None}

    async def close(self) -> None:
        self.closed = True


async def test_a_group_s_series_go_when_the_group_leaves_the_worker(tmp_path: Path) -> None:
    node = _node(tmp_path)
    try:
        node.groups = {0: _ClosingShell(tmp_path / "groups" / "0"),  # type: ignore[dict-item]
                       1: _ClosingShell(tmp_path / "groups" / "1")}
        node._write_latency.labels("0").observe(0.004)
        node._write_latency.labels("1").observe(0.003)
        node.update_gauges()
        text = generate_latest(node.metrics.registry).decode()
        assert 'shardgrid_group_term{group="0"} 2.0' in text and 'shardgrid_group_term{group="1"} 2.0' in text
        assert 'shardgrid_group_write_latency_seconds_count{group="0"} 1.0' in text
        await node._drop_group(0)
        node.update_gauges()
        text = generate_latest(node.metrics.registry).decode()
        assert '{group="0"' not in text, [line for line in text.splitlines() if '{group="0"' in line]
        assert 'shardgrid_group_term{group="1"} 2.0' in text
        assert 'shardgrid_group_write_latency_seconds_count{group="1"} 1.0' in text
    finally:
        await node.meta.close()
        await node.transport.close()


_TOPO = {"plugin": "entities", "models": [], "settings": {"fsync": False, "snapshot_every": 1000,
                                                          "quorum_timeout_ms": 2000, "lease_ms": 1500,
                                                          "embedding_dim": 4}}


async def test_a_group_corrupt_at_its_first_open_exports_no_series(tmp_path: Path, monkeypatch: Any) -> None:
    # Nothing removes the series of a group this worker never held: had the latency
    # histogram been bound before the open, an empty one would stay until a restart.
    from worker.group import GroupCorrupt, GroupShell

    def corrupt(self: GroupShell) -> None:
        raise GroupCorrupt("bad crc at seq 7")

    def disk_error(self: GroupShell) -> None:
        raise OSError(5, "Input/output error")

    node = _node(tmp_path)
    try:
        monkeypatch.setattr(GroupShell, "open", corrupt)
        assert node._open_group(7, _TOPO) is None
        assert 7 not in node.groups and 7 in node.corrupt
        text = generate_latest(node.metrics.registry).decode()
        assert [line for line in text.splitlines() if 'group="7"' in line] == []
        # A replica whose disk failed at open is kept and retried in place: it serves again, observed.
        monkeypatch.setattr(GroupShell, "open", disk_error)
        shell = node._open_group(8, _TOPO)
        assert shell is not None and shell.failed is not None and shell.on_write_latency is not None
        shell.on_write_latency(0.002)
        text = generate_latest(node.metrics.registry).decode()
        assert 'shardgrid_group_write_latency_seconds_count{group="8"} 1.0' in text
    finally:
        await node.meta.close()
        await node.transport.close()


async def test_heartbeats_and_healthz_carry_the_version(tmp_path: Path, aiohttp_client: Any) -> None:
    from shardgrid.common.identity import SoftwareIdentity
    from worker.server import WorkerApi

    node = WorkerNode(WorkerConfig("w1", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path,
                                   identity=SoftwareIdentity("1.2.3", "abc")), structlog.get_logger())
    await node.meta.close()
    sent: list[dict[str, Any]] = []

    class _Meta(_FakeMeta):
        async def heartbeat(self, wid: str, report: dict[str, Any], deadline_s: float = 1.0) -> dict[str, Any]:
            sent.append(report)
            return {"ok": True}

    node.meta = _Meta()  # type: ignore[assignment]
    try:
        await node._beat()
        assert sent[0]["version"] == "1.2.3" and sent[0]["boot"] == node.boot
        client = await aiohttp_client(WorkerApi(node).app())
        body = await (await client.get("/healthz")).json()
        assert body["version"] == "1.2.3" and body["id"] == "w1"
        text = await (await client.get("/metrics")).text()
        assert 'shardgrid_build_info{role="worker",version="1.2.3"} 1.0' in text
    finally:
        await node.transport.close()


async def test_a_refused_registration_is_logged_with_its_reason_and_retried_with_backoff(
        tmp_path: Path, monkeypatch: Any) -> None:
    import structlog.testing

    import worker.process
    from meta.client import MetaError

    monkeypatch.setattr(worker.process, "REGISTER_RETRY_S", 0.01)
    monkeypatch.setattr(worker.process, "REGISTER_REFUSED_MAX_S", 0.03)
    node, fake = await _with_fake_meta(tmp_path)
    answers: list[Exception | None] = [
        MetaError(409, "conflict", "worker w1 is live at 127.0.0.1:9", {"registered_addr": "127.0.0.1:9"}),
        MetaError(401, "unauthorized", "moving it needs the admin token", {"registered_addr": "127.0.0.1:9"}),
        MetaError(409, "conflict", "still live", {}), MetaError(409, "conflict", "still live", {}), None]

    async def register(wid: str, addr: str, zone: str | None, ram: int = 0, disk: int = 0, **_identity: str) -> dict[str, Any]:
        fake.calls.append("register")
        answer = answers.pop(0)
        if answer is not None:
            raise answer
        return {"ok": True}

    fake.register = register  # type: ignore[method-assign]
    try:
        with structlog.testing.capture_logs() as logs:
            await asyncio.wait_for(node._register(), 5)
        assert node.registered and fake.calls == ["register"] * 5 + ["heartbeat"]
        refused = [e for e in logs if e["event"] == "register_refused"]
        assert [(e["code"], e["retry_in_s"]) for e in refused] == [
            ("conflict", 0.01), ("unauthorized", 0.02), ("conflict", 0.03), ("conflict", 0.03)]
        assert refused[0]["reason"] == "worker w1 is live at 127.0.0.1:9"
        assert refused[0]["registered_addr"] == "127.0.0.1:9" and refused[0]["log_level"] == "error"
    finally:
        await node.transport.close()


class _ViewMeta:
    """A meta that answers GET /v1/cluster with `view` once `gate` is set."""

    def __init__(self, view: dict[str, Any]) -> None:
        self.view = view
        self.fetches = 0
        self.started: list[float] = []
        self.gate = asyncio.Event()

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        assert (method, path) == ("GET", "/v1/cluster") and "params" not in kw  # no long poll
        self.fetches += 1
        self.started.append(time.monotonic())
        await self.gate.wait()
        return self.view

    async def close(self) -> None:
        pass


def _cluster(revision: int, term: int) -> dict[str, Any]:
    group = {"term": term, "leader": "w2", "voters": ["w1", "w2", "w3"], "learners": [], "conf_ver": 0}
    groups = {"0": group, "1": dict(group), "2": {**group, "voters": ["w2"]}}
    return {"revision": revision, "workers": {}, "groups": groups}


async def test_cores_asking_for_meta_s_view_share_one_fetch_and_a_newer_view_is_applied(tmp_path: Path) -> None:
    node = _node(tmp_path)
    await node.meta.close()
    fake = _ViewMeta(_cluster(revision=8, term=5))
    node.meta = fake  # type: ignore[assignment]
    node.view = _cluster(revision=7, term=4)
    applied: list[int] = []
    node._apply_view = lambda view: applied.append(view["revision"])  # type: ignore[method-assign]
    try:
        asks = [asyncio.create_task(node.meta_view(g)) for g in (0, 1, 2)]
        await asyncio.sleep(0.01)
        assert fake.fetches == 1  # one fetch in flight serves every group that asks meanwhile
        fake.gate.set()
        views = await asyncio.gather(*asks)
        assert views[0] == views[1] == m.MetaView(5, "w2", ("w1", "w2", "w3"), (), 0)
        assert views[2] is None  # not placed here
        assert applied == [8]  # newer than the watch's: applied as if the watch had brought it
        node.view = _cluster(revision=9, term=5)
        assert await node.meta_view(0) is not None and fake.fetches == 2 and applied == [8]  # older: not applied
        assert fake.started[1] - fake.started[0] >= VIEW_FETCH_GAP_S * 0.9  # fetches are spaced out
    finally:
        await node.transport.close()
