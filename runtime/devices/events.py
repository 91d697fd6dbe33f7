"""An Event completed from another thread, awaitable from any event loop.

Why: the host device learns about finished work on a reader thread, while the scheduler
waits on the asyncio event loop (or blocks a plain thread). A `threading.Event` serves the
blocking `synchronize()`; awaiting tasks get an asyncio future that the reader thread
resolves through `loop.call_soon_threadsafe`, so waiting never blocks or spins the loop and
cancelling a waiting task cancels only that wait, not the device work.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio.to_thread

from specsched.scheduler.protocols import DeviceError


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class CompletionEvent:
    """Completion of one launched op; set exactly once by `set_result` or `set_error`."""

    def __init__(self, op: str, stream: str, seq: int, launch_ns: int, owner: object):
        self.op = op
        self.stream = stream
        self.seq = seq  # launch order on the owning device, from 0
        self.launch_ns = launch_ns  # host monotonic time of launch
        self.start_ns: int | None = None  # device interval, system monotonic clock
        self.end_ns: int | None = None
        self.owner = owner  # the device that launched it (for wait_event)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._result: Any = None
        self._error: tuple[type[DeviceError], str, str | None] | None = None

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._error else "done")
        return f"<CompletionEvent op={self.op!r} stream={self.stream!r} seq={self.seq} {state}>"

    # -- completion (called by the device, usually from its reader thread) --

    def set_result(self, result: Any, start_ns: int | None, end_ns: int | None) -> bool:
        return self._finish(result, None, start_ns, end_ns)

    def set_error(self, kind: type[DeviceError], message: str, remote_traceback: str | None = None,
                  start_ns: int | None = None, end_ns: int | None = None) -> bool:
        return self._finish(None, (kind, message, remote_traceback), start_ns, end_ns)

    def _finish(self, result: Any, error: tuple | None,
                start_ns: int | None, end_ns: int | None) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._result, self._error = result, error
            self.start_ns, self.end_ns = start_ns, end_ns
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that loop is closed; nobody is waiting there any more
                pass
        return True

    # -- the Event protocol --

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout_s: float | None = None) -> Any:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"device op {self.op!r} on stream {self.stream!r} "
                               f"not finished after {timeout_s} s")
        return self._outcome()

    async def wait(self) -> Any:
        if self._done.is_set():
            return self._outcome()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another async library (e.g. trio through anyio): use a thread
            await anyio.to_thread.run_sync(self._done.wait, abandon_on_cancel=True)
            return self._outcome()
        fut = loop.create_future()
        with self._lock:
            registered = not self._done.is_set()
            if registered:
                self._waiters.append((loop, fut))
        if registered:
            try:
                await fut
            finally:
                with self._lock:
                    if (loop, fut) in self._waiters:
                        self._waiters.remove((loop, fut))
        return self._outcome()

    def _outcome(self) -> Any:
        if self._error is None:
            return self._result
        raise_device_error(self.op, self._error)


def raise_device_error(op: str, error: tuple[type[DeviceError], str, str | None]) -> None:
    """Raise a failed op's error, with the device-side traceback as a note."""
    kind, message, remote_tb = error
    exc = kind(op, message, remote_traceback=remote_tb)
    if remote_tb:
        exc.add_note(f"device traceback:\n{remote_tb.rstrip()}")
    raise exc
