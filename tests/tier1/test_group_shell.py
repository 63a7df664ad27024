"""The I/O shell of one group (worker/group.py), in-process: a single voter, a real WAL."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import structlog

from tests.support.group_hooks import NullHooks
from worker import replica_msgs as m
from worker.group import SNAPSHOT_MAX_SPACING, GroupSettings, GroupShell, _Restore, _snapshot_interval, snapshot_due
from worker.plugins.base import ApplyContext, BadOp, NotFound, PluginSettings, load_plugin
from worker.plugins.entities import EntitiesPlugin
from worker.snapshots import read_meta, write_snapshot


class _NoPeers:
    def send(self, msg: Any) -> None:
        raise AssertionError("a single voter sends nothing")


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.005)


def _started(tmp_path: Path, snapshot_every: int = 100_000, plugin: Any = None, term: int = 1,
             **settings: Any) -> GroupShell:
    """A one-voter group (re)opened from `tmp_path`; meta names it leader of `term`."""
    g = GroupShell("a", 0, tmp_path, plugin or load_plugin("entities"),
                   GroupSettings(fsync="batch", snapshot_every=snapshot_every, **settings),
                   _NoPeers(), NullHooks(), structlog.get_logger())  # type: ignore[arg-type]
    g.open()
    g.start()
    g.deliver(m.MetaView(term, "a", ("a",), (), 0))
    return g


async def _single_voter(tmp_path: Path, snapshot_every: int, **settings: Any) -> GroupShell:
    """The ready leader of a one-voter group."""
    g = _started(tmp_path, snapshot_every, **settings)
    await _until(lambda: g.replica is not None and g.replica.ready)
    return g


@pytest.fixture
async def shell(tmp_path: Path) -> AsyncIterator[GroupShell]:
    g = await _single_voter(tmp_path, snapshot_every=50)
    yield g
    await g.close()


def put(i: int) -> dict[str, Any]:
    return {"kind": "put_item", "id": f"k{i}", "doc": {"n": i}}


async def test_writes_submitted_together_share_an_entry_and_get_their_own_results(shell: GroupShell) -> None:
    writes = [(put(1), "r1"), ({"kind": "nope"}, "r2"), (put(1), "r3"), (put(1), "r1")]
    out = await shell.write_many(writes, "quorum", 5.0)
    assert isinstance(out[1], BadOp)  # refused before the log
    ok = [o for o in out if not isinstance(o, BadOp)]
    assert all(o.ok for o in ok) and len({o.seq for o in ok}) == 1  # one "ops" entry
    assert out[0].result == {"id": "k1", "created": True} and out[2].result == {"id": "k1", "created": False}
    assert out[3].result == out[0].result  # the same rid twice: one write, one result
    # a retry while the results are still held gets the original answer, not a second apply
    again = await shell.write_many([(put(1), "r3")], "quorum", 5.0)
    assert again[0].ok and again[0].seq == out[2].seq
    assert shell.replica is not None and shell.replica.last_seq == out[0].seq


async def test_acknowledged_writes_are_counted_once_per_batch_in_the_latency_stats(shell: GroupShell) -> None:
    # What meta's heartbeat and /v1/status report as the group's writes and latency.
    before = (shell.latency.writes, len(shell.latency.samples))
    observed: list[float] = []  # the worker's histogram: one observation per call, in seconds
    shell.on_write_latency = observed.append
    out = await shell.write_many([(put(1), "a1"), ({"kind": "nope"}, "a2"), (put(2), "a3")], "quorum", 5.0)
    assert not isinstance(out[0], BadOp) and isinstance(out[1], BadOp)
    assert (shell.latency.writes, len(shell.latency.samples)) == (before[0] + 2, before[1] + 1)
    assert shell.latency.samples[-1] > 0
    assert observed == [pytest.approx(shell.latency.samples[-1] / 1000)]


async def test_every_pass_that_persists_entries_is_timed_and_the_p99_covers_the_last_100(shell: GroupShell) -> None:
    # What meta's hot-group relief compares across a group's replicas (persist_p99_ms).
    before = len(shell.persist.samples)
    await shell.write_many([(put(1), "p1"), (put(2), "p2")], "quorum", 5.0)
    assert len(shell.persist.samples) == before + 1 and shell.persist.samples[-1] > 0
    rep = shell.report()
    assert rep["persist_p99_ms"] > 0 and rep["persist_ema_ms"] > 0
    for i in range(150):
        await shell.write_many([(put(i), f"q{i}")], "quorum", 5.0)
    assert len(shell.persist.samples) == len(shell.latency.samples) == 100
    shell.persist.samples.extend([1.0] * 98 + [50.0, 900.0])
    assert shell.persist.p99() == 50.0  # nearest rank: one outlier in 100 is not the p99


async def test_a_rid_repeated_in_a_batch_gets_the_result_each_time(shell: GroupShell) -> None:
    out = await shell.write_many([(put(1), "r1"), (put(1), "r1")], "quorum", 5.0)
    assert [o.result for o in out] == [{"id": "k1", "created": True}] * 2 and out[0].seq == out[1].seq


async def test_a_bulk_put_is_one_entry_counted_by_its_records(shell: GroupShell) -> None:
    ids = [f"b{i}" for i in range(60)]
    bulk = {"kind": "put_items", "ids": ids, "docs": [b'{"n":%d}' % i for i in range(60)]}
    [out] = await shell.write_many([(bulk, "B#s0")], "quorum", 5.0)
    assert out.ok and out.result == {"created": [True] * 60}
    assert shell.plugin.query({"kind": "get_item", "id": "b59"}) == {"n": 59}
    # 60 client writes: past the fixture's snapshot_every of 50, in one entry.
    await _until(lambda: shell.latest_snapshot() is not None)
    assert shell.latest_snapshot().seq == out.seq  # type: ignore[union-attr]
    # The same request id again (a gateway's retry): applied once, same seq.
    changed = {**bulk, "docs": [b"0"] * 60}
    [again] = await shell.write_many([(changed, "B#s0")], "quorum", 5.0)
    assert again.ok and again.seq == out.seq
    assert shell.plugin.query({"kind": "get_item", "id": "b59"}) == {"n": 59}
    assert shell.replica is not None and shell.replica.last_seq == out.seq


async def test_an_op_refused_at_apply_fails_alone_in_its_batch(shell: GroupShell) -> None:
    def incr(v: int) -> dict[str, Any]:
        return {"kind": "signal", "entity": "e", "name": "n", "value": v, "mode": "incr"}
    [first] = await shell.write_many([(incr(2**63 - 1), "s0")], "quorum", 5.0)
    assert first.ok
    out = await shell.write_many([(put(5), "s1"), (incr(1), "s2"), (put(6), "s3")], "quorum", 5.0)
    assert [o.ok for o in out] == [True, False, True] and len({o.seq for o in out}) == 1
    assert out[0].result == {"id": "k5", "created": True} and out[2].result == {"id": "k6", "created": True}
    assert out[1].error_code == "bad_request" and "int64" in (out[1].message or "")


class _NewerEntities(EntitiesPlugin):
    """The next version of the plugin: it knows a `put_item_v2` op."""

    def validate(self, op: dict[str, Any]) -> None:
        if op.get("kind") != "put_item_v2":
            super().validate(op)

    def apply(self, op: dict[str, Any], ctx: ApplyContext) -> Any:
        if op.get("kind") == "put_item_v2":
            return super().apply({**op, "kind": "put_item"}, ctx)
        return super().apply(op, ctx)


async def test_a_committed_op_this_version_cannot_apply_stops_the_group_until_it_runs_one_that_can(
        tmp_path: Path) -> None:
    # A newer leader admitted an op of a kind this replica's plugin does not
    # know (a worker upgrade in the wrong order). Recording it as a no-op
    # would leave this replica silently different from the newer ones.
    g = await _single_voter(tmp_path, snapshot_every=1000)
    try:
        await g.write_many([(put(1), "w1")], "quorum", 5.0)
        g.plugin.validate = lambda op: None  # type: ignore[method-assign]  # the newer leader's admission
        [out] = await g.write_many([({"kind": "put_item_v2", "id": "k2", "doc": 2}, "w2")], "quorum", 5.0)
        assert not out.ok and out.error_code == "unavailable"
        await _until(lambda: g.failed is not None)
        assert "Unappliable" in (g.failed or "") and "put_item_v2" in (g.failed or "")
        assert _item(g, "k2") is None
        [refused] = await g.write_many([(put(3), "w3")], "quorum", 5.0)
        assert not refused.ok and "failed here" in (refused.message or "")
    finally:
        await g.close()
    # Restarted on the same version: it stops at the same entry again, never past it.
    g = _started(tmp_path, 1000, term=2)
    try:
        await _until(lambda: g.failed is not None)
        assert "put_item_v2" in (g.failed or "") and _item(g, "k2") is None
    finally:
        await g.close()
    # Upgraded: the entry applies, and the replica goes on.
    g = _started(tmp_path, 1000, _NewerEntities(PluginSettings()), term=3)
    try:
        await _until(lambda: g.replica is not None and g.replica.ready)
        await _until(lambda: _item(g, "k2") == 2)
        assert g.failed is None and _item(g, "k1") == {"n": 1}
    finally:
        await g.close()


def _item(g: GroupShell, id: str) -> Any:
    try:
        return g.plugin.query({"kind": "get_item", "id": id})
    except NotFound:
        return None


async def test_each_wal_fsync_is_reported_with_its_duration(shell: GroupShell) -> None:
    # The worker's shardgrid_wal_sync_seconds histogram: where disk stalls show.
    seen: list[float] = []
    shell.on_sync = seen.append
    out = await shell.write_many([(put(1), "s1")], "quorum", 5.0)
    assert out[0].ok and seen and all(0 <= d < 5 for d in seen)


async def test_snapshot_interval_counts_writes_not_entries(shell: GroupShell) -> None:
    for b in range(2):
        out = await shell.write_many([(put(b * 30 + i), f"s{b}-{i}") for i in range(30)], "quorum", 5.0)
        assert all(o.ok for o in out)
    # 60 writes in two entries: past snapshot_every=50, so a snapshot was taken
    await _until(lambda: shell.latest_snapshot() is not None)
    snap = shell.latest_snapshot()
    assert snap is not None and snap.seq <= 3  # at the second "ops" entry (seq 1 is the term start)


class _Recorder:
    """A transport that records what the leader sends, in order with its syncs."""

    def __init__(self, trail: list[str]) -> None:
        self.trail = trail
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, m.Append) and any(e.kind in ("op", "ops") for e in msg.entries):
            self.trail.append(f"append {msg.dst}")


async def _three_voter_leader(tmp_path: Path, trail: list[str]) -> tuple[GroupShell, _Recorder]:
    """Leader "a" of voters a, b, c, ready: b promised and acknowledged the term start."""
    peers = _Recorder(trail)
    g = GroupShell("a", 0, tmp_path, load_plugin("entities"), GroupSettings(fsync="batch"),
                   peers, NullHooks(), structlog.get_logger())  # type: ignore[arg-type]
    g.open()
    g.start()
    env = dict(src="b", dst="a", group=0, term=1)
    g.deliver(m.MetaView(1, "a", ("a", "b", "c"), (), 0))
    await _until(lambda: any(isinstance(s, m.Begin) for s in peers.sent))
    g.deliver(m.BeginOk(**env, last_term=0, last_seq=0, commit=0))
    await _until(lambda: any(isinstance(s, m.Append) and s.dst == "b" for s in peers.sent))
    g.deliver(m.AppendReply(**env, ok=True, prev_seq=0, match=1))
    await _until(lambda: g.replica is not None and g.replica.ready)
    assert g.wal is not None
    real_sync = g.wal.sync
    g.wal.sync = lambda: (trail.append("sync"), real_sync())[1]  # type: ignore[method-assign]
    return g, peers


async def test_the_leader_sends_a_fresh_entry_before_its_own_sync(tmp_path: Path) -> None:
    trail: list[str] = []
    g, peers = await _three_voter_leader(tmp_path, trail)
    try:
        write = asyncio.create_task(g.write_many([(put(1), "w1")], "quorum", 5.0))
        await _until(lambda: "sync" in trail)
        # b's stream had the entry before our fsync started (c has not answered the
        # term start yet, so its Append is still in flight and the entry waits).
        assert trail[:2] == ["append b", "sync"]
        g.deliver(m.AppendReply(src="b", dst="a", group=0, term=1, ok=True, prev_seq=1, match=2))
        out = await write
        assert out[0].ok and out[0].seq == 2
    finally:
        await g.close()


async def test_writes_cut_off_by_a_failed_group_may_still_commit(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    trail: list[str] = []
    g, peers = await _three_voter_leader(tmp_path, trail)
    try:
        def broken_disk(fd: int) -> None:
            raise OSError(5, "simulated EIO")
        monkeypatch.setattr(os, "fdatasync", broken_disk)
        out = await g.write_many([(put(1), "w1")], "quorum", 5.0)
        # The Append already left: the followers may commit it under the next leader.
        assert "append b" in trail
        assert not out[0].ok and out[0].error_code == "unavailable" and out[0].maybe_applied
        assert g.failed is not None and "EIO" in g.failed
    finally:
        await g.close()


async def test_close_waits_for_a_snapshot_pass_running_in_its_thread(tmp_path: Path) -> None:
    g = await _single_voter(tmp_path, snapshot_every=5)
    real = g._persist_all
    running, release = threading.Event(), threading.Event()
    snapshot_passes: list[str] = []

    def slow_disk(persists: list[m.Persist]) -> None:
        if not any(p.snapshot is not None for p in persists):
            real(persists)
            return
        running.set()
        assert release.wait(10)
        real(persists)  # raises WalClosed if close() did not wait
        snapshot_passes.append("done")
    g._persist_all = slow_disk  # type: ignore[method-assign]
    writes = asyncio.create_task(g.write_many([(put(i), f"c{i}") for i in range(10)], "quorum", 5.0))
    await _until(running.is_set)
    closing = asyncio.create_task(g.close())
    assert g._task is not None
    await _until(g._task.done)  # the loop is cancelled; the pass's thread is not
    assert not closing.done()
    release.set()
    await closing
    assert snapshot_passes == ["done"]
    await asyncio.gather(writes, return_exceptions=True)


class _GatedCapture:
    """Wraps a plugin's capture: each writer waits for `release`, and what
    happened is recorded as (event, thread id): "captured", "writing",
    "written" or the writer's exception name."""

    def __init__(self, plugin: Any) -> None:
        self.release = threading.Event()
        self.events: list[tuple[str, int]] = []
        self._capture = plugin.capture
        plugin.capture = self

    def count(self, event: str) -> int:
        return sum(1 for e, _ in self.events if e == event)

    def __call__(self) -> Any:
        write = self._capture()
        self.events.append(("captured", threading.get_ident()))

        def gated_write(d: Path) -> None:
            self.events.append(("writing", threading.get_ident()))
            assert self.release.wait(10)
            try:
                write(d)
            except OSError as exc:
                self.events.append((type(exc).__name__, threading.get_ident()))
                raise
            self.events.append(("written", threading.get_ident()))
        return gated_write


