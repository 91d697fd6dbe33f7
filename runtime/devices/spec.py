"""How a device learns which Worker to build, and the error it raises when it cannot.

Why: a host device builds its Worker inside a separate process, so the Worker cannot be
passed as an object (model weights do not cross a pipe). It is passed as a recipe -- an
importable factory plus keyword arguments -- that is cheap to pickle and built on the far side.
"""
from __future__ import annotations

import importlib
import pickle
from dataclasses import dataclass, field
from typing import Any

from specsched.scheduler.protocols import DeviceError, Worker


class DeviceStartError(DeviceError):
    """The device could not start: its Worker's construction failed or the worker process died."""

    def __init__(self, factory: str, message: str, *, remote_traceback: str | None = None):
        super().__init__("start", f"building worker {factory!r}: {message}",
                         remote_traceback=remote_traceback)
        self.factory = factory


@dataclass(frozen=True)
class WorkerSpec:
    """A picklable recipe for a Worker: `import module; module.callable(**kwargs)`."""

    factory: str  # "package.module:callable", e.g. "specsched.runtime.devices.testing_worker:TestingWorker"
    kwargs: dict[str, Any] = field(default_factory=dict)  # picklable keyword arguments

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not sep or not module or not attr or ":" in attr:
            raise ValueError("WorkerSpec.factory must look like 'module:callable', "
                             f"got {self.factory!r}")
        if not isinstance(self.kwargs, dict):
            raise TypeError(f"WorkerSpec.kwargs must be a dict, got {type(self.kwargs).__name__}")
        try:
            pickle.dumps(self.kwargs)
        except Exception as exc:
            raise TypeError(f"WorkerSpec.kwargs for {self.factory!r} must be picklable: "
                            f"{exc}") from exc

    def build(self) -> Worker:
        """Import the factory and call it; errors name the factory."""
        module_name, _, attr = self.factory.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(f"cannot import worker module {module_name!r}: {exc}") from exc
        target: Any = module
        for part in attr.split("."):
            if not hasattr(target, part):
                raise AttributeError(f"worker module {module_name!r} has no attribute {attr!r}")
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"worker factory {self.factory!r} is not callable")
        worker = target(**self.kwargs)
        if not callable(getattr(worker, "execute", None)):
            raise TypeError(f"worker factory {self.factory!r} returned {type(worker).__name__}, "
                            "which has no execute(op, batch) method")
        return worker
