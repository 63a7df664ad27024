"""An asyncio event loop on virtual time, for deterministic simulations.

The real shell code (worker/group.py) awaits queues, sleeps and timers. On
this loop `time()` is a number the loop advances itself: when nothing is
ready it jumps straight to the next timer instead of waiting, so seconds of
simulated time pass in microseconds, and the order of every callback is a
function of the program alone (asyncio runs ready callbacks FIFO and timers
by (when, insertion order)). Nothing here touches a socket: the selector is
a stub that never reports an event.

Blocking work goes to `InlineExecutor`, which runs a job at once on the
calling thread, so no thread ever races the loop.
"""
from __future__ import annotations

import asyncio
import selectors
from concurrent.futures import Executor, Future
from typing import Any, Callable


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is set: the simulation would wait forever."""


class _VirtualSelector(selectors.BaseSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("no callback is ready and no timer is set")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self) -> Any:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        super().__init__(_VirtualSelector(self))
        self._clock_resolution = 1e-9
        # asyncio.to_thread and run_in_executor(None) land here (the base
        # class insists on a ThreadPoolExecutor for set_default_executor).
        self._default_executor = InlineExecutor()

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def ms(self) -> int:
        return int(self._now * 1000)


class InlineExecutor(Executor):
    """Runs each job at once, on the caller's thread; its future is done on return."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the job, as a pool would
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass
