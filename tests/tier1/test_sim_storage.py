"""The semantics of SimStorage, the in-memory power-loss disk (tests/support/sim_storage.py)."""
from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from tests.support.sim_storage import BLOCK, MODES, SimCrash, SimStorage
from worker.storage import Storage

D = Path("/n1/data")
F = D / "f"
W = os.O_WRONLY | os.O_CREAT


def _disk(seed: int = 0) -> SimStorage:
    s = SimStorage(random.Random(seed))
    s.mkdir(D)
    s.fsync_dir(D.parent)
    s.fsync_dir(Path("/"))
    s.fsync_dir(D)
    return s


def _create(s: SimStorage, path: Path, data: bytes, *, sync: bool = True, dir_sync: bool = True) -> int:
    fd = s.open(path, W)
    s.write(fd, data)
    if sync:
        s.fsync(fd)
    if dir_sync:
        s.fsync_dir(path.parent)
    return fd


def test_is_a_storage() -> None:
    s: Storage = SimStorage(random.Random(0))
    assert s.exists(Path("/"))


@pytest.mark.parametrize("mode", MODES)
def test_synced_data_survives_and_unsynced_data_may_not(mode: str) -> None:
    for seed in range(30):
        s = _disk(seed)
        fd = _create(s, F, b"a" * 100)
        s.pwrite(fd, b"b" * 50, 100)
        assert s.read_bytes(F) == b"a" * 100 + b"b" * 50
        s.power_loss(random.Random(seed), mode)  # type: ignore[arg-type]
        data = s.read_bytes(F)
        assert data[:100] == b"a" * 100
        assert data[100:] in {b"b" * n for n in range(51)} | {b"\0" * 50}
        if mode == "lose":
            assert data == b"a" * 100


def test_lose_mode_loses_every_unsynced_write() -> None:
    s = _disk()
    fd = _create(s, F, b"x" * 10)
    s.pwrite(fd, b"y" * 10, 0)
    s.power_loss(mode="lose")
    assert s.read_bytes(F) == b"x" * 10


def test_a_new_name_needs_fsync_dir() -> None:
    outcomes = set()
    for seed in range(40):
        s = _disk(seed)
        _create(s, F, b"data", sync=True, dir_sync=False)
        s.power_loss(random.Random(seed), "prefix")
        outcomes.add(s.exists(F))
    assert outcomes == {True, False}
    s = _disk()
    _create(s, F, b"data")
    s.power_loss(mode="lose")
    assert s.read_bytes(F) == b"data"


def test_replace_is_atomic() -> None:
    seen = set()
    for seed in range(40):
        s = _disk(seed)
        s.close(_create(s, F, b"old"))
        tmp = D / "f.tmp"
        s.close(_create(s, tmp, b"new", dir_sync=False))
        s.replace(tmp, F)
        assert s.read_bytes(F) == b"new" and not s.exists(tmp)
        s.power_loss(random.Random(seed), "reorder")
        got = s.read_bytes(F)
        assert got in (b"old", b"new")
        seen.add(got)
        if got == b"new":
            assert not s.exists(tmp)
    assert seen == {b"old", b"new"}


def test_failed_fsync_loses_the_pending_pages_for_good() -> None:
    for mode in MODES:
        s = _disk()
        fd = _create(s, F, b"a" * 10)
        s.pwrite(fd, b"b" * 10, 0)
        s.fail_next_fsync()
        with pytest.raises(OSError) as info:
            s.fdatasync(fd)
        assert info.value.errno == errno.EIO
        assert s.read_bytes(F) == b"b" * 10  # still in the page cache
        s.fsync(fd)  # succeeds, but does not bring them back
        s.pwrite(fd, b"c", 20)  # later writes are persisted by a later fsync
        s.fsync(fd)
        s.power_loss(random.Random(1), mode)  # type: ignore[arg-type]
        assert s.read_bytes(F) == b"a" * 10 + b"\0" * 10 + b"c"


def test_reorder_leaves_holes() -> None:
    holes = 0
    for seed in range(30):
        s = _disk(seed)
        fd = _create(s, F, b"")
        s.pwrite(fd, b"\1" * (4 * BLOCK), 0)
        s.power_loss(random.Random(seed), "reorder")
        data = s.read_bytes(F)
        blocks = [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)]
        assert all(b in (b"\1" * len(b), b"\0" * len(b)) for b in blocks)
        holes += any(b == b"\0" * len(b) for b in blocks[:-1]) and blocks[-1][:1] == b"\1"
    assert holes > 0


def test_prefix_mode_tears_the_last_write() -> None:
    lengths = set()
    for seed in range(60):
        s = _disk(seed)
        fd = _create(s, F, b"")
        s.write(fd, b"1" * 100)
        s.write(fd, b"2" * 100)
        s.power_loss(random.Random(seed), "prefix")
        data = s.read_bytes(F)
        assert data == (b"1" * 100 + b"2" * 100)[:len(data)]
        lengths.add(len(data))
    assert {0, 100, 200} <= lengths and lengths - {0, 100, 200}


