"""What an operator's message says about a replica's snapshot download.

The message is stored in meta's replicated state (UpdateOperator), and meta
writes it only when it changes, so anything that changes it costs a Raft
entry on every meta node. A byte count straight from the heartbeats would
change with every report (about 3 a second per learner): the progress is
shown in steps of a twentieth of the snapshot instead. That bounds a
download to about 20 writes whatever its size and speed, and a slow one
(the ones worth watching: a minute for a 4 GB snapshot at the default 64 MB/s)
to one about every 3 s; a fast one ends within a few reports anyway. Whole
MiB steps would not do: 64 of them a second at the default rate.
"""
from __future__ import annotations

from shardgrid.common.units import format_bytes

STEPS = 20  # 5% of the snapshot


def snapshot_message(worker: str, received: int, total: int, waiting: bool) -> str:
    """`w4 receiving snapshot: 12 MB of 40 MB (30%)`, the bytes rounded down to a 5% step.

    `waiting`: the source serves its limit of snapshot downloads
    (settings.snapshot_concurrency) and the learner waits for a turn."""
    step = min(STEPS, max(0, received) * STEPS // total) if total > 0 else STEPS
    shown = total * step // STEPS
    where = f"{format_bytes(shown)} of {format_bytes(total)} ({step * 100 // STEPS}%)"
    if waiting:
        return f"{worker} waiting for a snapshot download slot (settings.snapshot_concurrency): {where}"
    return f"{worker} receiving snapshot: {where}"