async def test_a_plugin_snapshot_is_written_off_the_loop_while_the_group_goes_on(tmp_path: Path) -> None:
    # Packing and fsyncing a large state on the loop would stall every group
    # of the worker; only the capture may run there.
    g = await _single_voter(tmp_path, snapshot_every=5)
    loop_thread = threading.get_ident()
    gate = _GatedCapture(g.plugin)
    try:
        first = await g.write_many([(put(i), f"a{i}") for i in range(10)], "quorum", 5.0)
        assert all(o.ok for o in first)
        await _until(lambda: gate.count("writing") == 1)
        # the writer is stuck on "disk": writes still commit and apply
        later = await g.write_many([(put(100 + i), f"b{i}") for i in range(3)], "quorum", 5.0)
        assert all(o.ok for o in later)
        assert g.latest_snapshot() is None and g.replica is not None and g.replica.snapshot_seq == 0
        gate.release.set()
        await _until(lambda: g.latest_snapshot() is not None)
        snap = g.latest_snapshot()
        assert snap is not None and snap.seq == first[0].seq
        await _until(lambda: g.report().get("snapshot_seq") == snap.seq)  # installed by the shell
        assert all(tid != loop_thread for e, tid in gate.events if e != "captured")
        assert not list(g.snap_dir.glob(".plugin-*"))  # the capture's files went into the archive
    finally:
        gate.release.set()
        await g.close()


