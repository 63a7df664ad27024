"""topoctl as a command line: exit codes by verdict, --wait-for, -o table|json|yaml,
global options on both sides of the verb, --version, bash completion."""
from __future__ import annotations

import copy
import json
import subprocess
from typing import Any

import pytest
import yaml

from meta.client import MetaUnreachable
from shardgrid import topoctl
from shardgrid.common.identity import package_version
from tests.tier1.test_health import healthy


class FakeClient:
    """What the verbs under test ask meta for, with canned answers."""

    def __init__(self, ops: dict[str, Any] | None = None, topology: str = "") -> None:
        self.ops = ops or {}
        self.topology = topology
        self.calls: list[tuple[str, str]] = []

    async def __aenter__(self) -> "FakeClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        self.calls.append((method, path))
        if path == "/v1/operators":
            return {"operators": self.ops}
        if path.endswith("/transfer"):
            return {"changed": True, "old_leader": "w1", "old_term": 3, "new_leader": "w2", "new_term": 4}
        raise AssertionError(path)

    async def get_topology(self) -> tuple[str, int]:
        return self.topology, 4


@pytest.fixture
def statuses(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The statuses gather_status returns, one per call (the last one repeats); an
    exception in the list is raised instead."""
    seq: list[Any] = []

    async def gather(client: Any) -> dict[str, Any]:
        item = seq.pop(0) if len(seq) > 1 else seq[0]
        if isinstance(item, BaseException):
            raise item
        return copy.deepcopy(item)

    monkeypatch.setattr(topoctl, "gather_status", gather)
    monkeypatch.setattr(topoctl, "_client", lambda args, **kw: FakeClient())
    monkeypatch.setattr(topoctl, "WAIT_FOR_POLL_S", 0.01)
    return seq


def yellow() -> dict[str, Any]:
    st = healthy()
    st["groups"]["1"]["voters"] = ["w1", "w2"]  # under-replicated
    return st


def red() -> dict[str, Any]:
    st = healthy()
    st["groups"]["0"].update(leader=None, ready=False)
    return st


@pytest.mark.parametrize("make, code, first", [(healthy, 0, "green"), (yellow, 5, "yellow"), (red, 6, "red")])
def test_status_exits_by_verdict_and_opens_with_it(statuses: list[Any], capsys: pytest.CaptureFixture[str],
                                                    make: Any, code: int, first: str) -> None:
    statuses.append(make())
    assert topoctl.main(["status"]) == code
    out = capsys.readouterr().out.splitlines()
    assert out[0].split(":")[0] == first
    if code:
        assert out[1].split()[0] == first and "group" in out[1]  # why, right under it


def test_verdict_exit_codes_collide_with_no_other_exit_code() -> None:
    others = {0, topoctl.EXIT_REJECTED, 2, topoctl.EXIT_UNREACHABLE, topoctl.EXIT_NOT_CONVERGED}
    assert topoctl.VERDICT_EXIT[topoctl.Verdict.GREEN] == 0
    assert {topoctl.EXIT_YELLOW, topoctl.EXIT_RED} & others == set() and topoctl.EXIT_YELLOW != topoctl.EXIT_RED


def test_status_shows_each_replicas_lag(statuses: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    st = healthy(groups=1)
    st["workers"]["w1"]["report"]["groups"]["0"].update(last_seq=120, commit=118, applied=118)
    st["workers"]["w2"]["report"]["groups"]["0"].update(commit=118, applied=110)
    statuses.append(st)
    topoctl.main(["status"])
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("GROUP ") and "APPLY-LAG" in ln)
    rows = {ln.split()[1]: ln.split() for ln in lines[start + 1:start + 4]}
    assert rows["w1"] == ["0", "w1", "leader", "ok", "118", "118", "0", "2"]
    assert rows["w2"] == ["0", "w2", "voter", "ok", "118", "110", "8", "2"]
    assert rows["w3"][4:] == ["100", "100", "0", "20"]


def test_status_json_and_yaml_carry_the_same_data_and_the_verdict(statuses: list[Any],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    st = yellow()
    st["groups"] = {int(k): v for k, v in st["groups"].items()}  # as meta builds it: int keys
    statuses.append(st)
    assert topoctl.main(["status", "-o", "json"]) == 5
    as_json = json.loads(capsys.readouterr().out)
    assert topoctl.main(["status", "-o", "yaml"]) == 5
    as_yaml = yaml.safe_load(capsys.readouterr().out)
    assert as_json == as_yaml
    health = as_json.pop("health")
    assert as_json == json.loads(json.dumps({**st, "groups": {str(k): v for k, v in st["groups"].items()}}))
    assert health["verdict"] == "yellow"
    assert [(r["subject"], r["kind"]) for r in health["reasons"]] == [("group 1", "under-replicated")]
    assert topoctl.main(["status", "--json"]) == 5  # the old spelling
    assert json.loads(capsys.readouterr().out)["health"]["verdict"] == "yellow"


def test_wait_for_green_prints_each_change_once_and_exits_0_when_reached(
        statuses: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    statuses.extend([red(), red(), MetaUnreachable("m1 down"), yellow(), yellow(), healthy()])
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "30"]) == 0
    out = capsys.readouterr().out.splitlines()
    verdicts = [ln.split("] ")[1].split(":")[0] for ln in out if ln.startswith("[") and "] " in ln
                and not ln.split("] ")[1].startswith(" ")]
    assert verdicts == ["red", "meta did not answer", "yellow", "green"]


def test_wait_for_yellow_takes_green_too(statuses: list[Any]) -> None:
    statuses.append(healthy())
    assert topoctl.main(["status", "--wait-for", "yellow", "--timeout", "5"]) == 0
    statuses[:] = [yellow()]
    assert topoctl.main(["status", "--wait-for", "yellow", "--timeout", "5"]) == 0


def test_wait_for_gives_up_at_the_timeout_with_the_last_verdict(statuses: list[Any],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    statuses.append(yellow())
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "0.2"]) == 5
    cap = capsys.readouterr()
    assert cap.out.count("yellow: 1 yellow reason") == 1  # printed once, not once per poll
    assert "not green after 0 s; last verdict yellow" in cap.err and "under-replicated" in cap.err
    statuses[:] = [yellow(), red()]
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "0.2", "-o", "json"]) == 6
    cap = capsys.readouterr()
    assert json.loads(cap.out)["health"]["verdict"] == "red"  # stdout: one document, the last status
    assert "yellow" in cap.err  # progress went to stderr
    statuses[:] = [MetaUnreachable("all down")]
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "0.2"]) == topoctl.EXIT_UNREACHABLE


def test_global_options_go_before_or_after_the_verb() -> None:
    p = topoctl.build_parser()
    after = p.parse_args(["status", "--meta", "h:1", "--timeout", "3", "-o", "yaml", "--tls-ca", "ca.pem"])
    assert (after.meta, after.timeout, after.output, after.tls_ca) == ("h:1", 3.0, "yaml", "ca.pem")
    before = p.parse_args(["--meta", "h:1", "--timeout", "3", "-o", "yaml", "status"])
    assert (before.meta, before.timeout, before.output) == ("h:1", 3.0, "yaml")  # not reset by the verb's defaults
    both = p.parse_args(["--meta", "h:1", "--timeout", "3", "status", "--wait-for", "green", "--timeout", "60"])
    assert (both.meta, both.timeout, both.wait_for) == ("h:1", 60.0, "green")  # the verb's side wins
    default = p.parse_args(["operators"])
    assert (default.output, default.timeout) == ("table", None)
    assert p.parse_args(["operators", "--json"]).output == "json"
    assert p.parse_args(["--json", "transfer", "1"]).output == "json"
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["status", "-o", "xml"])
    assert exc.value.code == 2


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        topoctl.main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"topoctl {package_version()} (code ") and package_version() != ""


def test_operators_transfer_and_get_print_json_and_yaml(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    ops = {"0": {"group": 0, "kind": "add", "worker": "w4", "step": "catch_up", "message": "receiving"}}
    client = FakeClient(ops, topology="cluster: c1  # the file as applied\nshards: 3\n")
    monkeypatch.setattr(topoctl, "_client", lambda args, **kw: client)
    for fmt, load in (("json", json.loads), ("yaml", yaml.safe_load)):
        assert topoctl.main(["operators", "-o", fmt]) == 0
        assert load(capsys.readouterr().out) == ops
        assert topoctl.main(["transfer", "1", "--to", "w2", "-o", fmt]) == 0
        assert load(capsys.readouterr().out)["new_leader"] == "w2"
    assert topoctl.main(["operators"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:4] == ["0", "add", "w4", "catch_up"]
    assert topoctl.main(["get", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"topology_revision": 4, "topology": {"cluster": "c1", "shards": 3}}
    assert topoctl.main(["get"]) == 0
    assert "# the file as applied" in capsys.readouterr().out  # table: the text itself


def _complete(script: str, *words: str) -> list[str]:
    """What bash offers after `words` (the last one being completed) with `script` sourced."""
    line = " ".join(f"'{w}'" for w in words)
    prog = f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _topoctl; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    res = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=10)
    assert res.returncode == 0, res.stderr
    return sorted(res.stdout.split())


def test_bash_completion_is_generated_from_the_parser_and_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert topoctl.main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    verbs = topoctl._verbs(topoctl.build_parser())
    assert {"apply", "status", "get", "transfer", "replicas", "operators", "drain", "undrain", "worker",
            "completion"} <= set(verbs)
    assert "complete -o default -F _topoctl topoctl" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, timeout=10).returncode == 0
    assert _complete(script, "topoctl", "") == sorted([*verbs, *topoctl._options(topoctl.build_parser())[0]])
    assert _complete(script, "topoctl", "st") == ["status"]
    assert _complete(script, "topoctl", "status", "--wait-for", "") == ["green", "yellow"]
    assert _complete(script, "topoctl", "--meta", "h:1", "status", "--w") == ["--wait-for"]
    assert _complete(script, "topoctl", "worker", "re") == ["revoke"]
    assert _complete(script, "topoctl", "operators", "-o", "y") == ["yaml"]
