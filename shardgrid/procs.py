"""Child processes that die with their parent and are reaped as a group.

Used by `shardgrid dev`, the benchmark's local cluster and the tier3 tests.
Each child gets its own session (so a signal to the group reaches its
descendants) and PR_SET_PDEATHSIG=SIGKILL (so a SIGKILLed parent leaves no
orphans behind).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    _termed: bool = field(default=False, repr=False)

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._termed = False
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=env,
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        if sig == signal.SIGTERM:
            # A second TERM during shutdown would hit the default handler
            # once the process has removed its own: send it once.
            if self._termed:
                return
            self._termed = True
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group and reap it."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self._close_log()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait()
        # Reap anything left in the group (a grandchild that ignored TERM).
        self.signal_group(signal.SIGKILL)
        self._close_log()
        return self.proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_all(children: Sequence[Child], timeout: float = 10.0) -> dict[str, int | None]:
    """TERM every child at once, then wait for each; KILL stragglers."""
    for child in children:
        if child.alive():
            child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes: dict[str, int | None] = {}
    for child in children:
        codes[child.name] = child.stop(max(0.1, deadline - time.monotonic()))
    return codes
