"""The write-ahead log: round trips, recovery (torn tail vs corruption), segments,
truncation, compaction, hard state, fsync modes, and a model-based property test."""
from __future__ import annotations

import errno
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from worker.wal import (
    Entry,
    HardState,
    Wal,
    WalCompacted,
    WalCorrupt,
    WalError,
    WalFailed,
    _decode_hard_state,
    segment_name,
)

HEADER = struct.Struct("<IQ")


def payload(seq: int) -> dict[str, Any]:
    return {"seq": seq, "op": "put", "pad": "x" * (seq * 7 % 40), 3: b"\x00\x01"}


def recs(first: int, n: int, term: int = 1) -> list[tuple[int, int, Any]]:
    return [(term, s, payload(s)) for s in range(first, first + n)]


def expected(first: int, n: int, term: int = 1) -> list[Entry]:
    return [Entry(t, s, p) for t, s, p in recs(first, n, term)]


def seg_files(d: Path) -> list[Path]:
    return sorted(d.glob("wal-*.seg"))


def spans(path: Path) -> list[tuple[int, int]]:
    """(start, end) byte offsets of every complete record in a segment file
    (up to the zeros of the space allocated ahead: no record is empty)."""
    data, out, pos = path.read_bytes(), [], 0
    while pos + HEADER.size <= len(data):
        length, _ = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if length == 0 or end > len(data):
            break
        out.append((pos, end))
        pos = end
    return out


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def filled(d: Path, n: int, *, term: int = 1, batch: int = 10, **kw: Any) -> Wal:
    wal = Wal.open(d, **kw)
    wal.set_hard_state(term=term)
    for first in range(1, n + 1, batch):
        wal.append(recs(first, min(batch, n + 1 - first), term))
        wal.sync()
    return wal


def test_append_reopen_round_trip(tmp_path: Path) -> None:
    wal = Wal.open(tmp_path / "g1")
    assert (wal.first_seq, wal.last_seq, wal.last_term, len(wal)) == (1, 0, 0, 0)
    wal.set_hard_state(term=3, commit=4)
    wal.append([(2, 1, {"a": 1}), (3, 2, ("tuple", 1)), (3, 3, b"raw"), (3, 4, {7: None})])
    wal.append([(3, 5, "five")])
    wal.sync()
    assert (wal.last_seq, wal.last_term, wal.term_at(1), wal.term_at(4)) == (5, 3, 2, 3)
    wal.close()
    with pytest.raises(WalError):
        wal.sync()

    wal, rec = Wal.recover(tmp_path / "g1")
    # Payloads come back as msgpack decodes them: tuples as lists, int keys kept.
    assert rec.entries == [Entry(2, 1, {"a": 1}), Entry(3, 2, ["tuple", 1]), Entry(3, 3, b"raw"),
                           Entry(3, 4, {7: None}), Entry(3, 5, "five")]
    assert rec.hard_state == HardState(term=3, commit=4)  # the commit hint is saved by close()
    assert rec.recovery.torn_bytes == 0
    assert [p.name for p in seg_files(tmp_path / "g1")] == [segment_name(1)]
    wal.append([(3, 6, "six")])
    assert wal.entries(5) == [Entry(3, 5, "five"), Entry(3, 6, "six")]
    wal.close()


def test_records_have_the_documented_layout(tmp_path: Path) -> None:
    with Wal.open(tmp_path) as wal:
        wal.set_hard_state(term=1)
        wal.append([(1, 1, {"k": "v"})])
    data = (tmp_path / segment_name(1)).read_bytes()
    length, digest = HEADER.unpack_from(data, 0)
    body = data[12:]
    assert length == len(body) and digest == xxh3_64_intdigest(body)
    assert msgpack.unpackb(body) == [1, 1, {"k": "v"}]


