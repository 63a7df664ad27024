"""An in-memory `Storage` (worker/storage.py) that models a disk under power loss.

Deterministic given the `random.Random` it is handed: a simulator can run
the WAL and the snapshot archives on it, crash the machine at any point and
check what recovery finds.

The model (Linux-like, simplified):

* A file is an inode with `durable` bytes (what the disk holds), `volatile`
  bytes (the page cache: what reads see) and the `pending` data operations
  (write, truncate, allocate) since its last successful fsync/fdatasync.
  A successful fsync or fdatasync (both make data and size durable here)
  replays the pending operations onto `durable`.
* A directory maps names to inodes, with a `durable` and a `volatile` map
  and the `pending` name operations (create, rename/replace, unlink) since
  its last `fsync_dir`. A new file's name is durable only after `fsync_dir`
  of its directory, whatever was done to its data.
* `power_loss(rng, mode)`: every directory keeps a random prefix of its
  pending name operations (a rename is atomic: old or new); every inode's
  durable content is extended by what survives of its pending operations,
  per `mode`: "lose" (nothing), "prefix" (a random prefix of them, the last
  write possibly torn) or "reorder" (each BLOCK-byte block a pending write
  touched independently survives or not; one that does not keeps its durable
  bytes, zeros past the durable size: a hole). Then volatile := durable and
  every fd and lock is gone.
* `kill()`: the process dies, the machine does not: the page cache stays
  (it is written back eventually), fds and locks are dropped.
* A failed fsync (`fail_next_fsync`, `fsync_fail_rate`) raises EIO and
  forgets the inode's pending operations, as Linux does: their bytes stay in
  the page cache, but no later fsync makes them durable and a power loss
  reverts them.
* A write or pwrite may be short (`short_write_rate`): it writes a prefix of
  its bytes and returns their count, as write(2) does when the disk fills in
  the middle of it (then the next write fails with ENOSPC) or a signal
  interrupts it (then the next one goes on).
* `crash_after(n)`: the n-th mutating call from now raises `SimCrash` (a
  write first applies a random prefix of its bytes); until `kill()` or
  `power_loss()` every call raises `SimCrash` (the process is dead).
"""
from __future__ import annotations

import errno
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Union

from worker.wal import _BLOCK

# The block a lost writeback leaves as a unit: the one the WAL's recovery
# looks for holes in.
BLOCK = _BLOCK
PowerLossMode = Literal["lose", "prefix", "reorder"]
MODES: tuple[PowerLossMode, ...] = ("lose", "prefix", "reorder")

# Data ops: ("write", offset, bytes), ("trunc", size), ("alloc", end).
_DataOp = tuple
# Name ops: ("link", name, node), ("unlink", name), ("rename", src, dst, node).
_NameOp = tuple


class SimCrash(BaseException):
    """The simulated process died in the middle of a call (not an error to handle)."""


@dataclass(eq=False)
class _Inode:
    durable: bytearray = field(default_factory=bytearray)
    volatile: bytearray = field(default_factory=bytearray)
    pending: list[_DataOp] = field(default_factory=list)


@dataclass(eq=False)
class _Dir:
    durable: dict[str, _Node] = field(default_factory=dict)
    volatile: dict[str, _Node] = field(default_factory=dict)
    pending: list[_NameOp] = field(default_factory=list)


_Node = Union[_Inode, _Dir]


@dataclass
class _Fd:
    inode: _Inode
    pos: int = 0
    append: bool = False  # O_APPEND: every write goes to the end of the file
    writable: bool = True


def _apply(data: bytearray, op: _DataOp) -> None:
    kind = op[0]
    if kind == "write":
        _, offset, payload = op
        if offset > len(data):
            data.extend(bytes(offset - len(data)))
        data[offset:offset + len(payload)] = payload
    elif kind == "trunc":
        del data[op[1]:]
        data.extend(bytes(op[1] - len(data)))
    else:  # alloc
        data.extend(bytes(max(0, op[1] - len(data))))


