"""`shardgrid dev --tls`: every listener on HTTPS, every intra-cluster call verified.

The dev cluster runs on free ports (not 8080/7101: the plain dev test owns
those) with an admin token. Over https only: writes and reads through the
gateway (replication between the workers must then be wss), a leader
transfer through the gateway with the token, a replica added from a
snapshot (the download is https), topoctl with --tls-ca; and plain http to
each kind of listener fails.
"""
from __future__ import annotations

import http.client
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.cluster import DevRun, free_ports, http_json, wait_until

pytestmark = pytest.mark.tier3

TOKEN = "tier3-tls-admin-token"


def _topology(ports: list[int]) -> str:
    lines = ["cluster: tls", "shards: 3", "replication_factor: 3", "plugin: entities", "meta:"]
    lines += [f"  - {{id: m{i + 1}, raft: '127.0.0.1:{ports[i]}', http: '127.0.0.1:{ports[3 + i]}'}}"
              for i in range(3)]
    lines.append("workers:")
    lines += [f"  - {{id: w{i + 1}, http: '127.0.0.1:{ports[6 + i]}', zone: {'abc'[i]}}}" for i in range(3)]
    lines.append("settings: {ack: quorum, quorum_timeout_ms: 2000, lease_ms: 1500, fsync: batch, snapshot_every: 20}")
    return "\n".join(lines) + "\n"


def _plain_http_fails(addr: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/healthz", timeout=5) as r:
            r.read()
    except (OSError, http.client.HTTPException):
        return True
    return False


def test_shardgrid_dev_tls(tmp_path: Path) -> None:
    ports = free_ports(10)
    topo = tmp_path / "topology.yaml"
    topo.write_text(_topology(ports))
    data = tmp_path / "dev"
    gw_addr, meta_addrs = f"127.0.0.1:{ports[9]}", [f"127.0.0.1:{p}" for p in ports[3:6]]
    env = {**os.environ, "SHARDGRID_ADMIN_TOKEN": TOKEN}
    env.pop("SHARDGRID_TLS_CA", None)
    run = DevRun(["--tls", "--fresh", "--data", str(data), "--topology", str(topo), "--gateway-port", str(ports[9])],
                 env=env)
    proc, lines = run.proc, run.lines
    try:
        out = run.wait_up(120)
        ca = data / "tls" / "ca.pem"
        assert f"gateway:  https://{gw_addr}" in out and f"--cacert {ca}" in out, out
        assert oct((data / "tls" / "server.key").stat().st_mode & 0o777) == "0o600"
        ctx = ssl.create_default_context(cafile=str(ca))
        gw = f"https://{gw_addr}"

        code, body = http_json("PUT", f"{gw}/items/hello", {"greeting": "hi"}, timeout=5, context=ctx)
        assert code == 200, body
        assert http_json("GET", f"{gw}/items/hello", timeout=5, context=ctx) == (200, {"greeting": "hi"})
        # Enough writes to every group for a snapshot (snapshot_every: 20) to serve w4 below.
        for i in range(90):
            assert http_json("PUT", f"{gw}/items/k{i}", {"v": i}, timeout=5, context=ctx)[0] == 200

        # A leader transfer through the gateway: refused without the token, done with it.
        assert http_json("POST", f"{gw}/cluster/shards/1/transfer", {}, timeout=20, context=ctx)[0] == 401
        code, shards = http_json("GET", f"{gw}/cluster/shards", timeout=5, context=ctx,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        assert code == 200, shards
        before = next(s for s in shards["shards"] if s["id"] == 1)
        code, body = http_json("POST", f"{gw}/cluster/shards/1/transfer", {}, timeout=20, context=ctx,
                               headers={"Authorization": f"Bearer {TOKEN}"})
        assert code == 200, body
        assert body["old_term"] == before["term"] and body["new_leader"] != before["leader"], body
        code, body = http_json("PUT", f"{gw}/items/after-transfer", {"v": 1}, timeout=5, context=ctx)
        assert code == 200 and body["created"] is True, body

        # topoctl over https, verified against the dev CA (the token travels, encrypted).
        topoctl = [sys.executable, "-m", "shardgrid.topoctl", "--meta", ",".join(meta_addrs), "--tls-ca", str(ca)]
        st = subprocess.run([*topoctl, "status", "--json"], capture_output=True, text=True, timeout=30, env=env)
        # The exit code is the verdict's (0 green, 5 yellow): right after a transfer a report may lag.
        assert st.returncode in (0, 5), st.stderr
        dry = subprocess.run([*topoctl, "apply", str(topo), "--dry-run"], capture_output=True, text=True, timeout=30,
                             env=env)
        # PUT /v1/topology?dry_run=1 needs the token: it went over https.
        assert dry.returncode == 0 and "topology unchanged" in dry.stdout, dry.stdout + dry.stderr
        # ... and refuses a plain http address while a CA is configured (the token would go in clear).
        clear = subprocess.run([sys.executable, "-m", "shardgrid.topoctl", "--meta", f"http://{meta_addrs[0]}",
                                "--tls-ca", str(ca), "transfer", "1"], capture_output=True, text=True, timeout=30,
                               env=env)
        assert clear.returncode == 1 and "is plain http" in clear.stderr, clear.stderr

        # A worker added by hand joins group 1 from a snapshot it downloads over https.
        added = subprocess.run([sys.executable, "-m", "shardgrid.cli", "dev", "add-worker", "--data", str(data)],
                               capture_output=True, text=True, timeout=40)
        assert added.returncode == 0 and "started w4" in added.stdout, added.stdout + added.stderr
        # Its registration and heartbeats reach meta over https as well: add-worker
        # returns once meta's leader has heard it (a replica goes only to a worker it heard).
        assert "w4 is registered and live" in added.stdout, added.stdout + added.stderr
        code, body = http_json("POST", f"{gw}/cluster/shards/1/replicas", {"add": "w4"}, timeout=10, context=ctx,
                               headers={"Authorization": f"Bearer {TOKEN}"})
        assert code == 202, body

        def w4_voter() -> bool:
            code, shards = http_json("GET", f"{gw}/cluster/shards", timeout=5, context=ctx,
                                     headers={"Authorization": f"Bearer {TOKEN}"})
            g1 = next(s for s in shards["shards"] if s["id"] == 1)
            return code == 200 and "w4" in g1["voters"] and not g1["learners"]
        wait_until(w4_voter, 90, "w4 to be promoted in group 1", interval=0.5)
        assert "snapshot_downloaded" in (data / "logs" / "w4.log").read_text()

        # Plain http to the TLS listeners fails: gateway, meta, worker.
        for addr in (gw_addr, meta_addrs[0], f"127.0.0.1:{ports[6]}"):
            assert _plain_http_fails(addr), addr
        # A client that does not trust the dev CA is refused too.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            http_json("GET", f"{gw}/healthz", timeout=5, context=ssl.create_default_context())

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        wait_until(lambda: any(ln.startswith("stopped:") for ln in lines), 5, "the stop summary")
        stopped = next(ln for ln in lines if ln.startswith("stopped:"))
        assert all(part.strip().endswith("=0") for part in stopped[len("stopped:"):].split(",")), stopped
    finally:
        run.kill()
