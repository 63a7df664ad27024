"""Scenario 3 of the chaos gate, run INSIDE a private network namespace.

`ip netns exec NS python -m tests.tier3.partition_run --root DIR` starts a
cluster whose processes listen on distinct loopback addresses (meta
127.0.0.21-23, workers 127.0.0.11-13 with their outgoing connections bound to
those addresses, gateways 127.0.0.31-32), runs the load, partitions the
leader of group 0 from its followers and from meta with nftables rules on
`lo` (the gateways still reach it), waits for the new term, heals, checks
that the old leader stepped down, and judges the history. It prints one JSON
line of figures and exits non-zero on any failure. The namespace is private,
so fixed ports cannot collide and the rules touch nothing outside it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.support.cluster import Cluster, MetaSpec, wait_until
from tests.support.history import check_acknowledged, check_linearizable
from tests.support.load import LoadGenerator, final_state
from tests.tier3.test_chaos import GROUPS, Background

TABLE = "sgpartition"


def nft(script: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True)


def partition(victim_ip: str, others: list[str]) -> None:
    peers = ", ".join(others)
    # Match on addresses (not connection state): connections opened before
    # the rule must be cut too (see shared TESTING.md).
    nft(f"""table inet {TABLE} {{
  chain out {{
    type filter hook output priority 0; policy accept;
    ip saddr {victim_ip} ip daddr {{ {peers} }} drop
    ip saddr {{ {peers} }} ip daddr {victim_ip} drop
  }}
}}
""")


def heal() -> None:
    subprocess.run(["nft", "delete", "table", "inet", TABLE], check=False)


def build(root: Path) -> Cluster:
    meta = [MetaSpec(f"m{i}", f"127.0.0.2{i}:7001", f"127.0.0.2{i}:7101") for i in (1, 2, 3)]
    workers = [(f"w{i}", f"127.0.0.1{i}:7201", "abc"[i - 1]) for i in (1, 2, 3)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "cluster.secret").write_text("partition-secret\n")
    c = Cluster(root, meta, workers, gateways=["127.0.0.31:8080", "127.0.0.32:8080"])
    c.source = {w: h.split(":")[0] for w, h, _ in workers}
    return c


def run(root: Path) -> dict[str, object]:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    heal()
    c = build(root)
    try:
        c.boot(c.topology_yaml(snapshot_every=500, groups=GROUPS), gateways=True)
        load = Background(LoadGenerator(c.gateways, clients=8, ops_per_client=100_000, seed=31))
        try:
            load.wait_more(300)
            before = c.view()["groups"]["0"]
            victim = before["leader"]
            victim_ip = c.source[victim]
            others = [ip for w, ip in c.source.items() if w != victim] + [m.http.split(":")[0] for m in c.meta]
            partition(victim_ip, others)
            cut = time.monotonic()
            wait_until(lambda: (g := c.view()["groups"]["0"])["term"] > before["term"] and g["ready"], 15.0,
                       "group 0 to get a new ready leader while its old leader is cut off", interval=0.05)
            failover = time.monotonic() - cut
            load.wait_more(300)
            heal()
            new_term = c.view()["groups"]["0"]["term"]
            wait_until(lambda: (g := c.worker_status(victim)["groups"]["0"])["term"] >= new_term
                       and g["role"] != "leader", 15.0, f"old leader {victim} to step down after the heal")
            load.wait_more(200)
        finally:
            heal()
            result = load.finish()
        items, counters = asyncio.run(final_state(c.gateways[0], result))
        acked = check_acknowledged(result.history, items, counters)
        lin = check_linearizable(result.history)
        return {"ok": acked.ok and lin.ok, "victim": victim, "failover_s": round(failover, 2),
                "summary": result.summary(), "acknowledged": acked.summary(), "linearizable": lin.summary(),
                "details": "" if acked.ok and lin.ok else acked.details() + lin.details()}
    finally:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    args = ap.parse_args()
    try:
        out = run(Path(args.root))
    except AssertionError as exc:
        out = {"ok": False, "details": str(exc)}
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
