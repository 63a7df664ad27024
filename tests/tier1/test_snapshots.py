"""Snapshot archives: write, verify, restore, prune; corruption is detected."""
from __future__ import annotations

from pathlib import Path

import pytest

from worker.plugins.base import ApplyContext, load_plugin
from worker.replica_msgs import Config, SnapshotMeta
from worker.snapshots import (SnapshotCorrupt, file_digest, latest_snapshot, list_snapshots, prune_snapshots,
                              read_meta, restore_snapshot, snapshot_at, write_snapshot)

META = SnapshotMeta(term=4, seq=120, dedup=(("rid-a", 100, 7), ("rid-b", 119, 9)),
                    config=Config(("w1", "w2", "w3"), ("w4",)), config_seq=50, ts=9)


def filled_plugin(n: int = 50):  # type: ignore[no-untyped-def]
    p = load_plugin("entities")
    for i in range(n):
        p.apply({"kind": "put_item", "id": f"i{i}", "doc": {"n": i}}, ApplyContext(i + 1, 1, i))
        p.apply({"kind": "signal", "entity": "e", "name": "hits", "value": 1, "mode": "incr"},
                ApplyContext(i + 1, 1, i))
    return p


def archive(tmp_path: Path, plugin, meta: SnapshotMeta = META):  # type: ignore[no-untyped-def]
    files = tmp_path / f"plugin-{meta.seq}"
    files.mkdir()
    plugin.snapshot(files)
    return write_snapshot(tmp_path / "snaps", meta, files)


def test_round_trip_restores_state_and_meta(tmp_path: Path) -> None:
    snap = archive(tmp_path, filled_plugin())
    assert snap.digest == file_digest(snap.path) and snap.seq == 120 and snap.term == 4
    assert read_meta(snap.path) == META
    fresh = load_plugin("entities")
    assert restore_snapshot(snap.path, fresh, expect_digest=snap.digest) == META
    assert fresh.query({"kind": "get_item", "id": "i7"}) == {"n": 7}
    assert fresh.query({"kind": "get_signals", "entity": "e"})["counters"] == {"hits": 50}


def test_a_flipped_byte_is_caught_by_the_digest(tmp_path: Path) -> None:
    snap = archive(tmp_path, filled_plugin())
    raw = bytearray(snap.path.read_bytes())
    raw[-10] ^= 0xFF
    snap.path.write_bytes(bytes(raw))
    with pytest.raises(SnapshotCorrupt):
        restore_snapshot(snap.path, load_plugin("entities"), expect_digest=snap.digest)


def test_truncated_archive_is_corrupt(tmp_path: Path) -> None:
    snap = archive(tmp_path, filled_plugin())
    snap.path.write_bytes(snap.path.read_bytes()[:-20])
    with pytest.raises(SnapshotCorrupt):
        restore_snapshot(snap.path, load_plugin("entities"))
    snap.path.write_bytes(b"nope")
    with pytest.raises(SnapshotCorrupt):
        read_meta(snap.path)


def test_prune_keeps_the_newest_and_unfinished_archives_are_ignored(tmp_path: Path) -> None:
    p = filled_plugin(5)
    for seq in (10, 20, 30):
        archive(tmp_path, p, SnapshotMeta(term=1, seq=seq))
    assert [s.seq for s in list_snapshots(tmp_path / "snaps")] == [10, 20, 30]
    # An archive whose digest never reached disk is not a snapshot.
    (tmp_path / "snaps" / "snap-00000000000000000040-0000000001.snap").write_bytes(b"partial")
    assert latest_snapshot(tmp_path / "snaps").seq == 30  # type: ignore[union-attr]
    # Leftovers of our own writes go; a download in progress stays.
    snaps = tmp_path / "snaps"
    leftovers = [snaps / "snap-00000000000000000050-0000000001.partial",
                 snaps / "snap-00000000000000000050-0000000001.snap.xxh3.tmp"]
    download = snaps / ".download-60-1.partial"
    for f in (*leftovers, download):
        f.write_bytes(b"x")
    prune_snapshots(tmp_path / "snaps", 20)
    assert [s.seq for s in list_snapshots(tmp_path / "snaps")] == [20, 30]
    assert snapshot_at(tmp_path / "snaps", 10) is None and snapshot_at(tmp_path / "snaps", 20) is not None
    assert not any(f.exists() for f in leftovers) and download.exists()
    # A digest file is complete, never left under its temporary name.
    assert (snaps / "snap-00000000000000000030-0000000001.snap.xxh3").read_text() == \
        snapshot_at(snaps, 30).digest  # type: ignore[union-attr]
    assert not list(snaps.glob("*.tmp"))


