"""Admission over real processes: an outsider without the secret changes nothing
under load, a worker with the wrong secret is refused, and revoking a worker
moves its leaderships and replicas away with nothing lost."""
from __future__ import annotations

import json
import subprocess
import urllib.request
import sys
from pathlib import Path

import pytest

from shardgrid.common.auth import write_secret
from tests.support.cluster import Child, Cluster, free_ports, http_json, wait_until
from tests.support.load import LoadGenerator
from tests.tier3.test_chaos import GROUPS, Background, judge

pytestmark = pytest.mark.tier3

ROOT = Path(__file__).resolve().parents[2]


def placement(c: Cluster) -> dict[str, tuple[int, str, tuple[str, ...], int]]:
    return {gid: (g["term"], g["leader"], tuple(sorted(g["voters"])), g["conf_ver"])
            for gid, g in c.view()["groups"].items()}


def refused_total(c: Cluster, wid: str) -> float:
    with urllib.request.urlopen(f"http://{c.worker_addr(wid)}/metrics", timeout=2.0) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("shardgrid_peer_auth_refused_total{"))


def test_an_outsider_changes_nothing_and_a_wrong_secret_is_refused(tmp_path: Path) -> None:
    c = Cluster.create(tmp_path / "cluster", n_workers=3, n_gateways=2)
    intruder: Child | None = None
    try:
        c.boot(c.topology_yaml(snapshot_every=500, groups=GROUPS), gateways=True)
        before = placement(c)
        addrs = {w: rec["addr"] for w, rec in c.view()["workers"].items()}
        load = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=131))
        try:
            load.wait_more(300)
            out = subprocess.run([sys.executable, "-m", "tests.tier3.outsider", "--meta", c.meta_addrs.split(",")[0],
                                  "--workers", ",".join(h for _, h, _ in c.workers), "--rounds", "3"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=120, start_new_session=True)
            assert out.returncode == 0, out.stderr
            got = json.loads(out.stdout)
            # A worker started with a secret of its own: meta refuses its registration.
            secret = tmp_path / "wrong.secret"
            write_secret(secret, "not-the-cluster-secret")
            (port,) = free_ports(1)
            intruder = Child("w9", [sys.executable, "-m", "shardgrid.cli", "worker", "--id", "w9",
                                    "--http", f"127.0.0.1:{port}", "--meta", c.meta_addrs,
                                    "--data", str(tmp_path / "w9"), "--secret-file", str(secret)],
                             tmp_path / "w9.log")
            intruder.start()
            wait_until(lambda: any(r["principal"] == "worker:w9" and r["reason"] == "unknown_credentials"
                                   for m in c.meta for r in c.status(m.id)["refusals"]), 30,
                       "meta to refuse w9's credentials")
            load.wait_more(300)
        finally:
            result = load.finish()
        print(f"\n[outsider] {got}")
        assert got and all(got.values())
        for what, statuses in got.items():
            assert set(statuses) <= {401, 403}, (what, statuses)
        assert placement(c) == before, "a forged message changed a term, a leader or a membership"
        view = c.view()
        assert "intruder" not in view["workers"] and "w9" not in view["workers"]
        assert {w: rec["addr"] for w, rec in view["workers"].items()} == addrs
        assert all(refused_total(c, w) > 0 for w, _, _ in c.workers)
        wait_until(lambda: "register_refused" in (tmp_path / "w9.log").read_text(), 10, "w9 to log its refusal")
        status = c.topoctl("status")
        assert "worker:w9 (claimed) from 127.0.0.1: unknown_credentials" in status.stdout, status.stdout
        judge(c, result, "outsider", f"forgeries={sum(len(s) for s in got.values())}")
    finally:
        if intruder is not None:
            intruder.kill()
        c.close()


def test_revoking_a_worker_moves_its_leaderships_and_replicas(tmp_path: Path) -> None:
    c = Cluster.create(tmp_path / "cluster", n_workers=4, n_gateways=2)
    try:
        c.boot(c.topology_yaml(snapshot_every=500, groups=GROUPS, declared=3), gateways=True)
        load = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=141))
        try:
            load.wait_more(300)
            assert c.view()["groups"]["0"]["leader"] == "w1"
            res = c.topoctl("worker", "revoke", "w1")
            assert res.returncode == 0 and "revoked" in res.stdout, res.stdout + res.stderr
            wait_until(lambda: all(g["leader"] != "w1" and g["ready"] for g in c.view()["groups"].values()), 15,
                       "w1's leadership to fail over", interval=0.1)
            wait_until(lambda: all(sorted(g["voters"]) == ["w2", "w3", "w4"] and not g["learners"]
                                   for g in c.view()["groups"].values()), 90,
                       "every replica on w1 to be replaced by one on w4", interval=0.3)
            load.wait_more(300)
        finally:
            result = load.finish()
        status = c.topoctl("status")
        row = next(line for line in status.stdout.splitlines() if line.startswith("w1 "))
        assert "revoked" in row.split(), row
        assert refused_total(c, "w2") > 0  # w1 kept trying its peers and was refused
        judge(c, result, "revoke", f"errors={dict(result.errors)}")
    finally:
        c.close()

