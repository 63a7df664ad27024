"""Hot-group relief over real processes (meta/hotspot.py), under write load through gateways.

w1 leads groups 0 and 1 of four. Skewed load on group 0 alone first: its leader
is hot, but no move can help (it would only carry the hot spot to another
worker), so it stays. Then group 1 gets load too, and w1 carries both: group 0's
leadership moves once, to an idle worker, and stays there for three more
windows, as does every other leadership. Zero acknowledged writes lost, no
client error (a transfer's not_leader is retried by the gateway).

w1 runs on a CPU quota (`Throttle`: stopped 150 ms of every 200, as a container's
CFS quota throttles it). On a small test machine every process shares the
same cores and the same disk, so load alone does not make one worker's
replicas measurably slower than another's (fsync and machine-wide CPU
contention dominate the persist p99 of leaders and followers alike); a
worker short of CPU is what makes a hot leader in production, and it makes one
here, deterministically. The stop is long enough that w1's persist p99 (about
155 ms) stays above twice its followers' even on a disk whose fsync p99 nears
70 ms. A 50 ms stop failed in about one full CI run in three and never
alone; the likely cause (not observed) is one follower's fsync spike, which
breaks the hot window, as the median of three voters is the slower follower.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster, http_json, wait_until
from tests.support.load import LoadGenerator
from tests.tier3.test_chaos import Background, judge
from topology.routing import shard_for

pytestmark = pytest.mark.tier3

SHARDS = 4
GROUPS = [(0, "w1", ["w1", "w2", "w3"]), (1, "w1", ["w1", "w2", "w3"]), (2, "w2", ["w1", "w2", "w3"]),
          (3, "w3", ["w1", "w2", "w3"])]
WINDOW_S = 3.0


class Throttle(threading.Thread):
    """Emulate a CPU quota on one process: SIGSTOP for `stop_s` of every `stop_s + run_s`."""

    def __init__(self, pid: int, stop_s: float = 0.05, run_s: float = 0.025) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.run_s)
        except ProcessLookupError:
            pass

    def finish(self) -> None:
        self.done.set()
        self.join(5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def leaders(c: Cluster) -> dict[str, tuple[str, int]]:
    return {gid: (g["leader"], g["term"]) for gid, g in c.view()["groups"].items()}


def reported(c: Cluster, field: str) -> dict[str, dict[str, float]]:
    """Per group, what each worker last reported of `field` (persist_p99_ms, write_rate), as meta's leader heard it."""
    out: dict[str, dict[str, float]] = {}
    for wid, w in c.view()["workers"].items():
        for gid, rep in ((w.get("report") or {}).get("groups") or {}).items():
            out.setdefault(gid, {})[wid] = rep.get(field)
    return out


def hold(c: Cluster, expect: dict[str, tuple[str, int]], seconds: float, what: str) -> None:
    """Poll for `seconds`: every leadership (and term) must stay as `expect`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = leaders(c)
        assert now == expect, \
            f"{what}: leaderships changed from {expect} to {now} (persist p99s {reported(c, 'persist_p99_ms')})"
        time.sleep(0.2)


def decisions(c: Cluster) -> dict[str, float]:
    addr = c.meta_spec(c.wait_leader([m.id for m in c.meta if c.children[m.id].alive()])).http
    code, text = http_json("GET", f"http://{addr}/metrics")
    assert code == 200
    out = {}
    for line in str(text).splitlines():
        if line.startswith("shardgrid_meta_controller_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("shardgrid_meta_controller_decisions_total"):]] = float(value)
    return out


def test_skewed_load_moves_the_hot_leadership_once_and_it_stays(tmp_path: Path) -> None:
    c = Cluster.create(tmp_path / "cluster", n_workers=3, n_gateways=2)
    try:
        c.boot(c.topology_yaml(shards=SHARDS, groups=GROUPS, settings=f"rebalance_window_ms: {int(WINDOW_S * 1000)}"),
               gateways=True)
        planned = {str(gid): leader for gid, leader, _ in GROUPS}
        # A slow start may have failed a group over; leader balance brings it back.
        start = wait_until(lambda: (lambda now: now if {g: lt[0] for g, lt in now.items()} == planned else None)(
            leaders(c)), 60, "every group led by its planned leader", interval=0.3)
        throttle = Throttle(c.children["w1"].pid, stop_s=0.15, run_s=0.05)
        throttle.start()
        hot = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=1_000_000, seed=121, read_share=0.1,
                                       route=lambda k: shard_for(k, SHARDS) == 0))
        side: Background | None = None
        moved: dict[str, tuple[str, int]] = {}
        try:
            hot.wait_more(300)
            # Alone on w1, group 0 stays however hot: a move would carry the hot spot along.
            hold(c, start, 2 * WINDOW_S, "a lone hot group")
            side = Background(LoadGenerator(c.gateways, clients=4, ops_per_client=1_000_000, seed=122,
                                            read_share=0.1, route=lambda k: shard_for(k, SHARDS) == 1))
            side.wait_more(100)

            seen: list[str] = []

            def group0_moved() -> Any:
                now = leaders(c)
                seen.append(f"{time.monotonic():.1f} {now} p99 {reported(c, 'persist_p99_ms')} "
                            f"rates {reported(c, 'write_rate')}")
                return now if now["0"][0] != "w1" else None
            try:
                moved = wait_until(group0_moved, 60, "group 0's leadership to move off w1", interval=0.2)
            except AssertionError:
                print("\n".join(seen[::10]))
                for m in c.meta:
                    log = (c.root / "logs" / f"{m.id}.log").read_text(errors="replace").splitlines()
                    picked = [ln[:400] for ln in log if any(k in ln for k in (
                        "controller", "rebalance", "leader_count", "operator", "leader_set", "transfer", "warning"))]
                    print(f"--- {m.id}\n" + "\n".join(picked[-40:]))
                raise
            print(f"\n[hot-relief] moved: {start} -> {moved}; persist p99s {reported(c, 'persist_p99_ms')}; "
                  f"rates {reported(c, 'write_rate')}")
            assert {g: lt for g, lt in moved.items() if g != "0"} == {g: lt for g, lt in start.items() if g != "0"}
            assert moved["0"][0] in ("w2", "w3") and moved["0"][1] == start["0"][1] + 1  # one move
            hold(c, moved, 3 * WINDOW_S, "after the move")
            hot.wait_more(100)
        finally:
            throttle.finish()
            results = [hot.finish()] + ([side.finish()] if side is not None else [])
        counted = decisions(c)
        assert counted.get('{kind="hot_leader",reason="latency"}') == 1.0, counted
        for name, result in zip(("hot group", "side group"), results):
            assert sum(result.errors.values()) == 0, f"{name}: client-visible errors: {result.errors}"
            judge(c, result, f"hot-relief {name}")
    finally:
        c.close()