def _replay(base: bytearray, ops: list[_DataOp]) -> bytearray:
    out = bytearray(base)
    for op in ops:
        _apply(out, op)
    return out


def _apply_name(names: dict[str, _Node], op: _NameOp) -> None:
    if op[0] == "link":
        names[op[1]] = op[2]
    elif op[0] == "unlink":
        names.pop(op[1], None)
    else:  # rename: atomic, the old name goes with it
        names.pop(op[1], None)
        names[op[2]] = op[3]


class SimStorage:
    """An in-memory disk; see the module docstring. Paths are absolute `Path`s."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._root = _Dir()
        self._dirs: list[_Dir] = [self._root]  # every directory ever made (power loss visits them)
        self._inodes: list[_Inode] = []
        self._fds: dict[int, _Fd] = {}
        self._next_fd = 3
        self._locks: dict[int, int] = {}  # id(inode) -> fd holding its flock
        self._dead = False
        self._crash_in: int | None = None
        # Fault knobs.
        self.fsync_failures = 0  # the next n file fsync/fdatasync calls fail with EIO
        # For a simulator's bookkeeping of latent damage: pages a failed fsync
        # forgot are still cached (`forgotten`, until `settle` drops them), or
        # a power loss turned them into holes on the disk (`scarred`, until
        # the simulator sees a recovery read the disk).
        self.forgotten = False
        self.scarred = False
        self.fsync_fail_rate = 0.0
        # Consulted before a random fsync failure (fsync_fail_rate): False
        # holds it back (a simulator keeping to its fault budget).
        self.may_fail: Callable[[], bool] = lambda: True
        self.write_failures = 0  # the next n write/pwrite/fallocate calls fail with `write_errno`
        self.write_errno = errno.ENOSPC
        # Chance per write/pwrite of at least 2 bytes that it is short; `may_fail` holds it back too.
        self.short_write_rate = 0.0
        self.short_writes = 0  # how many there were (a simulator's statistics)
        self.crash_hook: Callable[[str], bool] | None = None  # op name -> crash now?
        self.mutations = 0  # mutating calls so far (to pick a crash point)

    # ------------------------------------------------------------ fault knobs

    def fail_next_fsync(self, n: int = 1) -> None:
        self.fsync_failures += n

    def fail_next_writes(self, n: int = 1, err: int = errno.ENOSPC) -> None:
        self.write_failures, self.write_errno = self.write_failures + n, err

    def crash_after(self, n: int) -> None:
        """The n-th mutating call from now (1: the next one) raises SimCrash."""
        self._crash_in = n

    def _mutating(self, op: str) -> bool:
        """Count a mutating call; True when the process must die in it."""
        self._alive()
        self.mutations += 1
        crash = self.crash_hook is not None and self.crash_hook(op)
        if self._crash_in is not None:
            self._crash_in -= 1
            crash = crash or self._crash_in == 0
        if crash:
            self._crash_in = None
            self._dead = True
        return crash

    def _alive(self) -> None:
        if self._dead:
            raise SimCrash("the process is dead")

    # ---------------------------------------------------------- crashes

    def kill(self) -> None:
        """The process dies: fds and locks go, the page cache stays."""
        self._fds.clear()
        self._locks.clear()
        self._dead = False
        self._crash_in = None

    def die(self) -> None:
        """The process is dead from now on: every call raises SimCrash until
        `kill()` or `power_loss()` (a simulator killing it between two calls)."""
        self._dead = True

    def holds(self, path: Path) -> bool:
        """Does `path` exist, as its process sees it or as a power loss may
        leave it (its name still durable)? For the simulator to look at a
        disk whatever state its process is in (a dead one's calls raise
        SimCrash)."""
        volatile: _Node | None = self._root
        durable: _Node | None = self._root
        for part in Path(path).parts[1:]:
            volatile = volatile.volatile.get(part) if isinstance(volatile, _Dir) else None
            durable = durable.durable.get(part) if isinstance(durable, _Dir) else None
        return volatile is not None or durable is not None

    def settle(self) -> None:
        """What worker/retry.py's `settle_from_disk` does before a group is
        reopened in place: every file and directory fsynced through a new
        descriptor (what is pending becomes durable; what a failed fsync
        forgot does not come back), then the page cache dropped."""
        self._alive()
        for d in self._dirs:
            for op in d.pending:
                _apply_name(d.durable, op)
            d.pending.clear()
            d.volatile = dict(d.durable)
        for ino in self._inodes:
            ino.durable = _replay(ino.durable, ino.pending)
            ino.pending.clear()
            ino.volatile = bytearray(ino.durable)
        self.forgotten = False

    def power_loss(self, rng: random.Random | None = None, mode: PowerLossMode = "prefix") -> None:
        """The machine loses power: only what is durable (and what survives by luck) stays."""
        rng = rng or self.rng
        if mode not in MODES:
            raise ValueError(mode)
        for d in self._dirs:
            for op in d.pending[:rng.randint(0, len(d.pending))]:
                _apply_name(d.durable, op)
            d.pending.clear()
            d.volatile = dict(d.durable)
        for ino in self._inodes:
            if ino.pending:
                ino.durable = self._survivor(ino, rng, mode)
            ino.pending.clear()
            ino.volatile = bytearray(ino.durable)
        self.scarred = self.scarred or self.forgotten
        self.forgotten = False
        self.kill()

    @staticmethod
    def _survivor(ino: _Inode, rng: random.Random, mode: PowerLossMode) -> bytearray:
        ops = ino.pending
        if mode == "lose":
            return ino.durable
        k = rng.randint(0, len(ops))
        if mode == "prefix":
            out = _replay(ino.durable, ops[:k])
            if k < len(ops) and ops[k][0] == "write" and rng.random() < 0.5:
                _, offset, payload = ops[k]  # torn: a prefix of its bytes
                _apply(out, ("write", offset, payload[:rng.randint(0, len(payload))]))
            return out
        # reorder: the size of some prefix of the ops, each touched block on its own.
        size = len(_replay(ino.durable, ops[:k]))
        full = _replay(ino.durable, ops)
        touched: set[int] = set()
        for op in ops:
            if op[0] == "write" and op[2]:
                touched.update(range(op[1] // BLOCK, (op[1] + len(op[2]) - 1) // BLOCK + 1))
        out = bytearray(size)
        for b in range(0, -(-size // BLOCK)):
            lo, hi = b * BLOCK, min(size, (b + 1) * BLOCK)
            src = full if b in touched and rng.random() < 0.5 else ino.durable
            chunk = src[lo:hi]
            out[lo:lo + len(chunk)] = chunk  # past src's end: zeros (a hole)
        return out

    def corrupt(self, path: Path, rng: random.Random, lo: int = 0, hi: int | None = None) -> int:
        """Flip one byte of the file in [lo, hi) (durable and cached); returns its offset."""
        ino = self._file(path)
        hi = len(ino.volatile) if hi is None else hi
        offset = rng.randrange(lo, hi)
        flip = rng.randint(1, 255)
        for data in (ino.durable, ino.volatile):
            if offset < len(data):
                data[offset] ^= flip
        for op in ino.pending:  # a pending write replayed later must not undo the damage
            if op[0] == "write" and op[1] <= offset < op[1] + len(op[2]):
                op[2][offset - op[1]] ^= flip
        return offset

    # ---------------------------------------------------------- paths

    def _walk(self, path: Path) -> _Node | None:
        node: _Node = self._root
        for part in Path(path).parts:
            if part == "/":
                continue
            if not isinstance(node, _Dir) or part not in node.volatile:
                return None
            node = node.volatile[part]
        return node

    def _parent(self, path: Path) -> tuple[_Dir, str]:
        parent = self._walk(Path(path).parent)
        if not isinstance(parent, _Dir):
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(Path(path).parent))
        return parent, Path(path).name

    def _file(self, path: Path) -> _Inode:
        node = self._walk(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        if not isinstance(node, _Inode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        return node

    def _dir(self, path: Path) -> _Dir:
        node = self._walk(path)
        if not isinstance(node, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
        return node

    def _fd(self, fd: int) -> _Fd:
        self._alive()
        if fd not in self._fds:
            raise OSError(errno.EBADF, "bad file descriptor")
        return self._fds[fd]

    # ---------------------------------------------------------- Storage: fds

    def open(self, path: Path, flags: int, mode: int = 0o644) -> int:
        self._alive()
        parent, name = self._parent(path)
        node = parent.volatile.get(name)
        if flags & (os.O_CREAT | os.O_TRUNC) and self._mutating("open"):
            raise SimCrash("open")
        if node is None:
            if not flags & os.O_CREAT:
                raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
            node = _Inode()
            self._inodes.append(node)
            parent.volatile[name] = node
            parent.pending.append(("link", name, node))
        elif flags & os.O_CREAT and flags & os.O_EXCL:
            raise FileExistsError(errno.EEXIST, "file exists", str(path))
        if not isinstance(node, _Inode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        if flags & os.O_TRUNC and node.volatile:
            self._data_op(node, ("trunc", 0))
        fd, self._next_fd = self._next_fd, self._next_fd + 1
        self._fds[fd] = _Fd(node, append=bool(flags & os.O_APPEND),
                            writable=flags & os.O_ACCMODE != os.O_RDONLY)
        return fd

    def close(self, fd: int) -> None:
        self._fd(fd)
        del self._fds[fd]
        for key, holder in list(self._locks.items()):
            if holder == fd:
                del self._locks[key]

    @staticmethod
    def _data_op(ino: _Inode, op: _DataOp) -> None:
        _apply(ino.volatile, op)
        ino.pending.append(op)

    def _write_check(self, name: str, f: _Fd, data: bytes | memoryview, offset: int) -> None:
        if not f.writable:
            raise OSError(errno.EBADF, "not open for writing")
        if self._mutating(name):
            cut = bytes(data[:self.rng.randint(0, len(data))])  # a write cut in the middle
            if cut:
                self._data_op(f.inode, ("write", offset, bytearray(cut)))
            raise SimCrash(name)
        if self.write_failures:
            self.write_failures -= 1
            raise OSError(self.write_errno, os.strerror(self.write_errno))

    def _written(self, size: int) -> int:
        """How many of `size` bytes a write that passed its checks writes."""
        if size < 2 or not self.short_write_rate or self.rng.random() >= self.short_write_rate \
                or not self.may_fail():
            return size
        self.short_writes += 1
        if self.rng.random() < 0.5:
            self.fail_next_writes(1, errno.ENOSPC)  # the disk filled up in the middle of it
        return self.rng.randint(1, size - 1)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        f = self._fd(fd)
        if f.append:
            f.pos = len(f.inode.volatile)
        self._write_check("write", f, data, f.pos)
        n = self._written(len(data))
        self._data_op(f.inode, ("write", f.pos, bytearray(data[:n])))
        f.pos += n
        return n

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        f = self._fd(fd)
        self._write_check("pwrite", f, data, offset)
        n = self._written(len(data))
        self._data_op(f.inode, ("write", offset, bytearray(data[:n])))
        return n

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return bytes(self._fd(fd).inode.volatile[offset:offset + size])

    def fsync(self, fd: int) -> None:
        ino = self._fd(fd).inode
        if self._mutating("fsync"):
            raise SimCrash("fsync")
        if self.fsync_failures or (self.fsync_fail_rate and self.may_fail()
                                   and self.rng.random() < self.fsync_fail_rate):
            self.fsync_failures = max(0, self.fsync_failures - 1)
            ino.pending.clear()  # Linux: the dirty pages are marked clean; they never reach the disk
            self.forgotten = True
            raise OSError(errno.EIO, "injected fsync failure")
        ino.durable = _replay(ino.durable, ino.pending)
        ino.pending.clear()

    fdatasync = fsync  # both make data and size durable in this model

    def ftruncate(self, fd: int, size: int) -> None:
        f = self._fd(fd)
        if self._mutating("ftruncate"):
            raise SimCrash("ftruncate")
        self._data_op(f.inode, ("trunc", size))

    def fsize(self, fd: int) -> int:
        return len(self._fd(fd).inode.volatile)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        f = self._fd(fd)
        self._write_check("fallocate", f, b"", offset)
        if offset + length > len(f.inode.volatile):
            self._data_op(f.inode, ("alloc", offset + length))

    def lock(self, path: Path) -> int:
        fd = self.open(path, os.O_RDWR | os.O_CREAT)
        key = id(self._fds[fd].inode)
        if key in self._locks:
            self.close(fd)
            raise BlockingIOError(errno.EWOULDBLOCK, "lock held", str(path))
        self._locks[key] = fd
        return fd

    # ---------------------------------------------------------- Storage: paths

    def truncate(self, path: Path, size: int) -> None:
        self._alive()
        ino = self._file(path)
        if self._mutating("truncate"):
            raise SimCrash("truncate")
        self._data_op(ino, ("trunc", size))

    def read_bytes(self, path: Path) -> bytes:
        self._alive()
        return bytes(self._file(path).volatile)

    def exists(self, path: Path) -> bool:
        self._alive()
        return self._walk(path) is not None

    def is_dir(self, path: Path) -> bool:
        self._alive()
        return isinstance(self._walk(path), _Dir)

    def is_file(self, path: Path) -> bool:
        self._alive()
        return isinstance(self._walk(path), _Inode)

    def listdir(self, path: Path) -> list[str]:
        self._alive()
        return list(self._dir(path).volatile)

    def size(self, path: Path) -> int:
        self._alive()
        return len(self._file(path).volatile)

    def unlink(self, path: Path, missing_ok: bool = False) -> None:
        self._alive()
        parent, name = self._parent(path)
        if not isinstance(parent.volatile.get(name), _Inode):
            if missing_ok and name not in parent.volatile:
                return
            self._file(path)  # raises the right error
        if self._mutating("unlink"):
            raise SimCrash("unlink")
        del parent.volatile[name]
        parent.pending.append(("unlink", name))

    def replace(self, src: Path, dst: Path) -> None:
        self._alive()
        sdir, sname = self._parent(src)
        ddir, dname = self._parent(dst)
        if sdir is not ddir:
            raise NotImplementedError("rename across directories is not modelled")
        node = self._file(src)
        if self._mutating("replace"):
            raise SimCrash("replace")
        _apply_name(sdir.volatile, ("rename", sname, dname, node))
        sdir.pending.append(("rename", sname, dname, node))

    def mkdir(self, path: Path) -> None:
        self._alive()
        node: _Dir = self._root
        for part in Path(path).parts:
            if part == "/":
                continue
            child = node.volatile.get(part)
            if child is None:
                if self._mutating("mkdir"):
                    raise SimCrash("mkdir")
                child = _Dir()
                self._dirs.append(child)
                node.volatile[part] = child
                node.pending.append(("link", part, child))
            elif not isinstance(child, _Dir):
                raise FileExistsError(errno.EEXIST, "file exists", str(path))
            node = child

    def fsync_dir(self, path: Path) -> None:
        self._alive()
        d = self._dir(path)
        if self._mutating("fsync_dir"):
            raise SimCrash("fsync_dir")
        if self.fsync_fail_rate and self.may_fail() and self.rng.random() < self.fsync_fail_rate:
            # The names stay pending: a later fsync of the directory may still make them durable.
            raise OSError(errno.EIO, "injected directory fsync failure")
        d.durable = dict(d.volatile)
        d.pending.clear()