async def test_a_failed_snapshot_write_is_dropped_and_the_next_point_tries_again(tmp_path: Path) -> None:
    # A full disk while writing a snapshot loses nothing (the log holds it
    # all): the group goes on, and its next snapshot point writes one.
    g = await _single_voter(tmp_path, snapshot_every=5)
    capture = g.plugin.capture
    failures: list[int] = []

    def failing_once() -> Any:
        write = capture()
        if failures:
            return write

        def full_disk(d: Path) -> None:
            failures.append(1)
            raise OSError(28, "No space left on device")
        return full_disk
    g.plugin.capture = failing_once  # type: ignore[method-assign]
    try:
        first = await g.write_many([(put(i), f"a{i}") for i in range(5)], "quorum", 5.0)
        assert all(o.ok for o in first)
        await _until(lambda: bool(failures) and not g._plugin_writes)
        assert g.failed is None and g.replica is not None and g.replica.snapshot_seq == 0
        assert not list(g.snap_dir.glob(".plugin-*")) and g.latest_snapshot() is None
        again = await g.write_many([(put(10 + i), f"b{i}") for i in range(5)], "quorum", 5.0)
        assert all(o.ok for o in again)
        await _until(lambda: g.latest_snapshot() is not None)
        snap = g.latest_snapshot()
        assert snap is not None and snap.seq == again[0].seq and g.failed is None
    finally:
        await g.close()