class _Recorder:
    """A plugin that records whether it was ever asked to restore."""

    def __init__(self) -> None:
        self.restored = False

    def restore(self, dir: Path) -> None:
        self.restored = True


def _hand_made(path: Path, header: object, body: bytes = b"", header_len: int | None = None) -> Path:
    """An archive written byte by byte, as a hostile or broken source could send it."""
    import struct

    from shardgrid.common.wire import packb
    from worker.snapshots import MAGIC

    raw = packb(header)
    path.write_bytes(MAGIC + struct.pack("<I", len(raw) if header_len is None else header_len) + raw + body)
    return path


GOOD_META = {"term": 1, "seq": 5, "dedup": [], "config": None, "config_seq": 0, "ts": 1}


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", ".hidden", "a\\b", "", "x\x00y", "/abs", 7, None,
                                  "n" * 300])
def test_an_archive_naming_a_file_outside_its_directory_is_refused_before_the_plugin(tmp_path: Path,
                                                                                      name: object) -> None:
    path = _hand_made(tmp_path / "a.snap", {"meta": GOOD_META, "files": [[name, 3]]}, b"abc")
    plugin = _Recorder()
    with pytest.raises(SnapshotCorrupt):
        restore_snapshot(path, plugin)
    assert not plugin.restored and not (tmp_path / "evil").exists()


@pytest.mark.parametrize("header, body", [
    ({"meta": GOOD_META, "files": [["a", -1]]}, b""),  # a negative size
    ({"meta": GOOD_META, "files": [["a", True]]}, b"x"),  # not an int
    ({"meta": GOOD_META, "files": [["a", 1 << 40]]}, b"abc"),  # past the archive's end
    ({"meta": GOOD_META, "files": [["a", 1]]}, b"abc"),  # bytes after the last file
    ({"meta": GOOD_META, "files": [["a", 1], ["a", 2]]}, b"abc"),  # a name twice
    ({"meta": GOOD_META, "files": "a"}, b""),
    ({"meta": GOOD_META, "files": [["a"]]}, b""),
    ({"meta": {**GOOD_META, "term": -1}, "files": []}, b""),
    ({"meta": {**GOOD_META, "seq": -5}, "files": []}, b""),
    ({"meta": {**GOOD_META, "seq": "5"}, "files": []}, b""),
    ({"meta": {**GOOD_META, "config_seq": 9}, "files": []}, b""),  # a config after its point
    ({"meta": {**GOOD_META, "dedup": [["r", 9, 1]]}, "files": []}, b""),  # a rid applied after its point
    ({"meta": {**GOOD_META, "dedup": [[1, 2]]}, "files": []}, b""),
    ({"meta": {**GOOD_META, "config": [["w1"]]}, "files": []}, b""),
    ({"meta": 5, "files": []}, b""),
    ([1, 2], b""),
])
def test_an_archive_with_a_bad_field_is_refused_before_the_plugin(tmp_path: Path, header: object,
                                                                  body: bytes) -> None:
    path = _hand_made(tmp_path / "a.snap", header, body)
    plugin = _Recorder()
    with pytest.raises(SnapshotCorrupt):
        restore_snapshot(path, plugin)
    assert not plugin.restored


def test_a_header_length_past_the_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = _hand_made(tmp_path / "a.snap", {"meta": GOOD_META, "files": []}, header_len=0xFFFFFFFF)
    with pytest.raises(SnapshotCorrupt, match="header"):
        read_meta(path)


def test_an_archive_at_another_point_than_expected_is_refused(tmp_path: Path) -> None:
    snap = archive(tmp_path, filled_plugin())
    plugin = _Recorder()
    with pytest.raises(SnapshotCorrupt, match="not"):
        restore_snapshot(snap.path, plugin, expect_point=(META.term, META.seq + 1))
    assert not plugin.restored
    assert restore_snapshot(snap.path, load_plugin("entities"), expect_point=(META.term, META.seq)) == META


def test_files_with_names_this_module_does_not_write_are_not_snapshots(tmp_path: Path) -> None:
    snap = archive(tmp_path, filled_plugin())
    for name in ("snap-x-y.snap", "snap-1-2-3.snap", "snap--1-2.snap"):
        (snap.path.parent / name).write_bytes(b"")
        (snap.path.parent / (name + ".xxh3")).write_text("0" * 32)
    assert [s.seq for s in list_snapshots(snap.path.parent)] == [120]
