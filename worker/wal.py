"""Segmented, checksummed write-ahead log of one shard-group replica.

One `Wal` owns one replica directory and persists the replica's Raft-like state:

* the hard state: `current_term`, plus two things recovery needs — the
  snapshot point `(snap_term, snap_seq)` the log starts after, and a `commit`
  hint. It lives in the small file `hardstate`, replaced atomically (write
  `hardstate.tmp`, fsync, rename, fsync the directory);
* the log: entries `(term, seq, payload)` with contiguous, increasing `seq`
  and non-decreasing `term`, in segment files `wal-<first_seq:020d>.seg`.
  A segment is a run of records
  `[u32 length LE][u64 xxh3_64 of the body LE][body]` where the body is
  `msgpack([term, seq, payload])`. A new segment is started once the next
  record would push the current one past `segment_bytes` (a record bigger
  than that gets a segment of its own). After a compaction the first segment
  may still hold entries <= snap_seq; they are skipped.
  The active segment is allocated ahead of its records (`PREALLOC_BYTES` at
  a time, zeros after the last record): an append then does not change the
  file's length, and the batch's sync is an `fdatasync` (which still makes
  the filesystem record that the allocated blocks now hold data). Rolling to
  the next segment, and `close()`, cut the file back to its records.
* `LOCK`, flocked while a `Wal` is open: one writer per directory.

The WAL is agnostic of the entry type: `payload` is any msgpack-able object.
It is read back as msgpack decodes it (`raw=False, strict_map_key=False`):
tuples come back as lists, `bytes` stay `bytes`, map keys may be ints.
Treat an appended payload as immutable: the tail cache hands the very object
back to readers.

What the WAL offers the shell for one batch of `Persist` effects (the
order and its reasons are the durability contract in worker/replica.py;
between 1 and 2 the shell installs a snapshot point, `compact_through`):

1. `set_hard_state(term=T)` — written and fsynced at once, because the
   replica must not answer anything at T before T is durable;
2. `truncate_after(seq)` — durable before it returns;
3. `append(records)` — only `write(2)`s in the default `batch` mode;
4. `set_hard_state(commit=c)` — memory only (commit is volatile in Raft; it
   reaches disk with the next hard-state write or `close()`);
5. `sync()` once for the whole batch, and only then send acknowledgements
   (`match seq`) or answer clients. This is the group commit.

fsync modes:

* `batch` (default): `append` writes, `sync()` fdatasyncs. Safe when the
  shell calls `sync()` before acknowledging anything.
* `always`: fdatasync inside every `append`; `sync()` has nothing left to do.
  Safe, slower: for comparison.
* `none`: never fsync, anywhere (not even the hard state). UNSAFE: a power
  loss can lose acknowledged entries and even the current term, and can
  leave torn records that recovery reports as corruption. Benchmarks only.

Recovery (`Wal.open`) scans every segment in order and verifies each record's
checksum, the seq contiguity (also against the file names), that terms never
decrease and never exceed the hard-state term. What it finds:

* the end of the log: in the last segment, zeros from a record boundary to
  the end of the file (the space allocated ahead, or a file extended by a
  lost write). They stay, as space for the next appends;
* a torn tail — it is truncated away (`Wal.recovery.torn_bytes`, the bytes
  of the record cut): the last segment ends inside a record header, or
  inside the body a record header announces; or the last record written
  (the one followed only by zeros, or by nothing) fails its checksum; or a
  bad record in the last segment has an all-zero header or 4 KiB block (a
  hole a power loss left in writes that were never synced: what follows it
  is cut too). A cut at or below the hard state's commit hint is corruption
  instead: the hint is written only once the log it covers is synced. A
  "short" record whose body is nevertheless complete — a msgpack object ends
  inside the file and matches the checksum, or is followed by a valid record —
  had its length field damaged: that is corruption, not a torn write,
  because cutting there would silently drop records that were fsynced.
* anything else that is wrong — `WalCorrupt`: a bad checksum or garbage
  before the tail, a bad record in any segment but the last, a seq gap, a
  segment name that does not match its records, a checksummed record that
  does not decode, a bad hard-state file. The replica must then stop serving
  the group and re-sync from the leader (snapshot + tail); `Wal.discard()`
  clears the log for that and keeps the term. A replica whose log was
  discarded has lost entries it may have acknowledged, so it must not count
  as an up-to-date voter until it has caught up again.

Recovery also fsyncs the last segment and the directory (unless `none`):
after a SIGKILL the page cache still holds records that were written but
never fsynced, and the replica is about to report them as its log.

Memory: the WAL keeps, per segment, an array of record offsets (8 bytes per
entry), the terms as runs `(first seq of run, term)`, and a tail cache of the
most recent entries bounded by count and bytes. Older entries are read from
disk with one `pread` per segment chunk.

Every file-system call goes through a `Storage` (worker/storage.py; the OS
by default), so that a simulator can run the WAL on a disk that models
power loss.

Not thread-safe. If the shell runs `sync()` in an executor thread, it must
not call any other method of the same `Wal` until `sync()` has returned
(queue the next batch meanwhile: that is the group commit anyway). After an
`OSError` from the disk (a failed write or fsync: the page cache state is
then unknown) the `Wal` refuses all further calls; close it and reopen to
recover.
"""
from __future__ import annotations

import errno
import functools
import os
import re
import struct
from array import array
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, NamedTuple, TypeVar

import msgpack
from xxhash import xxh3_64_intdigest

from worker.storage import LOCK_HELD_ERRNOS, OS_STORAGE, Storage, make_dirs, write_all

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CACHE_ENTRIES",
    "DEFAULT_SEGMENT_BYTES",
    "FSYNC_MODES",
    "HEADER_BYTES",
    "Entry",
    "FsyncMode",
    "HardState",
    "Recovered",
    "Recovery",
    "Wal",
    "WalClosed",
    "WalCompacted",
    "WalCorrupt",
    "WalError",
    "WalFailed",
    "segment_name",
]

FsyncMode = Literal["batch", "always", "none"]
FSYNC_MODES: tuple[str, ...] = ("batch", "always", "none")
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
DEFAULT_CACHE_ENTRIES = 8192
DEFAULT_CACHE_BYTES = 16 * 1024 * 1024

