"""Waiting for a condition inside an event loop, with a deadline (never sleep-and-hope)."""
from __future__ import annotations

import asyncio
from typing import Any, Callable


async def until(cond: Callable[[], Any], what: str, timeout_s: float = 10.0, interval_s: float = 0.05) -> None:
    """Poll `cond` until it is truthy; fail naming `what` after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() >= deadline:
            raise AssertionError(f"{what} within {timeout_s:g} s")
        await asyncio.sleep(interval_s)
