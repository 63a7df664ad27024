"""The WAL on SimStorage: random workloads, crashes anywhere (power loss in each
mode, or the process dying in the middle of a call), then recovery.

What must hold after every crash:
* every entry whose `sync()` (or `compact_through`, `close`) returned before
  the crash is recovered intact (after a kill that keeps the page cache:
  every entry whose append returned);
* the recovered entries are a contiguous run of seqs from the snapshot point,
  each exactly as appended (never an entry a durable truncation removed);
* the term and the snapshot point never go back;
* a torn tail is cut, and reported (`torn_bytes`), leaving records then zeros;
* recovery is itself durable: a second crash and recovery finds the same log;
* a damaged synced record before the tail is `WalCorrupt`, never skipped.
"""
from __future__ import annotations

import os
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from xxhash import xxh3_64_intdigest

from tests.support.sim_storage import MODES, SimCrash, SimStorage
from worker.wal import Entry, Wal, WalCorrupt, WalFailed

D = Path("/node/wal")
HEADER = struct.Struct("<IQ")
SEEDS = 300


def _records_end(data: bytes) -> int:
    """Where the run of valid records at the start of a segment ends."""
    pos = 0
    while pos + HEADER.size <= len(data):
        length, digest = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if length == 0 or end > len(data) or xxh3_64_intdigest(data[pos + HEADER.size:end]) != digest:
            break
        pos = end
    return pos


def _clean_tail(data: bytes) -> bool:
    """Records, then only zeros: nothing torn."""
    return data.count(0, _records_end(data)) == len(data) - _records_end(data)


def _last_segment(disk: SimStorage) -> Path | None:
    if not disk.is_dir(D):
        return None
    segs = sorted(n for n in disk.listdir(D) if n.startswith("wal-"))
    return D / segs[-1] if segs else None


@dataclass
class Model:
    """What the test knows it asked for, updated only when a call returns."""

    log: dict[int, Entry] = field(default_factory=dict)  # seq -> entry, from snap_seq + 1
    snap_seq: int = 0
    snap_term: int = 0
    synced: int = 0  # entries <= this are durable
    term: int = 0  # durable current term
    inflight: dict[int, Entry] = field(default_factory=dict)  # the batch of an append that crashed
    may_lose_all: bool = False  # a reset or truncation was cut in the middle
    truncating_to: int | None = None

    @property
    def last_seq(self) -> int:
        return max(self.log, default=self.snap_seq)

    def last_term(self) -> int:
        return self.log[self.last_seq].term if self.log else self.snap_term


def _payload(rng: random.Random) -> Any:
    size = rng.choice((0, 5, 40, 300, 3000, 9000))
    return {"b": rng.randbytes(size), "k": rng.randrange(1000)}


def _workload(rng: random.Random, disk: SimStorage, m: Model, wal: Wal, opts: dict[str, Any]) -> None:
    """Random operations until the step budget runs out (or SimCrash propagates)."""
    for _ in range(rng.randint(3, 40)):
        op = rng.choices(("append", "sync", "term", "commit", "truncate", "compact", "reset", "reopen"),
                         (40, 20, 5, 8, 6, 5, 2, 4))[0]
        if op == "append":
            term = max(m.last_term(), rng.choice((m.last_term(), m.term)))
            first = m.last_seq + 1
            batch = [Entry(term, s, _payload(rng)) for s in range(first, first + rng.randint(1, 6))]
            m.inflight = {e.seq: e for e in batch}
            wal.append(batch)
            m.log.update(m.inflight)
            m.inflight = {}
            if opts["fsync"] == "always":
                m.synced = m.last_seq
        elif op == "sync":
            wal.sync()
            m.synced = m.last_seq
        elif op == "term":
            wal.set_hard_state(term=m.term + 1)
            m.term += 1
        elif op == "commit":
            wal.set_hard_state(commit=rng.randint(0, m.last_seq))
        elif op == "truncate":
            lo = max(m.snap_seq, wal.commit)
            if lo > m.last_seq:
                continue
            seq = rng.randint(lo, m.last_seq)
            m.truncating_to = seq
            wal.truncate_after(seq)
            m.truncating_to = None
            for s in [s for s in m.log if s > seq]:
                del m.log[s]
            m.synced = min(m.synced, seq)
        elif op == "compact":
            if m.last_seq <= m.snap_seq:
                continue
            seq = rng.randint(m.snap_seq + 1, m.last_seq)
            wal.compact_through(seq)
            m.synced = m.last_seq
            m.snap_seq, m.snap_term = seq, m.log[seq].term
            for s in [s for s in m.log if s <= seq]:
                del m.log[s]
        elif op == "reset":
            seq = m.last_seq + rng.randint(1, 5)
            m.may_lose_all = True
            wal.reset(m.term, seq)
            m.may_lose_all = False
            m.log.clear()
            m.snap_seq, m.snap_term, m.synced = seq, m.term, seq
        elif op == "reopen":
            wal.close()
            m.synced = m.last_seq
            wal, rec = Wal.recover(D, storage=disk, **opts)
            assert rec.entries == [m.log[s] for s in sorted(m.log)]


