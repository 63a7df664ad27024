"""`shardgrid dev` from a second shell (shardgrid/devcontrol.py), and its apply
racing another one: against real child processes (sleepers) and a real meta node."""
from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from meta.client import MetaClient
from shardgrid.devcluster import apply_topology
from shardgrid.devcontrol import DevActions, DevControl, DevControlError, exit_text, request, run_client
from shardgrid.procs import Child, stop_all
from tests.support.waiting import until
from tests.tier1.test_meta_api import EXAMPLE, _single_meta

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, list[Child]]]:
    """A control socket over two sleeping children, answered by a thread (as the dev loop would)."""
    children = [Child(n, list(SLEEPER), tmp_path / "logs" / f"{n}.log") for n in ("w1", "w2")]
    for c in children:
        c.start()
    added: list[Child] = []

    def add(extra: list[str]) -> Child:
        c = Child(f"w{3 + len(added)}", [*SLEEPER, *extra], tmp_path / "logs" / "w3.log")
        c.start()
        added.append(c)
        children.append(c)
        return c

    control = DevControl(tmp_path, DevActions(children=lambda: list(children), start_child=lambda c: c.start(),
                                              add_worker=add))
    control.open()
    stop = threading.Event()
    loop = threading.Thread(target=lambda: [control.serve(0.05) for _ in iter(stop.is_set, True)], daemon=True)
    loop.start()
    try:
        yield tmp_path, children
    finally:
        stop.set()
        loop.join(5)
        control.close()
        stop_all(children, timeout=2)


def test_ps_kill_start_and_add(served: tuple[Path, list[Child]], capsys: pytest.CaptureFixture[str]) -> None:
    data, children = served
    assert [c["state"] for c in request(data, {"op": "ps"})["children"]] == ["running", "running"]
    assert run_client(data, "kill", "w1", "KILL") == 0
    assert "sent SIGKILL to w1" in capsys.readouterr().out
    children[0].proc.wait(5)  # type: ignore[union-attr]
    assert run_client(data, "ps", None, "KILL") == 0
    assert "w1" in (out := capsys.readouterr().out) and "signal 9 (SIGKILL)" in out and "running" in out
    # Refusals say why and exit 1: killing a dead child, starting a running one, unknown names and signals.
    assert run_client(data, "kill", "w1", "KILL") == 1
    assert run_client(data, "start", "w2", "KILL") == 1
    assert run_client(data, "kill", "w9", "KILL") == 1
    assert run_client(data, "kill", "w2", "BOGUS") == 1
    err = capsys.readouterr().err
    assert "w1 is not running (signal 9 (SIGKILL))" in err and "w2 is running already" in err
    assert "no child named 'w9'" in err and "unknown signal 'BOGUS'" in err
    # Back with the same command line, under a new pid.
    old = children[0].pid
    assert run_client(data, "start", "w1", "KILL") == 0
    assert children[0].alive() and children[0].pid != old
    assert run_client(data, "add-worker", None, "KILL", ram="8GB", wait_live=False) == 0
    assert "started w3" in capsys.readouterr().out and len(children) == 3
    assert children[2].argv[-2:] == ["--available-ram", "8GB"]
    assert run_client(data, "add-worker", None, "KILL", ram="8 lightyears") == 2
    assert run_client(data, "kill", None, "KILL") == 2  # a name is needed


def test_a_second_cluster_on_the_same_data_is_refused_and_a_stale_socket_is_not(tmp_path: Path,
                                                                                 served: Any) -> None:
    data, _ = served
    with pytest.raises(DevControlError, match="already runs"):
        DevControl(data, DevActions(list, lambda c: None, lambda e: None)).open()  # type: ignore[arg-type, return-value]
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "dev.sock").touch()  # left by a killed cluster
    control = DevControl(stale, DevActions(list, lambda c: None, lambda e: None))  # type: ignore[arg-type, return-value]
    control.open()
    control.close()
    with pytest.raises(DevControlError, match="no dev cluster runs"):
        request(stale, {"op": "ps"})


def test_exit_text() -> None:
    assert (exit_text(None), exit_text(0), exit_text(3), exit_text(-9)) == \
        ("running", "exit 0", "exit 3", "signal 9 (SIGKILL)")


async def test_an_apply_that_lands_meanwhile_is_planned_again(tmp_path: Path, aiohttp_server: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`shardgrid dev` applying while someone else applies: no traceback, the file wins."""
    raft, server = _single_meta(tmp_path, server_config())
    try:
        srv = await aiohttp_server(server.app())
        await until(raft.is_leader, "the single meta node to lead")
        addr = f"127.0.0.1:{srv.port}"
        other = EXAMPLE.replace("lease_ms: 1500", "lease_ms: 1700")
        assert other != EXAMPLE
        real = MetaClient.put_topology
        raced = []

        async def racing(self: MetaClient, text: str, **kw: Any) -> dict[str, Any]:
            if not kw.get("dry_run") and not raced:
                raced.append(await real(self, other))  # lands between our preview and our apply
            return await real(self, text, **kw)

        monkeypatch.setattr(MetaClient, "put_topology", racing)
        result = await apply_topology([addr], EXAMPLE)
        assert raced and result["topology_revision"] == 2
        assert raft.sm.topology_text == EXAMPLE
    finally:
        raft.close()


def server_config() -> Any:
    from meta.server import MetaServerConfig

    return MetaServerConfig()
