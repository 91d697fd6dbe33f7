"""The host device's worker process: build the Worker, then run launched ops in order.

Why a process and not a thread: the small models' forward is Python-dispatch bound and holds
the GIL, so a device thread gives no overlap with host work; a process does.

Wire format (both directions, one `send_bytes` message each): a pickled header followed by a
pickled payload, so a payload that fails to unpickle still names its op and sequence number.
- host -> worker: header `(seq, stream, op)` + batch; header `None` asks the worker to stop.
- worker -> host: `("ok", seq, start_ns, end_ns)` + result, or
  `("err", seq, start_ns, end_ns, message, traceback)` + `None`.
Before any of that the host sends `(spec, num_threads, sys_path, spin_s)` and the worker answers
`("ready", pid, libs)` (`native.runtime_libs()`: the allocator and OpenMP runtime it runs
with) or `("init_err", message, traceback)` (plain `send`/`recv` messages).
Times are `time.monotonic_ns()`: the system monotonic clock, the same base as the host's.

The worker reads the launch pipe itself between ops; there is no receiver thread. A thread
blocked on the pipe would be woken by every launch while the worker computes, contend for the
GIL and, on a 2-core machine, get the host process descheduled inside its `write`, so that
a launch, normally a fraction of a millisecond, would take several milliseconds. Launches still never block on a
busy worker unless a megabyte of unread work is queued: the pipe is enlarged to the system's
maximum (F_SETPIPE_SZ, usually 1 MiB), and past that the host's write simply waits.

Between ops the worker polls the pipe for `spin_s` (yielding the CPU between polls) before it
blocks on it. A core that goes idle runs the op after it slower -- on the 2-core VMs this runs
on, a bundled target's decode forward took ~1.4x as long after the ~1 ms the worker waits for
the host under `sync` as when launched back to back (`benchmarks/worker_spin.py`) -- so a worker
that waits less than `spin_s` keeps its core busy, as vLLM's shared-memory readers and NCCL's
proxies busy-poll. Yielding hands the core to any other runnable thread meanwhile.
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from specsched.runtime.devices.native import runtime_libs
from specsched.runtime.devices.spec import WorkerSpec

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def _set_threads(num_threads: int) -> None:
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(num_threads)


class _PipeInbox:
    """Launch messages read straight from the pipe, in order; None once the host is gone.
    `spin_s`: how long to poll for the next one before blocking on the pipe."""

    def __init__(self, conn: Any, spin_s: float = 0.0):
        self.conn = conn
        self.spin_s = spin_s

    def get(self) -> bytes | None:
        conn = self.conn
        try:
            if self.spin_s > 0 and not conn.poll():
                until = time.monotonic() + self.spin_s
                while not conn.poll() and time.monotonic() < until:
                    os.sched_yield()
            return conn.recv_bytes()
        except (EOFError, OSError):
            return None


class _Builtins:
    """Ops every host worker answers itself (names start with "__")."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self.num_ops = 0
        self.busy_ns = 0

    def execute(self, op: str, batch: Any) -> Any:
        if op == "__ping__":
            return None
        if op == "__stats__":
            torch = sys.modules.get("torch")
            return {"pid": os.getpid(), "num_ops": self.num_ops, "busy_ns": self.busy_ns,
                    "num_threads": self.num_threads,
                    "torch_threads": torch.get_num_threads() if torch else None}
        raise ValueError(f"unknown built-in op {op!r} (known: __ping__, __stats__)")


def entry() -> None:
    """Process entry: `python -c "...; entry()" LAUNCH_FD REPLY_FD NAME` (see process.py)."""
    launch_conn = Connection(int(sys.argv[1]), readable=True, writable=False)
    reply_conn = Connection(int(sys.argv[2]), readable=False, writable=True)
    try:
        spec, num_threads, sys_path, spin_s = launch_conn.recv()
    except EOFError:
        return
    sys.path[:] = sys_path  # the host's import path, so specs naming its modules resolve
    main(spec, num_threads, launch_conn, reply_conn, spin_s)


def main(spec: WorkerSpec, num_threads: int, launch_conn: Connection,
         reply_conn: Connection, spin_s: float = 0.0) -> None:
    """Build the Worker, report readiness, then serve launches until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when this process stops
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(num_threads)
    try:
        _set_threads(num_threads)
        worker = spec.build()
        _set_threads(num_threads)
    except Exception as exc:
        reply_conn.send(("init_err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    reply_conn.send(("ready", os.getpid(), runtime_libs()))

    inbox = _PipeInbox(launch_conn, spin_s)
    builtins = _Builtins(num_threads)
    try:
        _serve(worker, builtins, inbox, reply_conn)
    finally:
        close = getattr(worker, "close", None)
        if callable(close):
            close()


def _serve(worker: Any, builtins: _Builtins, inbox: _PipeInbox, reply_conn: Any) -> None:
    while True:
        message = inbox.get()
        if message is None:
            return
        buf = io.BytesIO(message)
        header = pickle.load(buf)
        if header is None:
            return
        seq, _stream, op = header
        start_ns = time.monotonic_ns()
        try:
            batch = pickle.load(buf)
            runner = builtins if op.startswith("__") else worker
            result = runner.execute(op, batch)
            end_ns = time.monotonic_ns()
            header = pickle.dumps(("ok", seq, start_ns, end_ns), _PROTOCOL)
            payload = header + pickle.dumps(result, _PROTOCOL)
        except Exception as exc:
            end_ns = time.monotonic_ns()
            message = f"{type(exc).__name__}: {exc}"
            reply = ("err", seq, start_ns, end_ns, message, traceback.format_exc())
            payload = pickle.dumps(reply, _PROTOCOL) + pickle.dumps(None, _PROTOCOL)
        builtins.num_ops += 1
        builtins.busy_ns += end_ns - start_ns
        try:
            reply_conn.send_bytes(payload)
        except (BrokenPipeError, OSError):
            return  # the host is gone
