"""Running `shardgrid bench` as a child in its own process group, reaped whatever happens."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson


def run_bench(out: Path, *argv: str, expect_rc: int = 0, timeout_s: float = 180) -> tuple[Any, str, str]:
    """(the JSON result written to `out`, stdout, stderr) of `shardgrid bench ARGV --json OUT`."""
    cmd = [sys.executable, "-m", "shardgrid.cli", "bench", *argv, "--json", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:  # the cluster and the generators are in its process group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == expect_rc, stderr[-3000:]
    return orjson.loads(out.read_bytes()), stdout, stderr


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
