"""Latency histograms and counters of `shardgrid bench`, and their merge across processes.

Latencies are recorded in microseconds into HdrHistograms (1 µs .. 120 s, 3
significant digits: any percentile is within 0.1 % of the true value). Each
generator process records into per-kind *interval* histograms and, once a
second, ships them as a `tick` (a plain dict: counters plus the histograms'
compressed base64 encoding) to the parent, then starts new ones. The parent
merges the ticks of every process: second k's line of the progress output is
the merge of every process's tick k, and the run's totals are the merge of
every tick after the warm-up. Merging is exact: an HdrHistogram merge adds
bucket counts, so percentiles of the merge are those of one histogram that
saw every value.

Only successful operations are recorded in the latency histograms; failures
are counted by error code (a fast 503 must not make p99 look better).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 120_000_000
SIG_FIGS = 3
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIG_FIGS)


def record_us(hist: HdrHistogram, us: int) -> None:
    hist.record_value(LOWEST_US if us < LOWEST_US else HIGHEST_US if us > HIGHEST_US else us)


def encode(hist: HdrHistogram) -> str:
    return hist.encode().decode("ascii")


def decode(encoded: str) -> HdrHistogram:
    hist = new_histogram()
    hist.decode_and_add(encoded.encode("ascii"))
    return hist


def merge_into(target: HdrHistogram, encoded: str | HdrHistogram) -> HdrHistogram:
    if isinstance(encoded, HdrHistogram):
        target.add(encoded)
    else:
        target.decode_and_add(encoded.encode("ascii"))
    return target


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def latency_summary(hist: HdrHistogram) -> dict[str, Any]:
    """count, mean, p50/p90/p99/p99.9 and max in milliseconds (None when empty)."""
    n = hist.get_total_count()
    if n == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "p999": None, "max": None}
    pct = hist.get_percentile_to_value_dict(list(PERCENTILES))
    return {"count": n, "mean": _ms(hist.get_mean_value()), "p50": _ms(pct[50.0]), "p90": _ms(pct[90.0]),
            "p99": _ms(pct[99.0]), "p999": _ms(pct[99.9]), "max": _ms(hist.get_max_value())}


def _add_counts(target: dict[str, int], source: dict[str, int] | None) -> None:
    if source:
        for code, n in source.items():
            target[code] = target.get(code, 0) + n


@dataclass(slots=True)
class KindStats:
    """What one process saw of one operation kind during one interval (the hot-path recorder)."""

    ok: int = 0
    records: int = 0  # records acknowledged: 1 per single op, the successful writes of a /batch
    misses: int = 0  # reads/deletes answered 404: served, counted as ok
    errors: dict[str, int] = field(default_factory=dict)
    record_errors: dict[str, int] = field(default_factory=dict)  # per-write errors inside a 200 /batch
    hist: HdrHistogram = field(default_factory=new_histogram)

    def to_wire(self) -> dict[str, Any]:
        return {"ok": self.ok, "records": self.records, "misses": self.misses, "errors": dict(self.errors),
                "record_errors": dict(self.record_errors), "hist": encode(self.hist)}


@dataclass
class KindTotals:
    """The merge of many KindStats (from ticks of many processes)."""

    ok: int = 0
    records: int = 0
    misses: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    record_errors: dict[str, int] = field(default_factory=dict)
    hist: HdrHistogram = field(default_factory=new_histogram)

    def add_wire(self, w: dict[str, Any]) -> None:
        self.ok += w["ok"]
        self.records += w["records"]
        self.misses += w["misses"]
        _add_counts(self.errors, w["errors"])
        _add_counts(self.record_errors, w["record_errors"])
        merge_into(self.hist, w["hist"])

    def add(self, other: "KindTotals") -> None:
        self.ok += other.ok
        self.records += other.records
        self.misses += other.misses
        _add_counts(self.errors, other.errors)
        _add_counts(self.record_errors, other.record_errors)
        self.hist.add(other.hist)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def merge_ticks(ticks: list[dict[str, Any]]) -> dict[str, KindTotals]:
    """Per kind, the merge of the given ticks (of any processes and seconds)."""
    out: dict[str, KindTotals] = {}
    for tick in ticks:
        for kind, w in tick["kinds"].items():
            out.setdefault(kind, KindTotals()).add_wire(w)
    return out


def overall(kinds: dict[str, KindTotals]) -> KindTotals:
    total = KindTotals()
    for k in kinds.values():
        total.add(k)
    return total
