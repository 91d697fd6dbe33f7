"""CUDA device: the Worker runs in this process and queues its kernels on torch CUDA streams.

Why: on a GPU, kernel launches are already asynchronous, so no extra process is needed; the
device only has to bracket each op with timing events and let the host wait without blocking
the event loop. torch is imported lazily, so importing this module works on CPU machines.

- Launch: `launch` hands the op to the device's dispatch thread and returns at once; the
  thread runs the ops in launch order, each under `torch.cuda.stream(s)` between a start and
  an end `torch.cuda.Event(enable_timing=True)`. An op must only enqueue GPU work (no syncs).
  Why a thread: an op's Python (an eager forward of every layer, FlashInfer's `plan`) takes
  milliseconds of host time, and run inside `launch` it would hold the event loop that
  schedules the next step for all of it; torch releases the GIL inside its ops, so the loop
  runs between them. `wait_event` goes through the same queue, so a stream waits on an op's
  end event only after the op was dispatched, in launch order. `dispatch="inline"` (or the
  environment variable SPECSCHED_CUDA_DISPATCH=inline) runs the op inside `launch` instead,
  in the caller's thread: no thread handoff, but the loop waits for the op's host work.
- Results: whatever the op returns is handed back by `synchronize()`/`wait()` once the end
  event completed. Device tensors are fine; host copies must be made by the op with
  `copy_(..., non_blocking=True)` into pinned memory -- they are valid after the event.
  A tensor made on one stream and used on another needs `tensor.record_stream(...)` in the op.
- Waiting: `query()` asks the end event; `synchronize()` blocks in cudaEventSynchronize (end
  events are created with `blocking=True`, so the waiting thread sleeps instead of spinning
  a core); `await wait()` hands that to a thread (anyio.to_thread), so the loop never spins and
  a cancelled wait only abandons the thread, never the GPU work.
- Timestamps: GPU event times are mapped onto the host monotonic clock through an anchor
  event on an otherwise idle calibration stream, measured at start-up by recording it and
  synchronizing (best of 5 tries). Every `recalibrate_every_s` a new anchor is recorded without
  a sync (its host time is the record time plus the measured submit latency), which keeps the
  float32 `elapsed_time` precise (~1 us) and bounds clock drift; error is a few microseconds.
- Errors: a Python exception in the op fails its Event with DeviceError. A CUDA error
  (device-side assert, illegal address) poisons the CUDA context: that op and every later one
  fail with DeviceCrashed.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

from specsched.runtime.devices.events import raise_device_error
from specsched.runtime.devices.spec import DeviceStartError, WorkerSpec
from specsched.scheduler.protocols import Batch, DeviceCrashed, DeviceError, Event

_Failure = tuple[type[DeviceError], str, "str | None"]


def _import_torch() -> Any:
    import torch

    return torch


def cuda_available() -> bool:
    try:
        return bool(_import_torch().cuda.is_available())
    except ImportError:
        return False


@dataclass(frozen=True)
class _Anchor:
    event: Any  # torch.cuda.Event(enable_timing=True) recorded on the idle calibration stream
    host_ns: int  # host monotonic time at which the GPU executed `event` (estimate)


class CudaEvent:
    """Completion of one op on a CudaDevice: its end CUDA event plus the op's result."""

    def __init__(self, device: CudaDevice, op: str, stream: str, launch_ns: int, *, error: _Failure | None = None):
        """A launched op, pending until `_dispatch_done`; with `error`, one that failed before
        anything was queued."""
        self.op = op
        self.stream = stream
        self.launch_ns = launch_ns  # host monotonic time of launch
        self.owner = device
        self._times: tuple[int, int] | None = None
        # set once the op ran on the host (its GPU work queued)
        self._dispatched = threading.Event()
        self._start = self._end = self._anchor = self._result = self._error = None
        self._done = False
        if error is not None:
            self._dispatch_done(error=error)

    def _dispatch_done(self, *, start: Any = None, end: Any = None, anchor: _Anchor | None = None,
                       result: Any = None, error: _Failure | None = None) -> None:
        self._start, self._end, self._anchor = start, end, anchor
        self._result, self._error = result, error
        self._done = end is None
        self._dispatched.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"<CudaEvent op={self.op!r} stream={self.stream!r} {state}>"

    @property
    def start_ns(self) -> int | None:
        return self._interval()[0]

    @property
    def end_ns(self) -> int | None:
        return self._interval()[1]

    def query(self) -> bool:
        if self._done:
            return True
        if not self._dispatched.is_set():
            return False
        try:
            self._done = bool(self._end.query())
        except RuntimeError as exc:
            self._fail_cuda(exc)
        return self._done

    def synchronize(self, timeout_s: float | None = None) -> Any:
        if timeout_s is None:
            self._block()
        else:
            deadline = time.monotonic() + timeout_s
            pause_s = 20e-6
            while not self.query():
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"device op {self.op!r} on stream {self.stream!r} "
                                       f"not finished after {timeout_s} s")
                time.sleep(min(pause_s, left_s))
                pause_s = min(pause_s * 2, 1e-3)
        return self._outcome()

    async def wait(self) -> Any:
        if not self.query():
            await anyio.to_thread.run_sync(self._block, abandon_on_cancel=True)
        return self._outcome()

    def _block(self) -> None:
        self._dispatched.wait()
        if self._done:
            return
        torch = self.owner.torch
        try:
            with torch.cuda.device(self.owner.index):
                self._end.synchronize()
            self._done = True
        except RuntimeError as exc:
            self._fail_cuda(exc)

    def _fail_cuda(self, exc: BaseException) -> None:
        message = f"CUDA error: {exc}"
        self.owner._mark_failed(f"device {self.owner.name!r} hit a CUDA error: {exc}")
        self._error = (DeviceCrashed, message, None)
        self._done = True

    def _interval(self) -> tuple[int | None, int | None]:
        anchor = self._anchor
        if self._times is None and anchor is not None and self.query() and anchor.event.query():
            try:
                self._times = (anchor.host_ns + round(anchor.event.elapsed_time(self._start) * 1e6),
                               anchor.host_ns + round(anchor.event.elapsed_time(self._end) * 1e6))
            except RuntimeError:
                return None, None
        return self._times or (None, None)

    def _outcome(self) -> Any:
        if self._error is None:
            return self._result
        raise_device_error(self.op, self._error)