def _check_recovered(disk: SimStorage, m: Model, *, kept_cache: bool, opts: dict[str, Any]) -> None:
    seg = _last_segment(disk)
    before = disk.read_bytes(seg) if seg is not None else b""
    wal, rec = Wal.recover(D, storage=disk, **opts)
    hs = rec.hard_state
    assert hs.term >= m.term
    assert hs.snap_seq >= m.snap_seq
    seqs = [e.seq for e in rec.entries]
    assert seqs == list(range(hs.snap_seq + 1, hs.snap_seq + 1 + len(seqs))), "not contiguous"
    for e in rec.entries:
        assert e == m.log.get(e.seq) or e == m.inflight.get(e.seq), f"entry {e.seq} is not as appended"
    if not m.may_lose_all:
        must = m.last_seq if kept_cache else m.synced
        if m.truncating_to is not None:
            must = min(must, m.truncating_to)
        got = {e.seq for e in rec.entries}
        missing = [s for s in m.log if hs.snap_seq < s <= must and s not in got]
        assert not missing, f"lost durable entries {missing[:5]} (must {must}, got {seqs[-1:] })"
    # A torn tail is cut and reported; what stays is records, then zeros.
    if seg is not None and disk.exists(seg):
        assert _clean_tail(disk.read_bytes(seg))
        if not _clean_tail(before):
            assert rec.recovery.torn_bytes > 0
    # Recovery made what it reports durable: another crash changes nothing.
    disk.power_loss(mode=disk.rng.choice(MODES))
    wal2, rec2 = Wal.recover(D, storage=disk, **opts)
    assert rec2.entries == rec.entries and rec2.hard_state == rec.hard_state
    wal2.close()
    del wal


def _run(seed: int) -> None:
    rng = random.Random(seed)
    disk = SimStorage(random.Random(seed + 1_000_000))
    opts = {"fsync": rng.choice(("batch", "batch", "always")),
            "segment_bytes": rng.choice((300, 2000, 9000, 1 << 20)),
            "cache_entries": rng.choice((0, 3, 100))}
    m = Model()
    wal = Wal.open(D, storage=disk, **opts)
    wal.set_hard_state(term=1)
    m.term = 1
    crash_mid_call = rng.random() < 0.6
    if crash_mid_call:
        disk.crash_after(rng.randint(1, 80))
    try:
        _workload(rng, disk, m, wal, opts)
    except SimCrash:
        pass
    else:
        m.inflight, m.may_lose_all, m.truncating_to = {}, False, None
    kill_only = rng.random() < 0.25
    if kill_only:
        disk.kill()
    else:
        disk.power_loss(mode=rng.choice(MODES))
    _check_recovered(disk, m, kept_cache=kill_only, opts=opts)


@pytest.mark.parametrize("chunk", range(10))
def test_wal_survives_crashes_on_sim_storage(chunk: int) -> None:
    for seed in range(chunk, SEEDS, 10):
        try:
            _run(seed)
        except BaseException as exc:
            raise AssertionError(f"seed {seed}: {exc!r}") from exc


