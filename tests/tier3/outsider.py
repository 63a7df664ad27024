"""An outsider: a process on the cluster's network without the cluster secret.

It reads what is open (/v1/status, /v1/cluster) to forge the most convincing
messages it can: Append/Heartbeat/Begin at the current term and above it with
`prev` copied from the follower's own status, a membership-rewriting
heartbeat to meta, a re-registration of a worker at its own address, a leader
CAS, snapshot downloads, direct writes, and hellos signed with a guessed
secret. It prints one JSON object: for each forgery, the HTTP statuses it got
(0: the connection failed). Run: python -m tests.tier3.outsider --meta ADDR
--workers ADDR,ADDR --rounds N.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import defaultdict
from typing import Any

import aiohttp

from shardgrid.common.peerauth import HELLO_HEADER, ClusterKeys, Principal, make_hello
from shardgrid.common.wire import packb
from worker import replica_msgs as m
from worker.codec import encode_message
from shardgrid.common.protocol import STREAM_PATH


def _forged(gid: int, rep: dict[str, Any], me: str, src: str, bump: int) -> list[Any]:
    term = int(rep.get("term", 1)) + bump
    last_seq, last_term = int(rep.get("last_seq", 0)), int(rep.get("last_term", 0))
    entry = m.Entry(term=term, seq=last_seq + 1, kind="ops", data=[{"kind": "put", "id": "forged", "doc": {}}],
                    rid=("forged-rid",))
    return [encode_message(m.Append(src=src, dst=me, group=gid, term=term, prev_term=last_term, prev_seq=last_seq,
                                    entries=(entry,), commit=last_seq + 1)),
            encode_message(m.Heartbeat(src=src, dst=me, group=gid, term=term, commit=last_seq + 10, round=1)),
            encode_message(m.Begin(src=src, dst=me, group=gid, term=term))]


async def attack(meta: str, workers: list[str], rounds: int) -> dict[str, list[int]]:
    got: dict[str, list[int]] = defaultdict(list)

    async def hit(name: str, method: str, url: str, **kw: Any) -> None:
        try:
            async with s.request(method, url, timeout=aiohttp.ClientTimeout(total=5), **kw) as r:
                await r.read()
                got[name].append(r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            got[name].append(0)

    async with aiohttp.ClientSession() as s:
        for _ in range(rounds):
            async with s.get(f"http://{meta}/v1/cluster") as r:
                view = await r.json()
            for addr in workers:
                async with s.get(f"http://{addr}/v1/status") as r:
                    status = await r.json()
                me = status["id"]
                for gid_s, rep in status["groups"].items():
                    gid = int(gid_s)
                    leader = view["groups"][gid_s]["leader"] or "w1"
                    src = leader if leader != me else next(v for v in view["groups"][gid_s]["voters"] if v != me)
                    for bump in (0, 5):
                        await hit("raft_post", "POST", f"http://{addr}/v1/raft", data=packb(_forged(gid, rep, me, src,
                                                                                                  bump)))
                    await hit("raft_stream", "GET", f"http://{addr}{STREAM_PATH}",
                              headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                       "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
                    await hit("snapshot_manifest", "GET", f"http://{addr}/v1/groups/{gid}/snapshot")
                    await hit("snapshot_data", "GET", f"http://{addr}/v1/groups/{gid}/snapshot/{rep.get('commit', 1)}")
                    await hit("worker_write", "POST", f"http://{addr}/v1/groups/{gid}/write",
                              json={"op": {"kind": "put", "id": "forged", "doc": {}}})
                    await hit("worker_members", "POST", f"http://{addr}/v1/groups/{gid}/members",
                              json={"remove": leader})
                    await hit("worker_transfer", "POST", f"http://{addr}/v1/groups/{gid}/transfer", json={"to": me})
                # A hello signed with a guessed secret.
                hello = make_hello(ClusterKeys(["guess"]), Principal("worker", me))
                await hit("hello_guessed", "POST", f"http://{addr}/v1/auth/hello",
                          headers={HELLO_HEADER: hello.header()})
            for gid_s, g in view["groups"].items():
                leader = g["leader"]
                if leader is None:
                    continue
                forged = {"groups": {gid_s: {"term": g["term"], "role": "leader", "last_term": g["term"],
                                             "last_seq": 10**9, "commit": 10**9, "applied": 10**9,
                                             "voters": [leader], "learners": [], "config_seq": 10**9}}}
                await hit("meta_heartbeat", "POST", f"http://{meta}/v1/workers/{leader}/heartbeat", json=forged)
                await hit("meta_leader", "POST", f"http://{meta}/v1/groups/{gid_s}/leader",
                          json={"leader": next(v for v in g["voters"] if v != leader), "expect_term": g["term"]})
                await hit("meta_ready", "POST", f"http://{meta}/v1/groups/{gid_s}/ready",
                          json={"term": g["term"] + 1, "leader": leader})
                await hit("meta_register", "POST", f"http://{meta}/v1/workers/register",
                          json={"id": leader, "addr": "127.0.0.1:9"})
            await hit("meta_register_new", "POST", f"http://{meta}/v1/workers/register",
                      json={"id": "intruder", "addr": "127.0.0.1:9"})
    return dict(got)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--meta", required=True)
    p.add_argument("--workers", required=True)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    out = asyncio.run(attack(args.meta, args.workers.split(","), args.rounds))
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