def test_kill_keeps_everything_but_drops_fds_and_locks() -> None:
    s = _disk()
    fd = _create(s, F, b"abc", sync=False, dir_sync=False)
    lock = s.lock(D / "LOCK")
    with pytest.raises(BlockingIOError):
        s.lock(D / "LOCK")
    s.kill()
    assert s.read_bytes(F) == b"abc"
    with pytest.raises(OSError):
        s.write(fd, b"x")
    s.close(s.lock(D / "LOCK"))
    del lock


def test_crash_after_cuts_a_write_and_kills_the_process() -> None:
    s = _disk(3)
    fd = _create(s, F, b"")
    s.crash_after(1)
    with pytest.raises(SimCrash):
        s.pwrite(fd, b"z" * 1000, 0)
    with pytest.raises(SimCrash):
        s.exists(F)  # dead until kill() or power_loss()
    s.kill()
    data = s.read_bytes(F)  # a prefix of the write, in the page cache
    assert data == b"z" * len(data) and len(data) <= 1000


def test_write_failures_and_corrupt() -> None:
    s = _disk()
    fd = _create(s, F, b"\0" * 64)
    s.fail_next_writes(1)
    with pytest.raises(OSError) as info:
        s.pwrite(fd, b"x", 0)
    assert info.value.errno == errno.ENOSPC
    off = s.corrupt(F, random.Random(5))
    assert s.read_bytes(F)[off] != 0
    s.power_loss(mode="lose")
    assert s.read_bytes(F)[off] != 0  # in the durable bytes too


def test_a_short_write_writes_a_prefix_and_half_the_time_the_next_write_fails() -> None:
    kinds = set()
    for seed in range(40):
        s = _disk(seed)
        fd = _create(s, F, b"")
        s.short_write_rate = 1.0
        n = s.write(fd, b"abcdefgh")
        assert 1 <= n < 8 and s.read_bytes(F) == b"abcdefgh"[:n] and s.short_writes == 1
        s.short_write_rate = 0.0
        try:
            assert s.pwrite(fd, b"xy", n) == 2
            kinds.add("went on")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            kinds.add("disk full")
        assert s.write(fd, b"z") == 1  # a single byte is never short
    assert kinds == {"went on", "disk full"}


def test_unlink_without_fsync_dir_may_come_back() -> None:
    seen = set()
    for seed in range(30):
        s = _disk(seed)
        s.close(_create(s, F, b"x"))
        s.unlink(F)
        assert not s.exists(F)
        s.power_loss(random.Random(seed))
        seen.add(s.exists(F))
    assert seen == {True, False}


# ------------------------------------------------ snapshot archives on SimStorage

def _plugin_files(tmp_path: Path, seq: int, n: int) -> tuple[Path, "SnapshotMeta"]:
    from worker.plugins.base import ApplyContext, load_plugin
    from worker.replica_msgs import SnapshotMeta

    p = load_plugin("entities")
    for i in range(n):
        p.apply({"kind": "put_item", "id": f"i{i}", "doc": {"n": i}}, ApplyContext(i + 1, 1, i))
    files = tmp_path / f"plugin-{seq}"
    files.mkdir()
    p.snapshot(files)
    return files, SnapshotMeta(term=1, seq=seq, dedup=(), config=None, config_seq=0, ts=0)