def _synced_log(seed: int) -> tuple[SimStorage, random.Random, Wal]:
    rng = random.Random(seed)
    disk = SimStorage(random.Random(seed))
    wal = Wal.open(D, storage=disk, segment_bytes=rng.choice((400, 3000, 1 << 20)))
    wal.set_hard_state(term=1)
    seq = 1
    for _ in range(rng.randint(2, 8)):
        n = rng.randint(1, 5)
        wal.append([(1, s, _payload(rng)) for s in range(seq, seq + n)])
        seq += n
        wal.sync()
    return disk, rng, wal


@pytest.mark.parametrize("chunk", range(4))
def test_damage_to_a_synced_record_before_the_tail_is_corruption(chunk: int) -> None:
    for seed in range(chunk, 100, 4):
        disk, rng, wal = _synced_log(seed)
        # (segment, start, end) of every record but the very last one of the log.
        spans = []
        for name in sorted(n for n in disk.listdir(D) if n.startswith("wal-")):
            data, pos = disk.read_bytes(D / name), 0
            while pos < _records_end(data):
                length, _ = HEADER.unpack_from(data, pos)
                spans.append((D / name, pos, pos + HEADER.size + length))
                pos += HEADER.size + length
        spans.pop()
        if not spans:
            continue
        path, lo, hi = rng.choice(spans)
        offset = disk.corrupt(path, rng, lo, hi)
        if rng.random() < 0.5:
            disk.power_loss(mode=rng.choice(MODES))
        else:
            disk.kill()
        with pytest.raises(WalCorrupt):
            Wal.open(D, storage=disk)
        del wal, offset


def test_a_failed_fsync_fails_the_wal_and_only_synced_entries_are_promised() -> None:
    for seed in range(50):
        disk, rng, wal = _synced_log(seed)
        synced = wal.last_seq
        kept = wal.entries(wal.first_seq)
        wal.append([(1, synced + 1, _payload(rng))])
        disk.fail_next_fsync()
        with pytest.raises(OSError):
            wal.sync()
        with pytest.raises(WalFailed):
            wal.append([(1, synced + 2, b"x")])
        with pytest.raises(WalFailed):
            wal.sync()
        wal.close()  # releases the files, writes nothing
        disk.power_loss(mode=rng.choice(MODES))
        wal, rec = Wal.recover(D, storage=disk)
        assert rec.entries == kept  # the failed sync's pages never reached the disk
        wal.close()


def test_hard_state_fsync_failure_keeps_the_old_term() -> None:
    disk, rng, wal = _synced_log(7)
    disk.fail_next_fsync()
    with pytest.raises(OSError):
        wal.set_hard_state(term=5)
    with pytest.raises(WalFailed):
        wal.set_hard_state(term=5)
    wal.close()
    disk.power_loss(mode="reorder")
    wal, rec = Wal.recover(D, storage=disk)
    assert rec.hard_state.term == 1
    wal.close()


def test_the_lock_is_held_on_sim_storage_and_dropped_by_kill() -> None:
    disk = SimStorage(random.Random(0))
    wal = Wal.open(D, storage=disk)
    with pytest.raises(Exception, match="in use"):
        Wal.open(D, storage=disk)
    disk.kill()
    Wal.open(D, storage=disk).close()
    del wal
    assert os.sep == "/"


@pytest.mark.parametrize("seed", range(20))
def test_recovery_makes_an_interrupted_hard_state_write_durable(seed: int) -> None:
    """Killed between the hard state's rename and its directory fsync: what
    recovery reports (the new term, from the page cache) must survive a power loss."""
    disk, rng, wal = _synced_log(seed)
    ops: list[str] = []

    def hook(op: str) -> bool:
        ops.append(op)
        return op == "fsync_dir" and ops[-2:-1] == ["replace"]

    disk.crash_hook = hook
    with pytest.raises(SimCrash):
        wal.set_hard_state(term=2)
    disk.crash_hook = None
    disk.kill()
    wal, rec = Wal.recover(D, storage=disk)
    assert rec.hard_state.term == 2  # the rename is in the page cache
    disk.power_loss(rng, "prefix")
    wal, rec2 = Wal.recover(D, storage=disk)
    assert rec2.hard_state.term == 2
    wal.close()


