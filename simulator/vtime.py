"""Virtual time: an asyncio event loop whose clock jumps to the next timer.

Why our own loop (about 60 lines) rather than trio's MockClock or `looptime`: the pipeline
runs on anyio's asyncio backend in the engine, so the simulator keeps the very same backend
and scheduling order (asyncio's ready queue is FIFO: a run is deterministic, no trio
scheduling randomness), and needs no extra dependency. When no callback is ready the loop
advances its clock to the earliest scheduled timer instead of sleeping; a run that waits with
nothing scheduled is a deadlock and raises instead of hanging.

Two ways for virtual time to pass: `VirtualClock.sleep_ns` waits (other tasks run, as
during a real await) and `VirtualClock.advance_ns` is busy time (the clock moves on while
the calling task keeps the loop, as a CPU stage does on a real event loop; timers that fall
due meanwhile fire late, at the next wait).
"""
from __future__ import annotations

import asyncio
import heapq
import selectors
from typing import Any, Awaitable, Callable



class SimulationDeadlock(RuntimeError):
    pass


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self.now_ns = 0  # the virtual clock, integer nanoseconds (asyncio's timers are floats)
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.now_ns / 1e9

    def call_after_ns(self, delay_ns: int, callback: Callable[..., Any], *args: Any) -> asyncio.TimerHandle:
        """`call_later` in integer nanoseconds: the timer fires exactly `delay_ns` later."""
        return self.call_at((self.now_ns + delay_ns) / 1e9, callback, *args)

    def _run_once(self) -> None:
        """One loop iteration, leaner than asyncio's: no I/O poll unless a file descriptor
        besides the loop's own wake-up pipe is registered (a simulation has none), and the
        clock jumps straight to the next timer when nothing is ready. This loop runs every
        virtual sleep, so it sets the simulator's speed."""
        scheduled, ready = self._scheduled, self._ready
        if self._timer_cancelled_count > 64 and self._timer_cancelled_count * 2 > len(scheduled):
            live = [h for h in scheduled if not h._cancelled]
            for h in scheduled:
                if h._cancelled:
                    h._scheduled = False
            heapq.heapify(live)
            self._scheduled = scheduled = live
            self._timer_cancelled_count = 0
        while scheduled and scheduled[0]._cancelled:
            self._timer_cancelled_count -= 1
            heapq.heappop(scheduled)._scheduled = False
        if len(self._selector.get_map()) > 1:
            self._process_events(self._selector.select(0))
        if not ready and not self._stopping:
            if not scheduled:
                raise SimulationDeadlock("simulation waits with nothing scheduled (deadlock)")
            when_ns = int(scheduled[0]._when * 1e9 + 0.5)
            if when_ns > self.now_ns:
                self.now_ns = when_ns
        # `<=`: at huge times (~1e9 s) a float second no longer resolves a nanosecond, and a
        # timer due exactly now would never count as due (the clock could not move on)
        end = self.now_ns / 1e9 + self._clock_resolution
        while scheduled and scheduled[0]._when <= end:
            h = heapq.heappop(scheduled)
            h._scheduled = False
            ready.append(h)
        for _ in range(len(ready)):
            h = ready.popleft()
            if not h._cancelled:
                h._run()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class VirtualClock:
    """The Clock protocol on a virtual loop (integer nanoseconds). Create it inside the
    running loop, or pass the loop. `sleep_ns` is `asyncio.sleep` without the float
    round trip (the simulator's most frequent call)."""

    def __init__(self, loop: VirtualTimeLoop | None = None):
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        if not isinstance(self.loop, VirtualTimeLoop):
            raise TypeError("VirtualClock needs a VirtualTimeLoop (run it under run_virtual)")

    def now_ns(self) -> int:
        return self.loop.now_ns

    def advance_ns(self, duration_ns: int) -> None:
        """Busy time: the clock moves on and no other task runs meanwhile, as while a CPU
        stage holds a real event loop; timers that fall due fire late, at the next wait."""
        if duration_ns > 0:
            self.loop.now_ns += int(duration_ns)

    async def sleep_ns(self, duration_ns: int) -> None:
        if duration_ns <= 0:
            await asyncio.sleep(0)
            return
        fut = self.loop.create_future()
        handle = self.loop.call_after_ns(int(duration_ns), _wake, fut)
        try:
            await fut
        except BaseException:  # cancelled before the timer fired: drop the timer
            handle.cancel()
            raise


def run_virtual(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run `fn()` on a fresh virtual-time loop; returns its result. anyio's primitives run on
    any asyncio loop, so this is asyncio's own runner: `anyio.run` would add ~0.13 ms of set-up
    per run, a few percent of a small replay."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(fn())
