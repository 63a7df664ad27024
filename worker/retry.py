"""Retry in place of a group replica that failed on an error from the disk.

A group whose loop hit an `OSError` (ENOSPC, EIO from a WAL write or fsync)
stops and reports `failed` (worker/group.py). The cause often clears (space
is freed, a path comes back), so the worker checks the disk with backoff and,
once a probe write + fsync there succeeds, closes the failed group and opens
it again from disk exactly as a restart of the process would: WAL recovery
cuts a torn tail, the replica comes back as a follower, and its leader
re-syncs it (appends, or a snapshot). That is PostgreSQL's answer to a failed
fsync: never retry the fsync on the same descriptor, recover from what is on
disk. This module holds the disk checks and the backoff; worker/process.py
runs them.

"What is on disk" needs one more step than a restart. After a failed
writeback the kernel may keep the pages it could not write, marked clean:
a process restart would read them back as the replica's log, and the
recovery's fsync (a new descriptor: the error was reported once already)
would not write them either. The replica would then count towards a quorum
for entries no disk holds. So before the reopen every file of the group is
fsynced through a new descriptor (what is still dirty gets written, or the
retry fails) and its cached pages are dropped: recovery reads the disk.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from worker.wal import fsync_dir

# First retry a second after the failure is seen, then doubling up to half a
# minute: a full disk is seldom freed within seconds, and a probe writes to it.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
RETRY_TICK_S = 0.2  # how often the worker looks for failed groups
PROBE_BYTES = 64 * 1024
PROBE_NAME = ".probe"  # not a name the group's own files use


@dataclass(frozen=True)
class RetryPolicy:
    first_s: float = RETRY_FIRST_S
    max_s: float = RETRY_MAX_S
    tick_s: float = RETRY_TICK_S


@dataclass
class Backoff:
    """When to try one failed group again, and how it went (monotonic seconds)."""

    policy: RetryPolicy
    failed_at: float
    next_at: float
    delay: float
    attempts: int = 0
    reopened_at: float | None = None

    @classmethod
    def first(cls, policy: RetryPolicy, now: float) -> Backoff:
        return cls(policy, failed_at=now, next_at=now + policy.first_s, delay=policy.first_s)

    def due(self, now: float) -> bool:
        return self.reopened_at is None and now >= self.next_at

    def wait_longer(self, now: float) -> None:
        """A try failed, or the reopened group failed again: back off further."""
        self.attempts += 1
        self.delay = min(self.delay * 2, self.policy.max_s)
        self.next_at = now + self.delay
        self.reopened_at = None

    def reopened(self, now: float) -> None:
        self.attempts += 1
        self.reopened_at = now

    def settled(self, now: float) -> bool:
        """Reopened and healthy for a whole maximum delay: forget the backoff.
        Until then a new failure continues it (a flapping disk is not
        reopened every second)."""
        return self.reopened_at is not None and now - self.reopened_at >= self.policy.max_s


def probe_disk(directory: Path, size: int = PROBE_BYTES) -> None:
    """Write, fsync and delete `size` bytes in `directory`. Raises OSError when the disk cannot."""
    path = directory / PROBE_NAME
    # Random bytes: a compressing or deduplicating filesystem must not make the probe free.
    data = memoryview(os.urandom(size))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    fsync_dir(directory)


def settle_from_disk(root: Path) -> None:
    """fsync every file under `root` through a new descriptor, then drop its
    cached pages, so that the next read of it is the disk's. Raises OSError."""
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            fsync_dir(path)
            continue
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    fsync_dir(root)
