"""A GroupShell's hooks for tests that run a group without a worker process around it."""
from __future__ import annotations

from worker.replica_msgs import MetaView


class NullHooks:
    """Reports nowhere; `w1` lives at `addr` (a peer the test serves), nobody else is known."""

    def __init__(self, addr: str | None = None) -> None:
        self.addr = addr

    def peer_addr(self, worker_id: str) -> str | None:
        return self.addr if worker_id == "w1" else None

    def report_ready(self, group: int, term: int) -> None:
        pass

    def transfer_ready(self, group: int, target: str, term: int) -> None:
        pass

    def report_quorum(self, group: int, term: int, ok: bool) -> None:
        pass

    async def meta_view(self, group: int) -> MetaView | None:
        return None