_HEADER = struct.Struct("<IQ")
HEADER_BYTES = _HEADER.size  # 12
_SEGMENT_RE = re.compile(r"^wal-(\d{20})\.seg$")
_HARD_STATE = "hardstate"
_HARD_STATE_TMP = "hardstate.tmp"
_LOCK = "LOCK"
# Disk reads are cut into chunks of about this size so that a long range
# (recovery of a big log, a far-behind follower) does not load a whole
# segment at once.
_READ_CHUNK = 4 * 1024 * 1024
_MAX_RECORD = 0xFFFFFFFF  # the u32 length field
# The active segment is allocated ahead of its writes, this much at a time,
# so that an append changes no file size and `fdatasync` suffices (a sync
# that need not update the file's size is cheaper; the measurements are in
# runbook/benchmarking.md, "Measurements behind constants").
PREALLOC_BYTES = 4 * 1024 * 1024


def segment_name(first_seq: int) -> str:
    return f"wal-{first_seq:020d}.seg"


class Entry(NamedTuple):
    term: int
    seq: int
    payload: Any


@dataclass(frozen=True)
class HardState:
    """What must survive a crash besides the log.

    `term` is the replica's current term. The log starts right after
    `(snap_term, snap_seq)`: `first_seq == snap_seq + 1`. `commit` is a hint
    (Raft's commit index is volatile): recovery returns it clamped to
    `[snap_seq, last_seq]`.
    """

    term: int = 0
    commit: int = 0
    snap_term: int = 0
    snap_seq: int = 0


@dataclass(frozen=True)
class Recovery:
    """What `Wal.open` had to repair; for logs and metrics."""

    torn_bytes: int = 0  # bytes cut off the tail of the last segment
    torn_segment: str | None = None
    # Segments whose entries were all covered by the snapshot: a compaction
    # that crashed between writing the hard state and deleting them.
    removed_segments: tuple[str, ...] = ()
    segments: int = 0


@dataclass(frozen=True)
class Recovered:
    """The replica's durable state, as `Wal.recover` returns it."""

    hard_state: HardState
    entries: list[Entry]  # seq hard_state.snap_seq + 1 .. last_seq
    recovery: Recovery


class WalError(Exception):
    """Base class of the WAL's own errors."""


class WalCorrupt(WalError):
    """The on-disk state is damaged beyond a torn tail.

    The replica must stop serving the group and re-sync it from the leader.
    """

    def __init__(self, path: Path | str, offset: int | None, reason: str) -> None:
        where = f"{path}" if offset is None else f"{path} at byte {offset}"
        super().__init__(f"WAL corrupt: {where}: {reason}")
        self.path = str(path)
        self.offset = offset
        self.reason = reason


class WalCompacted(WalError):
    """The requested entries were compacted into a snapshot: send the snapshot."""

    def __init__(self, seq: int, first_seq: int) -> None:
        super().__init__(f"seq {seq} is compacted; the log starts at {first_seq}")
        self.seq = seq
        self.first_seq = first_seq


class WalFailed(WalError):
    """An earlier disk error left the WAL in an unknown state; reopen it."""


class WalClosed(WalError):
    """The WAL was closed."""


@dataclass(eq=False)
class _Segment:
    first_seq: int
    path: Path
    # offsets[i] is the file offset of the record of seq first_seq + i.
    offsets: array = field(default_factory=lambda: array("Q"))
    size: int = 0  # bytes of whole records; the file holds zeros after them, up to `alloc`
    alloc: int = 0  # bytes the file is long (preallocated, see PREALLOC_BYTES)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.offsets) - 1

    def end_of(self, index: int) -> int:
        """File offset just past record `index` (0-based within the segment)."""
        return self.offsets[index + 1] if index + 1 < len(self.offsets) else self.size


_F = TypeVar("_F", bound=Callable[..., Any])


def _guarded(method: _F) -> _F:
    """Refuse calls on a closed or failed WAL; a disk error fails it for good.

    After a failed write or fsync the kernel may have dropped dirty pages
    (fsync errors are reported once), so nothing the WAL believes about the
    file can be trusted until recovery rescans it.
    """

    @functools.wraps(method)
    def wrapper(self: Wal, *args: Any, **kwargs: Any) -> Any:
        if self._failed is not None:
            raise WalFailed(f"WAL failed earlier ({self._failed!r}); reopen it") from self._failed
        if self._closed:
            raise WalClosed(str(self._dir))
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            self._failed = exc
            self._drop_unsynced()
            raise

    return wrapper  # type: ignore[return-value]


def _unpack_body(body: bytes | memoryview) -> Any:
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def _decode_entry(body: bytes | memoryview) -> Entry | None:
    """The entry a checksummed body holds, or None if it is not one."""
    try:
        obj = _unpack_body(body)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if (type(obj) is not list or len(obj) != 3 or type(obj[0]) is not int
            or type(obj[1]) is not int or obj[0] < 0 or obj[1] < 1):
        return None
    return Entry(obj[0], obj[1], obj[2])


_FIXARRAY_3 = 0x93
_UINTS = {0xCC: struct.Struct(">B"), 0xCD: struct.Struct(">H"), 0xCE: struct.Struct(">I"),
          0xCF: struct.Struct(">Q")}