class CudaStream:
    """A named torch.cuda.Stream on a CudaDevice."""

    def __init__(self, device: CudaDevice, name: str, torch_stream: Any):
        self.name = name
        self.device = device
        self.torch_stream = torch_stream

    def __repr__(self) -> str:
        return f"<CudaStream {self.device.name}/{self.name}>"

    def launch(self, op: str, batch: Batch) -> CudaEvent:
        return self.device._launch(self, op, batch)

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.device._submit(("wait", self, event))
        elif not event.query():
            raise ValueError(f"CUDA stream {self.name!r} cannot wait on unfinished op {event.op!r} "
                             "of a non-CUDA device; synchronize it on the host first")


class CudaDevice:
    """A device on one GPU of this process; the Worker is built here, inside its CUDA context."""

    kind = "cuda"
    needs_plans = True
    warm_first_launch = False  # an op's first launch pays one-off costs (kernel loads, allocation)

    def __init__(self, spec: WorkerSpec, *, device: str | int = "cuda", name: str | None = None,
                 num_threads: int | None = None, recalibrate_every_s: float = 5.0, dispatch: str | None = None):
        """`num_threads`, if given, sets torch's CPU threads -- of this whole process; `dispatch`:
        "thread" (default) or "inline", see the module's docstring."""
        dispatch = dispatch or os.environ.get("SPECSCHED_CUDA_DISPATCH", "thread")
        if dispatch not in ("thread", "inline"):
            raise ValueError(f"dispatch must be 'thread' or 'inline', got {dispatch!r}")
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"CudaDevice needs a WorkerSpec, got {type(spec).__name__}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch = _import_torch()
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs a CUDA GPU but torch.cuda.is_available() is False "
                               f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if target.type != "cuda":
            raise ValueError(f"CudaDevice needs a cuda device, got {device!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.torch = torch
        self.index = target.index if target.index is not None else torch.cuda.current_device()
        self.name = name or f"cuda:{self.index}"
        self.spec = spec
        self._recalibrate_every_ns = int(recalibrate_every_s * 1e9)
        self._streams: dict[str, CudaStream] = {}
        self._failure: str | None = None
        self._closed = False
        with torch.cuda.device(self.index):
            try:
                self._worker = spec.build()
            except Exception as exc:
                raise DeviceStartError(spec.factory, f"{type(exc).__name__}: {exc}",
                                       remote_traceback=traceback.format_exc()) from exc
            self._calib_stream = torch.cuda.Stream()
            self.recalibrate()
        self.dispatch = dispatch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        if dispatch == "thread":
            self._thread = threading.Thread(target=self._dispatch_loop, name=f"{self.name}-dispatch", daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"<CudaDevice {self.name!r}>"

    def __enter__(self) -> CudaDevice:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stream(self, name: str) -> CudaStream:
        if name not in self._streams:
            with self.torch.cuda.device(self.index):
                self._streams[name] = CudaStream(self, name, self.torch.cuda.Stream())
        return self._streams[name]

    def call(self, op: str, batch: Batch | None = None, *, timeout_s: float | None = 60.0) -> Any:
        """Launch `op` on the "control" stream and block for its result."""
        return self.stream("control").launch(op, batch or {}).synchronize(timeout_s)

    def recalibrate(self, num_tries: int = 5) -> None:
        """Re-measure the GPU-to-host clock mapping (waits only on the idle calibration stream)."""
        best = None
        for _ in range(num_tries):
            event = self.torch.cuda.Event(enable_timing=True)
            t0 = time.monotonic_ns()
            event.record(self._calib_stream)
            t1 = time.monotonic_ns()
            event.synchronize()
            t2 = time.monotonic_ns()
            if best is None or t2 - t0 < best[0]:
                best = (t2 - t0, event, t0, t1, t2)
        _, event, t0, t1, t2 = best
        self._anchor = _Anchor(event, (t0 + t2) // 2)
        self._submit_latency_ns = max(0, self._anchor.host_ns - t1)

    def is_alive(self) -> bool:
        return self._failure is None and not self._closed

    def close(self) -> None:
        """Wait for queued work, then release the Worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        try:
            with self.torch.cuda.device(self.index):
                for stream in self._streams.values():
                    stream.torch_stream.synchronize()
        except RuntimeError:
            pass
        close = getattr(self._worker, "close", None)
        if callable(close):
            close()
        self._worker = None

    def _mark_failed(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason

    def _current_anchor(self) -> _Anchor:
        if time.monotonic_ns() - self._anchor.host_ns > self._recalibrate_every_ns:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record(self._calib_stream)
            self._anchor = _Anchor(event, time.monotonic_ns() + self._submit_latency_ns)
        return self._anchor

    def _submit(self, item: tuple) -> None:
        if self._thread is not None:
            self._queue.put(item)
        else:
            self._run_item(item)

    def _launch(self, stream: CudaStream, op: str, batch: Batch) -> CudaEvent:
        if not isinstance(op, str) or not op:
            raise ValueError(f"op must be a non-empty string, got {op!r}")
        if self._closed:
            raise RuntimeError(f"CUDA device {self.name!r} is closed; cannot launch {op!r}")
        launch_ns = time.monotonic_ns()
        if self._failure is not None:
            return CudaEvent(self, op, stream.name, launch_ns,
                             error=(DeviceCrashed, self._failure, None))
        event = CudaEvent(self, op, stream.name, launch_ns)
        self._submit(("op", stream, op, batch, event))
        return event

    def _dispatch_loop(self) -> None:
        """The dispatch thread: runs launched ops and stream waits in launch order."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run_item(item)

    def _run_item(self, item: tuple) -> None:
        """One queued launch ("op", stream, op, batch, event) or stream wait ("wait", stream, event)."""
        with self.torch.cuda.device(self.index):
            if item[0] == "wait":
                _, stream, event = item
                event._dispatched.wait()  # queued before this wait: already dispatched
                if event._end is not None and self._failure is None:
                    stream.torch_stream.wait_event(event._end)
                return
            _, stream, op, batch, event = item
            if self._failure is not None:
                event._dispatch_done(error=(DeviceCrashed, self._failure, None))
                return
            try:
                self._run_op(stream, op, batch, event)
            except BaseException as exc:  # noqa: BLE001 - the dispatch thread must outlive any op
                event._dispatch_done(error=(DeviceError, f"{type(exc).__name__}: {exc}", traceback.format_exc()))

    def _run_op(self, stream: CudaStream, op: str, batch: Batch, event: CudaEvent) -> None:
        torch, s = self.torch, stream.torch_stream
        result, error = None, None
        try:
            anchor = self._current_anchor()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True, blocking=True)
            with torch.cuda.stream(s):
                start.record(s)
                try:
                    result = self._worker.execute(op, batch)
                except Exception as exc:
                    if _is_cuda_error(torch, exc):
                        raise
                    message = f"{type(exc).__name__}: {exc}"
                    error = (DeviceError, message, traceback.format_exc())
                end.record(s)
        except RuntimeError as exc:
            if not _is_cuda_error(torch, exc):
                raise
            self._mark_failed(f"device {self.name!r} hit a CUDA error: {exc}")
            event._dispatch_done(error=(DeviceCrashed, f"CUDA error: {exc}", traceback.format_exc()))
            return
        event._dispatch_done(start=start, end=end, anchor=anchor, result=result, error=error)


def _is_cuda_error(torch: Any, exc: BaseException) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