def test_entries_whose_sync_failed_are_not_reported_by_a_reopen_before_a_power_loss() -> None:
    # fsyncgate: the pages a failed fsync could not write stay in the page
    # cache, marked clean; recovery's own fsync would not write them either.
    # The WAL cuts them off when the fsync fails (Wal._drop_unsynced).
    disk, rng, wal = _synced_log(3)
    kept = wal.entries(wal.first_seq)
    wal.append([(1, wal.last_seq + 1, b"never durable")])
    disk.fail_next_fsync()
    with pytest.raises(OSError):
        wal.sync()
    wal.close()
    wal, rec = Wal.recover(D, storage=disk)  # the shell reopens after WalFailed
    reported = rec.entries
    wal.close()
    disk.power_loss(rng, "lose")
    wal, after = Wal.recover(D, storage=disk)
    wal.close()
    # What the reopened replica reported as its log (and may acknowledge) must survive.
    assert after.entries == reported, f"reported {len(reported)}, kept {len(kept)}, after {len(after.entries)}"


def test_a_full_disk_fails_the_append_and_the_log_recovers() -> None:
    for seed in range(30):
        disk, rng, wal = _synced_log(seed)
        kept = wal.entries(wal.first_seq)
        disk.fail_next_writes(2)  # the allocation ahead (tolerated), then the write
        with pytest.raises(OSError):
            wal.append([(1, wal.last_seq + 1, _payload(rng))])
        disk.write_failures = 0
        with pytest.raises(WalFailed):
            wal.sync()
        wal.close()
        disk.power_loss(rng, rng.choice(MODES))
        wal, rec = Wal.recover(D, storage=disk)
        assert rec.entries == kept
        wal.append([(1, wal.last_seq + 1, b"after")])
        wal.close()


def test_short_writes_leave_whole_records_or_a_failed_append_the_log_recovers_from() -> None:
    """A short write is looped on (a signal) or surfaces as the next write's ENOSPC
    (the disk filled up): never a record with a hole, never a lost synced entry."""
    failed = shorts = 0
    for seed in range(60):
        disk, rng, wal = _synced_log(seed)
        disk.short_write_rate = 0.5
        kept = wal.entries(wal.first_seq)
        batch = [(1, wal.last_seq + i, _payload(rng)) for i in range(1, rng.randint(2, 6))]
        try:
            wal.append(batch)
            wal.sync()
            kept = wal.entries(wal.first_seq)
        except OSError:
            failed += 1
            disk.write_failures = 0
            with pytest.raises(WalFailed):
                wal.sync()
        disk.short_write_rate, shorts = 0.0, shorts + disk.short_writes
        wal.close()
        disk.power_loss(rng, rng.choice(MODES))
        wal, rec = Wal.recover(D, storage=disk)
        # Unsynced records may outlive a power loss, but only whole and in order.
        extra = rec.entries[len(kept):]
        assert rec.entries[:len(kept)] == kept and extra == [Entry(*b) for b in batch[:len(extra)]]
        wal.close()
    assert 0 < failed < 60 and shorts > failed


def test_a_failed_fsync_in_truncate_after_keeps_the_synced_entries_it_was_asked_to_keep() -> None:
    # truncate_after reopens an earlier segment, synced whole; a failed fsync
    # of its cut must not cut it further to the size the deleted segment had
    # (found by review: _drop_unsynced cut synced entries).
    for seed in range(10):
        disk = SimStorage(random.Random(seed))
        wal = Wal.open(D, storage=disk, segment_bytes=2000)
        wal.set_hard_state(term=1)
        for s in range(1, 41):
            wal.append([(1, s, b"x" * 100)])
            wal.sync()
        prev = wal._segments[-2]
        keep = prev.first_seq + (seed % len(prev.offsets))
        disk.fail_next_fsync()
        with pytest.raises(OSError):
            wal.truncate_after(keep)
        wal.close()
        disk.settle()  # the worker's retry: what is there synced, the cache dropped
        wal, rec = Wal.recover(D, storage=disk)
        wal.close()
        assert rec.entries and rec.entries[-1].seq >= keep, (seed, keep, rec.entries[-1:])
        assert [e.seq for e in rec.entries] == list(range(1, rec.entries[-1].seq + 1))
