"""A throwaway 3-member etcd on loopback, for `shardgrid bench --target etcd --cluster local`.

The comparison point for shardgrid's write path: etcd replicates every put
through Raft to a quorum and fsyncs its WAL before acknowledging (group
commit, like shardgrid's `fsync: batch`). The members run as child
processes (own session, die with the benchmark) in a temporary data
directory; `stop()` sends TERM, then KILL. etcd comes from Debian
(`apt-get install -y etcd-server`).

The benchmark talks to etcd's JSON gateway (`/v3/kv/...`), which etcd
3.4+ serves on its client port. `--max-txn-ops` is raised to the batch size
when --batch asks for bigger transactions than etcd's default 128.
"""
from __future__ import annotations

import json
import secrets
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shardgrid.procs import Child, stop_all

DEFAULT_MAX_TXN_OPS = 128


def find_etcd() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise FileNotFoundError("no etcd binary on PATH; install it with "
                                "`apt-get update && apt-get install -y etcd-server etcd-client`")
    return path


@dataclass
class LocalEtcd:
    data: Path
    client_ports: list[int]
    peer_ports: list[int]
    max_txn_ops: int = DEFAULT_MAX_TXN_OPS
    say: Callable[[str], None] = print
    binary: str | None = None
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.client_ports) != len(self.peer_ports) or not self.client_ports:
            raise ValueError("one client port and one peer port per member")

    @property
    def names(self) -> list[str]:
        return [f"e{i + 1}" for i in range(len(self.client_ports))]

    @property
    def client_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.client_ports]

    def argv(self, i: int, binary: str, token: str) -> list[str]:
        name = self.names[i]
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        return [binary, "--name", name, "--data-dir", str(self.data / name),
                "--listen-client-urls", self.client_urls[i], "--advertise-client-urls", self.client_urls[i],
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", cluster, "--initial-cluster-token", token,
                "--initial-cluster-state", "new", "--logger", "zap", "--log-level", "warn",
                "--max-txn-ops", str(max(self.max_txn_ops, DEFAULT_MAX_TXN_OPS))]

    def start(self, timeout_s: float = 30.0) -> None:
        binary = self.binary or find_etcd()
        self.data.mkdir(parents=True, exist_ok=True)
        token = f"bench-{secrets.token_hex(4)}"
        for i, name in enumerate(self.names):
            child = Child(name, self.argv(i, binary, token), self.data / "logs" / f"{name}.log")
            child.start()
            self.children.append(child)
            self.say(f"started etcd {name} (pid {child.pid}), client {self.client_urls[i]}, log {child.log_path}")
        self.say("waiting for etcd to elect a leader ...")
        self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for url, child in zip(self.client_urls, self.children):
            while True:
                if not child.alive():
                    raise RuntimeError(f"etcd {child.name} exited; see {child.log_path}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                        if json.loads(r.read()).get("health") in ("true", True):
                            break
                except (urllib.error.URLError, OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd {child.name} at {url} not healthy after {timeout_s:.0f} s")
                time.sleep(0.1)

    def stop(self) -> dict[str, int | None]:
        return stop_all(self.children)
