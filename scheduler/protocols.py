"""The seams between the scheduler and whatever executes its work.

Why: the pipeline must run unchanged on a real device (a worker process or CUDA streams)
and on the simulator's virtual device and clock. So it only ever sees these protocols.

Work crosses the seam as messages -- an op name plus a typed message of arrays and scalars
(scheduler/messages.py) -- never as closures, so it can cross a process boundary (and, with
tensor parallelism, be broadcast to every rank unchanged).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specsched.scheduler.request import Request

# A launch's message: one of scheduler/messages.py's frozen dataclasses for the pipeline's ops
# (a test or service op may pass a plain mapping). Must be picklable.
Batch = Any


class DeviceError(RuntimeError):
    """Work launched on a device failed; raised at whoever waits on its event."""

    def __init__(self, op: str, message: str, *, remote_traceback: str | None = None):
        super().__init__(f"device op {op!r} failed: {message}")
        self.op = op
        self.remote_traceback = remote_traceback


class DeviceCrashed(DeviceError):
    """The device (e.g. its worker process) died; every pending and later wait raises this."""


@runtime_checkable
class Clock(Protocol):
    """Monotonic time in nanoseconds.

    A simulator's clock also has `advance_ns(duration)`: busy time, the clock moving on while
    no other task runs (what a CPU stage does to a real event loop). The pipeline uses it only
    to charge modelled host costs (`Pipeline.host_cost`), which the engine never sets.
    """

    def now_ns(self) -> int: ...


@runtime_checkable
class Event(Protocol):
    """Completion of launched work.

    `start_ns`/`end_ns` are the device interval of the op the event belongs to, on the
    system monotonic clock (the same base as the host's Clock), available once done.
    """

    op: str
    stream: str
    start_ns: int | None
    end_ns: int | None

    def query(self) -> bool:
        """True once the work finished (successfully or not). Never blocks."""
        ...

    def synchronize(self, timeout_s: float | None = None) -> Any:
        """Block the calling thread until done; return the op's result or raise DeviceError."""
        ...

    async def wait(self) -> Any:
        """Await completion from the event loop without blocking it; result or DeviceError."""
        ...


@runtime_checkable
class Stream(Protocol):
    """An in-order queue of device work."""

    name: str

    def launch(self, op: str, batch: Batch) -> Event:
        """Enqueue `op` on this stream and return at once with its completion event."""
        ...

    def wait_event(self, event: Event) -> None:
        """Later work on this stream starts only after `event` (a device-side dependency)."""
        ...


@runtime_checkable
class Device(Protocol):
    kind: str  # "host", "cuda", "virtual"
    name: str
    # launches carry attention metadata (a device that only models time, the simulator's, says False)
    needs_plans: bool
    # an op's first launch costs what any other does: no one-off costs (compilation, allocation),
    # so its interval teaches the draft-length policy's cost model (the simulator's: True)
    warm_first_launch: bool

    def stream(self, name: str) -> Stream: ...

    def close(self) -> None: ...


@runtime_checkable
class Worker(Protocol):
    """What actually executes ops, inside the device (worker process or CUDA context).

    `execute` runs one op on a packed batch and returns a picklable result (the part of
    the output the host needs, e.g. sampled or accepted token ids).
    """

    def execute(self, op: str, batch: Batch) -> Any: ...


class OutputSink(Protocol):
    """Host-side output handling: hands each request its new token ids; detokenizing and stop
    strings run in the request's consumer (off the step loop), which ends a request on a stop
    string through `Pipeline.stop_request`. A sink whose `wants_token_ids` is False (the
    simulator's) gets no `on_tokens` calls, and its requests keep counts only: their
    `output_token_ids` stay empty while `num_output_tokens` counts."""

    wants_token_ids: bool

    def on_tokens(self, req: "Request", token_ids: list[int]) -> None:
        """The new token ids the pipeline appended to `req.output_token_ids` (already cut at
        max_tokens / EOS)."""
        ...

    def on_finish(self, req: "Request") -> None: ...


class HostDrafter(Protocol):
    """Drafts made on the host for a proposer with `ProposerRules.host_drafts` (an n-gram
    lookup in each request's own tokens, which the host has under `sync`): the engine's looks
    them up, the simulator's draws how many each row drafts from its acceptance model."""

    def draft(self, batch: Any) -> tuple[Any, Any]:
        """(tokens [B, W] int64 or None where only counts are modelled, counts [B] int64) for
        the rows of a speculative `StepBatch`, each asked for up to `draft_lens[i]`."""
        ...
