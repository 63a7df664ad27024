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


class FakeClock:
    """--wait-for's clock: sleeping moves it on at once; each gather_status takes `ask_s`."""

    def __init__(self, ask_s: float = 0.05) -> None:
        self.t = 1000.0
        self.ask_s = ask_s

    def now(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s


class Statuses(list):  # type: ignore[type-arg]
    """The statuses gather_status returns, one per call (the last one repeats); an
    exception in the list is raised instead. `budgets`: the deadline_s of each call."""

    clock: FakeClock
    budgets: list[float | None]


@pytest.fixture
def statuses(monkeypatch: pytest.MonkeyPatch) -> Statuses:
    seq = Statuses()
    seq.clock = FakeClock()
    seq.budgets = []

    async def gather(client: Any, deadline_s: float | None = None) -> dict[str, Any]:
        seq.budgets.append(deadline_s)
        seq.clock.t += seq.clock.ask_s
        item = seq.pop(0) if len(seq) > 1 else seq[0]
        if isinstance(item, BaseException):
            raise item
        return copy.deepcopy(item)

    monkeypatch.setattr(topoctl, "gather_status", gather)
    monkeypatch.setattr(topoctl, "_client", lambda args, **kw: FakeClient())
    monkeypatch.setattr(topoctl, "system_clock", lambda: topoctl.Clock(seq.clock.now, seq.clock.sleep))
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


def _verdicts(out: str) -> list[str]:
    return [ln.split("] ")[1].split(":")[0] for ln in out.splitlines() if ln.startswith("[") and "] " in ln
            and not ln.split("] ")[1].startswith(" ")]


def test_wait_for_green_prints_each_change_once_and_exits_0_when_reached(
        statuses: Statuses, capsys: pytest.CaptureFixture[str]) -> None:
    statuses.extend([red(), red(), MetaUnreachable("m1 down"), yellow(), yellow(), healthy()])
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "30"]) == 0
    assert _verdicts(capsys.readouterr().out) == ["red", "meta did not answer", "yellow", "green", "confirming",
                                                  "green held for 2.0 s"]


def test_wait_for_green_must_hold_over_a_lease_and_a_report_period(statuses: Statuses,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # A worker that died a moment ago still counts as live for one lease: one green answer
    # (or two within 1.8 s) is not yet green. Polls every 1 s, each ask taking 0.05 s.
    statuses.extend([healthy(), healthy(), yellow(), healthy(), healthy(), healthy()])
    start = statuses.clock.t
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "30"]) == 0
    out = capsys.readouterr().out
    # green at 0 s and 1 s, yellow at 2 s (the run starts again), green from 3 s: done at 5 s, not 1 s.
    assert statuses.clock.t - start == pytest.approx(5.05 + 0.05 * 5, abs=0.01)
    assert out.count("confirming: green must hold for 1.8 s") == 2
    assert _verdicts(out)[-1].endswith("green held for 2.0 s")
    # The window follows the topology's lease: 3000 ms -> 3.6 s, so four polls after the first.
    slow = healthy()
    slow["topology"]["settings"]["lease_ms"] = 3000
    statuses[:] = [slow]
    start = statuses.clock.t
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "30"]) == 0
    assert "confirming: green must hold for 3.6 s" in capsys.readouterr().out
    assert 4.0 <= statuses.clock.t - start < 4.5
    # A failed try in between is a gap: the run starts again after it.
    statuses[:] = [healthy(), healthy(), MetaUnreachable("m1 down"), healthy()]
    start = statuses.clock.t
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "30"]) == 0
    assert 5.0 <= statuses.clock.t - start < 5.5


def test_wait_for_yellow_takes_green_too(statuses: Statuses) -> None:
    statuses.append(healthy())
    assert topoctl.main(["status", "--wait-for", "yellow", "--timeout", "5"]) == 0
    statuses[:] = [yellow()]
    assert topoctl.main(["status", "--wait-for", "yellow", "--timeout", "5"]) == 0


def test_wait_for_gives_up_at_the_timeout_with_the_last_verdict(statuses: Statuses,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    statuses.append(yellow())
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "3"]) == 5
    cap = capsys.readouterr()
    assert cap.out.count("yellow: 1 yellow reason") == 1  # printed once, not once per poll
    assert "not green after 3 s; last verdict yellow:" in cap.err and "under-replicated" in cap.err
    statuses[:] = [yellow(), red()]
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "3", "-o", "json"]) == 6
    cap = capsys.readouterr()
    assert json.loads(cap.out)["health"]["verdict"] == "red"  # stdout: one document, the last status
    assert "yellow" in cap.err  # progress went to stderr
    # Green, but not for long enough when the time is up: neither 0 nor a verdict's code.
    statuses[:] = [healthy()]
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "1.5"]) == topoctl.EXIT_NOT_CONVERGED
    assert "green after 2 s, but it had not held for 1.8 s yet" in capsys.readouterr().err


