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