async def test_one_snapshot_capture_at_a_time_and_the_group_does_not_wait_for_it(tmp_path: Path) -> None:
    # Every point is due (ratio 0): a unique-key state would otherwise defer them (snapshot_due).
    g = await _single_voter(tmp_path, snapshot_every=2, snapshot_state_ratio=0)
    gate = _GatedCapture(g.plugin)
    try:
        for i in range(6):  # six snapshot points while the first is being written
            out = await g.write_many([(put(2 * i), f"c{i}a"), (put(2 * i + 1), f"c{i}b")], "quorum", 5.0)
            assert all(o.ok for o in out)
        assert gate.count("captured") == 1  # the later points were skipped, not queued
        gate.release.set()
        await _until(lambda: g.latest_snapshot() is not None and not g._plugin_writes)
        out = await g.write_many([(put(100), "d1"), (put(101), "d2")], "quorum", 5.0)
        assert all(o.ok for o in out)
        await _until(lambda: gate.count("captured") == 2)  # the next point after it was written
    finally:
        gate.release.set()
        await g.close()


class _Sink:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def _incr() -> dict[str, Any]:
    return {"kind": "signal", "entity": "e1", "name": "c", "value": 1, "mode": "incr"}


def _follower(tmp_path: Path, settings: GroupSettings) -> tuple[GroupShell, _Sink]:
    peers = _Sink()
    b = GroupShell("b", 0, tmp_path / "b", load_plugin("entities"), settings,
                   peers, NullHooks(), structlog.get_logger())  # type: ignore[arg-type]
    return b, peers


