"""A tiny Worker for exercising devices without a model.

Why: device tests and benchmarks need ops with known behaviour -- a known duration, a known
failure, a crash, an order check -- that start in milliseconds (no torch import unless a
tensor op is used). Build it with `WorkerSpec("specsched.runtime.devices.testing_worker:TestingWorker")`.

Ops (batch keys in braces):
- "sleep" {ms}: sleep (no CPU use); returns None.
- "spin" {ms}: busy CPU loop until this thread used `ms` of CPU time; returns loop count.
- "echo": returns the batch as a dict.
- "counter": increments a per-worker counter; returns the new value (1, 2, ...).
- "fail" {message}: raises ValueError(message).
- "crash" {code}: ends the process at once with `os._exit(code)` (host devices only!).
- "matmul" {n, repeat}: `repeat` n x n matmuls on the current CUDA device (CPU if none);
  returns the sum of the last product as a float on the host (a sync inside the op).
- "gpu_sleep" {cycles}: `torch.cuda._sleep(cycles)` on the current stream; returns None.
- "gpu_fill" {n, value}: returns a CUDA tensor of n copies of `value` and, under "host",
  a pinned host copy made with `non_blocking=True` (valid once the event completes).
"""
from __future__ import annotations

import os
import time
from typing import Any

from specsched.scheduler.protocols import Batch


class TestingWorker:
    __test__ = False  # not a pytest test class

    def __init__(self, *, model_path: str | None = None, init_delay_ms: float = 0.0):
        if model_path is not None and not os.path.exists(model_path):
            raise FileNotFoundError(f"model path {model_path!r} does not exist")
        if init_delay_ms > 0:
            time.sleep(init_delay_ms / 1000)
        self.num_counted = 0

    def execute(self, op: str, batch: Batch) -> Any:
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            known = sorted(name[4:] for name in dir(self) if name.startswith("_op_"))
            raise ValueError(f"TestingWorker has no op {op!r} (known: {', '.join(known)})")
        return handler(batch)

    def _op_sleep(self, batch: Batch) -> None:
        time.sleep(float(batch["ms"]) / 1000)

    def _op_spin(self, batch: Batch) -> int:
        return spin_cpu_ms(float(batch["ms"]))

    def _op_echo(self, batch: Batch) -> dict[str, Any]:
        return dict(batch)

    def _op_counter(self, batch: Batch) -> int:
        self.num_counted += 1
        return self.num_counted

    def _op_fail(self, batch: Batch) -> None:
        raise ValueError(batch.get("message", "requested failure"))

    def _op_crash(self, batch: Batch) -> None:
        os._exit(int(batch.get("code", 3)))

    def _op_matmul(self, batch: Batch) -> float:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        n, repeat = int(batch.get("n", 256)), int(batch.get("repeat", 1))
        a = torch.ones(n, n, device=device) / n
        for _ in range(repeat):
            a = a @ a
        return float(a.sum())

    def _op_gpu_sleep(self, batch: Batch) -> None:
        import torch

        torch.cuda._sleep(int(batch["cycles"]))

    def _op_gpu_fill(self, batch: Batch) -> dict[str, Any]:
        import torch

        values = torch.full((int(batch["n"]),), float(batch["value"]), device="cuda")
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        return {"device": values, "host": host}


def spin_cpu_ms(ms: float) -> int:
    """Busy-loop until the calling thread has used `ms` of CPU time; returns the loop count.

    CPU time, not wall time: two spins sharing one core take twice as long in wall time, so
    overlap measured with them is real parallelism.
    """
    deadline_ns = time.thread_time_ns() + int(ms * 1e6)
    count = 0
    while time.thread_time_ns() < deadline_ns:
        count += 1
    return count
