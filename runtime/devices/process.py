"""Starting and stopping the host device's worker process.

Why not `multiprocessing.Process`: its spawn start method re-runs the caller's `__main__`
module in the child -- slow when the main script loads models at import, and an error when
it lacks an `if __name__ == "__main__"` guard -- and fork is unsafe once threads or torch are
live. A plain `python -c` child that imports only the worker module avoids both; the pipes
are `multiprocessing.connection.Connection`s over inherited file descriptors.

Death is noticed twice over: EOF on the reply pipe, and (on Linux) a pidfd that becomes
readable when the process exits, which covers a child that leaked its pipe to a grandchild.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

_ENTRY = "from specsched.runtime.devices.worker_main import entry; entry()"


class WorkerProcess:
    """A child Python process with a launch pipe (host -> worker) and a reply pipe (back)."""

    def __init__(self, name: str, env: dict[str, str] | None = None):
        """`env`: the child's environment (default: this process's)."""
        launch_r, launch_w = os.pipe()
        _enlarge_pipe(launch_w)
        reply_r, reply_w = os.pipe()
        env = dict(os.environ if env is None else env)
        package_root = str(Path(__file__).resolve().parents[2])  # holds runtime/ and scheduler/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(launch_r), str(reply_w), name],
                pass_fds=(launch_r, reply_w), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (launch_r, launch_w, reply_r, reply_w):
                os.close(fd)
            raise
        os.close(launch_r)
        os.close(reply_w)
        self.pid = self.popen.pid
        self.launch = Connection(launch_w, readable=False, writable=True)
        self.replies = Connection(reply_r, readable=True, writable=False)
        self.sentinel: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                self.sentinel = os.pidfd_open(self.pid)
            except OSError:
                pass

    def waitables(self) -> list:
        """What to pass to `multiprocessing.connection.wait`: the reply pipe and the pidfd."""
        return [self.replies] if self.sentinel is None else [self.replies, self.sentinel]

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def exitcode(self, timeout_s: float = 0.0) -> int | None:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def describe_exit(self, timeout_s: float = 1.0) -> str:
        code = self.exitcode(timeout_s)
        if code is None:
            return f"(pid {self.pid}) closed its pipe but is still running"
        if code < 0:
            try:
                return f"(pid {self.pid}) was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"(pid {self.pid}) was killed by signal {-code}"
        return f"(pid {self.pid}) exited with code {code}"

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a clean exit, then terminate, then kill."""
        if self.exitcode(timeout_s) is None:
            self.popen.terminate()
            if self.exitcode(2.0) is None:
                self.popen.kill()
                self.popen.wait()

    def close_handles(self) -> None:
        self.launch.close()
        self.replies.close()
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def kill_quietly(popen: subprocess.Popen) -> None:
    """Last-resort cleanup at interpreter exit for a device nobody closed."""
    if popen.poll() is None:
        popen.kill()
        popen.wait()


def _enlarge_pipe(fd: int) -> None:
    """Grow a pipe's buffer to the system maximum (Linux), so launches queue without blocking."""
    try:
        import fcntl

        with open("/proc/sys/fs/pipe-max-size") as f:
            size = int(f.read())
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (OSError, ValueError, ImportError):
        pass  # other platforms: the default buffer; a long queue then just waits in write
