"""Retry in place of a group failed on a disk error, and stale replica data
(worker/retry.py, worker/process.py), on a real WorkerNode and GroupShell.

The disk fault is injected at the system calls: while `full`, every write,
fsync and allocation of a file under the node's data directory fails with
ENOSPC, as on a full disk; files elsewhere are untouched.
"""
from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import structlog

from worker.group import GroupShell
from worker.process import WorkerConfig, WorkerNode
from worker.retry import PROBE_NAME, Backoff, RetryPolicy, probe_disk, settle_from_disk

FAST = RetryPolicy(first_s=0.05, max_s=0.4, tick_s=0.01)


class _Disk:
    """ENOSPC for writes, syncs and allocations of files under `root` while `full`."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = str(root.resolve())
        self.full = False
        self.refused = 0
        for name in ("write", "pwrite", "fsync", "fdatasync", "posix_fallocate"):
            monkeypatch.setattr(os, name, self._guard(getattr(os, name)))

    def _guard(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, *args: Any) -> Any:
            if self.full and self._ours(fd):
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, *args)
        return call

    def _ours(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False


class _FakeMeta:
    async def call(self, method: str, path: str, **kw: Any) -> Any:
        return {}

    async def close(self) -> None:
        pass


def _view(revision: int, groups: dict[int, tuple[int, str, list[str]]]) -> dict[str, Any]:
    """Meta's /v1/cluster: gid -> (term, leader, voters)."""
    return {
        "revision": revision,
        "workers": {"w1": {"addr": "127.0.0.1:1"}},
        "topology": {"plugin": "entities",
                     "settings": {"fsync": "batch", "snapshot_every": 100_000, "quorum_timeout_ms": 2000,
                                  "lease_ms": 1500, "embedding_dim": 4, "ack": "quorum"}},
        "groups": {str(gid): {"term": term, "leader": leader, "voters": voters, "learners": [], "conf_ver": 0}
                   for gid, (term, leader, voters) in groups.items()},
    }


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[WorkerNode]:
    n = WorkerNode(WorkerConfig("w1", "127.0.0.1:1", "127.0.0.1:1", ["127.0.0.1:2"], tmp_path / "data"),
                   structlog.get_logger())
    await n.meta.close()
    n.meta = _FakeMeta()  # type: ignore[assignment]
    n.retry_policy = FAST
    yield n
    await n.close()


def _retrying(node: WorkerNode) -> None:
    node._tasks.append(asyncio.create_task(node._retry_failed()))


def _retries(node: WorkerNode, outcome: str) -> float:
    return node.metrics.registry.get_sample_value("shardgrid_group_retries_total", {"outcome": outcome}) or 0.0


async def _until(cond: Callable[[], Any], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.005)


def _ready(node: WorkerNode, gid: int) -> bool:
    shell = node.groups.get(gid)
    return shell is not None and shell.replica is not None and shell.replica.ready


def put(i: int) -> dict[str, Any]:
    return {"kind": "put_item", "id": f"k{i}", "doc": {"n": i}}


