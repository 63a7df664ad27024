"""The running `shardgrid dev` cluster, driven from a second shell.

`shardgrid dev` serves one request per connection on a Unix socket in its
data directory (`DATA/dev.sock`): a JSON line in, a JSON line out. A second
shell sends `ps`, `kill NAME [--signal SIG]`, `start NAME` or `add-worker`
(`shardgrid dev ps` and friends are the client), so a user can SIGKILL a
worker of the local cluster, watch the failover, and bring it back with its
data, which is what shardgrid promises to survive.

The supervisor side (`DevControl`) is plain sockets polled by `shardgrid
dev`'s own loop: no thread, nothing to lock.
"""
from __future__ import annotations

import json
import select
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shardgrid.procs import Child

SOCKET_NAME = "dev.sock"
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT,
           "INT": signal.SIGINT}
MAX_REQUEST = 64 * 1024
# How long `add-worker` waits for meta's leader to hear the new worker: a
# replica can be placed on it only then (meta refuses a worker it has not heard).
LIVE_WAIT_S = 20.0


class DevControlError(Exception):
    """A request the running cluster refuses, with why (sent back to the client)."""


def exit_text(code: int | None) -> str:
    """How a child ended, as a person reads it: `exit 1`, `signal 9 (SIGKILL)`."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


@dataclass
class DevActions:
    """What the control socket may do to the cluster (LocalCluster provides them)."""

    children: Callable[[], list[Child]]
    start_child: Callable[[Child], None]
    add_worker: Callable[[list[str]], Child]  # extra worker arguments (--available-ram ...)


class DevControl:
    def __init__(self, data: Path, actions: DevActions) -> None:
        self.path = data / SOCKET_NAME
        self.actions = actions
        self.sock: socket.socket | None = None

    def open(self) -> None:
        if self.path.exists():
            if _answers(self.path):
                raise DevControlError(f"a dev cluster already runs with this data directory ({self.path})")
            self.path.unlink()  # left behind by a cluster that was killed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise DevControlError(f"cannot listen on {self.path}: {exc}") from None
        sock.listen(8)
        sock.setblocking(False)
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.path.unlink(missing_ok=True)

    def serve(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for requests and answer those that came."""
        if self.sock is None:
            return
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        if not ready:
            return
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                request = _read_line(conn)
                reply = {"ok": True, **self.handle(json.loads(request))}
            except (DevControlError, ValueError, KeyError, TypeError) as exc:
                reply = {"ok": False, "error": str(exc)}
            except OSError:
                return  # the client went away
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "ps":
            return {"children": [_describe(c) for c in self.actions.children()]}
        if op == "kill":
            child = self._child(req.get("name"))
            sig = SIGNALS.get(str(req.get("signal", "KILL")).upper().removeprefix("SIG"))
            if sig is None:
                raise DevControlError(f"unknown signal {req.get('signal')!r}: one of {', '.join(SIGNALS)}")
            if not child.alive():
                raise DevControlError(f"{child.name} is not running ({exit_text(_code(child))})")
            child.signal_group(sig)
            return {"name": child.name, "pid": child.pid, "signal": sig.name}
        if op == "start":
            child = self._child(req.get("name"))
            if child.alive():
                raise DevControlError(f"{child.name} is running already (pid {child.pid})")
            self.actions.start_child(child)
            return _describe(child)
        if op == "add-worker":
            extra: list[str] = []
            for key, flag in (("available_ram", "--available-ram"), ("available_disk", "--available-disk")):
                if req.get(key):
                    extra += [flag, str(req[key])]
            return _describe(self.actions.add_worker(extra))
        raise DevControlError(f"unknown request {op!r}: ps, kill, start, add-worker")

    def _child(self, name: Any) -> Child:
        children = {c.name: c for c in self.actions.children()}
        if name not in children:
            raise DevControlError(f"no child named {name!r}: {', '.join(children)}")
        return children[name]


def _code(child: Child) -> int | None:
    return child.proc.poll() if child.proc is not None else None


def _describe(child: Child) -> dict[str, Any]:
    alive = child.alive()
    return {"name": child.name, "pid": child.pid if child.proc is not None else None,
            "state": "running" if alive else exit_text(_code(child)), "log": str(child.log_path),
            "args": child.argv[child.argv.index("shardgrid.cli") + 1:] if "shardgrid.cli" in child.argv else []}


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST:
            raise DevControlError("request too large")
    return buf


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


# -- the client (a second shell) ------------------------------------------------------------


