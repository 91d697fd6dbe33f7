"""OpenTelemetry export: request spans (gen_ai conventions) plus step and stage spans.

Why: production stacks already collect OTel; a run should show up in Jaeger/Tempo next to
the service that called the engine. Shape of the export:

- one span per request, `text_completion {model}` (gen_ai semantic conventions: operation
  name, request model and sampling parameters, usage tokens, finish reasons), from arrival
  to finish, with time to first token as the attribute `gen_ai.server.time_to_first_token`
  (seconds, named after the semconv metric) and a `first_token` event;
- one span per scheduler step, `step`, linked (span links) to the request spans of its batch;
- one span per stage, a child of its step's span: `spec.draft`, `spec.verify`,
  `spec.accept`, `spec.fill`, `spec.mtp`, and `schedule`, `kv_alloc`, `plan`,
  `sync`, `output`, ... as recorded; device spans carry `specsched.device.stream`.

Span attributes from the trace are exported as `specsched.<key>`. Trace timestamps are
mapped to epoch ns with the header's (created_unix_s, created_clock_ns) anchor.

`OtelTracer` implements the `Tracer` hook on an SDK TracerProvider; stage spans wait (a
bounded number of steps) for their step record so they can be parented under it. Where the
spans go -- a live collector during a run, an OTLP endpoint or an OTLP/JSON file after it --
is traces/otel_export.py.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from specsched.traces.otel_names import (OPERATION, SPEC_STAGES, _attr, epoch_offset_ns,  # noqa: F401
                                         SpanMapper, finish_attributes, request_attributes,
                                         stage_span_name, step_attributes)
from specsched.traces.schema import DEVICE_TRACK_PREFIX, FORMAT_VERSION, Header

class OtelTracer(SpanMapper):
    """The tracer hook turning records into OpenTelemetry SDK spans on a span processor."""

    def __init__(self, header: Header, span_processor: SpanProcessor, *,
                 clock_offset_ns: int | None = None, max_pending_steps: int = 256,
                 max_remembered: int = 65536, shutdown_on_exit: bool = True):
        super().__init__(max_pending_steps, max_remembered)
        self.header = header
        if clock_offset_ns is None:
            clock_offset_ns = epoch_offset_ns(header, None)
        self.clock_offset_ns = clock_offset_ns
        resource = Resource.create({
            "service.name": os.environ.get("OTEL_SERVICE_NAME", "specsched"),
            "specsched.source": header.source, "specsched.schedule": header.schedule,
            "specsched.proposer": header.proposer, "specsched.draft_len": header.draft_len,
            "specsched.model": header.model, "specsched.device.kind": header.device.kind,
            "specsched.device.name": header.device.name})
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=shutdown_on_exit)
        self.provider.add_span_processor(span_processor)
        self._tracer = self.provider.get_tracer("specsched.traces", FORMAT_VERSION)
        self._open: dict[str, Any] = {}  # request_id -> open request span

    def _ns(self, t_ns: int) -> int:
        return t_ns + self.clock_offset_ns

    def request(self, request_id: str, arrival_ns: int, prompt_len: int, max_tokens: int,
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None, synthetic_acceptance_length: float | None = None,
                synthetic_acceptance_rates: list[float] | None = None) -> None:
        attrs = request_attributes(self.header.model, request_id, prompt_len, max_tokens, temperature,
                                   top_p, top_k, seed)
        self._open[request_id] = self._tracer.start_span(
            f"{OPERATION} {self.header.model}", kind=SpanKind.INTERNAL, attributes=attrs,
            start_time=self._ns(arrival_ns))
        self._stats[request_id] = [0, 0, 0]
        self._last_ns = max(self._last_ns, arrival_ns)

    def step(self, step: int, kind: str, start_ns: int, end_ns: int,
             request_ids: Sequence[str], num_new_tokens: Sequence[int],
             kv_lens: Sequence[int], num_drafted: Sequence[int] | None = None,
             num_accepted: Sequence[int] | None = None,
             num_output: Sequence[int] | None = None, draft_len: int | None = None,
             predicted_gain: float | None = None) -> None:
        self._last_ns = max(self._last_ns, end_ns)
        drafted, accepted, contexts = self._tally(request_ids, num_drafted, num_accepted)
        links = [Link(ctx) for ctx in contexts]
        attrs = step_attributes(step, kind, len(request_ids), num_new_tokens, kv_lens, drafted, accepted,
                                num_output, draft_len, predicted_gain)
        span = self._tracer.start_span("step", attributes=attrs, links=links,
                                       start_time=self._ns(start_ns))
        span.end(end_time=self._ns(end_ns))
        self._step_known(step, span.get_span_context())

    def finish(self, request_id: str, finish_ns: int, finish_reason: str, output_len: int,
               first_token_ns: int | None, ttft_ns: int | None = None,
               agreement: Sequence[int] | None = None, agreement_kind: str | None = None,
               error: str | None = None) -> None:
        self._last_ns = max(self._last_ns, finish_ns)
        span = self._open.pop(request_id, None)
        if span is None:  # its request record was never seen: start at the best guess
            start_ns = (first_token_ns - ttft_ns if first_token_ns is not None
                        and ttft_ns is not None else finish_ns)
            span = self._tracer.start_span(f"{OPERATION} {self.header.model}",
                                           start_time=self._ns(start_ns), attributes={
                                               "gen_ai.operation.name": OPERATION,
                                               "gen_ai.request.model": self.header.model,
                                               "specsched.request_id": request_id})
        span.set_attributes(finish_attributes(output_len, finish_reason,
                                              self._stats.pop(request_id, (0, 0, 0)), ttft_ns, agreement))
        if first_token_ns is not None:
            span.add_event("first_token", timestamp=self._ns(first_token_ns))
        if finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, error or "error"))
        span.end(end_time=self._ns(finish_ns))
        self._remember(self._request_ctx, request_id, span.get_span_context())

    def close(self) -> None:
        """Emits waiting stage spans, ends unfinished requests, shuts the provider down."""
        if self._closed:
            return
        self._closed = True
        self._drain_pending()
        for span in self._open.values():
            span.set_attribute("specsched.finished", False)
            span.end(end_time=self._ns(self._last_ns))
        self._open.clear()
        self._shutdown()

    def _shutdown(self) -> None:
        self.provider.shutdown()

    def _request_context(self, request_id: str) -> Any:
        span = self._open.get(request_id)
        return span.get_span_context() if span is not None else self._request_ctx.get(request_id)

    def _emit_stage(self, entry: tuple, parent_ctx: Any) -> None:
        track, name, step, start_ns, end_ns, attrs = entry
        otel_attrs = {"specsched.stage": name, "specsched.track": track}
        if step is not None:
            otel_attrs["specsched.step"] = step
        if track.startswith(DEVICE_TRACK_PREFIX):
            otel_attrs["specsched.device.stream"] = track[len(DEVICE_TRACK_PREFIX):]
        for key, value in attrs.items():
            value = _attr(value)
            if value is not None:
                otel_attrs[f"specsched.{key}"] = value
        context = (otel_trace.set_span_in_context(otel_trace.NonRecordingSpan(parent_ctx))
                   if parent_ctx is not None else None)
        span = self._tracer.start_span(stage_span_name(name), context=context,
                                       attributes=otel_attrs, start_time=self._ns(start_ns))
        span.end(end_time=self._ns(end_ns))

    def _emit_orphan_step(self, step: int, entries: list[tuple]) -> None:
        """A step whose record never came: a `step` span spanning its stage spans."""
        span = self._tracer.start_span(
            "step", attributes={"specsched.step": step, "specsched.step.complete": False},
            start_time=self._ns(min(e[3] for e in entries)))
        span.end(end_time=self._ns(max(e[4] for e in entries)))
        self._remember(self._step_ctx, step, span.get_span_context())
        for entry in entries:
            self._emit_stage(entry, span.get_span_context())
