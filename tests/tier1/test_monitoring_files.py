"""The Grafana dashboard and Prometheus alert rules shipped in runbook/monitoring/.

Every metric their queries name must be one some process exports (a renamed
metric breaks a panel or silences an alert without a word otherwise), the
rules must be what `promtool check rules` accepts, and the alerts must be
the ones runbook/operations.md suggests.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.support.registries import exposed_names, histogram_names, process_registries

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "runbook" / "monitoring" / "alerts.yaml"
DASHBOARD = ROOT / "runbook" / "monitoring" / "grafana-dashboard.json"
OPERATIONS = ROOT / "runbook" / "operations.md"

# What a PromQL identifier can be besides a metric name: aggregations and
# functions (followed by "("), keywords, and label lists after by/on/....
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w$.:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
             "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    bare = _LABEL_LISTS.sub(" ", _RANGES.sub(" ", _MATCHERS.sub(" ", _STRINGS.sub(" ", expr))))
    return {name for name in _IDENT.findall(bare) if name.lower() not in _KEYWORDS}


def test_metric_names_are_read_out_of_promql() -> None:
    expr = ('histogram_quantile(0.99, sum by (group, le) (rate(shardgrid_group_write_latency_seconds_bucket'
            '{process="worker",route=~"/v1/{gid}"}[$__rate_interval]))) > 1 and on (instance) group_left (role) '
            'shardgrid_build_info or max(shardgrid_meta_revision) - min(x_y offset 5m) > bool 0')
    assert metric_names(expr) == {"shardgrid_group_write_latency_seconds_bucket", "shardgrid_build_info",
                                  "shardgrid_meta_revision", "x_y"}


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in _panels(dash["panels"])
            for target in panel.get("targets", [])]


@pytest.fixture
async def exported(tmp_path: Path) -> set[str]:
    async with process_registries(tmp_path) as regs:
        return set().union(*(exposed_names(reg) for reg in regs.values()))


@pytest.fixture
async def histograms(tmp_path: Path) -> set[str]:
    async with process_registries(tmp_path) as regs:
        return set().union(*(histogram_names(reg) for reg in regs.values()))


async def test_every_metric_the_alerts_and_the_dashboard_query_is_exported(exported: set[str]) -> None:
    queries = [(f"alert {rule['alert']}", rule["expr"]) for rule in _alert_rules()] + _dashboard_exprs()
    assert len(queries) > 30
    missing = {where: sorted(metric_names(expr) - exported) for where, expr in queries
               if metric_names(expr) - exported}
    assert missing == {}
    # The check itself sees names: a query of nothing would pass it.
    assert all(metric_names(expr) for _, expr in queries)


def test_the_alert_rules_are_well_formed() -> None:
    rules = _alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["runbook"].startswith("runbook/")
        assert (ROOT / rule["annotations"]["runbook"].partition("#")[0]).is_file(), rule["alert"]


def test_the_alerts_are_the_ones_operations_md_suggests() -> None:
    text = OPERATIONS.read_text()
    section = text[text.index("### Suggested alerts"):text.index("## Log events worth knowing")]
    assert set(re.findall(r"`(Shardgrid[A-Za-z]+)`", section)) == {rule["alert"] for rule in _alert_rules()}
    assert "monitoring/alerts.yaml" in section
    # The table's expression of each alert is the rule's (spacing aside).
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(Shardgrid\w+)` \| `([^`]+)`", section, re.M)}
    assert table == {rule["alert"]: " ".join(rule["expr"].split()) for rule in _alert_rules()}


def test_the_dashboard_is_grafana_json_with_unique_panel_ids() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = list(_panels(dash["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_promtool_accepts_the_alert_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in done.stdout


def test_revision_alerts_compare_against_an_earlier_value() -> None:
    # Two revisions scraped at different moments differ while meta commits (several times
    # a second in a catch-up): comparing them as they are alerts on no lag at all.
    rules = {rule["alert"]: " ".join(rule["expr"].split()) for rule in _alert_rules()}
    for name, expr in rules.items():
        if len(re.findall(r"_revision\b", expr)) > 1:
            assert "offset" in expr, name


def _promtool_case(series: dict[str, str], alerts: dict[str, str | None]) -> dict[str, Any]:
    """A `promtool test rules` case: `series` (name{labels} -> values), and per alert the
    $value it fires with at 8m (None: it must not fire)."""
    by_name = {rule["alert"]: rule for rule in _alert_rules()}
    tests = []
    for name, value in alerts.items():
        rule = by_name[name]
        exp = [] if value is None else [{
            "exp_labels": dict(rule["labels"]),
            "exp_annotations": {k: v.replace("{{ $value }}", value) for k, v in rule["annotations"].items()}}]
        tests.append({"eval_time": "8m", "alertname": name, "exp_alerts": exp})
    return {"interval": "15s", "input_series": [{"series": k, "values": v} for k, v in series.items()],
            "alert_rule_test": tests}


def test_promtool_revision_alerts_ignore_scrape_skew_and_catch_a_stuck_node(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    behind = ("ShardgridMetaNodeBehind", "ShardgridGatewayRoutingBehind")
    cases = [
        # Meta commits 10 revisions per 15 s scrape; m2 and the gateway are scraped a moment
        # before m1, so they always read a few behind: in step, no alert.
        _promtool_case({'shardgrid_meta_revision{instance="m1"}': "100+10x40",
                        'shardgrid_meta_revision{instance="m2"}': "95+10x40",
                        'shardgrid_gateway_routing_revision{instance="g1"}': "92+10x40"},
                       {name: None for name in behind}),
        # m3 and the gateway stopped following: both alerts fire.
        _promtool_case({'shardgrid_meta_revision{instance="m1"}': "100+10x40",
                        'shardgrid_meta_revision{instance="m3"}': "50x40",
                        'shardgrid_gateway_routing_revision{instance="g1"}': "60x40"},
                       {"ShardgridMetaNodeBehind": "50", "ShardgridGatewayRoutingBehind": "60"}),
    ]
    spec = tmp_path / "revision-alerts.test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "15s", "tests": cases}))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


CI_RUN = ROOT / ".ci" / "run"


def _ci_promtool_step(tmp_path: Path, apt_updated: str | None, update_code: int) -> tuple[int, str, list[str]]:
    """.ci/run's optional promtool step, run alone under its `set -euo pipefail` with a
    stub apt-get (its update exits `update_code`, its download finds nothing) and no
    promtool on PATH. Returns the exit code, stderr and the apt-get calls."""
    text = CI_RUN.read_text()
    step = text[text.index("# `promtool check rules`"):text.index("# Everything the suite starts is reaped")]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls"
    (stubs / "apt-get").write_text(f'#!/bin/sh\necho "$1" >> {calls}\n[ "$1" = update ] && exit {update_code}\n'
                                   'echo "E: Unable to locate package prometheus" >&2; exit 100\n')
    (stubs / "apt-get").chmod(0o755)
    for tool in ("mktemp", "rm"):  # the step's only other commands; PATH holds nothing else
        found = shutil.which(tool)
        assert found is not None
        (stubs / tool).symlink_to(found)
    prelude = "set -euo pipefail\n" + (f"APT_UPDATED={apt_updated}\n" if apt_updated is not None else "")
    done = subprocess.run(["/bin/bash", "-c", prelude + step + "echo reached the test run\n"],
                          env={"PATH": str(stubs)}, capture_output=True, text=True, timeout=30)
    assert "reached the test run" in done.stdout or done.returncode != 0
    return done.returncode, done.stderr, calls.read_text().split() if calls.exists() else []


def test_ci_promtool_step_is_optional_even_when_apt_get_update_fails(tmp_path: Path) -> None:
    code, err, calls = _ci_promtool_step(tmp_path, "0", update_code=100)
    assert code == 0, err  # CI goes on to the tests
    assert calls == ["update"] and "promtool not installed" in err


def test_ci_promtool_step_does_not_update_twice(tmp_path: Path) -> None:
    code, err, calls = _ci_promtool_step(tmp_path, "1", update_code=0)
    assert code == 0 and calls == ["download"]  # the first block's update serves this step too


# Names the runbook mentions only to say what replaced them.
RETIRED = {"shardgrid_group_write_latency_p99_ms", "shardgrid_group_leader_silence_ms"}


async def test_every_metric_the_runbook_names_is_exported(exported: set[str], histograms: set[str]) -> None:
    named: dict[str, set[str]] = {}
    for doc in sorted((ROOT / "runbook").glob("*.md")):
        for name in re.findall(r"\b(shardgrid_[a-z0-9_]*[a-z0-9])\b", doc.read_text()):
            named.setdefault(name, set()).add(doc.name)
    assert len(named) > 30
    unknown = {name: sorted(docs) for name, docs in named.items() if name not in exported | histograms | RETIRED}
    assert unknown == {}


def test_the_runbook_says_the_write_latency_histogram_misses_timed_out_calls() -> None:
    # worker/group.py observes a call only once it acknowledged a write: a group that stops
    # committing shows no tail in the histogram, and an operator reading only it would miss that.
    row = next(line for line in OPERATIONS.read_text().splitlines()
               if line.startswith("| `shardgrid_group_write_latency_seconds`"))
    assert "finished calls only" in row and "error counters" in row