def request(data: Path, req: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request to the dev cluster running with `data`; its answer."""
    path = data / SOCKET_NAME
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise DevControlError(f"no dev cluster runs with data directory {data} (start one with "
                                  f"`shardgrid dev --data {data}`)") from None
        s.sendall(json.dumps(req).encode() + b"\n")
        raw = _read_line(s)
    reply: dict[str, Any] = json.loads(raw) if raw else {"ok": False, "error": "no answer"}
    return reply


def run_client(data: Path, action: str, name: str | None, sig: str, ram: str | None = None,
               disk: str | None = None, wait_live: bool = True) -> int:
    """`shardgrid dev ps|kill|start|add-worker`: print the answer; 0, or 1 when
    refused. `add-worker` waits (unless not `wait_live`) for meta's leader to hear the worker."""
    req: dict[str, Any] = {"op": action}
    if action == "add-worker":
        from shardgrid.common.units import parse_bytes
        try:
            req.update({k: v for k, v in (("available_ram", ram), ("available_disk", disk)) if v and parse_bytes(v)})
        except ValueError as exc:
            sys.stderr.write(f"shardgrid dev add-worker: {exc}\n")
            return 2
    if action in ("kill", "start"):
        if not name:
            sys.stderr.write(f"shardgrid dev {action}: name a child (see `shardgrid dev ps`)\n")
            return 2
        req["name"] = name
    if action == "kill":
        req["signal"] = sig
    try:
        reply = request(data, req)
    except DevControlError as exc:
        sys.stderr.write(f"shardgrid dev {action}: {exc}\n")
        return 1
    except OSError as exc:
        sys.stderr.write(f"shardgrid dev {action}: {exc}\n")
        return 1
    if not reply.get("ok"):
        sys.stderr.write(f"shardgrid dev {action}: {reply.get('error')}\n")
        return 1
    if action == "ps":
        sys.stdout.write(f"{'NAME':<6} {'PID':>8}  {'STATE':<22} LOG\n")
        for c in reply["children"]:
            sys.stdout.write(f"{c['name']:<6} {c['pid'] or '-':>8}  {c['state']:<22} {c['log']}\n")
    elif action == "kill":
        sys.stdout.write(f"sent {reply['signal']} to {reply['name']} (pid {reply['pid']})\n")
    else:
        sys.stdout.write(f"started {reply['name']} (pid {reply['pid']}): {' '.join(reply['args'])}\n"
                         f"  log {reply['log']}\n")
        if action == "add-worker" and wait_live:
            return _report_live(reply)
    return 0


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def _report_live(reply: dict[str, Any]) -> int:
    """Wait until meta's leader hears the added worker and say so: until then
    a `replicas add` of it is refused (not live), which a user would otherwise
    meet first."""
    import asyncio

    args, name = [str(a) for a in reply.get("args", [])], str(reply["name"])
    metas = (_flag(args, "--meta") or "").split(",")
    ca = _flag(args, "--tls-ca")
    sys.stdout.write(f"waiting for meta to hear {name} ...\n")
    sys.stdout.flush()
    try:
        leader = asyncio.run(wait_worker_live([m for m in metas if m], name, LIVE_WAIT_S,
                                              Path(ca) if ca else None))
    except TimeoutError as exc:
        sys.stderr.write(f"shardgrid dev add-worker: {exc}; see its log {reply['log']}\n")
        return 1
    sys.stdout.write(f"{name} is registered and live (heard by meta leader {leader}): meta may place replicas "
                     f"on it\n")
    return 0


async def wait_worker_live(metas: list[str], worker: str, deadline_s: float, ca: Path | None = None) -> str:
    """Until the meta leader's view says `worker` is live; the leader's id. Only
    the leader's view carries `live` (it alone hears heartbeats)."""
    import asyncio
    import time

    from meta.client import MetaClient, MetaError, MetaUnreachable
    from shardgrid.common.tls import client_context

    tls = client_context(ca) if ca is not None else None
    deadline = time.monotonic() + deadline_s
    state = "not registered yet"
    async with MetaClient(metas, tls=tls) as client:
        while time.monotonic() < deadline:
            try:
                view = await client.cluster(deadline_s=max(0.1, min(2.0, deadline - time.monotonic())))
            except (MetaError, MetaUnreachable) as exc:
                state = f"meta did not answer ({exc})"
            else:
                leader = view.get("meta_leader")
                w = view.get("workers", {}).get(worker)
                if w is not None:
                    state = f"registered ({w.get('state')}), not heard by the meta leader yet"
                if view.get("served_by") == leader and w is not None and w.get("live") is True:
                    return str(leader)
                led = next((n for n in view.get("meta", []) if n.get("id") == leader), None)
                if led is not None and led.get("http") and view.get("served_by") != leader:
                    client.prefer(str(led["http"]))
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{worker} is {state} after {deadline_s:.0f} s")
