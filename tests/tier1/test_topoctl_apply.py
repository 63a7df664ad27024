"""`topoctl apply` against a fake meta: what it prints around the plan."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from shardgrid import topoctl

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "topology.yaml").read_text()


class FakeMeta:
    """The two calls apply makes before it applies: the dry run, and the view."""

    def __init__(self, preview: dict[str, Any], view: dict[str, Any]) -> None:
        self.preview, self.view, self.applied = preview, view, False

    async def put_topology(self, text: str, *, dry_run: bool = False, expect_revision: int | None = None) -> Any:
        if not dry_run:
            self.applied = True
        return self.preview

    async def cluster(self, deadline_s: float | None = None) -> dict[str, Any]:
        return self.view


def _view_after_repair() -> dict[str, Any]:
    def g(voters: list[str], leader: str, preferred: str) -> dict[str, Any]:
        return {"term": 3, "leader": leader, "ready": True, "voters": voters, "learners": [], "desired": voters,
                "preferred_leader": preferred}
    # w3 led group 2: a failover gave it to w4 and the file's w3 stays its preferred leader.
    return {"groups": {"0": g(["w1", "w2", "w4"], "w1", "w1"), "1": g(["w1", "w2", "w4"], "w2", "w2"),
                       "2": g(["w1", "w2", "w4"], "w4", "w3")},
            "workers": {"w1": {"state": "active", "live": True}, "w2": {"state": "active", "live": True},
                        "w3": {"state": "removed", "live": True}, "w4": {"state": "available", "live": True}},
            "operators": {}, "meta": [], "meta_leader": None, "served_by": "m1"}


async def _apply(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake: FakeMeta, *flags: str) -> int:
    @contextlib.asynccontextmanager
    async def client(_args: Any) -> AsyncIterator[FakeMeta]:
        yield fake

    monkeypatch.setattr(topoctl, "_client", client)
    path = tmp_path / "t.yaml"
    path.write_text(EXAMPLE)
    args = topoctl.build_parser().parse_args(["apply", str(path), *flags])
    return await topoctl.cmd_apply(args)


async def test_dry_run_prints_the_drift_and_applies_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    preview = {"topology_revision": 1, "changed": True, "plan_text": "+ group 0: add replica w3\n"
               "- group 0: remove replica w4", "plan": [{"kind": "add_replica", "group": 0, "worker": "w3"}]}
    fake = FakeMeta(preview, _view_after_repair())
    assert await _apply(monkeypatch, tmp_path, fake, "--dry-run") == 0
    out = capsys.readouterr().out.splitlines()
    assert not fake.applied
    assert out[:3] == ["plan against topology revision 1:", "  + group 0: add replica w3",
                       "  - group 0: remove replica w4"]
    assert out[3] == "drift: the live cluster differs from this file's groups (applying it steers them back):"
    # w3 was declared gone but is live again: applying the file makes it active, and the replicas move back.
    assert "  group 2: file w1,w2,w3 leader w3; live w1,w2,w4 leader w4 (w3 removed: repaired onto w4; " \
           "the controller keeps w1,w2,w4 until the file is applied again)" in out
    assert "    ~ group 2: replica w4 -> w3" in out and "    ~ group 2: leader w4 -> w3 once w3 is a caught-up " \
           "voter (leader balance)" in out
    assert out[-1] == "dry run: nothing applied"


async def test_an_unchanged_file_says_the_controller_already_steers_there(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    moving = {"topology_revision": 1, "changed": False, "plan_text": "+ group 0: add replica w3",
              "plan": [{"kind": "add_replica", "group": 0, "worker": "w3"}]}
    assert await _apply(monkeypatch, tmp_path, FakeMeta(moving, _view_after_repair())) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("topology unchanged: nothing to apply (the controller "
                                                        "already steers toward it; topoctl status shows the drift)")
    still = {"topology_revision": 1, "changed": False, "plan_text": "no changes", "plan": []}
    assert await _apply(monkeypatch, tmp_path, FakeMeta(still, _view_after_repair())) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "topology unchanged: nothing to apply" and not any(line.startswith("drift") for line in out)
