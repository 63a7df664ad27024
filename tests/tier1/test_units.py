"""Sizes as operators write them (`--available-ram 8GB`)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from shardgrid.common.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, value", [("4096", 4096), ("8GB", 8 * 10**9), ("8 gb", 8 * 10**9),
                                         ("512MiB", 512 * 2**20), ("1.5TB", 15 * 10**11), ("2KiB", 2048)])
def test_parse(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "8 lightyears", "1e3", "9999999TB"])
def test_parse_refuses_with_why(text: str) -> None:
    with pytest.raises(ValueError, match="not a size|too large"):
        parse_bytes(text)


def test_format_reads_back() -> None:
    for n in (10, 8 * 10**9, 1_500_000_000, 50 * 10**9):
        assert format_bytes(n) in {"10 B", "8 GB", "1.5 GB", "50 GB"}
        assert parse_bytes(format_bytes(n).replace(" ", "")) == n


def test_the_worker_refuses_a_bad_size_before_it_starts() -> None:
    r = subprocess.run([sys.executable, "-m", "shardgrid.cli", "worker", "--id", "w9", "--http", "127.0.0.1:1",
                        "--meta", "127.0.0.1:2", "--data", "/nonexistent", "--available-ram", "lots"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'lots' is not a size" in r.stderr
