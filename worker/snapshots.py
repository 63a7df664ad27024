"""Snapshot archives of one group replica: write, find, verify, unpack.

A snapshot is the plugin's state at a seq plus the `SnapshotMeta` the
replication core needs (dedup table, configuration). On disk it is one file,
so that a learner can download it with HTTP range requests and resume:

    b"SGSNAP1\n" | u32 header length | msgpack {meta, files: [[name, size]...]} | file bytes...

Its xxh3-128 digest is computed once at write time and kept beside it
(`.xxh3`); its holder publishes it with the replication message that sends a
learner to download it, and the learner verifies the whole file against that
before renaming the temp file into place. Every field of an archive's header
is checked before a plugin sees a byte of it (`_read_header`): it may come
from a peer. Files are written to a temp name, fsynced and
renamed, so a crash leaves either the old snapshot or the new one.

The archives (the snapshot directory) are reached through a `Storage`
(worker/storage.py; the OS by default) so that a simulator can put them on
a disk that models power loss. The plugin's own files are not: they are
scratch directories on the real file system (what `capture()` wrote, what
`restore()` reads), copied into or out of an archive.
"""
from __future__ import annotations

import os
import struct
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType
from typing import Protocol

import xxhash

from shardgrid.common.wire import packb, unpackb
from worker.codec import decode_snapshot_meta, encode_snapshot_meta
from worker.replica_msgs import SnapshotMeta
from worker.storage import OS_STORAGE, Storage, make_dirs, write_all

MAGIC = b"SGSNAP1\n"
_HEADER_LEN = struct.Struct("<I")
_CHUNK = 1 << 20
_SYNC_EVERY = 4 << 20
# An archive's header: its meta (the dedup table, up to dedup_max triples,
# a few MB) and file list. A length past this is damage or a hostile file,
# not a header to read into memory.
MAX_HEADER = 256 << 20
MAX_FILE_NAME = 255
_DIGEST_CHARS = frozenset("0123456789abcdef")


def valid_digest(value: object) -> bool:
    """Is `value` an xxh3-128 hex digest as `file_digest` writes it?"""
    return isinstance(value, str) and len(value) == 32 and set(value) <= _DIGEST_CHARS


def valid_count(value: object) -> bool:
    """A term, seq or size from a peer or a file: a plain non-negative int (not a bool)."""
    return type(value) is int and value >= 0


def check_file_name(name: object) -> str:
    """A plugin file's name from an archive, or SnapshotCorrupt: one plain
    name inside the restore directory, never a path out of it."""
    if not isinstance(name, str) or not name or len(name) > MAX_FILE_NAME or name.startswith(".") \
            or any(c in name for c in ("/", "\\", "\x00")) or name != os.path.basename(name):
        raise SnapshotCorrupt(f"bad file name {str(name)[:80]!r} in snapshot")
    return name


class SnapshotCorrupt(Exception):
    pass


class Restorable(Protocol):
    def restore(self, dir: Path) -> None: ...


@dataclass(frozen=True)
class SnapshotFile:
    path: Path
    seq: int
    term: int
    size: int
    digest: str  # xxh3-128 hex of the whole file


class _ArchiveReader:
    """A sequential reader of one archive through `Storage.pread`.

    Reads only what is asked (at most `_CHUNK` at a time by the callers),
    so a multi-GB archive is never held in memory."""

    def __init__(self, storage: Storage, path: Path) -> None:
        self._io = storage
        self._fd = storage.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._pos = 0
        try:
            self.size = storage.fsize(self._fd)
        except BaseException:
            storage.close(self._fd)
            raise

    def read(self, n: int) -> bytes:
        """Up to `n` bytes (fewer only at the end of the file)."""
        out = []
        while n > 0:
            chunk = self._io.pread(self._fd, n, self._pos)
            if not chunk:
                break
            out.append(chunk)
            self._pos += len(chunk)
            n -= len(chunk)
        return b"".join(out)

    def close(self) -> None:
        self._io.close(self._fd)

    def __enter__(self) -> _ArchiveReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# What Python's open(..., "w"/"wb") passes to open(2); O_CLOEXEC as Python's
# files are non-inheritable.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def _publish_digest(final: Path, digest: str, storage: Storage) -> None:
    """The digest beside `final`, durably. Its presence marks the snapshot
    finished, so it must never be there empty: after a power loss a plain
    write could leave the name with no content, and the snapshot the WAL
    points at would fail its check (a full resync from the leader)."""
    side = final.with_name(final.name + ".xxh3")
    tmp = side.with_name(side.name + ".tmp")
    fd = storage.open(tmp, _CREATE, 0o666)
    try:
        write_all(storage, fd, digest.encode("ascii"))
        storage.fsync(fd)
    finally:
        storage.close(fd)
    storage.replace(tmp, side)
    storage.fsync_dir(final.parent)


def file_digest(path: Path, *, storage: Storage = OS_STORAGE) -> str:
    h = xxhash.xxh3_128()
    with _ArchiveReader(storage, path) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _name(seq: int, term: int) -> str:
    return f"snap-{seq:020d}-{term:010d}.snap"


