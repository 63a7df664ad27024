"""CPU accounting of the cluster under test, from /proc/PID/stat.

The figure `shardgrid bench` reports is CPU time of the whole cluster per
acknowledged write: the sum of utime + stime (fields 14 and 15 of
/proc/PID/stat, in clock ticks, all threads of the process) of every cluster
process, after the run minus before it, divided by the writes the cluster
acknowledged in between. Descendants of the named processes are included
(a process started through a wrapper is still counted).

Where the PIDs come from:
- `--cluster local`: the children LocalCluster (or the local etcd) started;
- `--cluster-pids-from DIR`: every `*.pid` file in DIR (one PID per file,
  the file's stem is the name reported);
- `--cluster-pids 12,34`: explicit PIDs;
- `--cluster-pgrep REGEX`: every process whose command line matches (like
  `pgrep -f`), except this benchmark, its ancestors and its descendants.

A process that exits during the run takes its CPU time with it: it is
reported under `gone` and the total is then a lower bound.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    ppid: int
    utime: int  # clock ticks
    stime: int

    @property
    def ticks(self) -> int:
        return self.utime + self.stime


def parse_stat(text: str) -> ProcStat:
    """Parse one /proc/PID/stat line. comm is in parentheses and may hold spaces and ')'."""
    lpar, rpar = text.index("("), text.rindex(")")
    pid = int(text[:lpar].strip())
    comm = text[lpar + 1:rpar]
    rest = text[rpar + 1:].split()
    # rest[0] is field 3 (state): field n is rest[n - 3]
    return ProcStat(pid=pid, comm=comm, ppid=int(rest[1]), utime=int(rest[11]), stime=int(rest[12]))


class ProcReader:
    """Reads /proc (or a fake tree with the same layout, for tests)."""

    def __init__(self, root: str | Path = "/proc", clk_tck: int | None = None) -> None:
        self.root = Path(root)
        self.clk_tck = clk_tck or os.sysconf("SC_CLK_TCK")

    def stat(self, pid: int) -> ProcStat | None:
        try:
            return parse_stat((self.root / str(pid) / "stat").read_text())
        except (OSError, ValueError, IndexError):
            return None

    def pids(self) -> list[int]:
        try:
            return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit())
        except OSError:
            return []

    def cmdline(self, pid: int) -> str:
        try:
            return (self.root / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return ""

    def all_stats(self) -> dict[int, ProcStat]:
        out = {}
        for pid in self.pids():
            st = self.stat(pid)
            if st is not None:
                out[pid] = st
        return out


def descendants(stats: dict[int, ProcStat], roots: set[int]) -> set[int]:
    """Every process below `roots` (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found and c not in roots:
                found.add(c)
                todo.append(c)
    return found


def ancestors(stats: dict[int, ProcStat], pid: int) -> set[int]:
    out: set[int] = set()
    while pid in stats and pid not in out:
        out.add(pid)
        pid = stats[pid].ppid
    return out


def role_of(name: str) -> str:
    """m1 -> meta, w2 -> worker, g1 -> gateway, e3 -> etcd; else the name without its digits."""
    base = name.split("/", 1)[0].split(":", 1)[0]
    short = {"m": "meta", "w": "worker", "g": "gateway", "e": "etcd"}
    stem = base.rstrip("0123456789")
    return short[stem] if stem in short and stem != base else base


class CpuAccount:
    """CPU ticks of a set of processes (and their descendants) at two moments."""

    def __init__(self, pids: dict[int, str], reader: ProcReader | None = None, include_descendants: bool = True):
        if not pids:
            raise ValueError("no cluster processes to account CPU for")
        self.roots = dict(pids)
        self.reader = reader or ProcReader()
        self.include_descendants = include_descendants

    def sample(self) -> dict[int, tuple[str, int]]:
        """pid -> (name, utime + stime ticks) for every root still alive and its descendants."""
        out: dict[int, tuple[str, int]] = {}
        if self.include_descendants:
            stats = self.reader.all_stats()
            for pid, name in self.roots.items():
                if pid in stats:
                    out[pid] = (name, stats[pid].ticks)
                    for d in sorted(descendants(stats, {pid})):
                        if d in self.roots:
                            continue
                        out[d] = (f"{name}/{stats[d].comm}:{d}", stats[d].ticks)
        else:
            for pid, name in self.roots.items():
                st = self.reader.stat(pid)
                if st is not None:
                    out[pid] = (name, st.ticks)
        return out

    def report(self, before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, Any]:
        """CPU seconds between two samples: total, per process, per role; processes that vanished."""
        hz = self.reader.clk_tck
        procs = []
        for pid, (name, ticks) in sorted(after.items(), key=lambda kv: kv[1][0]):
            start = before.get(pid, (name, 0))[1]  # a process born during the run counts from 0
            procs.append({"pid": pid, "name": name, "cpu_s": round((ticks - start) / hz, 3)})
        gone = [{"pid": pid, "name": name} for pid, (name, _) in sorted(before.items()) if pid not in after]
        by_role: dict[str, float] = {}
        for p in procs:
            r = role_of(p["name"])
            by_role[r] = round(by_role.get(r, 0.0) + p["cpu_s"], 3)
        total = sum((after[p][1] - before.get(p, ("", 0))[1]) for p in after) / hz
        return {"cpu_s": round(total, 3), "by_role": by_role, "processes": procs, "gone": gone,
                "clk_tck": hz, "lower_bound": bool(gone)}


def pids_from_dir(path: str | Path) -> dict[int, str]:
    """`*.pid` files in `path`: pid -> the file's stem."""
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"--cluster-pids-from {d}: not a directory")
    out: dict[int, str] = {}
    for f in sorted(d.glob("*.pid")):
        text = f.read_text().strip()
        if not text.isdigit():
            raise ValueError(f"{f}: expected one PID, got {text[:40]!r}")
        out[int(text)] = f.stem
    if not out:
        raise ValueError(f"--cluster-pids-from {d}: no *.pid files there")
    return out


def pids_from_list(spec: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"--cluster-pids: {part!r} is not a PID")
        out[int(part)] = f"pid{part}"
    return out


def pids_from_pattern(pattern: str, reader: ProcReader | None = None, me: int | None = None) -> dict[int, str]:
    """Processes whose command line matches `pattern` (a regex), not this process's own tree.

    Named by the matching process's comm plus its pid.
    """
    reader = reader or ProcReader()
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"--cluster-pgrep {pattern!r}: bad regular expression: {exc}") from None
    me = os.getpid() if me is None else me
    stats = reader.all_stats()
    exclude = ancestors(stats, me) | descendants(stats, {me}) | {me}
    out: dict[int, str] = {}
    for pid, st in stats.items():
        if pid in exclude:
            continue
        if rx.search(reader.cmdline(pid)):
            out[pid] = f"{st.comm}:{pid}"
    # A matching process's matching children are counted as its descendants, not twice.
    nested = {pid for pid in out if (ancestors(stats, stats[pid].ppid) & set(out))}
    return {pid: name for pid, name in out.items() if pid not in nested}
