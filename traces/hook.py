"""The tracer hook: what the engine's pipeline and the simulator call to record a run.

Why: the pipeline must not know where trace data goes (a JSONL file, memory, a live
OpenTelemetry collector, several at once, or nowhere). It calls these five methods; call
sites guard argument building with `if tracer.enabled:` so a disabled tracer costs one
attribute load per call site.

Calls happen when the thing is known: `request` at arrival, `span` when a stage or a device
interval has ended, `step` when a step's outcome (accepted counts) is known, `finish` when a
request finishes. Field meanings are those of the records in `specsched.traces.schema`.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from specsched.traces.schema import Trace


@runtime_checkable
class Tracer(Protocol):
    enabled: bool

    def request(self, request_id: str, arrival_ns: int, prompt_len: int, max_tokens: int,
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None, synthetic_acceptance_length: float | None = None,
                synthetic_acceptance_rates: list[float] | None = None) -> None: ...

    def span(self, track: str, name: str, step: int | None, start_ns: int, end_ns: int,
             **attrs: Any) -> None: ...

    def step(self, step: int, kind: str, start_ns: int, end_ns: int,
             request_ids: Sequence[str], num_new_tokens: Sequence[int],
             kv_lens: Sequence[int], num_drafted: Sequence[int] | None = None,
             num_accepted: Sequence[int] | None = None,
             num_output: Sequence[int] | None = None, draft_len: int | None = None,
             predicted_gain: float | None = None) -> None: ...

    def finish(self, request_id: str, finish_ns: int, finish_reason: str, output_len: int,
               first_token_ns: int | None, ttft_ns: int | None = None,
               agreement: Sequence[int] | None = None, agreement_kind: str | None = None,
               error: str | None = None) -> None: ...

    def close(self) -> None: ...


class NullTracer:
    """Records nothing. `enabled` is False so guarded call sites skip argument building."""

    enabled = False

    def request(self, *args: Any, **kwargs: Any) -> None:
        pass

    def span(self, *args: Any, **kwargs: Any) -> None:
        pass

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def finish(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


NULL_TRACER = NullTracer()


class MultiTracer:
    """Fans every call out to several tracers (e.g. a file recorder and a live OTel export)."""

    def __init__(self, *tracers: Tracer):
        self.tracers = [t for t in tracers if t.enabled]
        self.enabled = bool(self.tracers)

    def request(self, *args: Any, **kwargs: Any) -> None:
        for t in self.tracers:
            t.request(*args, **kwargs)

    def span(self, *args: Any, **kwargs: Any) -> None:
        for t in self.tracers:
            t.span(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> None:
        for t in self.tracers:
            t.step(*args, **kwargs)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        for t in self.tracers:
            t.finish(*args, **kwargs)

    def close(self) -> None:
        """Closes every tracer, even when one of them raises; re-raises the first error."""
        first_error: BaseException | None = None
        for t in self.tracers:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - re-raised below after closing the rest
                first_error = first_error or e
        if first_error is not None:
            raise first_error


def replay(trace: Trace, tracer: Tracer, *, close: bool = False) -> None:
    """Feeds a recorded trace into a tracer in about the order a live run called it.

    Records are merged by the time they become known (request: arrival, span: end, step:
    end, finish: finish; ties go request < span < step < finish) while the records of each
    kind keep their order in the trace, so replaying into a recorder reproduces every list.
    Used to rewrite a trace (`write_trace`) and to export one offline (OTel) through the
    same code as a live run.
    """
    keyed = heapq.merge(
        ((r.arrival_ns, 0, i, r) for i, r in enumerate(trace.requests)),
        ((s.end_ns, 1, i, s) for i, s in enumerate(trace.spans)),
        ((s.end_ns, 2, i, s) for i, s in enumerate(trace.steps)),
        ((f.finish_ns, 3, i, f) for i, f in enumerate(trace.finishes)),
    )
    feed((rec for *_, rec in keyed), tracer)
    if close:
        tracer.close()


def feed(records: Iterable[Any], tracer: Tracer) -> None:
    """Calls the tracer once per record, in the order given (a file's order, for streaming)."""
    for rec in records:
        kind = rec.type
        if kind == "span":
            tracer.span(rec.track, rec.name, rec.step, rec.start_ns, rec.end_ns, **rec.attrs)
        elif kind == "step":
            tracer.step(rec.step, rec.kind, rec.start_ns, rec.end_ns, rec.request_ids,
                        rec.num_new_tokens, rec.kv_lens, rec.num_drafted, rec.num_accepted,
                        rec.num_output, rec.draft_len, rec.predicted_gain)
        elif kind == "request":
            tracer.request(rec.request_id, rec.arrival_ns, rec.prompt_len, rec.max_tokens,
                           rec.temperature, rec.top_p, rec.top_k, rec.seed)
        elif kind == "finish":
            tracer.finish(rec.request_id, rec.finish_ns, rec.finish_reason, rec.output_len,
                          rec.first_token_ns, rec.ttft_ns, rec.agreement, rec.agreement_kind,
                          rec.error)
        elif kind != "header":
            raise ValueError(f"unknown record type {kind!r}")