async def test_a_group_failed_on_a_full_disk_stays_failed_then_is_reopened_once_space_is_back(
        node: WorkerNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _Disk(tmp_path / "data", monkeypatch)
    node._apply_view(_view(1, {0: (1, "w1", ["w1"])}))
    await _until(lambda: _ready(node, 0))
    old = node.groups[0]
    [ok] = await old.write_many([(put(1), "r1")], "quorum", 5.0)
    assert ok.ok

    disk.full = True
    [out] = await old.write_many([(put(2), "r2")], "quorum", 5.0)
    assert not out.ok and out.error_code == "unavailable"
    assert old.failed is not None and "No space left on device" in old.failed and old.failed_on_disk
    assert node.group_reports()["0"]["failed"] == old.failed

    _retrying(node)
    # While the disk stays full: probed with backoff, never reopened.
    await _until(lambda: _retries(node, "probe_failed") >= 3)
    assert node.groups[0] is old and old.failed is not None and _retries(node, "reopened") == 0
    backoff = node._retries[0]
    assert backoff.delay > FAST.first_s and not (Path(old.root) / PROBE_NAME).exists()

    disk.full = False
    await _until(lambda: node.groups[0] is not old)
    fresh = node.groups[0]
    assert fresh.failed is None and fresh.replica is not None and node.group_reports()["0"]["failed"] is None
    assert _retries(node, "reopened") == 1
    assert fresh.plugin is not old.plugin and fresh.replica is not old.replica and fresh.wal is not old.wal
    assert fresh.replica.last_seq >= ok.seq  # recovered from the WAL on disk

    # Meta fails the group over (a new term, as it does when a leader's replica fails):
    # the reopened replica leads again, with the acknowledged write, and takes writes.
    node._apply_view(_view(2, {0: (2, "w1", ["w1"])}))
    await _until(lambda: _ready(node, 0))
    read = await fresh.read({"kind": "get_item", "id": "k1"}, "strong", 0, 5.0)
    assert read.ok and read.result == {"n": 1}
    [again] = await fresh.write_many([(put(3), "r3")], "quorum", 5.0)
    assert again.ok and again.term == 2


async def test_a_group_that_cannot_open_for_a_disk_error_is_reported_failed_and_retried(
        node: WorkerNode, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").mkdir()
    disk = _Disk(tmp_path / "data", monkeypatch)
    disk.full = True
    node._apply_view(_view(1, {0: (1, "w1", ["w1"])}))  # must not raise out of the watch loop
    held = node.groups[0]
    assert held.failed is not None and held.failed_on_disk and held.replica is None and held.wal is None
    assert node.group_reports()["0"] == {"state": "failed", "failed": held.failed, "disk_bytes": 0}
    out = await held.write_many([(put(1), "r1")], "quorum", 1.0)
    assert out[0].error_code == "unavailable"

    _retrying(node)
    await _until(lambda: _retries(node, "probe_failed") >= 1)
    assert node.groups[0] is held
    disk.full = False
    await _until(lambda: _ready(node, 0))  # reopened with meta's view: term 1, it leads
    [ok] = await node.groups[0].write_many([(put(1), "r1")], "quorum", 5.0)
    assert ok.ok


async def test_only_a_group_failed_on_the_disk_is_retried(node: WorkerNode) -> None:
    node._apply_view(_view(1, {0: (1, "w1", ["w1"]), 1: (1, "w1", ["w1"])}))
    await _until(lambda: _ready(node, 0) and _ready(node, 1))
    for gid, why in ((0, AssertionError("log conflicts with a committed entry")),
                     (1, OSError(errno.EIO, "Input/output error"))):
        shell = node.groups[gid]
        assert shell._task is not None
        shell._task.cancel()
        shell.mark_failed(why)
    assert not node.groups[0].failed_on_disk and node.groups[1].failed_on_disk
    assert node._retries_due(0.0) == []  # the first failure seen starts a backoff
    due = node._retries_due(FAST.first_s)
    # A bug is not a cause that clears: it waits for an operator, or repair.
    assert [gid for gid, _, _ in due] == [1] and set(node._retries) == {1}


async def test_a_replica_dropped_from_the_view_is_not_reopened(node: WorkerNode, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _Disk(tmp_path / "data", monkeypatch)
    node._apply_view(_view(1, {0: (1, "w1", ["w1"])}))
    await _until(lambda: _ready(node, 0))
    disk.full = True
    await node.groups[0].write_many([(put(1), "r1")], "quorum", 5.0)
    assert node.groups[0].failed is not None
    disk.full = False
    # Replaced (repair) before the retry came: the worker drops it instead.
    node._apply_view(_view(2, {0: (2, "w2", ["w2", "w3"])}))
    _retrying(node)
    await _until(lambda: 0 not in node.groups and not (tmp_path / "data" / "groups" / "0").exists())
    assert [p.name.startswith("0.removed-") for p in (tmp_path / "data" / "groups").iterdir()] == [True]
    assert _retries(node, "reopened") == 0


async def test_stale_replica_data_is_moved_aside_when_the_view_places_the_group_elsewhere(
        node: WorkerNode, tmp_path: Path) -> None:
    groups = tmp_path / "data" / "groups"
    for name in ("5", "6", "7", "9", "notes"):
        (groups / name).mkdir(parents=True)
        (groups / name / "keep").write_text(name)
    node.corrupt[6] = "WAL hard state unreadable"  # found corrupt at start, then replaced
    node.corrupt[8] = "WAL hard state unreadable"  # corrupt, still a member: the operator's
    # 5 and 6: replaced while this worker was away; 7: ours; 8: ours, corrupt; 9, notes: meta knows nothing of them.
    node._apply_view(_view(3, {5: (4, "w2", ["w2", "w3"]), 6: (2, "w3", ["w2", "w3"]), 7: (1, "w1", ["w1"]),
                               8: (1, "w2", ["w1", "w2"])}))
    await _until(lambda: _ready(node, 7))
    names = sorted(p.name for p in groups.iterdir())
    gone5 = [n for n in names if n.startswith("5.removed-")]
    gone6 = [n for n in names if n.startswith("6.removed-")]
    assert len(gone5) == 1 and len(gone6) == 1
    assert (groups / gone5[0] / "keep").read_text() == "5"  # kept, not deleted
    assert {"7", "9", "notes"} <= set(names) and "5" not in names and "6" not in names
    assert (groups / "7" / "keep").read_text() == "7" and (groups / "7" / "wal").is_dir()
    assert (groups / "9" / "keep").read_text() == "9"
    assert node.corrupt == {8: "WAL hard state unreadable"}
    assert "6" not in node.group_reports() and node.group_reports()["8"]["state"] == "corrupt"

    # Replaced again after coming back: the new tombstone does not clash with the old one.
    (groups / "5").mkdir()
    node._apply_view(_view(4, {5: (4, "w2", ["w2", "w3"]), 7: (1, "w1", ["w1"])}))
    assert len([p for p in groups.iterdir() if p.name.startswith("5.removed-")]) == 2
    assert not (groups / "5").exists() and (groups / "7").is_dir()


def test_the_probe_writes_syncs_and_removes_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe_disk(tmp_path)
    assert list(tmp_path.iterdir()) == []
    disk = _Disk(tmp_path, monkeypatch)
    disk.full = True
    with pytest.raises(OSError) as err:
        probe_disk(tmp_path)
    assert err.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_settling_syncs_every_file_and_drops_its_cached_pages(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "wal").mkdir()
    for name in ("wal/wal-1.seg", "hardstate", "snap"):
        (tmp_path / name).write_bytes(b"x" * 8192)
    dropped: list[str] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path))
        real(fd, offset, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    settle_from_disk(tmp_path)
    assert sorted(dropped) == ["hardstate", "snap", "wal/wal-1.seg"]
    # A writeback error the kernel still holds fails the settle (and so the retry).
    disk = _Disk(tmp_path, monkeypatch)
    disk.full = True
    with pytest.raises(OSError):
        settle_from_disk(tmp_path)


def test_backoff_doubles_to_its_cap_and_continues_after_a_reopen_that_fails_again() -> None:
    policy = RetryPolicy(first_s=1.0, max_s=30.0)
    b = Backoff.first(policy, now=100.0)
    assert not b.due(100.5) and b.due(101.0)
    delays = []
    for _ in range(7):
        b.wait_longer(b.next_at)
        delays.append(b.delay)
    assert delays == [2, 4, 8, 16, 30, 30, 30]
    b = Backoff.first(policy, now=0.0)
    b.wait_longer(1.0)  # probe failed: 2 s
    b.reopened(3.0)
    assert not b.due(100.0) and not b.settled(32.9) and b.settled(33.0)
    b.wait_longer(5.0)  # the reopened group failed again: 4 s, not back to 1 s
    assert b.delay == 4.0 and b.next_at == 9.0 and b.due(9.0)


def test_group_shell_releases_its_wal_when_open_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.group import GroupSettings
    from worker.plugins.base import load_plugin
    from worker.wal import Wal

    shell = GroupShell("w1", 0, tmp_path, load_plugin("entities"), GroupSettings(), None,  # type: ignore[arg-type]
                       None, structlog.get_logger())  # type: ignore[arg-type]

    def broken(*a: Any, **kw: Any) -> None:
        raise OSError(errno.EIO, "simulated EIO")
    monkeypatch.setattr("worker.group.prune_snapshots", broken)
    (tmp_path / "snapshots").mkdir()
    with pytest.raises(OSError):
        shell.open()
    assert shell.wal is None
    Wal.open(tmp_path / "wal").close()  # not held any more


async def test_a_group_opens_with_the_topology_snapshot_ratio_or_the_default_without_one(node: WorkerNode) -> None:
    # A topology stored before settings.snapshot_state_ratio existed has none.
    view = _view(1, {0: (1, "w1", ["w1"])})
    node._apply_view(view)
    await _until(lambda: _ready(node, 0))
    assert node.groups[0].settings.snapshot_state_ratio == 0.5
    view = _view(2, {0: (1, "w1", ["w1"]), 1: (1, "w1", ["w1"])})
    view["topology"]["settings"]["snapshot_state_ratio"] = 0.0
    node._apply_view(view)
    await _until(lambda: _ready(node, 1))
    assert node.groups[1].settings.snapshot_state_ratio == 0.0
