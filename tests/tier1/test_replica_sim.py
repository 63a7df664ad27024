"""Seeded simulations of worker/replica.py (see tests/tier1/replica_sim.py).

    SHARDGRID_SIM_SEEDS=N   how many seeds `test_seeds` runs (default 2000)
    SHARDGRID_SIM_SEED=S    `test_seeds` runs only seed S, with a full trace

A failing seed is a bug in the replica (or the simulator), never a seed to
skip: replay it, read the trace, fix the cause.
"""
from __future__ import annotations

import os

import pytest

from tests.tier1.replica_sim import SimViolation, run_seed

SEEDS = int(os.environ.get("SHARDGRID_SIM_SEEDS", "2000"))
REPLAY_HINT = "SHARDGRID_SIM_SEED={seed} .venv/bin/pytest -q -s tests/tier1/test_replica_sim.py -k seeds"
REPLAY = os.environ.get("SHARDGRID_SIM_SEED")


@pytest.mark.timeout(900)
def test_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    if REPLAY is not None:
        with capsys.disabled():  # the trace is the point of a replay
            sim = run_seed(int(REPLAY), verbose=True)
            print(f"seed {REPLAY} passed: {dict(sim.stats)}")
        return
    for seed in range(SEEDS):
        try:
            run_seed(seed)
        except SimViolation as exc:
            print(REPLAY_HINT.format(seed=seed))
            pytest.fail(f"{exc}\nreplay: {REPLAY_HINT.format(seed=seed)}", pytrace=False)


def test_runs_exercise_the_protocol() -> None:
    """Guard against a simulator that silently stops doing anything."""
    total: dict[str, int] = {}
    for seed in range(40):
        sim = run_seed(seed)
        for k, v in sim.stats.items():
            total[k] = total.get(k, 0) + v
        total["acked"] = total.get("acked", 0) + len(sim.commits.acked)
    for what in (
        "acked",
        "write_ok_quorum",
        "write_ok_all",
        "served_strong",
        "served_follower",
        "transfer_done",
        "snapshot_installed",
        "membership_ok",
        "crash_power",
        "crash_kill",
        "crash_mid_list",
        "crash_after_early_append",
        "crash_disk_lost",
        "write_quorum_timeout",
        "write_batches",
        "ops_entries_committed",
        "compact_held",
        "snapshot_taken",
        "commit_from_heartbeat",
        "announce_behind",
        "quorum_lost",
        "quorum_regained",
        "meta_isolation_failover",
        "availability_checked",
        "flap_checked",
        "resent_acked",
        "resent_answered_from_log",
        "wall_clock_stepped",
        "forged",
        "NeedMetaView",
    ):
        assert total.get(what, 0) > 0, f"no {what} in 40 seeds: {total}"