async def _commit_and_restore_in_one_pass(b: GroupShell, peers: _Sink, tmp_path: Path) -> None:
    """Follower b holds 1..3 (three increments) with commit 1; then a heartbeat
    committing 3 and the restore of the leader's snapshot at 4 reach it in one pass."""
    b.deliver(m.MetaView(1, "a", ("a", "b", "c"), (), 0))
    entries = (m.Entry(1, 1, "term_start", None, None, 1),) + tuple(
        m.Entry(1, s, "op", _incr(), f"r{s}", 1) for s in (2, 3))
    env: dict[str, Any] = dict(src="a", dst="b", group=0, term=1)
    b.deliver(m.Append(**env, prev_term=0, prev_seq=0, entries=entries, commit=1))
    await _until(lambda: any(isinstance(x, m.AppendReply) for x in peers.sent))
    leader = load_plugin("entities")
    for s in (2, 3, 4):
        leader.apply(_incr(), ApplyContext(s, 1, 1))
    files = tmp_path / "files"
    files.mkdir()
    leader.snapshot(files)
    snap = write_snapshot(b.snap_dir, m.SnapshotMeta(term=1, seq=4, ts=1), files)
    b.deliver(m.Heartbeat(**env, commit=3, round=0))
    b.deliver(_Restore(snap))


async def test_a_downloaded_snapshot_replaces_the_state_after_what_the_pass_applied_before_it(tmp_path: Path) -> None:
    # The Apply of 2..3 must not be performed on top of the restored state (a divergence).
    b, peers = _follower(tmp_path, GroupSettings(fsync="batch"))
    b.open()
    b.start()
    try:
        await _commit_and_restore_in_one_pass(b, peers, tmp_path)
        await _until(lambda: b.replica is not None and b.replica.applied_seq == 4)
        assert b.plugin.query({"kind": "get_signals", "entity": "e1"})["counters"] == {"c": 3}
        assert b.failed is None
    finally:
        await b.close()


async def test_a_capture_superseded_by_a_downloaded_snapshot_is_removed_only_once_written(tmp_path: Path) -> None:
    # b reaches its own snapshot point (3) in the pass that restores the
    # leader's snapshot at 4: its capture is superseded while its writer
    # still runs, and must not have its directory removed under it.
    b, peers = _follower(tmp_path, GroupSettings(fsync="batch", snapshot_every=2))
    gate = _GatedCapture(b.plugin)
    b.open()
    b.start()
    try:
        await _commit_and_restore_in_one_pass(b, peers, tmp_path)
        # the install (on the persist thread) is done once the WAL starts after 4
        await _until(lambda: b.wal is not None and b.wal.snapshot[1] == 4)
        assert list(b.snap_dir.glob(".plugin-3-*"))  # still being written
        gate.release.set()
        await _until(lambda: gate.count("written") == 1 and not list(b.snap_dir.glob(".plugin-*")))
        assert [e for e, _ in gate.events] == ["captured", "writing", "written"]
        assert b.failed is None and not b._plugin_writes
        assert b.plugin.query({"kind": "get_signals", "entity": "e1"})["counters"] == {"c": 3}
    finally:
        gate.release.set()
        await b.close()