def test_snapshot_archives_on_sim_storage_survive_crashes(tmp_path: Path) -> None:
    from worker.plugins.base import load_plugin
    from worker.snapshots import (file_digest, install_downloaded, latest_snapshot, list_snapshots,
                                  prune_snapshots, read_meta, restore_snapshot, snapshot_at, write_snapshot)

    snaps = Path("/node/snaps")
    old_files, old_meta = _plugin_files(tmp_path, 10, 5)
    new_files, new_meta = _plugin_files(tmp_path, 20, 9)
    outcomes = set()
    for seed in range(60):
        disk = SimStorage(random.Random(seed))
        disk.mkdir(snaps)
        disk.fsync_dir(Path("/"))
        disk.fsync_dir(snaps.parent)
        old = write_snapshot(snaps, old_meta, old_files, storage=disk)
        assert old.digest == file_digest(old.path, storage=disk) and read_meta(old.path, storage=disk) == old_meta
        disk.crash_after(random.Random(seed).randint(1, 20))  # (its first few: the directories' fsyncs)
        try:
            write_snapshot(snaps, new_meta, new_files, storage=disk)
            prune_snapshots(snaps, 20, storage=disk)
        except SimCrash:
            pass
        disk.power_loss(random.Random(seed), random.Random(seed).choice(MODES))
        found = list_snapshots(snaps, storage=disk)
        outcomes.add(tuple(s.seq for s in found))
        assert found, f"seed {seed}: no snapshot left"
        for s in found:  # a listed snapshot is complete: its digest matches
            assert file_digest(s.path, storage=disk) == s.digest, f"seed {seed}: {s}"
        latest = latest_snapshot(snaps, storage=disk)
        assert latest is not None and snapshot_at(snaps, latest.seq, storage=disk) == latest
        fresh = load_plugin("entities")
        meta = restore_snapshot(latest.path, fresh, expect_digest=latest.digest, storage=disk, scratch=tmp_path)
        assert meta.seq == latest.seq
        assert fresh.query({"kind": "get_item", "id": "i4"}) == {"n": 4}
    assert {(10,), (20,)} <= outcomes

    # A download lands as a partial file in the snapshot directory, then is installed.
    disk = SimStorage(random.Random(1))
    snap = write_snapshot(snaps, new_meta, new_files, storage=disk)
    partial = snaps / ".download-x"
    fd = disk.open(partial, os.O_WRONLY | os.O_CREAT)
    disk.write(fd, disk.read_bytes(snap.path))
    disk.fsync(fd)
    disk.close(fd)
    got = install_downloaded(snaps, partial, 3, 30, snap.digest, storage=disk)
    assert got.size == snap.size and [s.seq for s in list_snapshots(snaps, storage=disk)] == [20, 30]


def test_a_snapshot_in_a_fresh_directory_survives_a_power_loss(tmp_path: Path) -> None:
    from worker.snapshots import list_snapshots, write_snapshot

    files, meta = _plugin_files(tmp_path, 10, 3)
    for seed in range(20):
        disk = SimStorage(random.Random(seed))
        disk.mkdir(Path("/node"))
        disk.fsync_dir(Path("/"))
        write_snapshot(Path("/node/snaps"), meta, files, storage=disk)  # returned: durable
        disk.power_loss(random.Random(seed), "prefix")
        assert [s.seq for s in list_snapshots(Path("/node/snaps"), storage=disk)] == [10], f"seed {seed}"


def test_a_directory_whose_first_making_failed_is_durable_once_a_retry_succeeds() -> None:
    # A group's first open hit a failed directory fsync after its mkdir; the
    # retry found the directory there. If it fsynced only what it created,
    # nothing would make the name durable and a power loss would take the
    # group away with everything synced in it (found by the shell simulator).
    from worker.storage import make_dirs

    for mode in MODES:
        disk = SimStorage(random.Random(3))
        path = Path("/data/groups/0")
        disk.fsync_fail_rate = 1.0
        with pytest.raises(OSError):
            make_dirs(disk, path)
        disk.fsync_fail_rate = 0.0
        make_dirs(disk, path)
        disk.power_loss(random.Random(3), mode)
        assert disk.is_dir(path), mode


def test_o_append_writes_at_the_end_and_a_read_only_fd_refuses_writes() -> None:
    # A resumed snapshot download appends to its partial file (worker/group.py
    # `_fetch`); a model that wrote at offset 0 hid that path from the simulator.
    import errno
    import os

    disk = SimStorage(random.Random(0))
    path = Path("/d/partial")
    disk.mkdir(path.parent)
    fd = disk.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    disk.write(fd, b"head-")
    disk.close(fd)
    fd = disk.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    disk.write(fd, b"tail")
    disk.close(fd)
    assert disk.read_bytes(path) == b"head-tail"
    fd = disk.open(path, os.O_RDONLY)
    with pytest.raises(OSError) as err:
        disk.write(fd, b"x")
    assert err.value.errno == errno.EBADF
    disk.close(fd)


def test_a_snapshot_pruned_while_it_is_listed_is_left_out(tmp_path: Path) -> None:
    # The loop lists snapshots (a manifest, a SnapshotNeeded) while the
    # persist thread may prune them: a file gone between the listing and its
    # read was a 500 for the manifest.
    from worker.snapshots import list_snapshots, prune_snapshots, write_snapshot

    class PrunedMidway(SimStorage):
        armed = False

        def read_bytes(self, path: Path) -> bytes:
            if self.armed and path.name.startswith("snap-00000000000000000010-"):
                self.armed = False
                prune_snapshots(snaps, 20, storage=self)  # the other thread, just now
            return super().read_bytes(path)

    snaps = Path("/node/snaps")
    disk = PrunedMidway(random.Random(0))
    old_files, old_meta = _plugin_files(tmp_path, 10, 5)
    new_files, new_meta = _plugin_files(tmp_path, 20, 9)
    write_snapshot(snaps, old_meta, old_files, storage=disk)
    write_snapshot(snaps, new_meta, new_files, storage=disk)
    disk.armed = True
    assert [s.seq for s in list_snapshots(snaps, storage=disk)] == [20]