def write_snapshot(snap_dir: Path, meta: SnapshotMeta, plugin_files: Path, *,
                   storage: Storage = OS_STORAGE) -> SnapshotFile:
    """Pack the plugin's snapshot files (a directory) and `meta` into one archive.

    `plugin_files` is a real directory (read with plain `open`); the archive
    is written to `snap_dir` in `storage`.

    Older snapshots stay until `prune_snapshots`: the WAL's snapshot point
    moves only after this file is durable, and a crash in between must still
    find the snapshot the WAL points at.
    """
    make_dirs(storage, snap_dir)
    names = sorted(p.name for p in plugin_files.iterdir() if p.is_file())
    files = [[n, (plugin_files / n).stat().st_size] for n in names]
    header = packb({"meta": encode_snapshot_meta(meta), "files": files})
    final = snap_dir / _name(meta.seq, meta.term)
    partial = final.with_suffix(".partial")
    h = xxhash.xxh3_128()
    out = storage.open(partial, _CREATE, 0o666)
    try:
        # The small header pieces in one write, as a buffered file did.
        head = MAGIC + _HEADER_LEN.pack(len(header)) + header
        write_all(storage, out, head)
        h.update(head)
        unsynced = 0
        for n in names:
            with open(plugin_files / n, "rb") as src:
                while chunk := src.read(_CHUNK):
                    write_all(storage, out, chunk)
                    h.update(chunk)
                    unsynced += len(chunk)
                    if unsynced >= _SYNC_EVERY:
                        # Synced a few MB at a time: one fsync of tens of MB
                        # holds the disk (and, on ext4, the journal) long
                        # enough to stall every WAL fsync of the machine.
                        storage.fdatasync(out)
                        unsynced = 0
        storage.fsync(out)
    finally:
        storage.close(out)
    digest = h.hexdigest()
    storage.replace(partial, final)
    _publish_digest(final, digest, storage)
    return SnapshotFile(final, meta.seq, meta.term, storage.size(final), digest)


def _glob(storage: Storage, directory: Path, pattern: str) -> list[Path]:
    # Path.glob's match for these patterns (a literal "snap-" prefix, so no
    # hidden files; case-sensitive as on Linux), through `storage`.
    if not storage.is_dir(directory):
        return []
    return [directory / n for n in storage.listdir(directory) if fnmatchcase(n, pattern)]


def prune_snapshots(snap_dir: Path, keep_seq: int, *, storage: Storage = OS_STORAGE) -> None:
    """Delete every snapshot older than `keep_seq` (and stray partial files)."""
    for old in list_snapshots(snap_dir, storage=storage):
        if old.seq < keep_seq:
            remove_snapshot(old, storage=storage)
    # Our own archives' leftovers only: a download in progress (.download-*) is not stray.
    for pattern in ("snap-*.partial", "snap-*.xxh3.tmp"):
        for stray in _glob(storage, snap_dir, pattern):
            storage.unlink(stray, missing_ok=True)


def snapshot_at(snap_dir: Path, seq: int, *, storage: Storage = OS_STORAGE) -> SnapshotFile | None:
    return next((s for s in list_snapshots(snap_dir, storage=storage) if s.seq == seq), None)


def remove_snapshot(s: SnapshotFile, *, storage: Storage = OS_STORAGE) -> None:
    storage.unlink(s.path, missing_ok=True)
    storage.unlink(s.path.with_name(s.path.name + ".xxh3"), missing_ok=True)


def list_snapshots(snap_dir: Path, *, storage: Storage = OS_STORAGE) -> list[SnapshotFile]:
    out: list[SnapshotFile] = []
    for p in _glob(storage, snap_dir, "snap-*.snap"):
        side = p.with_name(p.name + ".xxh3")
        if not storage.exists(side):
            continue  # its digest never made it to disk: not a finished snapshot
        parts = p.stem.split("-")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            continue  # not a name this module writes (_name)
        try:
            digest = storage.read_bytes(side).decode().strip()
            size = storage.size(p)
        except FileNotFoundError:
            # Pruned while we listed (the persist thread installs and prunes
            # while the loop serves a manifest): not a snapshot any more.
            continue
        out.append(SnapshotFile(p, int(parts[1]), int(parts[2]), size, digest))
    return sorted(out, key=lambda s: s.seq)


def latest_snapshot(snap_dir: Path, *, storage: Storage = OS_STORAGE) -> SnapshotFile | None:
    snaps = list_snapshots(snap_dir, storage=storage)
    return snaps[-1] if snaps else None


def read_meta(path: Path, *, storage: Storage = OS_STORAGE) -> SnapshotMeta:
    with _ArchiveReader(storage, path) as f:
        meta, _ = _read_header(f)
    return meta


