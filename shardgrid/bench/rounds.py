"""How much of a replication round each acknowledged write paid for (`shardgrid bench`).

A worker's CPU goes mostly to rounds, not to records: a group loop pass, a
frame to each peer, an fsync. How many writes share each of those is what
moves the CPU per write (runbook/benchmarking.md). The workers count them
(`shardgrid_worker_passes_total` and friends on `/metrics`); the benchmark
reads the counters of every worker when it samples CPU and reports the
difference per acknowledged write.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

# Report key -> Prometheus sample name (summed over labels and workers).
COUNTERS = {
    "passes": "shardgrid_worker_passes_total",
    "events": "shardgrid_worker_events_total",
    "peer_messages": "shardgrid_worker_peer_messages_total",
    "peer_frames": "shardgrid_worker_peer_frames_total",
    "fsyncs": "shardgrid_wal_sync_seconds_count",
}
SCRAPE_TIMEOUT_S = 2.0


def parse_counters(text: str) -> dict[str, float]:
    """The `COUNTERS` found in a Prometheus text exposition, each summed over its label sets."""
    wanted = {name: key for key, name in COUNTERS.items()}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        key = wanted.get(name)
        if key is None:
            continue
        try:
            found[key] = found.get(key, 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    return found


class WorkerCounters:
    """Samples the round counters of every worker of a cluster."""

    def __init__(self, metrics_urls: list[str]) -> None:
        self.urls = metrics_urls

    def sample(self) -> dict[str, float] | None:
        """The counters summed over the workers; None if any worker did not answer (no report then)."""
        total: dict[str, float] = {}
        for url in self.urls:
            try:
                with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
                    text = resp.read().decode("utf-8", "replace")
            except (urllib.error.URLError, OSError, ValueError):
                return None
            for key, value in parse_counters(text).items():
                total[key] = total.get(key, 0.0) + value
        return total


def rounds_report(before: dict[str, float] | None, after: dict[str, float] | None,
                  acked_writes: int) -> dict[str, Any] | None:
    """Per acknowledged write: passes, peer messages and frames, fsyncs; and events per pass."""
    if before is None or after is None or not acked_writes:
        return None
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in COUNTERS}
    if any(v < 0 for v in delta.values()):
        return None  # a worker restarted meanwhile: its counters began again
    per = {f"{key}_per_write": round(v / acked_writes, 3) for key, v in delta.items() if key != "events"}
    per["events_per_pass"] = round(delta["events"] / delta["passes"], 2) if delta["passes"] else None
    per["totals"] = {k: int(v) for k, v in delta.items()}
    return per


def format_rounds(r: dict[str, Any]) -> str:
    events = f" ({r['events_per_pass']:.1f} events each)" if r["events_per_pass"] is not None else ""
    return (f"  rounds       per acknowledged write, all workers: {r['passes_per_write']:.2f} group-loop passes"
            f"{events}, {r['peer_messages_per_write']:.2f} peer messages in {r['peer_frames_per_write']:.2f} frames, "
            f"{r['fsyncs_per_write']:.2f} WAL fsyncs")
