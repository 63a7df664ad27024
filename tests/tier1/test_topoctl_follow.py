"""What `topoctl apply` and `topoctl drain` print while they follow operators: one
line per group each time its step or message changes (snapshot bytes included)."""
from __future__ import annotations

import argparse
from typing import Any

import pytest

from shardgrid import topoctl


def _view(ops: dict[str, dict[str, Any]], *, w1_hosts: bool = True, w1_state: str = "draining") -> dict[str, Any]:
    members = ["w1", "w2", "w3"] if w1_hosts else ["w2", "w3", "w4"]
    groups = {str(g): {"term": 2, "leader": "w2", "ready": True, "preferred_leader": "w2", "voters": members,
                       "learners": ["w4"] if str(g) in ops else [], "desired": ["w2", "w3", "w4"]}
              for g in (0, 1)}
    return {"revision": 1, "groups": groups, "operators": ops,
            "workers": {"w1": {"state": w1_state}, "w4": {"state": "available"}}}


def _add(step: str, message: str) -> dict[str, Any]:
    return {"kind": "add", "worker": "w4", "step": step, "message": message}


RECEIVING = [
    {"0": _add("catch_up", "w4 receiving snapshot: 0 B of 40 MB (0%)"),
     "1": _add("catch_up", "w4 waiting for a snapshot download slot (settings.snapshot_concurrency): 0 B of 40 MB (0%)")},
    {"0": _add("catch_up", "w4 receiving snapshot: 0 B of 40 MB (0%)"),  # nothing new: no line
     "1": _add("catch_up", "w4 waiting for a snapshot download slot (settings.snapshot_concurrency): 0 B of 40 MB (0%)")},
    {"0": _add("catch_up", "w4 receiving snapshot: 12 MB of 40 MB (30%)"),
     "1": _add("catch_up", "w4 waiting for a snapshot download slot (settings.snapshot_concurrency): 0 B of 40 MB (0%)")},
    {"0": _add("promote", "w4 caught up: applied 900 of 910"),
     "1": _add("catch_up", "w4 receiving snapshot: 2 MB of 40 MB (5%)")},
]


class _FakeMeta:
    def __init__(self, views: list[dict[str, Any]]) -> None:
        self.views = views

    async def __aenter__(self) -> "_FakeMeta":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass

    async def cluster(self) -> dict[str, Any]:
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]

    async def call(self, method: str, path: str, **kw: Any) -> Any:
        assert (method, path) == ("POST", "/v1/workers/w1/drain")
        return {"worker": "w1", "state": "draining"}


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topoctl, "POLL_S", 0)


# What following the views of RECEIVING prints: each group's change once.
RECEIVED = [
        "group 0: add w4: catch_up: w4 receiving snapshot: 0 B of 40 MB (0%)",
        "group 1: add w4: catch_up: w4 waiting for a snapshot download slot (settings.snapshot_concurrency): "
        "0 B of 40 MB (0%)",
        "group 0: add w4: catch_up: w4 receiving snapshot: 12 MB of 40 MB (30%)",
        "group 0: add w4: promote: w4 caught up: applied 900 of 910",
        "group 1: add w4: catch_up: w4 receiving snapshot: 2 MB of 40 MB (5%)",
]


def _progress_lines(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.strip().startswith("group ")]


async def test_apply_follow_prints_each_change_of_a_groups_snapshot_progress_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    views = [_view(ops) for ops in RECEIVING] + [_view({}, w1_hosts=False)]
    assert await topoctl.follow_convergence(_FakeMeta(views), wait_s=10) == 0  # type: ignore[arg-type]
    assert _progress_lines(capsys.readouterr().out) == [
        *RECEIVED,
        "group 0: converged (voters w2,w3,w4; leader w2)",
        "group 1: converged (voters w2,w3,w4; leader w2)",
    ]


async def test_drain_follow_prints_operator_messages_one_line_per_group_change(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    views = [_view(ops) for ops in RECEIVING] + [_view({}, w1_hosts=False, w1_state="drained")]
    monkeypatch.setattr(topoctl, "_client", lambda args: _FakeMeta(views))
    args = argparse.Namespace(worker="w1", no_wait=False, wait=10.0)
    assert await topoctl.cmd_drain(args) == 0
    out = capsys.readouterr().out
    assert _progress_lines(out) == RECEIVED
    assert out.count("leads groups -; hosts groups 0,1") == 1 and "w1: drained" in out