def _read_header(f: _ArchiveReader) -> tuple[SnapshotMeta, list[tuple[str, int]]]:
    """The archive's meta and its (name, size) files, each checked, or
    SnapshotCorrupt. The file sizes must add up to the archive's length:
    no file reads past its end, and nothing follows the last."""
    if f.read(len(MAGIC)) != MAGIC:
        raise SnapshotCorrupt("not a shardgrid snapshot (bad magic)")
    raw_len = f.read(_HEADER_LEN.size)
    if len(raw_len) != _HEADER_LEN.size:
        raise SnapshotCorrupt("truncated snapshot header")
    (hlen,) = _HEADER_LEN.unpack(raw_len)
    total = f.size
    start = len(MAGIC) + _HEADER_LEN.size
    if hlen > MAX_HEADER or start + hlen > total:
        raise SnapshotCorrupt(f"snapshot header of {hlen} bytes in a file of {total}")
    try:
        header = unpackb(f.read(hlen))
        meta = decode_snapshot_meta(header["meta"])
        raw_files = header["files"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise SnapshotCorrupt(f"unreadable snapshot header: {type(exc).__name__}: {exc}") from None
    _check_meta(meta)
    if not isinstance(raw_files, list):
        raise SnapshotCorrupt("snapshot header: files is not a list")
    files: list[tuple[str, int]] = []
    seen: set[str] = set()
    for item in raw_files:
        if not isinstance(item, list) or len(item) != 2 or not valid_count(item[1]):
            raise SnapshotCorrupt(f"snapshot header: bad file entry {str(item)[:80]}")
        name = check_file_name(item[0])
        if name in seen:
            raise SnapshotCorrupt(f"snapshot header: file {name!r} twice")
        seen.add(name)
        files.append((name, item[1]))
    if start + hlen + sum(size for _, size in files) != total:
        raise SnapshotCorrupt(f"snapshot files add up to {sum(size for _, size in files)} bytes, the archive "
                              f"holds {total - start - hlen} after its header")
    return meta, files


def _check_meta(meta: SnapshotMeta) -> None:
    # ts is log time (worker/replica.py): an int, of any sign.
    if not (valid_count(meta.term) and valid_count(meta.seq) and valid_count(meta.config_seq)
            and type(meta.ts) is int):
        raise SnapshotCorrupt(f"snapshot meta: term, seq, config_seq must be ints >= 0 and ts an int, got "
                              f"{meta.term!r}, {meta.seq!r}, {meta.config_seq!r}, {meta.ts!r}")
    if meta.config_seq > meta.seq:
        raise SnapshotCorrupt(f"snapshot meta: config_seq {meta.config_seq} is past its seq {meta.seq}")
    for rid, seq, ts in meta.dedup:
        if not isinstance(rid, str) or not valid_count(seq) or seq > meta.seq or type(ts) is not int:
            raise SnapshotCorrupt(f"snapshot meta: bad dedup entry {str((rid, seq, ts))[:80]}")
    if meta.config is not None and not all(isinstance(w, str) and w for w in meta.config.voters + meta.config.learners):
        raise SnapshotCorrupt("snapshot meta: a config member is not a worker id")


def restore_snapshot(path: Path, plugin: Restorable, expect_digest: str | None = None,
                     expect_point: tuple[int, int] | None = None, *, storage: Storage = OS_STORAGE,
                     scratch: Path | None = None) -> SnapshotMeta:
    """Verify (when a digest is given), unpack and restore `plugin` from `path`.

    `expect_point`: the (term, seq) the archive must be at (what its name
    and its source said); checked, like every field of the header, before
    the plugin is touched. Raises SnapshotCorrupt.

    The archive is read through `storage`; the plugin's files are unpacked
    into a real temporary directory under `scratch` (default: beside the
    archive, which only exists on the real file system with OS storage)."""
    if expect_digest is not None and file_digest(path, storage=storage) != expect_digest:
        raise SnapshotCorrupt(f"{path.name}: xxh3-128 mismatch")
    with _ArchiveReader(storage, path) as f, \
            tempfile.TemporaryDirectory(dir=scratch or path.parent, prefix=".restore-") as tmp:
        meta, files = _read_header(f)
        if expect_point is not None and (meta.term, meta.seq) != expect_point:
            raise SnapshotCorrupt(f"{path.name} holds the snapshot at (term, seq) ({meta.term}, {meta.seq}), "
                                  f"not {expect_point}")
        for name, size in files:
            with open(Path(tmp) / name, "wb") as out:
                remaining = size
                while remaining:
                    chunk = f.read(min(_CHUNK, remaining))
                    if not chunk:
                        raise SnapshotCorrupt(f"{path.name} is truncated")
                    out.write(chunk)
                    remaining -= len(chunk)
        plugin.restore(Path(tmp))
    return meta


def install_downloaded(snap_dir: Path, partial: Path, term: int, seq: int, digest: str, *,
                       storage: Storage = OS_STORAGE) -> SnapshotFile:
    """Move a verified download into place as this replica's latest snapshot.

    Its bytes are made durable first: the name, made durable with the
    digest beside it, must not outlive them in a power loss (the WAL's
    snapshot point moves to it next, and the replica would have to re-sync
    from nothing)."""
    final = snap_dir / _name(seq, term)
    fd = storage.open(partial, os.O_RDONLY)
    try:
        storage.fsync(fd)
    finally:
        storage.close(fd)
    storage.replace(partial, final)
    _publish_digest(final, digest, storage)
    return SnapshotFile(final, seq, term, storage.size(final), digest)