@pytest.mark.parametrize("cut", ["header:1", "header:11", "body:0", "body:1", "body:mid", "body:-1"])
def test_torn_last_record_is_dropped_and_appends_continue(tmp_path: Path, cut: str) -> None:
    filled(tmp_path, 20).close()
    path = seg_files(tmp_path)[-1]
    start, end = spans(path)[-1]
    where, arg = cut.split(":")
    body_len = end - start - 12
    keep = {"header": start + int(arg) if where == "header" else 0,
            "body": start + 12 + {"0": 0, "1": 1, "mid": body_len // 2, "-1": body_len - 1}.get(arg, 0)}[where]
    os.truncate(path, keep)

    wal = Wal.open(tmp_path)
    assert wal.last_seq == 19 and wal.recovery.torn_bytes == keep - start
    assert path.stat().st_size == start
    wal.append(recs(20, 3))
    wal.close()
    wal, rec = Wal.recover(tmp_path)
    assert rec.entries == expected(1, 22) and rec.recovery.torn_bytes == 0
    wal.close()


def test_bad_checksum_on_the_very_last_record_is_a_torn_tail(tmp_path: Path) -> None:
    filled(tmp_path, 5).close()
    path = seg_files(tmp_path)[-1]
    start, end = spans(path)[-1]
    flip(path, end - 1)
    with Wal.open(tmp_path) as wal:
        assert wal.last_seq == 4 and wal.recovery.torn_bytes == end - start


def test_zeros_after_the_last_record_are_free_space(tmp_path: Path) -> None:
    # The space allocated ahead of the writes, or a file extended by a power
    # loss where a write was lost: either way nothing was written there.
    filled(tmp_path, 5).close()
    path = seg_files(tmp_path)[-1]
    with path.open("ab") as f:
        f.write(b"\0" * 4096)
    with Wal.open(tmp_path) as wal:
        assert wal.last_seq == 5 and wal.recovery.torn_bytes == 0
        wal.append(recs(6, 2))
    with Wal.open(tmp_path) as wal:
        assert wal.entries(1) == expected(1, 7)


def test_a_write_cut_short_in_allocated_space_is_a_torn_tail(tmp_path: Path) -> None:
    wal = filled(tmp_path, 5)
    wal.append(recs(6, 1))
    wal.sync()
    path = seg_files(tmp_path)[-1]
    start, end = spans(path)[-1]
    assert path.stat().st_size > end  # allocated ahead
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy"))  # a crash while open
    wal.close()
    data = bytearray((copy / path.name).read_bytes())
    data[end - 3:end] = b"\0\0\0"  # the last sector of the write never reached the disk
    (copy / path.name).write_bytes(bytes(data))
    with Wal.open(copy) as wal:
        assert wal.last_seq == 5 and wal.recovery.torn_bytes == end - start
        wal.append(recs(6, 2))
    with Wal.open(copy) as wal:
        assert wal.entries(1) == expected(1, 7) and wal.recovery.torn_bytes == 0


def _crash_copy_with(tmp_path: Path, damage: Any) -> tuple[Path, list[tuple[int, int]]]:
    """Five synced records, then three big unsynced ones; a copy of the
    directory as a power loss could leave it after `damage(data, spans)`."""
    wal = filled(tmp_path, 5)
    wal.append([(1, s, {"seq": s, "blob": "y" * 9000}) for s in (6, 7, 8)])
    path = seg_files(tmp_path)[-1]
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy"))
    wal.close()
    target = copy / path.name
    data = bytearray(target.read_bytes())
    where = spans(target)
    damage(data, where)
    target.write_bytes(bytes(data))
    return copy, where


@pytest.mark.parametrize("hole", ["block", "header"])
def test_a_hole_in_unsynced_writes_ends_the_log_there(tmp_path: Path, hole: str) -> None:
    def damage(data: bytearray, where: list[tuple[int, int]]) -> None:
        start, end = where[5]  # seq 6; seqs 7 and 8 reached the disk
        if hole == "header":
            data[start:start + HEADER.size] = bytes(HEADER.size)
        else:
            block = -(-(start + HEADER.size) // 4096) * 4096
            assert block + 4096 <= end
            data[block:block + 4096] = bytes(4096)
    copy, where = _crash_copy_with(tmp_path, damage)
    with Wal.open(copy) as wal:
        assert wal.last_seq == 5 and wal.recovery.torn_bytes == where[-1][1] - where[5][0]
        wal.append(recs(6, 2))
    with Wal.open(copy) as wal:
        assert wal.entries(1) == expected(1, 7) and wal.recovery.torn_bytes == 0


def test_a_bad_record_without_a_hole_before_other_records_is_corruption(tmp_path: Path) -> None:
    def damage(data: bytearray, where: list[tuple[int, int]]) -> None:
        data[where[5][0] + 40] ^= 0x40  # one flipped bit in seq 6, seqs 7 and 8 intact
    copy, _ = _crash_copy_with(tmp_path, damage)
    with pytest.raises(WalCorrupt, match="checksum mismatch"):
        Wal.open(copy)


def test_a_damaged_committed_record_full_of_zeros_is_corruption_not_a_hole(tmp_path: Path) -> None:
    with Wal.open(tmp_path) as wal:
        wal.set_hard_state(term=1)
        wal.append([(1, s, {"seq": s, "v": bytes(9000) if s == 3 else b"x"}) for s in range(1, 8)])
        wal.sync()
        wal.set_hard_state(commit=7)
    path = seg_files(tmp_path)[-1]
    start, _ = spans(path)[2]
    flip(path, start + HEADER.size + 2)  # seq 3, synced and committed, damaged on disk later
    with pytest.raises(WalCorrupt, match="at or below the commit hint 7"):
        Wal.open(tmp_path)


def hard_state_on_disk(d: Path) -> HardState:
    path = d / "hardstate"
    return _decode_hard_state(path, path.read_bytes())


def test_the_commit_hint_on_disk_never_runs_ahead_of_the_synced_log(tmp_path: Path) -> None:
    wal = filled(tmp_path, 5)
    wal.sync()
    wal.set_hard_state(commit=5, term=2)
    assert hard_state_on_disk(tmp_path).commit == 5  # all of the log was synced
    wal.append(recs(6, 3, term=2))
    wal.set_hard_state(commit=8, term=3)  # a new term while seqs 6-8 are not synced yet
    assert hard_state_on_disk(tmp_path).commit == 5
    wal.sync()
    wal.close()
    assert hard_state_on_disk(tmp_path).commit == 8


def test_no_room_to_allocate_ahead_still_appends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    wal = filled(tmp_path, 5)
    wal.append(recs(6, 3))
    wal.sync()
    assert seg_files(tmp_path)[-1].stat().st_size == spans(seg_files(tmp_path)[-1])[-1][1]
    wal.close()
    with Wal.open(tmp_path) as wal:
        assert wal.entries(1) == expected(1, 8)


def test_a_damaged_length_that_swallows_later_records_is_corruption(tmp_path: Path) -> None:
    wal = filled(tmp_path, 6)
    path = seg_files(tmp_path)[-1]
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy"))
    wal.close()
    target = copy / path.name
    (s2, _), (_, e_last) = spans(target)[2], spans(target)[-1]
    data = bytearray(target.read_bytes())
    HEADER.pack_into(data, s2, e_last - s2 - HEADER.size + 7, HEADER.unpack_from(data, s2)[1])
    target.write_bytes(bytes(data))
    with pytest.raises(WalCorrupt, match="checksum mismatch"):
        Wal.open(copy)


@pytest.mark.parametrize("target", ["body", "checksum", "length-small"])
def test_bad_record_followed_by_others_is_corruption(tmp_path: Path, target: str) -> None:
    filled(tmp_path, 10).close()
    path = seg_files(tmp_path)[-1]
    start, end = spans(path)[4]
    if target == "length-small":
        data = bytearray(path.read_bytes())
        struct.pack_into("<I", data, start, end - start - 12 - 3)
        path.write_bytes(bytes(data))
    else:
        flip(path, {"body": end - 2, "checksum": start + 6}[target])
    with pytest.raises(WalCorrupt) as info:
        Wal.open(tmp_path)
    assert info.value.offset == start and info.value.path == str(path)
    with pytest.raises(WalCorrupt):  # again: the failed open released the directory
        Wal.open(tmp_path)


def test_damaged_length_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    # A bit flip in a length field that points past the end of the file would
    # look like a torn record; cutting there would drop fsynced records.
    filled(tmp_path, 10).close()
    path = seg_files(tmp_path)[-1]
    start, _ = spans(path)[3]
    data = bytearray(path.read_bytes())
    data[start + 3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(WalCorrupt, match="length damaged"):
        Wal.open(tmp_path)


def test_corrupt_wal_is_released_and_can_be_discarded_keeping_the_term(tmp_path: Path) -> None:
    filled(tmp_path, 10, term=4).close()
    flip(seg_files(tmp_path)[0], 20)
    with pytest.raises(WalCorrupt):
        Wal.open(tmp_path)
    Wal.discard(tmp_path)  # would raise WalError if the failed open kept the lock
    with Wal.open(tmp_path) as wal:
        assert (wal.term, wal.first_seq, wal.last_seq) == (4, 1, 0)
        wal.reset(3, 8)  # the leader's snapshot, then its tail
        wal.append(recs(9, 2, term=4))
    with Wal.open(tmp_path) as wal:
        assert wal.snapshot == (3, 8) and wal.entries(9) == expected(9, 2, term=4)


def test_segments_roll_and_recover_across_segments(tmp_path: Path) -> None:
    wal = filled(tmp_path, 100, batch=7, segment_bytes=512, cache_entries=3)
    files = seg_files(tmp_path)
    assert len(files) > 5
    firsts = []
    for path in files:
        assert path.stat().st_size <= 512
        first = msgpack.unpackb(path.read_bytes()[12:spans(path)[0][1]], strict_map_key=False)[1]
        assert path.name == segment_name(first)
        firsts.append(first)
    assert firsts == sorted(firsts) and firsts[0] == 1
    assert wal.entries(1) == expected(1, 100)  # mostly from disk: the cache holds 3
    wal.close()

    wal = Wal.open(tmp_path, segment_bytes=512, cache_entries=3)
    assert wal.recovery.segments == len(files)
    assert wal.entries(1) == expected(1, 100)
    assert wal.entries(40, 45) == expected(40, 6)
    wal.append(recs(101, 30))
    wal.close()
    wal, rec = Wal.recover(tmp_path, segment_bytes=512)
    assert rec.entries == expected(1, 130)
    wal.close()


def test_a_record_larger_than_a_segment_gets_its_own(tmp_path: Path) -> None:
    with Wal.open(tmp_path, segment_bytes=100) as wal:
        wal.set_hard_state(term=1)
        wal.append([(1, 1, "a"), (1, 2, "b" * 500), (1, 3, "c")])
    assert [p.name for p in seg_files(tmp_path)] == [segment_name(1), segment_name(2), segment_name(3)]
    with Wal.open(tmp_path, segment_bytes=100) as wal:
        assert [e.payload for e in wal.entries(1)] == ["a", "b" * 500, "c"]


def test_torn_record_in_a_segment_that_is_not_the_last_is_corruption(tmp_path: Path) -> None:
    filled(tmp_path, 60, segment_bytes=512).close()
    first = seg_files(tmp_path)[0]
    start, _ = spans(first)[-1]
    os.truncate(first, start + 5)
    with pytest.raises(WalCorrupt, match="not the last"):
        Wal.open(tmp_path, segment_bytes=512)


def test_missing_segment_is_corruption(tmp_path: Path) -> None:
    filled(tmp_path, 60, segment_bytes=512).close()
    seg_files(tmp_path)[1].unlink()
    with pytest.raises(WalCorrupt, match="expected a segment starting at seq"):
        Wal.open(tmp_path)


def test_record_with_the_wrong_seq_is_corruption(tmp_path: Path) -> None:
    filled(tmp_path, 3).close()
    body = msgpack.packb([1, 7, "x"])
    with seg_files(tmp_path)[-1].open("ab") as f:
        f.write(HEADER.pack(len(body), xxh3_64_intdigest(body)) + body)
    with pytest.raises(WalCorrupt, match="seq 7 where 4 was expected"):
        Wal.open(tmp_path)


@pytest.mark.parametrize("cut", [37, 40, 41, 60])
def test_truncate_after_across_segments(tmp_path: Path, cut: int) -> None:
    wal = filled(tmp_path, 100, segment_bytes=512, cache_entries=5)
    files_before = seg_files(tmp_path)
    wal.set_hard_state(term=2)
    wal.truncate_after(cut)
    assert (wal.last_seq, wal.last_term, wal.term_at(cut + 1)) == (cut, 1, None)
    left = seg_files(tmp_path)
    assert left == [p for p in files_before if int(p.name[4:24]) <= cut]
    assert spans(left[-1])[-1][1] == left[-1].stat().st_size  # cut on a record boundary
    assert not wal.unsynced  # durable on return
    wal.append(recs(cut + 1, 10, term=2))
    assert wal.entries(cut - 2, cut + 3) == expected(cut - 2, 3) + expected(cut + 1, 3, term=2)
    wal.close()
    wal, rec = Wal.recover(tmp_path, segment_bytes=512)
    assert rec.entries == expected(1, cut) + expected(cut + 1, 10, term=2)
    assert (wal.term_at(cut), wal.term_at(cut + 1)) == (1, 2)
    wal.close()


def test_truncate_across_a_term_boundary_then_a_new_term(tmp_path: Path) -> None:
    with Wal.open(tmp_path) as wal:
        wal.set_hard_state(term=3)
        wal.append(recs(1, 4, term=1) + recs(5, 4, term=2))
        wal.truncate_after(2)
        wal.append(recs(3, 6, term=3))
        assert [wal.term_at(s) for s in range(0, 10)] == [0, 1, 1, 3, 3, 3, 3, 3, 3, None]
    with Wal.open(tmp_path) as wal:
        assert [wal.term_at(s) for s in range(0, 10)] == [0, 1, 1, 3, 3, 3, 3, 3, 3, None]


def test_truncate_guards(tmp_path: Path) -> None:
    with filled(tmp_path, 20) as wal:
        wal.truncate_after(25)  # beyond the end: nothing to do
        assert wal.last_seq == 20
        wal.set_hard_state(commit=12)
        with pytest.raises(ValueError, match="committed"):
            wal.truncate_after(11)
        wal.compact_through(10)
        with pytest.raises(ValueError, match="snapshot"):
            wal.truncate_after(9)
        wal.truncate_after(12)
        assert wal.last_seq == 12


def test_compact_through_deletes_old_segments_and_recovery_starts_at_the_snapshot(tmp_path: Path) -> None:
    wal = filled(tmp_path, 100, segment_bytes=512, cache_entries=4)
    wal.set_hard_state(term=2)
    wal.append(recs(101, 5, term=2))
    before = seg_files(tmp_path)
    wal.compact_through(55)
    after = seg_files(tmp_path)
    assert after == [p for i, p in enumerate(before)
                     if i + 1 == len(before) or int(before[i + 1].name[4:24]) > 56]
    assert int(after[0].name[4:24]) <= 56 < int(after[1].name[4:24])
    assert (wal.first_seq, wal.snapshot, wal.term_at(55), wal.term_at(54)) == (56, (1, 55), 1, None)
    with pytest.raises(WalCompacted):
        wal.entries(55)
    assert wal.entries(56, 58) == expected(56, 3)
    wal.close()

    wal, rec = Wal.recover(tmp_path, segment_bytes=512)
    assert rec.hard_state == HardState(term=2, commit=55, snap_term=1, snap_seq=55)
    assert rec.entries == expected(56, 45) + expected(101, 5, term=2)
    assert wal.first_seq == 56
    wal.compact_through(105)  # everything: no segment left
    assert seg_files(tmp_path) == [] and (wal.first_seq, wal.last_seq, wal.last_term) == (106, 105, 2)
    wal.close()
    with Wal.open(tmp_path) as wal:
        assert (wal.first_seq, wal.last_seq, wal.last_term, wal.entries(106)) == (106, 105, 2, [])
        wal.append(recs(106, 2, term=2))
    assert [p.name for p in seg_files(tmp_path)] == [segment_name(106)]


def test_interrupted_compaction_is_finished_on_recovery(tmp_path: Path) -> None:
    wal = filled(tmp_path, 60, segment_bytes=512)
    saved = {p.name: p.read_bytes() for p in seg_files(tmp_path)}
    wal.compact_through(40)
    wal.close()
    for name, data in saved.items():  # as if the deletions never reached the disk
        (tmp_path / name).write_bytes(data)
    with Wal.open(tmp_path, segment_bytes=512) as wal:
        assert wal.recovery.removed_segments and wal.first_seq == 41
        assert wal.entries(41) == expected(41, 20)
    assert len(seg_files(tmp_path)) < len(saved)


def test_hard_state_is_atomic_and_survives_reopen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wal = filled(tmp_path, 10, term=2)
    wal.set_hard_state(term=5, commit=8)
    with pytest.raises(ValueError, match="below the current term"):
        wal.set_hard_state(term=4)

    # A crash between writing the temp file and the rename: the old state stays.
    def crash(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "simulated crash")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        wal.set_hard_state(term=6)
    with pytest.raises(WalFailed):  # a disk error fails the WAL until it is reopened
        wal.append(recs(11, 1, term=5))
    monkeypatch.undo()
    wal.close()
    assert (tmp_path / "hardstate.tmp").exists()

    with Wal.open(tmp_path) as wal:
        assert wal.hard_state == HardState(term=5, commit=8)  # term 5 was written with its commit
        assert not (tmp_path / "hardstate.tmp").exists()
        wal.set_hard_state(commit=9)  # memory only, until close()
    with Wal.open(tmp_path) as wal:
        assert wal.commit == 9
        wal.set_hard_state(commit=50)
        shutil.copytree(tmp_path, tmp_path / "crashed", ignore=shutil.ignore_patterns("crashed"))
    with Wal.open(tmp_path / "crashed") as wal:  # the commit hint was lost; the term was not
        assert (wal.term, wal.commit) == (5, 9)
    with Wal.open(tmp_path) as wal:  # clamped to the log
        assert wal.commit == 10


def test_damaged_hard_state_is_corruption(tmp_path: Path) -> None:
    filled(tmp_path, 3, term=2).close()
    flip(tmp_path / "hardstate", 14)
    with pytest.raises(WalCorrupt, match="hard state"):
        Wal.open(tmp_path)
    Wal.discard(tmp_path, HardState(term=9))  # the term meta says the group is at
    with Wal.open(tmp_path) as wal:
        assert (wal.term, wal.last_seq) == (9, 0)


@pytest.mark.parametrize("mode,per_sync,per_append,hard_state", [
    ("batch", 1, 0, 2), ("always", 0, 1, 2), ("none", 0, 0, 0)])
def test_fsync_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, per_sync: int,
                     per_append: int, hard_state: int) -> None:
    calls: list[int] = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, real=real: (calls.append(fd), real(fd))[1])
    wal = Wal.open(tmp_path, fsync=mode)  # type: ignore[arg-type]
    calls.clear()
    wal.set_hard_state(term=1)  # temp file + directory
    assert len(calls) == hard_state
    wal.append(recs(1, 1))  # creates the first segment
    wal.sync()
    calls.clear()
    seq = 2
    for _ in range(5):
        wal.append(recs(seq, 64))
        wal.append(recs(seq + 64, 64))
        seq += 128
        wal.sync()
        wal.sync()  # nothing new: no second fsync
    assert len(calls) == 5 * per_sync + 10 * per_append
    wal.close()


def test_append_validates_the_whole_batch_first(tmp_path: Path) -> None:
    wal = filled(tmp_path, 5, term=2)
    size = seg_files(tmp_path)[-1].stat().st_size
    bad = [
        (ValueError, [(2, 6, "ok"), (2, 8, "gap")]),
        (ValueError, [(2, 5, "dup")]),
        (ValueError, [(2, 6, "ok"), (1, 7, "term goes back")]),
        (ValueError, [(3, 6, "term not persisted")]),
        (TypeError, [(2, True, "bool seq")]),
        (TypeError, [(2, 6, "ok"), (2, 7, object())]),
    ]
    for exc, batch in bad:
        with pytest.raises(exc):
            wal.append(batch)
    assert seg_files(tmp_path)[-1].stat().st_size == size and wal.last_seq == 5
    wal.append([(2, 6, "ok")])
    assert wal.entries(6) == [Entry(2, 6, "ok")]
    wal.close()


def test_reads_use_the_index_and_respect_limits(tmp_path: Path) -> None:
    wal = filled(tmp_path, 50, segment_bytes=400, cache_entries=2, cache_bytes=10_000)
    assert wal.entries(49, 60) == expected(49, 2)  # clamped to the end, from the cache
    assert wal.entries(51) == [] and wal.entries(5, 4) == []
    one = wal.entries(3, max_bytes=1)
    assert one == expected(3, 1)  # at least one entry
    some = wal.entries(3, max_bytes=200)
    assert some == expected(3, len(some)) and 1 < len(some) < 10
    assert list(wal.iter_entries()) == expected(1, 50)
    wal.compact_through(10)
    with pytest.raises(WalCompacted) as info:
        wal.entries(10)
    assert info.value.first_seq == 11
    wal.close()


def test_disk_read_verifies_checksums(tmp_path: Path) -> None:
    wal = filled(tmp_path, 20, cache_entries=1)
    path = seg_files(tmp_path)[-1]
    start, end = spans(path)[2]
    flip(path, end - 1)
    with pytest.raises(WalCorrupt, match="checksum mismatch on read"):
        wal.entries(1)
    wal.close()


def test_fsync_error_fails_the_wal_until_reopened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wal = filled(tmp_path, 5)
    wal.append(recs(6, 2))

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "simulated EIO")
    monkeypatch.setattr(os, "fsync", eio)
    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(OSError):
        wal.sync()
    with pytest.raises(WalFailed):
        wal.append(recs(8, 1))
    wal.close()  # releases the directory without trying to sync
    monkeypatch.undo()
    with Wal.open(tmp_path) as wal:
        # The page cache still had 6 and 7, but after a failed fsync it may
        # hold them marked clean and never write them (fsyncgate): the WAL
        # cut them off when the fsync failed. They were never acknowledged.
        assert wal.last_seq == 5


def test_one_wal_per_directory(tmp_path: Path) -> None:
    with Wal.open(tmp_path):
        with pytest.raises(WalError, match="in use"):
            Wal.open(tmp_path)
    Wal.open(tmp_path).close()


def test_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync must be one of"):
        Wal.open(tmp_path, fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Wal.open(tmp_path, segment_bytes=0)


# ------------------------------------------------------------ property test

OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 6)),
    st.tuples(st.just("term"), st.just(0)),
    st.tuples(st.just("sync"), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 100)),
    st.tuples(st.just("compact"), st.integers(0, 100)),
    st.tuples(st.just("reopen"), st.just(0)),
    st.tuples(st.just("crash"), st.just(0)),        # SIGKILL: the page cache survives
    st.tuples(st.just("powerloss"), st.integers(0, 100)),  # unsynced bytes of the tail are lost
), max_size=30)


