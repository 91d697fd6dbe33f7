"""Host (CPU) device: a separate worker process that runs launched ops in order.

Why: on a CPU machine the only way device work overlaps host work is another process: the
models' forwards are Python-dispatch bound and hold the GIL, so a device thread would
serialize with the host's stages. `Stream.launch` pickles the batch, writes it to a pipe and
returns an Event at once; a reader thread receives completions and finishes the Events.

Streams: all streams of one host device execute in launch order in the one worker process.
That is a valid in-order execution of a multi-stream device (each stream is in order, and any
interleaving of streams is allowed); a CPU has no intra-device concurrency to offer. Hence
`wait_event` on an event of the same device is satisfied by construction.

Failures: an exception in an op fails that op's Event with `DeviceError` (remote traceback
attached) and the device keeps working. A dead worker process fails every pending and later
Event with `DeviceCrashed` naming its exit code; nothing waits forever.
"""
from __future__ import annotations

import io
import itertools
import os
import pickle
import sys
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_any
from typing import Any

from specsched.runtime.devices.events import CompletionEvent
from specsched.runtime.devices.native import preload_env
from specsched.runtime.devices.process import WorkerProcess, kill_quietly
from specsched.runtime.devices.spec import DeviceStartError, WorkerSpec
from specsched.scheduler.protocols import Batch, DeviceCrashed, DeviceError, Event

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class HostStream:
    """A named in-order queue on a HostDevice (all its streams share one execution order)."""

    def __init__(self, device: HostDevice, name: str):
        self.name = name
        self.device = device

    def __repr__(self) -> str:
        return f"<HostStream {self.device.name}/{self.name}>"

    def launch(self, op: str, batch: Batch) -> CompletionEvent:
        return self.device._launch(self.name, op, batch)

    def wait_event(self, event: Event) -> None:
        if getattr(event, "owner", None) is self.device or event.query():
            return  # launched earlier on this device, so it runs first; or already done
        raise ValueError(f"host device {self.device.name!r} cannot wait on unfinished op "
                         f"{event.op!r} of another device; synchronize it on the host first")


