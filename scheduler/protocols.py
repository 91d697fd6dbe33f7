"""The seams between the scheduler and whatever executes its work (a real device or the simulator's virtual one).

Work crosses as an op name plus a typed message of arrays and scalars, never closures, so it can cross a process
boundary (and be broadcast unchanged to every tensor-parallel rank).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specsched.scheduler.request import Request

# A launch's message (a messages.py dataclass; a test or service op may pass a mapping). Must be picklable.
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
    """Monotonic time in nanoseconds. A simulator's clock also has `advance_ns(duration)`: busy time, the clock moving
    on while no other task runs; used only to charge modelled host costs (`Pipeline.host_cost`, unset in the engine).
    """

    def now_ns(self) -> int: ...


@runtime_checkable
class Event(Protocol):
    """Completion of launched work. `start_ns`/`end_ns`: the op's device interval on the system monotonic clock (the
    host Clock's base), set once done."""

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
    needs_plans: bool  # launches carry attention metadata (False: a device that only models time)
    # an op's first launch has no one-off costs (compilation, allocation), so the cost model may learn from it
    warm_first_launch: bool

    def stream(self, name: str) -> Stream: ...

    def close(self) -> None: ...


@runtime_checkable
class Worker(Protocol):
    """Executes ops inside the device: `execute` returns a picklable result (what the host needs, e.g. token ids)."""

    def execute(self, op: str, batch: Batch) -> Any: ...


class OutputSink(Protocol):
    """Host-side output: hands each request its new token ids; detokenizing and stop strings run in the request's
    consumer (off the step loop), which calls `Pipeline.stop_request`. With `wants_token_ids` False no `on_tokens`
    calls are made and requests keep counts only (`output_token_ids` empty, `num_output_tokens` counting)."""

    wants_token_ids: bool

    def on_tokens(self, req: "Request", token_ids: list[int], logprobs: tuple | None = None) -> None:
        """The new token ids appended to `req.output_token_ids` (already cut at max_tokens / EOS); for a request
        with `SamplingParams.logprobs` k, their log-probabilities: arrays ([n] each token's, [n, k] the top ids,
        [n, k] their log-probabilities)."""
        ...

    def on_finish(self, req: "Request") -> None: ...

    def on_prompt_logprobs(self, req: "Request", first: int, logprobs: tuple) -> None:
        """For a request with `SamplingParams.prompt_logprobs` k: its prompt tokens first, first + 1, ...
        scored as `on_tokens`' arrays (a recomputed prompt after a preemption scores them again)."""
        ...


class HostDrafter(Protocol):
    """Drafts made on the host (`ProposerRules.host_drafts`): the engine's looks them up, the simulator's draws how many
    each row drafts from its acceptance model."""

    def draft(self, batch: Any) -> tuple[Any, Any]:
        """(tokens [B, W] int64, or None where only counts are modelled; counts [B] int64), row i <= draft_lens[i]."""
        ...
