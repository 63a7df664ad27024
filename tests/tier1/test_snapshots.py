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
