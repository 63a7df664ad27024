"""PySyncObj glue: replicates `MetaStateMachine` across the meta nodes.

PySyncObj is treated as fragile (releases before 0.3.17 lost terms and
votes on restart): it is configured with its journal and full dump on disk, an encrypted transport (`password`; its wire
format is pickle), and a short `leaderFallbackTimeout` so that a partitioned
leader stops believing it leads within ~2 s instead of 30 s. It runs its own
thread; results come back to asyncio through `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated

from meta.state import MetaStateMachine


@dataclass(frozen=True)
class RaftPeer:
    id: str
    raft: str
    http: str


class _Replicated(SyncObjConsumer):
    """The consumer PySyncObj serializes: only `sm` is replicated state."""

    def __init__(self, on_applied: Callable[[], None]) -> None:
        # Set before SyncObjConsumer.__init__ so PySyncObj treats it as a
        # local property and never pickles it into the dump.
        self.on_applied = on_applied
        super().__init__()
        self.sm = MetaStateMachine()

    @replicated
    def apply_command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        result = self.sm.apply(cmd)
        self.on_applied()
        return result


_FAIL_NAMES = {
    FAIL_REASON.QUEUE_FULL: "queue_full",
    FAIL_REASON.MISSING_LEADER: "missing_leader",
    FAIL_REASON.DISCARDED: "discarded",
    FAIL_REASON.NOT_LEADER: "not_leader",
    FAIL_REASON.LEADER_CHANGED: "leader_changed",
    FAIL_REASON.REQUEST_DENIED: "request_denied",
}


class RaftUnavailable(Exception):
    """The command was not (or not known to be) committed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MetaRaft:
    def __init__(self, me: RaftPeer, peers: list[RaftPeer], data_dir: Path, password: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.me = me
        self.peers = peers
        self._loop = loop
        self._changed = asyncio.Event()
        data_dir.mkdir(parents=True, exist_ok=True)
        self._consumer = _Replicated(self._notify)
        conf = SyncObjConf(
            password=password,
            # PySyncObj binds 0.0.0.0 unless told otherwise: keep the raft
            # port on the address the operator chose.
            bindAddress=me.raft,
            journalFile=str(data_dir / "raft.journal"),
            fullDumpFile=str(data_dir / "raft.dump"),
            leaderFallbackTimeout=2.0,
            raftMinTimeout=0.4,
            raftMaxTimeout=1.4,
            connectionTimeout=3.5,
            connectionRetryTime=0.5,
            logCompactionMinEntries=2000,
            logCompactionMinTime=300,
            dynamicMembershipChange=False,
            commandsWaitLeader=True,
        )
        self._by_raft = {p.raft: p for p in [me, *peers]}
        self._syncobj = SyncObj(me.raft, [p.raft for p in peers], conf=conf, consumers=[self._consumer])

    # -- state ----------------------------------------------------------------

    @property
    def sm(self) -> MetaStateMachine:
        """This node's applied state. May lag the leader: use `submit` for anything that must be current."""
        return self._consumer.sm

    def _notify(self) -> None:
        # Called on PySyncObj's thread after every applied command.
        self._loop.call_soon_threadsafe(self._wake_watchers)

    def _wake_watchers(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout: float) -> None:
        event = self._changed
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def is_leader(self) -> bool:
        return bool(self._syncobj._isLeader())

    def leader(self) -> RaftPeer | None:
        addr = self._syncobj._getLeader()
        if addr is None:
            return None
        return self._by_raft.get(str(addr.address if hasattr(addr, "address") else addr))

    def status(self) -> dict[str, Any]:
        raw = self._syncobj.getStatus()
        leader = self.leader()
        peers = {}
        for p in self.peers:
            peers[p.id] = {"raft": p.raft, "http": p.http,
                           "connected": raw.get("partner_node_status_server_" + p.raft) == 2}
        return {
            "id": self.me.id,
            "role": {0: "follower", 1: "candidate", 2: "leader"}.get(raw["state"], str(raw["state"])),
            "leader": leader.id if leader else None,
            "leader_http": leader.http if leader else None,
            "has_quorum": bool(raw["has_quorum"]),
            "raft_term": raw["raft_term"],
            "commit_index": raw["commit_idx"],
            "last_applied": raw["last_applied"],
            "log_len": raw["log_len"],
            "peers": peers,
            "revision": self.sm.revision,
        }

    # -- commands ----------------------------------------------------------------

    async def submit(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Commit `cmd` through the Raft log and return the state machine's result.

        Works on any node: PySyncObj forwards a follower's command to the
        leader. A timeout means the outcome is unknown; since every command is
        a compare-and-set, a retry after re-reading is always safe.
        """
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()

        def done(result: Any, error: int) -> None:
            self._loop.call_soon_threadsafe(_resolve, fut, result, error)

        self._consumer.apply_command(cmd, callback=done)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RaftUnavailable("timeout") from None

    def close(self) -> None:
        self._syncobj.destroy()


def _resolve(fut: asyncio.Future[dict[str, Any]], result: Any, error: int) -> None:
    if fut.done():
        return
    if error == FAIL_REASON.SUCCESS:
        fut.set_result(result)
    else:
        fut.set_exception(RaftUnavailable(_FAIL_NAMES.get(error, f"error_{error}")))