def _dirs(root: Path) -> Iterator[Path]:
    n = 0
    while True:
        n += 1
        yield root / f"d{n}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, cache_entries=st.sampled_from([0, 3, 1000]))
def test_random_operations_match_a_model(tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int]],
                                         cache_entries: int) -> None:
    root = tmp_path_factory.mktemp("wal")
    dirs = _dirs(root)
    opts: dict[str, Any] = {"segment_bytes": 160, "cache_entries": cache_entries, "cache_bytes": 300}
    d = next(dirs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)  # durability is simulated by copying files
        mp.setattr(os, "fdatasync", lambda fd: None)
        wal = Wal.open(d, **opts)
        term, snap, log, durable = 1, (0, 0), [], 0  # log: entries after the snapshot
        wal.set_hard_state(term=term)

        def last() -> tuple[int, int]:
            return (log[-1].term, log[-1].seq) if log else snap

        for op, arg in ops:
            if op == "append":
                first = last()[1] + 1
                new = [Entry(term, s, {"s": s, "p": "y" * (s % 13)}) for s in range(first, first + arg)]
                wal.append(new)
                log += new
            elif op == "term":
                term += 1
                wal.set_hard_state(term=term)
            elif op == "sync":
                wal.sync()
                durable = last()[1]
            elif op == "truncate":
                seq = snap[1] + (last()[1] - snap[1]) * arg // 100
                wal.truncate_after(seq)
                log = [e for e in log if e.seq <= seq]
                durable = seq
            elif op == "compact":
                seq = snap[1] + (last()[1] - snap[1]) * arg // 100
                if seq > snap[1]:
                    wal.compact_through(seq)
                    snap = (wal.term_at(seq), seq)
                    assert snap == (next(e.term for e in log if e.seq == seq), seq)
                    log = [e for e in log if e.seq > seq]
                    durable = last()[1]
            elif op == "reopen":
                wal.close()
                wal = Wal.open(d, **opts)
                durable = last()[1]
            else:  # crash / powerloss: copy what the disk (or page cache) holds
                new_d = next(dirs)
                shutil.copytree(d, new_d)
                wal.close()
                d = new_d
                files = seg_files(d)
                if op == "powerloss" and files:
                    path = files[-1]
                    unsynced = [s for s, e in spans(path)
                                if msgpack.unpackb(path.read_bytes()[s + 12:e], strict_map_key=False)[1] > durable]
                    if unsynced:
                        size = spans(path)[-1][1]
                        cut = unsynced[0] + (size - unsynced[0]) * arg // 100
                        if arg % 3 == 0:
                            os.truncate(path, cut)  # the file's new length was lost too
                        elif arg % 3 == 1:  # the allocated length survived, the writes did not
                            with path.open("r+b") as f:
                                f.seek(cut)
                                f.write(b"\0" * (size - cut))
                        else:  # a hole: the first unsynced header was lost, later writes were not
                            with path.open("r+b") as f:
                                f.seek(unsynced[0])
                                f.write(b"\0" * HEADER.size)
                wal = Wal.open(d, **opts)
                event(f"{op}, torn tail: {wal.recovery.torn_bytes > 0}")
                assert durable <= wal.last_seq <= last()[1]
                log = [e for e in log if e.seq <= wal.last_seq]
                durable = wal.last_seq
            assert (wal.first_seq, wal.last_seq, wal.last_term) == (snap[1] + 1, last()[1], last()[0])
            assert wal.term == term and wal.snapshot == snap
            assert wal.entries(wal.first_seq) == log
            # Bounded memory: the tail cache holds exactly its window, within limits.
            assert list(wal._cache) == list(range(wal._cache_lo, wal.last_seq + 1))
            assert len(wal._cache) <= cache_entries and wal._cache_nbytes <= opts["cache_bytes"]
            assert len(wal._run_term) <= len({e.term for e in log}) + 1
            terms = [wal.term_at(s) for s in range(snap[1] - 1, last()[1] + 2)]
            assert terms == [None, snap[0], *(e.term for e in log), None]
        wal.close()
        wal, rec = Wal.recover(d, **opts)
        assert rec.entries == log and rec.hard_state.term == term
        wal.close()