def test_wait_for_exits_3_only_when_no_try_answered(statuses: Statuses, capsys: pytest.CaptureFixture[str]) -> None:
    # Meta answered (yellow), then stopped answering: the last verdict's code, not 3.
    statuses.extend([yellow(), MetaUnreachable("all down")])
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "3"]) == 5
    assert "last verdict yellow (meta did not answer the last try)" in capsys.readouterr().err
    statuses[:] = [MetaUnreachable("all down")]
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "3"]) == topoctl.EXIT_UNREACHABLE
    capsys.readouterr()
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "3", "-o", "json"]) == 3
    cap = capsys.readouterr()
    assert json.loads(cap.out)["error"] == {"code": "meta_unreachable", "exit": 3, "message":
                                            f"not green after 3 s: no meta node answered at {topoctl.DEFAULT_META}"}


def test_wait_for_never_asks_meta_for_longer_than_the_time_left(statuses: Statuses) -> None:
    statuses.clock.ask_s = 0.7
    statuses.append(yellow())
    start = statuses.clock.t
    assert topoctl.main(["status", "--wait-for", "green", "--timeout", "2.5"]) == 5
    # Asked at 0 and at 1.7 (0.7 s asking, 1 s sleeping): each ask's budget is what was left, and the
    # wait ends at 2.5 s, with no ask started past it.
    assert statuses.budgets == pytest.approx([2.5, 0.8])
    assert statuses.clock.t - start == pytest.approx(2.5)


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


class FailingClient(FakeClient):
    """A meta that raises `exc` for every call; replicas and drain verbs that never finish."""

    def __init__(self, exc: BaseException | None = None) -> None:
        super().__init__()
        self.exc = exc

    async def __aenter__(self) -> "FailingClient":
        return self

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        if self.exc is not None:
            raise self.exc
        if path == "/v1/groups/1/replicas":
            return {"kind": "add", "worker": "w4", "step": "catch_up", "message": "receiving"}
        if path == "/v1/operators":
            return {"operators": {"1": {"kind": "add", "worker": "w4", "step": "catch_up", "message": "receiving"}}}
        if path == "/v1/workers/w1/drain":
            return {"worker": "w1", "state": "draining"}
        raise AssertionError(path)

    async def cluster(self, deadline_s: float | None = None) -> dict[str, Any]:
        st = healthy()
        st["workers"]["w1"]["state"] = "draining"  # it leads and hosts both groups: never drained
        return st


@pytest.mark.parametrize("fmt, load", [("json", json.loads), ("yaml", yaml.safe_load)])
def test_a_failing_verb_prints_one_error_document_with_json_and_yaml(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any, fmt: str,
        load: Any) -> None:
    from meta.client import MetaError

    def run(client: FakeClient, *argv: str) -> tuple[int, Any]:
        monkeypatch.setattr(topoctl, "_client", lambda args, **kw: client)
        code = topoctl.main([*argv, "-o", fmt])
        cap = capsys.readouterr()
        assert "topoctl: " in cap.err  # a person still reads why on stderr
        return code, load(cap.out)  # one document: a second one would not parse

    code, doc = run(FailingClient(MetaUnreachable("m1: ClientConnectorError")), "operators")
    assert code == 3 and doc["error"]["code"] == "meta_unreachable" and doc["error"]["exit"] == 3
    assert "ClientConnectorError" in doc["error"]["message"]
    code, doc = run(FailingClient(MetaError(409, "conflict", "w2 is not a voter of group 1")), "transfer", "1")
    assert code == 1 and doc["error"] == {"code": "conflict", "message": "w2 is not a voter of group 1", "exit": 1,
                                          "status": 409}
    code, doc = run(FailingClient(), "replicas", "1", "--add", "w4", "--wait=-1")
    assert code == 1 and doc["error"]["code"] == "not_done" and doc["error"]["operator"]["worker"] == "w4"
    code, doc = run(FailingClient(), "drain", "w1", "--wait=-1")
    assert code == topoctl.EXIT_NOT_CONVERGED and doc["error"]["code"] == "not_drained"
    assert doc["error"]["leads"] == [0, 1]
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: c1\nshards: -3\n")
    code, doc = run(FailingClient(), "apply", str(bad))
    assert code == 1 and doc["error"]["code"] == "invalid" and doc["error"]["errors"]
    # table: no document at all, only stderr
    monkeypatch.setattr(topoctl, "_client", lambda args, **kw: FailingClient(MetaUnreachable("down")))
    assert topoctl.main(["operators"]) == 3 and capsys.readouterr().out == ""
