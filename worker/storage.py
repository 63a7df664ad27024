"""The file-system calls the WAL and the snapshot archives make, behind one interface.

`worker/wal.py` and `worker/snapshots.py` reach the disk only through a
`Storage`. In production that is `OS_STORAGE`, a thin pass-through to `os`
and `fcntl` that makes exactly the calls the modules made before this
interface existed (same flags, same order), so the on-disk bytes and the
durability behaviour are unchanged. A deterministic simulator passes
instead an in-memory disk that models power loss, torn and reordered writes
and failed fsyncs (tests/support/sim_storage.py), to check recovery against
crashes a real test machine cannot produce on demand.

The interface is deliberately fd-based and os-like (`open` returns an int,
`pwrite` returns the count written, errors are `OSError` with an errno):
the callers' code stays a mechanical `os.X(...)` -> `storage.X(...)`, and
a fake has to model the same small set of system calls, nothing richer.
Paths are `pathlib.Path`.
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Protocol

__all__ = ["LOCK_HELD_ERRNOS", "OS_STORAGE", "OsStorage", "Storage"]


class Storage(Protocol):
    """A file system, as the WAL and the snapshot archives use it."""

    # -- file descriptors
    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        """Like os.open; O_CLOEXEC and similar flags are passed through."""
        ...

    def close(self, fd: int) -> None: ...

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """Write at the fd's position (os.write); may be short."""
        ...

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int: ...

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        """Up to `size` bytes at `offset`; fewer at the end of the file."""
        ...

    def fsync(self, fd: int) -> None: ...

    def fdatasync(self, fd: int) -> None: ...

    def ftruncate(self, fd: int, size: int) -> None: ...

    def fsize(self, fd: int) -> int:
        """The file's length (fstat st_size)."""
        ...

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        """posix_fallocate: OSError(ENOSPC) when the space is not there."""
        ...

    def lock(self, path: Path) -> int:
        """Open (creating) `path` and take an exclusive non-blocking flock on it.

        Returns the fd (closing it releases the lock); OSError with
        EWOULDBLOCK or EAGAIN if another holder has it.
        """
        ...

    # -- paths
    def truncate(self, path: Path, size: int) -> None: ...

    def read_bytes(self, path: Path) -> bytes: ...

    def exists(self, path: Path) -> bool: ...

    def is_dir(self, path: Path) -> bool: ...

    def is_file(self, path: Path) -> bool: ...

    def listdir(self, path: Path) -> list[str]:
        """Names in directory `path` (no order promised)."""
        ...

    def size(self, path: Path) -> int: ...

    def unlink(self, path: Path, missing_ok: bool = False) -> None: ...

    def replace(self, src: Path, dst: Path) -> None:
        """Atomic rename over `dst` (os.replace)."""
        ...

    def mkdir(self, path: Path) -> None:
        """Create `path` and its missing parents; no error if it exists."""
        ...

    def fsync_dir(self, path: Path) -> None:
        """Make the names in directory `path` (creations, renames, deletions) durable."""
        ...


class OsStorage:
    """`Storage` on the real file system: exactly the os calls the modules made before.

    Stateless: every method is a direct call into `os`/`fcntl`, looked up at
    call time (tests monkeypatch `os.fsync` and friends to inject errors).
    """

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return os.write(fd, data)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsize(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def lock(self, path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        return fd

    def truncate(self, path: Path, size: int) -> None:
        os.truncate(path, size)

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def exists(self, path: Path) -> bool:
        return path.exists()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def size(self, path: Path) -> int:
        return path.stat().st_size

    def unlink(self, path: Path, missing_ok: bool = False) -> None:
        path.unlink(missing_ok=missing_ok)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def mkdir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# Stateless, so sharing one instance is not shared mutable state.
OS_STORAGE: Storage = OsStorage()

# errno values `lock` raises when the lock is held elsewhere.
LOCK_HELD_ERRNOS = (errno.EWOULDBLOCK, errno.EAGAIN)


def make_dirs(io: Storage, path: Path, *, sync: bool = True) -> None:
    """Create `path` and its missing parents, durably when `sync`: a new
    directory's name lives in its parent, and until that parent is fsynced a
    power loss may take the directory back, with every file in it, however
    well those were synced.

    Every ancestor is fsynced, not only those this call creates: a call that
    failed after its mkdir (a directory fsync that failed) leaves a
    directory that exists but may not last, and the retry cannot tell. It
    runs when a group opens and a snapshot is written, where a few fsyncs
    of clean directories cost nothing next to the rest."""
    io.mkdir(path)
    if sync:
        for p in (path, *path.parents):
            if p.parent != p:
                io.fsync_dir(p.parent)


def write_all(io: Storage, fd: int, data: bytes | memoryview) -> None:
    """All of `data`: a regular-file write(2) is short only on ENOSPC/EFBIG or
    a signal, and looping makes a short write surface as the OSError of the
    next call instead of a hole."""
    view = memoryview(data)
    while view:
        view = view[io.write(fd, view):]
