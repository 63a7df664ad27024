"""Seeded simulations of real group shells on simulated disks (tests/support/shell_sim.py).

    make sim [SEEDS=N]                  `test_seeds` over N seeds (default 200)
    make sim SEED=S                     only seed S, with its whole trace
    SHARDGRID_SIM_PLANT=NAME make sim   the same with a known bug planted: it must fail

A failing seed is a bug in the shell, the WAL, the snapshots (or the
simulator), never a seed to skip: replay it, read the trace, fix the cause.
"""
from __future__ import annotations

import os
from collections import Counter

import pytest

from tests.support.shell_sim import PLANTS, SimViolation, replay_hint, run_seed

SEEDS = int(os.environ.get("SHARDGRID_SHELL_SIM_SEEDS") or "200")
REPLAY = os.environ.get("SHARDGRID_SHELL_SIM_SEED") or None
PLANT = os.environ.get("SHARDGRID_SIM_PLANT") or None
PLANT_BUDGET = 200  # seeds within which the simulator must catch each planted bug


@pytest.mark.timeout(1800)
def test_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    if REPLAY is not None:
        with capsys.disabled():  # the trace is the point of a replay
            sim = run_seed(int(REPLAY), PLANT, verbose=True)
            print(f"seed {REPLAY} passed: {dict(sim.stats)}")
        return
    for seed in range(SEEDS):
        try:
            run_seed(seed, PLANT)
        except SimViolation as exc:
            pytest.fail(f"{exc}\nreplay: {replay_hint(seed, PLANT)}", pytrace=False)


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_bug_is_caught(plant: str) -> None:
    for seed in range(PLANT_BUDGET):
        try:
            run_seed(seed, plant)
        except SimViolation:
            return
    pytest.fail(f"the simulator did not catch the planted bug {plant!r} in {PLANT_BUDGET} seeds")


def test_an_unknown_plant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown plant"):
        run_seed(0, "no-such-bug")


def test_a_seed_replays_exactly() -> None:
    a, b = run_seed(11), run_seed(11)
    assert a.digest == b.digest and a.trace == b.trace and a.stats == b.stats and a.stats["acked"] > 0


def test_runs_exercise_the_shell() -> None:
    """Guard against a simulator that silently stops doing anything."""
    total: Counter[str] = Counter()
    for seed in range(60):
        total.update(run_seed(seed).stats)
    for what in (
        "acked", "acked_all",
        "crash_power", "crash_kill", "outage",
        # crashes inside the durable steps: recovery must survive each point
        "crash_during_append", "crash_during_roll", "crash_during_write_hard_state_file",
        "crash_during_write_snapshot", "crash_during_install_downloaded", "crash_during_fetch",
        "crash_in_pwrite", "crash_in_fsync", "crash_in_replace", "crash_in_fsync_dir",
        "torn_tail_truncated", "wal_damaged",
        "reopened_after_disk_error",
        "snapshot_installed", "download_cut", "download_busy", "download_flipped",
        "partition", "transfer_done", "short_writes",
        # membership: each step of meta's operators completed, recorded by meta,
        # a new replica caught up by a download, a removed one dropped by its worker
        "members_add_learner", "members_promote", "members_remove", "members_recorded",
        "learner_snapshot_installed", "members_dropped",
    ):
        assert total[what] > 0, f"no {what} in 60 seeds: {dict(total)}"