class HostDevice:
    """A device backed by one worker process that owns the Worker (weights, KV cache)."""

    kind = "host"
    needs_plans = True
    warm_first_launch = False  # the worker's first launch of an op pays one-off costs

    def __init__(self, spec: WorkerSpec, *, name: str = "host", num_threads: int = 1,
                 spin_ms: float = 0.0, start_timeout_s: float = 120.0, close_timeout_s: float = 10.0,
                 malloc: str = "system", openmp: str = "system"):
        """`spin_ms`: how long the worker polls for its next launch before blocking
        (worker_main.py: an idle core runs the next op slower). `malloc` / `openmp`: the
        allocator and OpenMP runtime the worker starts with (native.py: "auto", "system" or a
        library's path); `runtime_libs` says what it runs with."""
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"HostDevice needs a WorkerSpec, got {type(spec).__name__}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if not spin_ms >= 0:
            raise ValueError(f"spin_ms must be >= 0, got {spin_ms}")
        self.name = name
        self.spec = spec
        self.num_threads = num_threads
        self._close_timeout_s = close_timeout_s
        self._streams: dict[str, HostStream] = {}
        self._seq = itertools.count()
        self._send_lock = threading.Lock()  # launch order == pipe order == execution order
        self._pending_lock = threading.Lock()
        self._pending: dict[int, CompletionEvent] = {}
        self._failure: str | None = None  # set once the worker is gone; fails later launches
        self._closed = False

        self.runtime_libs: dict[str, str] = {}
        self._process = WorkerProcess(name, preload_env(dict(os.environ), malloc, openmp))
        self.pid = self._process.pid
        weakref.finalize(self, kill_quietly, self._process.popen)
        try:
            try:
                self._process.launch.send((spec, num_threads, list(sys.path), spin_ms / 1e3))
            except OSError:
                pass  # the process already died; the handshake reports how
            self._handshake(start_timeout_s)
        except BaseException:
            self._process.stop(timeout_s=0.5)
            self._process.close_handles()
            self._closed = True
            raise
        self._reader = threading.Thread(target=self._read_replies, name=f"{name}-replies",
                                        daemon=True)
        self._reader.start()

    def __repr__(self) -> str:
        return f"<HostDevice {self.name!r} pid={self.pid} pending={self.num_pending}>"

    def __enter__(self) -> HostDevice:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- public API --

    def stream(self, name: str) -> HostStream:
        if name not in self._streams:
            self._streams[name] = HostStream(self, name)
        return self._streams[name]

    def call(self, op: str, batch: Batch | None = None, *, timeout_s: float | None = 60.0) -> Any:
        """Launch `op` on the "control" stream and block for its result (e.g. "__stats__")."""
        return self.stream("control").launch(op, batch or {}).synchronize(timeout_s)

    def stats(self) -> dict[str, Any]:
        """Worker-process counters: pid, num_ops, busy_ns, num_threads, torch_threads."""
        return self.call("__stats__")

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def is_alive(self) -> bool:
        return self._failure is None and not self._closed and self._process.is_alive()

    def close(self) -> None:
        """Finish queued ops, stop the worker process (terminate it after close_timeout_s)."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._process.launch.send_bytes(pickle.dumps(None, _PROTOCOL))
            except OSError:
                pass
        self._process.stop(self._close_timeout_s)
        self._reader.join(timeout=5.0)
        self._process.close_handles()

    # -- internals --

    def _handshake(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        factory, replies = self.spec.factory, self._process.replies
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeviceStartError(factory, f"worker process not ready after {timeout_s} s")
            ready = wait_any(self._process.waitables(), timeout=remaining)
            if not ready:
                continue
            try:
                if replies not in ready and not replies.poll():
                    raise EOFError
                message = replies.recv()
            except EOFError:
                raise DeviceStartError(factory, "worker process " + self._process.describe_exit()
                                       + " before it was ready") from None
            if message[0] == "ready":
                self.runtime_libs = message[2]
                return
            raise DeviceStartError(factory, message[1], remote_traceback=message[2])

    def _launch(self, stream: str, op: str, batch: Batch) -> CompletionEvent:
        if not isinstance(op, str) or not op:
            raise ValueError(f"op must be a non-empty string, got {op!r}")
        try:
            payload = pickle.dumps(batch, _PROTOCOL)
        except Exception as exc:
            raise TypeError(f"batch for device op {op!r} is not picklable: {exc}") from exc
        with self._send_lock:
            if self._closed:
                raise RuntimeError(f"host device {self.name!r} is closed; cannot launch {op!r}")
            seq = next(self._seq)
            event = CompletionEvent(op, stream, seq, time.monotonic_ns(), owner=self)
            with self._pending_lock:
                if self._failure is not None:
                    event.set_error(DeviceCrashed, self._failure)
                    return event
                self._pending[seq] = event
            try:
                header = pickle.dumps((seq, stream, op), _PROTOCOL)
                self._process.launch.send_bytes(header + payload)
            except OSError:
                pass  # the worker is gone; the reader thread fails every pending event
        return event

    def _read_replies(self) -> None:
        conn, waitables = self._process.replies, self._process.waitables()
        broken: str | None = None
        while True:
            try:
                ready = wait_any(waitables)
                if conn not in ready and not conn.poll():
                    break  # the process exited and nothing is left to read
                self._complete(conn.recv_bytes())
            except (EOFError, OSError):
                break
            except Exception as exc:  # an unreadable reply: the pipe can no longer be trusted
                broken = f"unreadable reply from the worker process: {type(exc).__name__}: {exc}"
                self._process.stop(timeout_s=0.0)
                break
        if self._closed:
            reason = f"host device {self.name!r} was closed"
        else:
            broken = broken or "worker process " + self._process.describe_exit()
            reason = f"host device {self.name!r}: {broken}"
        with self._pending_lock:
            self._failure = reason
            pending, self._pending = self._pending, {}
        for event in pending.values():
            event.set_error(DeviceCrashed, reason)

    def _complete(self, data: bytes) -> None:
        buf = io.BytesIO(data)
        header = pickle.load(buf)  # reads the first pickle only; the payload follows
        with self._pending_lock:
            event = self._pending.pop(header[1], None)
        if event is None:
            return
        if header[0] == "err":
            _, _, start_ns, end_ns, message, remote_tb = header
            event.set_error(DeviceError, message, remote_tb, start_ns, end_ns)
            return
        _, _, start_ns, end_ns = header
        try:
            result = pickle.load(buf)
        except Exception as exc:
            event.set_error(DeviceError, f"result could not be unpickled on the host: "
                            f"{type(exc).__name__}: {exc}", None, start_ns, end_ns)
            return
        event.set_result(result, start_ns, end_ns)
