"""Virtual time: an asyncio event loop whose clock jumps to the next timer.

Why our own loop (about 40 lines) rather than trio's MockClock or `looptime`: the pipeline
runs on anyio's asyncio backend in the engine, so the simulator keeps the very same backend
and scheduling order (asyncio's ready queue is FIFO: a run is deterministic, no trio
scheduling randomness), and needs no extra dependency. When no callback is ready the loop
advances its clock to the earliest scheduled timer instead of sleeping; a run that waits with
nothing scheduled is a deadlock and raises instead of hanging.
"""
from __future__ import annotations

import asyncio
import selectors
from typing import Any, Awaitable, Callable

import anyio


class SimulationDeadlock(RuntimeError):
    pass


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: "VirtualTimeLoop | None" = None

    def select(self, timeout: float | None = None):
        ready = super().select(0)  # poll only: never block in real time
        if ready or self.loop is None:
            return ready
        if timeout is None:
            if not self.loop._ready:
                raise SimulationDeadlock("simulation waits with nothing scheduled (deadlock)")
            return ready
        if timeout > 0:
            self.loop._advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now_s = 0.0
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now_s

    def _advance(self, dt_s: float) -> None:
        when = self._scheduled[0]._when if self._scheduled else self._now_s + dt_s
        self._now_s = max(self._now_s, when)


class VirtualClock:
    """The Clock protocol on the running virtual loop (nanoseconds)."""

    def now_ns(self) -> int:
        return int(round(asyncio.get_running_loop().time() * 1e9))

    async def sleep_ns(self, duration_ns: int) -> None:
        if duration_ns > 0:
            await asyncio.sleep(duration_ns / 1e9)
        else:
            await asyncio.sleep(0)


def run_virtual(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run `fn()` under anyio on a fresh virtual-time loop; returns its result."""
    return anyio.run(fn, backend="asyncio", backend_options={"loop_factory": VirtualTimeLoop})
