"""Every metric each process exports follows Prometheus's naming conventions
(https://prometheus.io/docs/practices/naming/), so that a gauge of p99 in ms
or a counter without `_total` fails here rather than in a dashboard."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from tests.support.registries import families, process_registries

SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
# Families prometheus_client's own collectors export under their standard names.
STANDARD_PREFIXES = ("process_", "python_")
# Units other than the base ones (seconds, bytes), and what a latency gauge would be named after.
NON_BASE_UNITS = {"ms", "msec", "millis", "milliseconds", "us", "usec", "micros", "microseconds", "ns",
                  "nanoseconds", "minutes", "hours", "days", "kb", "kib", "mb", "mib", "gb", "gib", "percent"}
QUANTILE_WORDS = {"p50", "p90", "p95", "p99", "p999", "median", "quantile", "avg", "ema"}
# A family whose name says it measures time must say the unit: seconds.
TIME_WORDS = {"latency", "duration", "silence", "delay", "elapsed", "wait", "time", "age", "uptime"}
UNITS = {"seconds", "bytes"}


def violations(family: Metric) -> list[str]:
    """What is wrong with one family's name, type and samples (empty: nothing)."""
    name, kind = family.name, family.type
    words = name.split("_")
    bad: list[str] = []
    if not SNAKE.fullmatch(name):
        bad.append("not snake_case")
    if not name.startswith("shardgrid_") and not name.startswith(STANDARD_PREFIXES):
        bad.append("no shardgrid_ prefix")
    if NON_BASE_UNITS & set(words):
        bad.append(f"a non-base unit ({', '.join(sorted(NON_BASE_UNITS & set(words)))}): use seconds or bytes")
    if QUANTILE_WORDS & set(words):
        bad.append("a precomputed statistic: export a histogram and let queries take quantiles")
    if TIME_WORDS & set(words) and "seconds" not in words:
        bad.append("measures time without saying seconds")
    for unit in UNITS & set(words):
        if words[-1] != unit and not (kind == "counter" and words[-2:] == [unit, "total"]):
            bad.append(f"the unit ({unit}) is not the name's suffix")
    if kind != "counter" and name.endswith(("_total", "_count", "_sum", "_bucket")):
        bad.append(f"a {kind} named like a counter or histogram series")
    if kind not in ("counter", "gauge", "histogram", "info"):
        bad.append(f"type {kind}: summaries cannot be aggregated across processes")
    if not family.documentation.strip():
        bad.append("no HELP text")
    for sample in family.samples:
        if kind == "counter" and not sample.name.endswith(("_total", "_created")):
            bad.append(f"counter sample {sample.name} does not end in _total")
        for label in sample.labels:
            if not SNAKE.fullmatch(label):
                bad.append(f"label {label!r} is not snake_case")
    if name.endswith("_info") and kind == "gauge":
        if any(s.value != 1 for s in family.samples):
            bad.append("an _info gauge whose value is not 1")
    return bad


@pytest.fixture
async def registries(tmp_path: Path) -> Any:
    async with process_registries(tmp_path) as regs:
        yield regs


async def test_every_family_of_every_process_follows_the_conventions(registries: Any) -> None:
    problems = {f"{role}: {family.name} ({family.type})": bad
                for role, reg in registries.items() for family in families(reg)
                if (bad := violations(family))}
    assert problems == {}


async def test_a_name_has_one_type_in_every_process(registries: Any) -> None:
    kinds: dict[str, set[str]] = {}
    for reg in registries.values():
        for family in families(reg):
            kinds.setdefault(family.name, set()).add(family.type)
    assert {name: k for name, k in kinds.items() if len(k) > 1} == {}


async def test_every_process_exports_build_info_and_the_process_and_gc_collectors(registries: Any) -> None:
    for role, reg in registries.items():
        text = generate_latest(reg).decode()
        [build] = [line for line in text.splitlines() if line.startswith("shardgrid_build_info{")]
        assert f'role="{role}"' in build and 'version="' in build and 'version=""' not in build
        assert build.endswith(" 1.0")
        names = {family.name for family in families(reg)}
        assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds",
                "python_gc_collections", "python_info"} <= names, (role, sorted(names))


def test_the_rules_catch_what_they_are_for() -> None:
    """A future `_ms` gauge, a p99 gauge or a counter-looking gauge fails the test above."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    Gauge("shardgrid_group_leader_silence_ms", "ms", ["group"], registry=reg)
    Gauge("shardgrid_group_write_latency_p99_seconds", "p99", registry=reg)
    Gauge("shardgrid_worker_requests_total", "a gauge", registry=reg)
    Histogram("shardgrid_write_latency", "no unit", registry=reg)
    Counter("worker_passes", "no prefix", registry=reg)
    Gauge("shardgrid_queue_bytes_free", "unit inside", registry=reg)
    Gauge("shardgrid_wal_sync_seconds_last", "the unit not last", registry=reg)
    Histogram("shardgrid_wal_sync_seconds", "fine", registry=reg)
    bad = {family.name: violations(family) for family in reg.collect()}
    assert bad.pop("shardgrid_wal_sync_seconds") == []
    assert all(bad.values()), bad
