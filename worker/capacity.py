"""Whether this worker can take one more replica: its answer when meta assigns it one. Pure.

Meta's controller asks the worker it chose before it starts an add
(meta/repair.py); a refusal names its reason, and the controller tries the
next worker. The worker is the one that knows its disk and memory: what it
advertised at registration (`--available-disk`, `--available-ram`), what
its replicas already use, and what the filesystem has left.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# A replica grows while it catches up (the log tail on top of the snapshot):
# want a quarter more room than the group holds now.
HEADROOM = 1.25

# Never fill the filesystem: a full disk fails every group here (ENOSPC), not only the new one.
MIN_FREE_BYTES = 64 << 20



@dataclass(frozen=True)
class Capacity:
    state: str  # this worker's state in meta's view ("" when not known yet)
    disk_budget: int  # advertised bytes (0: not said, only the filesystem counts)
    disk_used: int  # bytes under the data directory's groups/
    disk_free: int  # free bytes on the data directory's filesystem
    ram_budget: int  # advertised bytes (0: not said)
    ram_used: int  # resident set size


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of shardgrid.common.wire.REFUSAL_REASONS
    message: str


def refusal(cap: Capacity, need_bytes: int) -> Refusal | None:
    """Why this worker cannot take a replica holding about `need_bytes`, or None when it can."""
    if cap.state in ("draining", "drained", "removed"):
        return Refusal("draining", f"this worker is {cap.state}")
    want = int(max(0, need_bytes) * HEADROOM)
    if cap.disk_free - want < MIN_FREE_BYTES:
        return Refusal("insufficient_disk", f"{cap.disk_free} bytes free on the data filesystem; the replica needs "
                       f"about {want} and {MIN_FREE_BYTES} must stay free")
    if cap.disk_budget and cap.disk_used + want > cap.disk_budget:
        return Refusal("insufficient_disk", f"{cap.disk_used} of the advertised {cap.disk_budget} bytes of disk are "
                       f"used; the replica needs about {want}")
    # The entities state lives in memory too: about as large as on disk.
    if cap.ram_budget and cap.ram_used + want > cap.ram_budget:
        return Refusal("insufficient_ram", f"{cap.ram_used} of the advertised {cap.ram_budget} bytes of memory are "
                       f"used; the replica needs about {want}")
    return None


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under `root` (0 when it does not exist); files vanishing meanwhile are skipped."""
    total = 0
    for path in root.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue  # removed while we walked (a snapshot rotated, a WAL segment dropped)
    return total


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) `path`: a worker
    that hosts nothing yet may not have created its data directory."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue  # not there (yet): its parent's filesystem is where it will be
    return 0


def resident_bytes() -> int:
    """This process's resident set size (Linux), 0 when it cannot be read."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