def test_replicas_spread_their_snapshots_over_the_last_quarter_of_the_interval() -> None:
    # Replicas under the same load must not all write their snapshots at once.
    every = 100_000
    points = {(w, g): _snapshot_interval(every, w, g) for w in ("w1", "w2", "w3") for g in range(3)}
    assert all(every * 3 // 4 <= p <= every for p in points.values())
    assert points == {(w, g): _snapshot_interval(every, w, g) for w, g in points}  # stable across restarts
    assert len(set(points.values())) == len(points) and max(points.values()) - min(points.values()) > every // 10
    assert _snapshot_interval(1, "w1", 0) == 1


async def test_a_read_cut_off_by_shutdown_changed_nothing(tmp_path: Path) -> None:
    trail: list[str] = []
    g, peers = await _three_voter_leader(tmp_path, trail)
    read = asyncio.create_task(g.read({"kind": "get_item", "id": "k"}, "strong", 0, 5.0))
    await _until(lambda: any(isinstance(s, m.Heartbeat) and s.round for s in peers.sent))  # it waits for b
    await g.close()
    out = await read
    assert not out.ok and out.error_code == "unavailable" and not out.maybe_applied


async def test_the_loop_counts_its_passes_and_the_events_each_carried(shell: GroupShell,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # No timer ticks meanwhile: every event below is one this test delivers.
    monkeypatch.setattr(shell, "_set_timer", lambda at: None)
    if shell._timer is not None:
        shell._timer.cancel()
    await _until(lambda: shell._queue.empty())
    passes, events = shell.stats.passes, shell.stats.events
    # Events queued in one loop iteration are handled in one pass (natural batching).
    for _ in range(3):
        shell.deliver(m.Tick())
    await _until(lambda: shell.stats.events == events + 3)
    assert shell.stats.passes == passes + 1
    out = await shell.write_many([(put(1), "p1"), (put(2), "p2")], "quorum", 5.0)
    assert all(o.ok for o in out)
    assert (shell.stats.passes, shell.stats.events) == (passes + 2, events + 4)  # one call: one event, one pass


async def _writes_to_a_snapshot(g: GroupShell) -> int:
    """Five puts in one entry (a snapshot point at snapshot_every=5); its seq, once the shell installed it.

    (The core's snapshot_seq moves when it asks for the install, before the
    persist thread has written the archive and removed the capture.)"""
    out = await g.write_many([(put(i), f"a{i}") for i in range(5)], "quorum", 5.0)
    assert all(o.ok for o in out)
    await _until(lambda: g.report().get("snapshot_seq") == out[0].seq)
    return out[0].seq


async def test_the_snapshot_thread_writes_the_archive_and_the_install_only_moves_the_wal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Written from the group's pass, the archive (a copy and fsyncs of the whole
    # state) held every write of the group for tens of milliseconds.
    archived: list[tuple[str, int]] = []

    def recording(snap_dir: Path, meta: m.SnapshotMeta, files: Path, **kw: Any) -> Any:
        archived.append((threading.current_thread().name, meta.seq))
        return write_snapshot(snap_dir, meta, files, **kw)
    monkeypatch.setattr("worker.group.write_snapshot", recording)
    g = await _single_voter(tmp_path, snapshot_every=5)
    try:
        seq = await _writes_to_a_snapshot(g)
        assert [(name.startswith("group-0-snapshot"), at) for name, at in archived] == [(True, seq)]
        snap = g.latest_snapshot()
        assert snap is not None and snap.seq == seq and read_meta(snap.path).seq == seq
        assert not list(g.snap_dir.glob(".plugin-*"))
    finally:
        await g.close()


async def test_an_install_of_another_meta_than_the_archived_one_archives_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = await _single_voter(tmp_path, snapshot_every=5)
    take = g._snapshot_plugin
    true: list[m.SnapshotMeta] = []

    def stale_meta(seq: int, meta: m.SnapshotMeta | None = None, writes: int = 0) -> None:
        assert meta is not None
        true.append(meta)
        take(seq, dataclasses.replace(meta, ts=meta.ts - 1), writes)  # not what the core installs
    monkeypatch.setattr(g, "_snapshot_plugin", stale_meta)
    try:
        await _writes_to_a_snapshot(g)
        snap = g.latest_snapshot()
        assert snap is not None and true and read_meta(snap.path) == true[0]
    finally:
        await g.close()


async def test_a_failed_archive_write_is_dropped_and_the_next_point_tries_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The snapshot thread writes the archive now: its failure (a full disk) must
    # cost no more than a failed plugin write does.
    failures: list[int] = []

    def full_disk_once(snap_dir: Path, meta: m.SnapshotMeta, files: Path, **kw: Any) -> Any:
        if not failures:
            failures.append(meta.seq)
            raise OSError(28, "No space left on device")
        return write_snapshot(snap_dir, meta, files, **kw)
    monkeypatch.setattr("worker.group.write_snapshot", full_disk_once)
    g = await _single_voter(tmp_path, snapshot_every=5)
    try:
        first = await g.write_many([(put(i), f"a{i}") for i in range(5)], "quorum", 5.0)
        assert all(o.ok for o in first)
        await _until(lambda: bool(failures) and not g._plugin_writes)
        assert g.failed is None and g.replica is not None and g.replica.snapshot_seq == 0
        assert g.latest_snapshot() is None and not list(g.snap_dir.glob(".plugin-*"))
        again = await g.write_many([(put(10 + i), f"b{i}") for i in range(5)], "quorum", 5.0)
        assert all(o.ok for o in again)
        await _until(lambda: g.report().get("snapshot_seq") == again[0].seq)  # installed by the shell
        snap = g.latest_snapshot()
        assert snap is not None and snap.seq == again[0].seq and g.failed is None
    finally:
        await g.close()


async def test_an_archive_ahead_of_the_wal_is_served_but_recovery_uses_the_wals_point(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A crash after the snapshot thread wrote the archive, before the core
    # heard of it: the WAL's snapshot point did not move.
    g = await _single_voter(tmp_path, snapshot_every=5)
    monkeypatch.setattr(g, "_plugin_written", lambda seq, written: None)  # Compact never reaches the core
    out = await g.write_many([(put(i), f"a{i}") for i in range(5)], "quorum", 5.0)
    assert all(o.ok for o in out)
    await _until(lambda: g.latest_snapshot() is not None)
    assert g.replica is not None and g.replica.snapshot_seq == 0
    await g.close()

    # (A snapshot interval the replayed log does not reach: this run takes no snapshot of its own.)
    h = GroupShell("a", 0, tmp_path, load_plugin("entities"), GroupSettings(fsync="batch", snapshot_every=1000),
                   _NoPeers(), NullHooks(), structlog.get_logger())  # type: ignore[arg-type]
    h.open()
    h.start()
    h.deliver(m.MetaView(2, "a", ("a",), (), 0))  # the restarted voter leads the next term
    try:
        await _until(lambda: h.replica is not None and h.replica.ready)
        assert h.replica is not None and h.replica.snapshot_seq == 0 and h.replica.last_seq >= out[0].seq
        assert [h.plugin.query({"kind": "get_item", "id": f"k{i}"}) for i in range(5)] == [{"n": i} for i in range(5)]
        ahead = h.latest_snapshot()  # committed state: what a follower that must download gets
        assert ahead is not None and ahead.seq == out[0].seq and read_meta(ahead.path).seq == out[0].seq
    finally:
        await h.close()


async def test_opening_a_group_removes_what_a_crashed_run_left_in_its_snapshot_dir(tmp_path: Path) -> None:
    snaps = tmp_path / "snapshots"
    (snaps / ".plugin-7-abc").mkdir(parents=True)
    leftovers = [snaps / ".download-9-1.partial", snaps / "snap-00000000000000000009-0000000001.partial"]
    for f in leftovers:
        f.write_bytes(b"x")
    g = await _single_voter(tmp_path, snapshot_every=1000)
    try:
        assert not any(f.exists() for f in leftovers) and not (snaps / ".plugin-7-abc").exists()
    finally:
        await g.close()


async def test_a_full_group_refuses_new_calls_at_once_and_serves_again_once_they_drain(tmp_path: Path) -> None:
    # Two follower reads waiting for a seq that never comes hold the group's
    # two slots: the next write and read are refused at once (nothing queued),
    # counted, and once the waiting reads end the group serves again.
    from worker.group import GroupOverloaded

    g = _started(tmp_path, max_pending=2, max_pending_bytes=1 << 20)
    try:
        await _until(lambda: g.replica is not None and g.replica.ready)
        query = {"kind": "get_item", "id": "k1"}
        waiting = [asyncio.create_task(g.read(query, "follower", 10**9, 1.0, 10)) for _ in range(2)]
        await _until(lambda: g.pending_calls == 2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(GroupOverloaded):
            await g.write(put(1), "quorum", "r1", 5.0, 10)
        with pytest.raises(GroupOverloaded):
            await g.read(query, "strong", 0, 5.0, 10)
        assert loop.time() - t0 < 0.1  # refused, not queued behind the waiting reads
        assert g.overloaded == 2 and g.stats.overloaded == 2 and g.report()["overloaded"] == 2
        assert g.replica.last_seq == 1  # type: ignore[union-attr]  # only the term start: nothing was queued
        outs = await asyncio.gather(*waiting)
        assert [o.error_code for o in outs] == ["deadline_exceeded"] * 2
        assert g.pending_calls == 0 and g.pending_bytes == 0
        out = await g.write(put(1), "quorum", "r1", 5.0, 10)
        assert out.ok and (await g.read(query, "strong", 0, 5.0)).ok
        assert g.pending_calls == 0 and g.pending_bytes == 0
    finally:
        await g.close()


async def test_a_full_byte_budget_refuses_but_a_call_alone_is_always_admitted(tmp_path: Path) -> None:
    from worker.group import GroupOverloaded

    g = _started(tmp_path, max_pending=100, max_pending_bytes=1000)
    try:
        await _until(lambda: g.replica is not None and g.replica.ready)
        # Over the budget, but alone: admitted, or a valid call could never pass.
        assert (await g.write(put(1), "quorum", "r1", 5.0, 5000)).ok
        held = asyncio.create_task(g.read({"kind": "get_item", "id": "k1"}, "follower", 10**9, 0.5, 900))
        await _until(lambda: g.pending_bytes == 900)
        with pytest.raises(GroupOverloaded):
            await g.write_many([(put(2), "r2"), (put(3), "r3")], "quorum", 5.0, 200)
        assert (await held).error_code == "deadline_exceeded"
        outs = await g.write_many([(put(2), "r2"), (put(3), "r3")], "quorum", 5.0, 200)
        assert all(o.ok for o in outs) and g.pending_bytes == 0  # type: ignore[union-attr]
    finally:
        await g.close()


def test_entry_sizes_are_measured_once_per_term_and_seq_and_bounded() -> None:
    from shardgrid.common.wire import packb
    from worker.codec import encode_entry
    from worker.group import EntrySizes

    sizes = EntrySizes(capacity=2)
    e1 = m.Entry(1, 1, "op", {"pad": "x" * 100}, "r1", 1)
    assert sizes(e1) == len(packb(encode_entry(e1)))
    assert sizes(m.Entry(1, 1, "op", {}, None, 1)) == sizes(e1)  # (term, seq) names one entry: not measured again
    sizes(m.Entry(1, 2, "op", {}, None, 1))
    sizes(m.Entry(1, 3, "op", {}, None, 1))
    assert len(sizes._sizes) == 2 and (1, 1) not in sizes._sizes  # the oldest measured went first
    assert sizes(m.Entry(1, 4, "op", {1, 2}, None, 1)) == 0  # unpackable: nothing to send


async def test_a_downloaded_archive_at_another_point_than_its_name_is_refused_and_the_group_goes_on(
        tmp_path: Path) -> None:
    # Its digest matched what the source published, but its header names
    # another point: refused before the plugin is touched, the archive
    # removed, and the group serves on (the core asks for a snapshot again).
    from worker.snapshots import SnapshotFile, file_digest

    b, peers = _follower(tmp_path, GroupSettings(fsync="batch"))
    b.open()
    b.start()
    try:
        b.deliver(m.MetaView(1, "a", ("a", "b", "c"), (), 0))
        files = tmp_path / "files"
        files.mkdir()
        load_plugin("entities").snapshot(files)
        real = write_snapshot(tmp_path / "elsewhere", m.SnapshotMeta(term=1, seq=9, ts=1), files)
        b.snap_dir.mkdir(parents=True, exist_ok=True)
        named = b.snap_dir / "snap-00000000000000000004-0000000001.snap"
        real.path.replace(named)
        snap = SnapshotFile(named, 4, 1, named.stat().st_size, file_digest(named))
        b.deliver(_Restore(snap))
        await _until(lambda: b.snapshot_refused == 1)
        assert b.failed is None and not named.exists()
        assert b.replica is not None and b.replica.applied_seq == 0
        # Still a working follower: it takes the leader's entries.
        env: dict[str, Any] = dict(src="a", dst="b", group=0, term=1)
        b.deliver(m.Append(**env, prev_term=0, prev_seq=0, entries=(m.Entry(1, 1, "term_start", None, None, 1),),
                           commit=1))
        await _until(lambda: b.replica is not None and b.replica.applied_seq == 1)
    finally:
        await b.close()


def test_snapshot_due_grows_with_the_state_up_to_its_cap() -> None:
    assert snapshot_due(100, 0, 0.5) == 100  # a small state: every snapshot_every writes
    assert snapshot_due(100, 150, 0.5) == 100
    assert snapshot_due(100, 1_000, 0.5) == 500  # half the state's records
    assert snapshot_due(100, 10**9, 0.5) == 100 * SNAPSHOT_MAX_SPACING  # the log's bound
    assert snapshot_due(100, 10**9, 0) == 100  # ratio 0: off


def _counting_captures(g: GroupShell) -> list[int]:
    """The state size (items) at each capture the shell makes from now on."""
    sizes: list[int] = []
    capture = g.plugin.capture

    def counted() -> Any:
        sizes.append(g.plugin.stats()["items"])
        return capture()
    g.plugin.capture = counted  # type: ignore[method-assign]
    return sizes


async def test_a_growing_state_spaces_its_snapshots_and_an_unchanging_one_does_not(tmp_path: Path) -> None:
    # Unique keys: a snapshot only once the writes since the last one reach
    # half the state (ratio 0.5), each a whole-state write. Rewritten keys: every point.
    g = await _single_voter(tmp_path / "grow", snapshot_every=5)
    try:
        sizes = _counting_captures(g)
        for i in range(8):  # 8 points, 5 new items each
            out = await g.write_many([(put(5 * i + k), f"u{i}.{k}") for k in range(5)], "quorum", 5.0)
            assert all(o.ok for o in out)
            await _until(lambda: not g._plugin_writes)
        # 5 items (5 since), 10 (5 >= 10 / 2), 20 (10 >= 20 / 2), 40 (20 >= 40 / 2): 4 of 8 points.
        assert sizes == [5, 10, 20, 40]
    finally:
        await g.close()
    same = await _single_voter(tmp_path / "same", snapshot_every=5)
    try:
        sizes = _counting_captures(same)
        for i in range(4):  # the same 5 keys, over and over
            out = await same.write_many([(put(k), f"s{i}.{k}") for k in range(5)], "quorum", 5.0)
            assert all(o.ok for o in out)
            await _until(lambda: not same._plugin_writes)
        assert sizes == [5, 5, 5, 5]
    finally:
        await same.close()


async def test_the_capture_being_written_compacts_without_a_replay_of_the_dedup_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The core keeps two prepared metas: the oldest point and the newest. The
    # oldest may be one the shell deferred (the point at 15 items) and the
    # newest one asked for while a capture is written: the capture's own meta
    # is gone, and Compact would replay the dedup table from the previous
    # snapshot on the group's loop (up to 10 x snapshot_every writes). The
    # shell hands the meta back instead.
    g = await _single_voter(tmp_path, snapshot_every=5)
    replica = g.replica
    assert replica is not None
    replays: list[int] = []
    meta_at = replica._snapshot_meta_at

    def counted(seq: int, exact: Any = None) -> Any:
        if exact is None:
            replays.append(seq)
        return meta_at(seq, exact)
    monkeypatch.setattr(replica, "_snapshot_meta_at", counted)
    gate: _GatedCapture | None = None
    try:
        for i in range(4):  # points at 5, 10, 15 (deferred), 20 items
            if i == 3:
                gate = _GatedCapture(g.plugin)  # hold the write of the capture at 20
            out = await g.write_many([(put(5 * i + k), f"u{i}.{k}") for k in range(5)], "quorum", 5.0)
            assert all(o.ok for o in out)
            if i < 3:
                await _until(lambda: not g._plugin_writes)
        await _until(lambda: bool(g._plugin_writes))
        (writing,) = list(g._plugin_writes)
        for j in range(2):  # two more points while it is written
            out = await g.write_many([(put(100 + 5 * j + k), f"v{j}.{k}") for k in range(5)], "quorum", 5.0)
            assert all(o.ok for o in out)
        assert writing not in replica._prepared  # dropped by the core meanwhile
        assert gate is not None
        gate.release.set()
        await _until(lambda: replica.snapshot_seq == writing and not g._plugin_writes)
        assert replays == []
        snap = g.latest_snapshot()
        assert snap is not None and snap.seq == writing
    finally:
        if gate is not None:
            gate.release.set()
        await g.close()
