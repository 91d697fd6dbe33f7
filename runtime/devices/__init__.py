"""Real devices behind the scheduler's Device/Stream/Event protocols.

Why: the pipeline only sees `specsched.scheduler.protocols`; this package supplies the two real
implementations -- a host device (a worker process, for CPU machines) and a CUDA device
(torch streams and events, in-process) -- built from the same picklable `WorkerSpec`.
Importing it never touches CUDA, so it works on CPU-only machines.
"""
from __future__ import annotations

from typing import Any, Literal

from specsched.runtime.devices.cuda import CudaDevice, CudaEvent, CudaStream, cuda_available
from specsched.runtime.devices.events import CompletionEvent
from specsched.runtime.devices.host import HostDevice, HostStream
from specsched.runtime.devices.spec import DeviceStartError, WorkerSpec

__all__ = [
    "CompletionEvent", "CudaDevice", "CudaEvent", "CudaStream", "DeviceStartError", "HostDevice",
    "HostStream", "WorkerSpec", "cuda_available", "make_device",
]


def make_device(kind: Literal["host", "cuda"], spec: WorkerSpec,
                **kwargs: Any) -> HostDevice | CudaDevice:
    """Build a device of `kind` running `spec`'s Worker; kwargs go to the device's constructor."""
    if kind == "host":
        return HostDevice(spec, **kwargs)
    if kind == "cuda":
        return CudaDevice(spec, **kwargs)
    raise ValueError(f"unknown device kind {kind!r} (expected 'host' or 'cuda')")