def _peek_term_seq(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(term, seq) of the body `data[pos:end]` without decoding its payload.

    Recovery only needs these two numbers from most records; decoding every
    payload would make it several times slower. A body is
    `fixarray(3) uint uint payload` (append only takes non-negative ints).
    """
    if end - pos < 3 or data[pos] != _FIXARRAY_3:
        return None
    pos += 1
    out = []
    for _ in range(2):
        b = data[pos]
        if b < 0x80:
            out.append(b)
            pos += 1
        else:
            st = _UINTS.get(b)
            if st is None or pos + 1 + st.size >= end:
                return None
            out.append(st.unpack_from(data, pos + 1)[0])
            pos += 1 + st.size
        if pos >= end:
            return None  # no room left for the payload
    return out[0], out[1]


def _pwrite_all(io: Storage, fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = io.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _pread_exact(io: Storage, path: Path, size: int, offset: int) -> bytes:
    fd = io.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = io.pread(fd, size, offset)
    finally:
        io.close(fd)
    if len(data) != size:
        raise WalCorrupt(path, offset, f"expected {size} bytes, the file has {len(data)}")
    return data


def fsync_dir(path: Path, storage: Storage = OS_STORAGE) -> None:
    storage.fsync_dir(path)


def _encode_hard_state(hs: HardState) -> bytes:
    body = msgpack.packb({"v": 1, "term": hs.term, "commit": hs.commit,
                          "snap_term": hs.snap_term, "snap_seq": hs.snap_seq}, use_bin_type=True)
    return _HEADER.pack(len(body), xxh3_64_intdigest(body)) + body


def _decode_hard_state(path: Path, data: bytes) -> HardState:
    # The file is replaced by rename, so it is never torn: any damage is
    # corruption, and guessing a term would be unsafe.
    if len(data) < HEADER_BYTES:
        raise WalCorrupt(path, 0, "hard state shorter than its header")
    length, digest = _HEADER.unpack_from(data, 0)
    body = data[HEADER_BYTES:]
    if length != len(body) or xxh3_64_intdigest(body) != digest:
        raise WalCorrupt(path, 0, "hard state checksum or length mismatch")
    try:
        obj = _unpack_body(body)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WalCorrupt(path, 0, f"hard state does not decode: {exc}") from exc
    keys = ("term", "commit", "snap_term", "snap_seq")
    if not isinstance(obj, dict) or not all(type(obj.get(k)) is int and obj[k] >= 0 for k in keys):
        raise WalCorrupt(path, 0, f"hard state malformed: {obj!r}")
    if obj["snap_term"] > obj["term"]:
        raise WalCorrupt(path, 0, "hard state snapshot term is above the current term")
    return HardState(term=obj["term"], commit=obj["commit"], snap_term=obj["snap_term"],
                     snap_seq=obj["snap_seq"])


# A filesystem block: what a lost writeback leaves as zeros.
_BLOCK = 4096


def _has_hole(data: bytes, start: int, stop: int) -> bool:
    """Does the bad record in data[start:stop] have an all-zero header or an
    all-zero filesystem block? A write that did not all reach the disk
    leaves them; a record damaged after its sync rarely does, unless its
    payload itself held 4 KiB of aligned zero bytes (the commit-hint check
    in `open()` catches that case for committed records)."""
    if data.count(0, start, start + HEADER_BYTES) == HEADER_BYTES:
        return True
    first = -(-start // _BLOCK) * _BLOCK
    return any(data.count(0, b, b + _BLOCK) == _BLOCK for b in range(first, stop - _BLOCK + 1, _BLOCK))


def _length_damaged(data: bytes, pos: int, digest: int, or_followed: bool = True) -> bool:
    """Is the record at `pos`, whose length disagrees with its body, really complete?

    A torn write leaves a prefix of the record. If instead a whole msgpack
    object starts at the body and matches the checksum, or (`or_followed`) a
    valid record follows it, the record was written completely and its
    length field was damaged afterwards: that is corruption, and the records
    after it were probably fsynced and acknowledged. (A record with a hole
    is followed by valid records whenever later writes reached the disk
    before it: there only the checksum can tell.)
    """
    start = pos + HEADER_BYTES
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data))
    unpacker.feed(data[start:])
    try:
        unpacker.unpack()
    except (ValueError, TypeError, msgpack.UnpackException):
        return False  # OutOfData (a prefix) or garbage: what a torn write leaves
    end = start + unpacker.tell()
    if xxh3_64_intdigest(data[start:end]) == digest:
        return True
    if or_followed and end + HEADER_BYTES <= len(data):
        length, next_digest = _HEADER.unpack_from(data, end)
        next_end = end + HEADER_BYTES + length
        if length and next_end <= len(data) and \
                xxh3_64_intdigest(data[end + HEADER_BYTES:next_end]) == next_digest:
            return True
    return False


class Wal:
    """The write-ahead log of one replica directory. Create with `Wal.open`."""

    def __init__(self, directory: Path, *, fsync: FsyncMode, segment_bytes: int,
                 cache_entries: int, cache_bytes: int, lock_fd: int, storage: Storage) -> None:
        # Private: `Wal.open` takes the directory lock and runs recovery.
        self._dir = directory
        self._io = storage  # every file-system call goes through it
        self._fsync: FsyncMode = fsync
        self._sync_on = fsync != "none"
        self._segment_bytes = segment_bytes
        self._cache_entries = cache_entries
        self._cache_bytes = cache_bytes
        self._lock_fd: int | None = lock_fd
        self._packer = msgpack.Packer(use_bin_type=True)
        self._segments: list[_Segment] = []
        self._fd: int | None = None  # append fd of self._segments[-1]
        self._dirty = False  # written to the active segment since its last fsync
        # (first seq, size) of the active segment at its last fsync (see _drop_unsynced).
        self._synced_at: tuple[int, int] | None = None
        self._hard = HardState()
        self._commit = 0  # in-memory commit hint, >= self._hard.commit
        self._last_seq = 0
        self._last_term = 0
        # Terms as runs: entry seq s has term _run_term[i] for the greatest
        # i with _run_seq[i] <= s (terms never decrease along the log).
        self._run_seq: list[int] = []
        self._run_term: list[int] = []
        # Tail cache: seq -> (entry, encoded record bytes), holding exactly
        # the seqs _cache_lo .. _last_seq (empty when _cache_lo > _last_seq).
        self._cache: dict[int, tuple[Entry, int]] = {}
        self._cache_lo = 1
        self._cache_nbytes = 0
        self._failed: BaseException | None = None
        self._closed = False
        self.recovery = Recovery()

    # ------------------------------------------------------------------ open

    @classmethod
    def open(cls, directory: str | os.PathLike[str], *, fsync: FsyncMode = "batch",
             segment_bytes: int = DEFAULT_SEGMENT_BYTES,
             cache_entries: int = DEFAULT_CACHE_ENTRIES,
             cache_bytes: int = DEFAULT_CACHE_BYTES, storage: Storage = OS_STORAGE) -> Wal:
        """Open (creating if needed) and recover the WAL in `directory`.

        Raises `WalCorrupt` if the log or hard state is damaged beyond a torn
        tail, `WalError` if another `Wal` holds the directory.
        """
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}, got {fsync!r}")
        if segment_bytes < 1 or cache_entries < 0 or cache_bytes < 0:
            raise ValueError("segment_bytes must be >= 1, cache limits >= 0")
        path = Path(directory)
        make_dirs(storage, path, sync=fsync != "none")
        lock_fd = _lock(storage, path)
        wal = cls(path, fsync=fsync, segment_bytes=segment_bytes, cache_entries=cache_entries,
                  cache_bytes=cache_bytes, lock_fd=lock_fd, storage=storage)
        try:
            wal._recover()
        except BaseException:
            wal._release()
            raise
        return wal

    @classmethod
    def recover(cls, directory: str | os.PathLike[str], *, fsync: FsyncMode = "batch",
                segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                cache_entries: int = DEFAULT_CACHE_ENTRIES,
                cache_bytes: int = DEFAULT_CACHE_BYTES,
                storage: Storage = OS_STORAGE) -> tuple[Wal, Recovered]:
        """`open`, and also read the whole log (from the snapshot point on).

        Fine when snapshots keep the log short; for a long log use `open`
        and stream `iter_entries()` instead.
        """
        wal = cls.open(directory, fsync=fsync, segment_bytes=segment_bytes,
                       cache_entries=cache_entries, cache_bytes=cache_bytes, storage=storage)
        try:
            entries = wal.entries(wal.first_seq)
        except BaseException:
            wal.close()
            raise
        return wal, Recovered(hard_state=wal.hard_state, entries=entries, recovery=wal.recovery)

    @staticmethod
    def discard(directory: str | os.PathLike[str], hard_state: HardState | None = None, *,
                fsync: bool = True, storage: Storage = OS_STORAGE) -> None:
        """Delete the log of a corrupt replica so it can re-sync from the leader.

        Keeps the hard-state file (the term must never go back), unless
        `hard_state` is given: then that replaces it — for a damaged
        hard-state file, with a term no lower than any this replica may have
        promised (the group's current term from meta is such a term). The
        snapshot point stays; install the leader's snapshot with `reset`.
        """
        path = Path(directory)
        lock_fd = _lock(storage, path)
        try:
            for _, seg_path in reversed(_list_segments(storage, path)):
                storage.unlink(seg_path)
            if fsync:
                storage.fsync_dir(path)
            if hard_state is not None:
                _write_hard_state_file(storage, path, hard_state, sync=fsync)
        finally:
            storage.close(lock_fd)

    def _recover(self) -> None:
        sync = self._sync_on
        io = self._io
        io.unlink(self._dir / _HARD_STATE_TMP, missing_ok=True)  # a write that never got renamed
        hs_path = self._dir / _HARD_STATE
        hard = _decode_hard_state(hs_path, io.read_bytes(hs_path)) if io.exists(hs_path) else HardState()
        self._hard = hard
        files = _list_segments(io, self._dir)
        tail: deque[tuple[Path, int, int, bytes]] = deque(maxlen=max(self._cache_entries, 1))
        use_cache = self._cache_entries > 0 and self._cache_bytes > 0
        prev_seq: int | None = None  # last seq seen so far
        prev_term = 0
        torn_bytes, torn_segment = 0, None
        segments: list[_Segment] = []
        for index, (first_seq, path) in enumerate(files):
            is_last = index == len(files) - 1
            if prev_seq is None:
                if first_seq > hard.snap_seq + 1:
                    raise WalCorrupt(path, None, f"log starts at seq {first_seq}, after a gap "
                                                 f"from the snapshot at {hard.snap_seq}")
            elif first_seq != prev_seq + 1:
                raise WalCorrupt(path, None, f"expected a segment starting at seq {prev_seq + 1}")
            data = io.read_bytes(path)
            seg = _Segment(first_seq, path)
            n = len(data)
            view = memoryview(data)
            pos = 0
            expect = first_seq
            offsets = seg.offsets
            while pos < n:
                torn = False
                if n - pos < HEADER_BYTES:
                    torn, why = True, "record header cut short"
                else:
                    length, digest = _HEADER.unpack_from(data, pos)
                    end = pos + HEADER_BYTES + length
                    if end > n:
                        torn = not _length_damaged(data, pos, digest)
                        why = "record body cut short" if torn else "record length damaged"
                    elif xxh3_64_intdigest(view[pos + HEADER_BYTES:end]) != digest:
                        # The last record written, maybe followed by space
                        # allocated for more: a write cut short, unless a
                        # damaged length made it swallow the records after it.
                        torn = data.count(0, end) == n - end and not _length_damaged(data, pos, digest)
                        why = "checksum mismatch"
                    else:
                        head = _peek_term_seq(data, pos + HEADER_BYTES, end)
                        if head is None:
                            raise WalCorrupt(path, pos, "checksummed record is not an entry")
                        term, seq = head
                        if seq != expect:
                            raise WalCorrupt(path, pos, f"seq {seq} where {expect} was expected")
                        if term < prev_term:
                            raise WalCorrupt(path, pos, f"term {term} after term {prev_term}")
                        if term > hard.term:
                            raise WalCorrupt(path, pos, f"entry term {term} is above the "
                                                        f"durable current term {hard.term}")
                        offsets.append(pos)
                        if not self._run_term or self._run_term[-1] != term:
                            self._run_seq.append(seq)
                            self._run_term.append(term)
                        if use_cache:
                            # Decoded after the scan, for the entries the cache keeps.
                            tail.append((path, pos, seq, data[pos + HEADER_BYTES:end]))
                        prev_term = term
                        expect += 1
                        pos = end
                        continue
                # A bad record: the end of what was written, a torn tail
                # (cut it off) or corruption.
                written = len(data[pos:].rstrip(b"\0")) if is_last else n - pos
                if written == 0:
                    break  # zeros: space allocated ahead of the writes (or a lost extension)
                rec_end = min(n, end) if n - pos >= HEADER_BYTES else n
                if not torn and is_last and _has_hole(data, pos, rec_end) and \
                        not _length_damaged(data, pos, digest, or_followed=False):
                    # A power loss can leave holes in the last writes: space
                    # allocated ahead reads as zeros until its writeback is
                    # committed, and a later part of a write may reach the
                    # disk first. Nothing after a hole was synced (a sync
                    # covers all that was written before it), so cut there.
                    torn, why = True, "a hole in the last write"
                if not (torn and is_last):
                    raise WalCorrupt(path, pos, why + ("" if is_last else " in a segment that is not the last"))
                if expect <= hard.commit:
                    # The hint is only written once what it covers is synced:
                    # this record reached the disk and was damaged after.
                    raise WalCorrupt(path, pos, f"{why} at seq {expect}, at or below the commit hint {hard.commit}")
                io.truncate(path, pos)
                # The bytes cut: the bad record, and anything written after it
                # (not the free space after that).
                torn_bytes, torn_segment = max(rec_end, pos + written) - pos, path.name
                n = pos
                break
            seg.size = pos
            seg.alloc = n
            if offsets:
                prev_seq = seg.last_seq
            elif not is_last:
                raise WalCorrupt(path, 0, "empty segment that is not the last")
            else:
                prev_seq = first_seq - 1  # an empty last segment (a roll, then a crash)
            segments.append(seg)

        # Finish a compaction that crashed before deleting its segments.
        removed: list[str] = []
        while segments and segments[0].last_seq <= hard.snap_seq:
            seg = segments.pop(0)
            io.unlink(seg.path)
            removed.append(seg.path.name)
        last_seq = segments[-1].last_seq if segments else hard.snap_seq
        self._segments = segments
        self._last_seq = last_seq
        if segments and segments[0].first_seq <= hard.snap_seq:
            # The log still holds the snapshot's own entry: it must agree.
            t = self._run_term_at(hard.snap_seq)
            if t != hard.snap_term:
                raise WalCorrupt(segments[0].path, None, f"entry {hard.snap_seq} has term {t}, "
                                                         f"the snapshot says {hard.snap_term}")
        if last_seq > hard.snap_seq and self._run_term_at(hard.snap_seq + 1) < hard.snap_term:
            raise WalCorrupt(segments[0].path, None, f"entry {hard.snap_seq + 1} has a term below "
                                                     f"the snapshot term {hard.snap_term}")
        self._last_term = self._run_term[-1] if last_seq > hard.snap_seq else hard.snap_term
        self._drop_runs_before(hard.snap_seq)
        self._commit = min(max(hard.commit, hard.snap_seq), last_seq)
        self._hard = replace(hard, commit=self._commit)

        # `tail` ends at the last valid entry; keep what fits the byte budget.
        kept: list[tuple[Entry, int]] = []
        kept_bytes = 0
        for path, pos, seq, body in reversed(tail):
            nbytes = HEADER_BYTES + len(body)
            if seq <= hard.snap_seq or kept_bytes + nbytes > self._cache_bytes:
                break
            entry = _decode_entry(body)
            if entry is None:
                raise WalCorrupt(path, pos, "checksummed record is not an entry")
            kept.append((entry, nbytes))
            kept_bytes += nbytes
        kept.reverse()
        self._cache = {entry.seq: (entry, nbytes) for entry, nbytes in kept}
        self._cache_nbytes = kept_bytes
        self._cache_lo = kept[0][0].seq if kept else last_seq + 1

        if segments:
            self._fd = io.open(segments[-1].path, os.O_WRONLY | os.O_CLOEXEC)
            if sync:
                # Records that survived a SIGKILL may be only in the page cache.
                io.fsync(self._fd)
            self._synced_at = (segments[-1].first_seq, segments[-1].size)
        if sync:
            io.fsync_dir(self._dir)  # deletions above, and a rename a SIGKILL interrupted
        self.recovery = Recovery(torn_bytes=torn_bytes, torn_segment=torn_segment,
                                 removed_segments=tuple(removed), segments=len(segments))

    # ------------------------------------------------------------ properties

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def fsync_mode(self) -> FsyncMode:
        return self._fsync

    @property
    def hard_state(self) -> HardState:
        """The current hard state; `commit` is the in-memory hint."""
        return replace(self._hard, commit=self._commit)

    @property
    def term(self) -> int:
        return self._hard.term

    @property
    def commit(self) -> int:
        return self._commit

    @property
    def snapshot(self) -> tuple[int, int]:
        """(snap_term, snap_seq): the log starts right after this point."""
        return self._hard.snap_term, self._hard.snap_seq

    @property
    def first_seq(self) -> int:
        """Seq of the first entry; `last_seq + 1` when the log is empty."""
        return self._hard.snap_seq + 1

    @property
    def last_seq(self) -> int:
        """Seq of the last entry, or the snapshot seq when the log is empty."""
        return self._last_seq

    @property
    def last_term(self) -> int:
        """Term of the last entry, or the snapshot term when the log is empty."""
        return self._last_term

    @property
    def unsynced(self) -> bool:
        """Whether `sync()` has anything to do."""
        return self._dirty

    def __len__(self) -> int:
        return self._last_seq - self._hard.snap_seq

    def term_at(self, seq: int) -> int | None:
        """The term of entry `seq`; the snapshot term at `snap_seq`.

        None outside `[snap_seq, last_seq]` (compacted, or not there yet).
        """
        if seq == self._hard.snap_seq:
            return self._hard.snap_term
        if seq < self._hard.snap_seq or seq > self._last_seq:
            return None
        return self._run_term_at(seq)

    def _run_term_at(self, seq: int) -> int:
        return self._run_term[bisect_right(self._run_seq, seq) - 1]

    # ----------------------------------------------------------------- write

    @_guarded
    def append(self, records: Iterable[tuple[int, int, Any]]) -> None:
        """Append `(term, seq, payload)` records after the last entry.

        `seq` must continue the log (`last_seq + 1`, then +1 each), `term`
        must not decrease and must not exceed the durable current term
        (persist the term first). The batch is validated and encoded before
        anything is written, so a bad batch (ValueError, or TypeError for a
        payload msgpack cannot encode) leaves the log unchanged. Written with
        one write(2) per segment touched; durable after `sync()` in `batch`
        mode, on return in `always` mode.
        """
        pack = self._packer.pack
        header = _HEADER.pack
        expect = self._last_seq + 1
        prev_term = self._last_term
        max_term = self._hard.term
        encoded: list[tuple[Entry, bytes, bytes]] = []
        for term, seq, payload in records:
            if type(seq) is not int or type(term) is not int:  # bool is an int, but packs as bool
                raise TypeError(f"term and seq must be ints, got {term!r}, {seq!r}")
            if seq != expect:
                raise ValueError(f"append of seq {seq}: the log needs seq {expect} next")
            if term < prev_term:
                raise ValueError(f"append of seq {seq} at term {term} after term {prev_term}")
            if term > max_term:
                raise ValueError(f"append of seq {seq} at term {term}: the durable current term is "
                                 f"{max_term}; set_hard_state(term=...) first")
            body = pack([term, seq, payload])
            if len(body) > _MAX_RECORD:
                raise ValueError(f"entry {seq} is {len(body)} bytes; a record holds at most 4 GiB")
            encoded.append((Entry(term, seq, payload), header(len(body), xxh3_64_intdigest(body)), body))
            prev_term = term
            expect += 1
        if not encoded:
            return

        seg = self._segments[-1] if self._segments else None
        if seg is None:
            seg = self._new_segment(encoded[0][0].seq)
        parts: list[bytes] = []
        batch: list[tuple[Entry, int]] = []
        pos = seg.size
        for entry, head, body in encoded:
            nbytes = HEADER_BYTES + len(body)
            if pos > 0 and pos + nbytes > self._segment_bytes:
                self._write_chunk(seg, parts, batch, pos)
                parts, batch = [], []
                seg = self._roll(entry.seq)
                pos = 0
            seg.offsets.append(pos)  # undone by _write_chunk if the write fails
            parts.append(head)
            parts.append(body)
            batch.append((entry, nbytes))
            pos += nbytes
        self._write_chunk(seg, parts, batch, pos)
        if self._fsync == "always":
            assert self._fd is not None
            self._io.fdatasync(self._fd)
            self._synced()

    def _write_chunk(self, seg: _Segment, parts: list[bytes], batch: list[tuple[Entry, int]],
                     end: int) -> None:
        if not batch:
            return
        assert self._fd is not None and seg is self._segments[-1]
        try:
            if end > seg.alloc:
                self._allocate(seg, end)
            _pwrite_all(self._io, self._fd, b"".join(parts), seg.size)
            seg.alloc = max(seg.alloc, end)
        except OSError:
            del seg.offsets[len(seg.offsets) - len(batch):]
            raise
        self._dirty = True
        seg.size = end
        run_term = self._run_term
        cache = self._cache
        use_cache = self._cache_entries > 0
        for entry, nbytes in batch:
            if not run_term or run_term[-1] != entry.term:
                self._run_seq.append(entry.seq)
                run_term.append(entry.term)
            if use_cache:
                cache[entry.seq] = (entry, nbytes)
                self._cache_nbytes += nbytes
        last = batch[-1][0]
        self._last_seq = last.seq
        self._last_term = last.term
        if use_cache:
            self._evict()
        else:
            self._cache_lo = last.seq + 1

    def _evict(self) -> None:
        cache = self._cache
        while cache and (len(cache) > self._cache_entries or self._cache_nbytes > self._cache_bytes):
            _, nbytes = cache.pop(self._cache_lo)
            self._cache_nbytes -= nbytes
            self._cache_lo += 1
        if not cache:
            self._cache_lo = self._last_seq + 1

    def _new_segment(self, first_seq: int) -> _Segment:
        path = self._dir / segment_name(first_seq)
        # O_EXCL: a leftover file of that name would mean our bookkeeping is wrong.
        self._fd = self._io.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        seg = _Segment(first_seq, path)
        self._segments.append(seg)
        self._synced()
        if self._sync_on:
            self._io.fsync_dir(self._dir)  # the new name must survive for its records to
        return seg

    def _roll(self, first_seq: int) -> _Segment:
        # fsync the full segment before the next one exists: then only the
        # last segment can ever hold a torn tail, and recovery may treat a
        # bad record in any other segment as corruption.
        assert self._fd is not None
        # Only the last segment may end in unwritten space (recovery treats
        # zeros anywhere else as damage).
        self._trim_allocation()
        if self._dirty and self._sync_on:
            self._io.fdatasync(self._fd)
        self._io.close(self._fd)
        self._fd = None
        return self._new_segment(first_seq)

    @_guarded
    def sync(self) -> bool:
        """Make every appended entry durable: one fdatasync (nothing in `none` mode).
        True when it called fdatasync."""
        synced = False
        if self._dirty and self._fd is not None:
            if self._sync_on:
                self._io.fdatasync(self._fd)
                synced = True
            self._synced()
        return synced

    def _synced(self) -> None:
        """What the active segment holds is durable now."""
        self._dirty = False
        seg = self._segments[-1] if self._segments else None
        self._synced_at = (seg.first_seq, seg.size) if seg is not None else None

    def _drop_unsynced(self) -> None:
        """After a disk error: cut the active segment back to what its last
        fsync made durable. A failed fsync leaves the pages it could not
        write in the page cache, marked clean: a process that dies before
        the worker's retry drops them (worker/retry.py) would be followed
        by one that reads them back as its log, and recovery's own fsync
        would not write them. The replica would then count towards a quorum
        for entries no disk holds. Nothing after that size was ever
        acknowledged (the durability contract waits for the fsync), so
        nothing is lost by cutting it; a power loss may still leave a torn
        tail there, which recovery cuts."""
        seg = self._segments[-1] if self._segments else None
        # Only the segment the synced size was taken of: another one (an
        # earlier segment reopened by truncate_after) was synced whole. A
        # write that failed part-way may have left bytes past the segment's
        # size: those go too.
        if self._fd is None or seg is None or self._synced_at is None or self._synced_at[0] != seg.first_seq:
            return
        try:
            if self._io.fsize(self._fd) > self._synced_at[1]:  # never grow a file a truncation cut
                self._io.ftruncate(self._fd, self._synced_at[1])
        except OSError:
            pass  # the disk refuses even that: recovery rescans whatever is there

    @_guarded
    def set_hard_state(self, term: int | None = None, commit: int | None = None) -> None:
        """Raise the current term (durable on return) and/or note the commit hint.

        The term never decreases (ValueError). A new term is written at once
        with fsync of the file and the directory; the commit hint only in
        memory — it is saved with the next hard-state write or `close()`.
        """
        if commit is not None:
            if commit < 0:
                raise ValueError(f"commit {commit} < 0")
            self._commit = max(self._commit, commit)
        if term is not None:
            if term < self._hard.term:
                raise ValueError(f"term {term} is below the current term {self._hard.term}")
            if term > self._hard.term:
                # The hint on disk never runs ahead of the synced log, so that
                # recovery may treat a cut below it as damage (see open()).
                hint = self._hard.commit if self._dirty else self._commit
                self._write_hard_state(replace(self._hard, term=term, commit=hint))

    @_guarded
    def truncate_after(self, seq: int) -> None:
        """Drop every entry with seq > `seq`; durable on return.

        `seq` must be >= the snapshot seq and >= the commit hint: a committed
        entry is never truncated (ValueError — a replica bug, stop).
        """
        if seq < self._hard.snap_seq:
            raise ValueError(f"truncate_after({seq}) reaches into the snapshot at {self._hard.snap_seq}")
        if seq < self._commit:
            raise ValueError(f"truncate_after({seq}) would drop committed entries (commit {self._commit})")
        if seq >= self._last_seq:
            return
        new_last_term = self.term_at(seq)
        assert new_last_term is not None
        keep = bisect_right(self._segments, seq, key=lambda s: s.first_seq)
        drop = self._segments[keep:]
        self._close_fd()
        # Delete from the end so a crash at any point leaves a contiguous prefix.
        for seg in reversed(drop):
            self._io.unlink(seg.path)
        del self._segments[keep:]
        if drop and self._sync_on:
            # Before the cut below: the deleted segments must not come back
            # behind a shortened one.
            self._io.fsync_dir(self._dir)
        if self._segments:
            seg = self._segments[-1]
            index = seq + 1 - seg.first_seq
            self._fd = self._io.open(seg.path, os.O_WRONLY | os.O_CLOEXEC)
            if drop:
                # An earlier segment, synced whole when the log rolled past it.
                self._synced_at = (seg.first_seq, seg.size)
            if index < len(seg.offsets):
                seg.size = seg.offsets[index]
                self._io.ftruncate(self._fd, seg.size)
                seg.alloc = seg.size
                del seg.offsets[index:]
                if self._sync_on:
                    self._io.fsync(self._fd)
            # else: an earlier segment, fsynced when the log rolled past it.
        self._synced()
        cut = bisect_right(self._run_seq, seq)
        del self._run_seq[cut:], self._run_term[cut:]
        self._last_seq = seq
        self._last_term = new_last_term
        while self._cache and next(reversed(self._cache)) > seq:
            _, (_, nbytes) = self._cache.popitem()
            self._cache_nbytes -= nbytes
        self._cache_lo = min(self._cache_lo, seq + 1)

    @_guarded
    def compact_through(self, seq: int) -> None:
        """Forget the log through `seq`, which a plugin snapshot now covers.

        Records the snapshot point `(term_at(seq), seq)` durably in the hard
        state, then deletes the segments whose entries are all <= seq (a
        segment straddling `seq` stays; recovery skips its old entries).
        Call it only after the plugin snapshot at `seq` is durable. `seq`
        must be <= last_seq (use `reset` for a snapshot from the leader that
        is ahead of the log); `seq <= snap_seq` is a no-op.
        """
        if seq <= self._hard.snap_seq:
            return
        if seq > self._last_seq:
            raise ValueError(f"compact_through({seq}) is past the last entry {self._last_seq}; use reset()")
        self.sync()  # the hard state must not describe a log that is not on disk
        snap_term = self.term_at(seq)
        assert snap_term is not None
        self._commit = max(self._commit, seq)
        self._write_hard_state(replace(self._hard, commit=self._commit, snap_term=snap_term, snap_seq=seq))
        # No directory fsync: if a deletion is lost, recovery redoes it.
        while self._segments and self._segments[0].last_seq <= seq:
            seg = self._segments.pop(0)
            if not self._segments:
                self._close_fd()
            self._io.unlink(seg.path)
        self._drop_runs_before(seq)
        while self._cache_lo <= seq and self._cache:
            _, nbytes = self._cache.pop(self._cache_lo)
            self._cache_nbytes -= nbytes
            self._cache_lo += 1
        self._cache_lo = max(self._cache_lo, seq + 1)

    @_guarded
    def reset(self, snap_term: int, snap_seq: int) -> None:
        """Replace the whole log by a snapshot point (a snapshot installed from the leader).

        Deletes every segment (durably) before recording `(snap_term,
        snap_seq)`: a crash in between leaves an empty log at the old
        snapshot point, never old entries behind the new point. The next
        append must be `snap_seq + 1`.
        """
        if snap_term > self._hard.term:
            raise ValueError(f"snapshot term {snap_term} is above the current term {self._hard.term}")
        if snap_seq < 0 or snap_term < 0:
            raise ValueError("negative snapshot point")
        self._close_fd()
        for seg in reversed(self._segments):
            self._io.unlink(seg.path)
        self._segments.clear()
        if self._sync_on:
            self._io.fsync_dir(self._dir)
        self._synced()
        self._commit = snap_seq
        self._write_hard_state(replace(self._hard, commit=snap_seq, snap_term=snap_term, snap_seq=snap_seq))
        self._run_seq.clear()
        self._run_term.clear()
        self._cache.clear()
        self._cache_nbytes = 0
        self._cache_lo = snap_seq + 1
        self._last_seq = snap_seq
        self._last_term = snap_term

    def _write_hard_state(self, hs: HardState) -> None:
        _write_hard_state_file(self._io, self._dir, hs, sync=self._sync_on)
        self._hard = hs

    def _drop_runs_before(self, seq: int) -> None:
        # Keep the run holding `seq` + 1 onwards; earlier runs are compacted.
        cut = bisect_right(self._run_seq, seq + 1) - 1
        if cut > 0:
            del self._run_seq[:cut], self._run_term[:cut]

    # ------------------------------------------------------------------ read

    def entries(self, from_seq: int, to_seq: int | None = None, *,
                max_bytes: int | None = None) -> list[Entry]:
        """Entries `from_seq .. to_seq` (inclusive; to the end if None or past it).

        Stops before exceeding `max_bytes` of encoded records, but returns at
        least one entry. `[]` if `from_seq > last_seq`; `WalCompacted` if
        `from_seq < first_seq` (send the snapshot instead); `WalCorrupt` if
        a record read from disk fails its checksum.
        """
        return list(self.iter_entries(from_seq, to_seq, max_bytes=max_bytes))

    def iter_entries(self, from_seq: int | None = None, to_seq: int | None = None, *,
                     max_bytes: int | None = None) -> Iterator[Entry]:
        """Stream entries like `entries()`, reading disk in chunks of ~4 MiB.

        Do not modify the WAL while iterating.
        """
        if self._failed is not None:
            raise WalFailed(f"WAL failed earlier ({self._failed!r}); reopen it")
        if self._closed:
            raise WalClosed(str(self._dir))
        lo = self.first_seq if from_seq is None else from_seq
        if lo < self.first_seq:
            raise WalCompacted(lo, self.first_seq)
        hi = self._last_seq if to_seq is None else min(to_seq, self._last_seq)
        return self._iter(lo, hi, max_bytes)

    def _iter(self, lo: int, hi: int, max_bytes: int | None) -> Iterator[Entry]:
        budget = max_bytes
        first = True
        seq = lo
        while seq <= hi:
            if seq >= self._cache_lo:
                for s in range(seq, hi + 1):
                    entry, nbytes = self._cache[s]
                    if budget is not None:
                        if nbytes > budget and not first:
                            return
                        budget -= nbytes
                    first = False
                    yield entry
                return
            seg = self._segments[bisect_right(self._segments, seq, key=lambda s: s.first_seq) - 1]
            base = seg.first_seq
            i = seq - base
            j = min(hi, seg.last_seq, self._cache_lo - 1) - base  # last index of this read
            start = seg.offsets[i]
            limit = _READ_CHUNK if budget is None else min(_READ_CHUNK, budget)
            if seg.end_of(j) - start > limit:
                # Largest j' >= i whose records fit in `limit` (at least one record).
                j = max(i, bisect_right(seg.offsets, start + limit, lo=i + 1) - 2)
            data = _pread_exact(self._io, seg.path, seg.end_of(j) - start, start)
            pos = 0
            for k in range(i, j + 1):
                length, digest = _HEADER.unpack_from(data, pos)
                end = pos + HEADER_BYTES + length
                body = data[pos + HEADER_BYTES:end]
                if len(body) != length or xxh3_64_intdigest(body) != digest:
                    raise WalCorrupt(seg.path, start + pos, "checksum mismatch on read")
                entry = _decode_entry(body)
                if entry is None or entry.seq != base + k:
                    raise WalCorrupt(seg.path, start + pos, "record on disk does not match the index")
                nbytes = end - pos
                if budget is not None:
                    if nbytes > budget and not first:
                        return
                    budget -= nbytes
                first = False
                yield entry
                pos = end
            seq = base + j + 1

    # ----------------------------------------------------------------- close

    def close(self) -> None:
        """Sync, save the commit hint, release the directory. Idempotent.

        After a disk error it only releases the files (nothing can be made
        durable any more; recovery sorts it out).
        """
        if self._closed:
            return
        try:
            if self._failed is None:
                try:
                    self._trim_allocation()
                    self.sync()
                    if self._commit > self._hard.commit:
                        self._write_hard_state(replace(self._hard, commit=self._commit))
                except OSError as exc:
                    self._failed = exc
                    raise
        finally:
            self._release()

    def _allocate(self, seg: _Segment, end: int) -> None:
        assert self._fd is not None
        target = max(end, min(seg.alloc + PREALLOC_BYTES, self._segment_bytes))
        try:
            self._io.fallocate(self._fd, seg.alloc, target - seg.alloc)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            # No room to allocate ahead (some may have been): the write
            # itself tells whether the records fit.
            return
        seg.alloc = target

    def _trim_allocation(self) -> None:
        """Give back the space allocated past the records of the active segment."""
        seg = self._segments[-1] if self._segments else None
        if seg is not None and self._fd is not None and \
                (seg.alloc > seg.size or self._io.fsize(self._fd) > seg.size):
            self._io.ftruncate(self._fd, seg.size)
            seg.alloc = seg.size
            self._dirty = True

    def _close_fd(self) -> None:
        if self._fd is not None:
            self._io.close(self._fd)
            self._fd = None

    def _release(self) -> None:
        self._closed = True
        self._close_fd()
        if self._lock_fd is not None:
            self._io.close(self._lock_fd)  # drops the flock
            self._lock_fd = None

    def __enter__(self) -> Wal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Wal({str(self._dir)!r}, fsync={self._fsync!r}, term={self._hard.term}, "
                f"first_seq={self.first_seq}, last_seq={self._last_seq}, segments={len(self._segments)})")


# ---------------------------------------------------------------- helpers


def _list_segments(io: Storage, directory: Path) -> list[tuple[int, Path]]:
    found = []
    for name in io.listdir(directory):
        m = _SEGMENT_RE.match(name)
        if m:
            found.append((int(m.group(1)), directory / name))
    found.sort()
    return found


def _lock(io: Storage, path: Path) -> int:
    # Two processes appending to one log would interleave records: take an
    # exclusive flock for as long as the Wal is open (released with the fd,
    # also when the process dies).
    try:
        return io.lock(path / _LOCK)
    except OSError as exc:
        if exc.errno in LOCK_HELD_ERRNOS:
            raise WalError(f"{path} is in use by another WAL") from exc
        raise


def _write_hard_state_file(io: Storage, directory: Path, hs: HardState, *, sync: bool) -> None:
    tmp = directory / _HARD_STATE_TMP
    fd = io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        write_all(io, fd, _encode_hard_state(hs))
        if sync:
            io.fsync(fd)
    finally:
        io.close(fd)
    io.replace(tmp, directory / _HARD_STATE)
    if sync:
        io.fsync_dir(directory)
