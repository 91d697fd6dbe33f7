"""A guard against host reads of device values inside an op: the CPU counterpart of
`torch.cuda.set_sync_debug_mode("error")`.

Why: the schedules overlap host work with device work only if an op's launch enqueues device
work and returns. Reading a device value on the host inside the op (`Tensor.tolist`, `.item`,
`.numpy`, `int(t)`, `float(t)`, `bool(t)`, `t.__index__`) waits for the device: on CUDA the
event loop blocks until the GPU catches up, and `overlap` degrades into `sync` -- invisibly on
a CPU machine, where there is nothing to wait for. Under `no_host_sync(device)` such a read of
a tensor on `device` raises `HostSyncError`, so a CPU test sees what a GPU run would suffer.

The other direction counts too: host data made into a device tensor with a blocking copy
(`torch.as_tensor(array, device=...)`, `torch.tensor(list, device=...)`) synchronizes the
stream on CUDA (torch copies from pageable memory, then waits). Under the guard those raise
as well; `to_device` is the copy an op makes instead (pinned staging, non-blocking).

What may be read: tensors on another device (host tensors while the op runs on CUDA), and
tensors marked with `host_side` -- the result buffers an op fills (with a non-blocking copy
on CUDA) and the host reads only once the op's completion event is done. On a CPU worker,
where every tensor is on the device, those marks are the only exemption.
"""
from __future__ import annotations

import traceback
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that hand a device value to the host
MATERIALIZE = frozenset({"tolist", "item", "numpy", "__array__", "__int__", "__float__", "__bool__", "__index__",
                         "__complex__"})
_HOST_SIDE = "_specsched_host_side"
# factories that copy host data to their `device=` argument with a blocking copy
BLOCKING_UPLOAD = frozenset({"as_tensor", "tensor"})


class HostSyncError(RuntimeError):
    """A device value was read on the host inside an op run under `no_host_sync`."""


def to_device(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (numpy array, list, scalar or CPU tensor) as a tensor on `device`, without a
    sync: on CUDA staged in pinned memory and copied non-blocking on the current stream (the
    caching host allocator keeps the staging buffer until the copy is done); on the CPU the
    data itself, shared where `torch.as_tensor` shares it."""
    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type == "cpu" or t.device == device:
        return t
    return t.pin_memory().to(device, non_blocking=True)


def host_side(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` as a host-side buffer (an op's result, read after its event): `no_host_sync`
    lets it be read. Returns `t`."""
    setattr(t, _HOST_SIDE, True)
    return t


def read_now(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values on the host now, waiting for the device where it must: the one deliberate sync an op may make
    (structured output's masks need its drafts and kept tokens), allowed under `no_host_sync` and CUDA's sync
    debug mode alike."""
    if t.device.type != "cuda":
        return host_side(t.detach().clone())
    with _cuda_sync_debug(0):
        return host_side(t.detach().to("cpu"))


@contextmanager
def _cuda_sync_debug(mode: int | str) -> Iterator[None]:
    """CUDA's sync debug mode set to `mode` within the block, the one before restored after."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


class _Guard(TorchFunctionMode):
    def __init__(self, device: torch.device, what: str, record: list | None):
        super().__init__()
        self.device = device
        self.what = what
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in BLOCKING_UPLOAD and kwargs and kwargs.get("device") is not None and args \
                and not isinstance(args[0], torch.Tensor) and torch.device(kwargs["device"]).type == self.device.type:
            if self.record is not None:
                self.record.append((self.what, f"torch.{name}(device=...)", _caller()))
                return func(*args, **kwargs)
            raise HostSyncError(
                f"{self.what}: torch.{name}(..., device={kwargs['device']!s}) copies host data to the "
                "device with a blocking copy (a stream sync on CUDA); use sync_guard.to_device")
        if name in MATERIALIZE and args:
            t = args[0]
            if (isinstance(t, torch.Tensor) and t.device.type == self.device.type
                    and not getattr(t, _HOST_SIDE, False)):
                if self.record is not None:
                    self.record.append((self.what, name, _caller()))
                    return func(*args, **(kwargs or {}))
                raise HostSyncError(
                    f"{self.what}: Tensor.{name}() reads a {t.device} value on the host (shape "
                    f"{tuple(t.shape)}, {t.dtype}); inside an op that waits for the device. Keep it "
                    "on the device, or copy it into a host_side() buffer read after the op's event")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_sync(device: torch.device | str, what: str = "op", record: list | None = None) -> Iterator[None]:
    """Within the block, reading a tensor on `device` on the host raises HostSyncError
    (`what` names the op in the message). With `record`, each such read is appended to it as
    (what, method, "file:line") instead, and goes ahead: an inventory of an op's host reads."""
    with _Guard(torch.device(device), what, record):
        yield


@contextmanager
def guarded(device: torch.device, what: str = "op") -> Iterator[None]:
    """`no_host_sync(device)`, and on CUDA its sync debug mode set to "error" too: torch's own syncs fail as well."""
    with _cuda_sync_debug("error") if device.type == "cuda" else nullcontext(), no_host_sync(device, what=what):
        yield


def _caller() -> str:
    """The innermost frame outside torch and this module: where the read is."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        parts = frame.filename.replace("\\", "/").split("/")
        if "torch" not in parts and parts[-1] != "sync_guard.py":
            return f"{'/'.join(parts[-2:])}:{frame.lineno}"
    return "?"
