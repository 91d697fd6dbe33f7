"""OpenTelemetry export paths: live during a run, to a collector or to a file after it.

Why apart from traces/otel.py (which maps trace records to spans): delivery has its own
failure modes. The live tracer exports through a BatchSpanProcessor (bounded queue that drops
when full, export in a background thread, short OTLP timeout) behind a circuit breaker, so a
slow or dead collector never blocks or slows the engine; offline export (to a collector or an
OTLP/JSON file) builds the JSON straight from the records (traces/otlp_json.py), streamed in
chunks, and stops at the first batch a collector does not take.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from specsched.traces.hook import replay
from specsched.traces.otel import OtelTracer, epoch_offset_ns
from specsched.traces.otlp_json import (OtlpExportError, check_otlp_url, export_otel_json,  # noqa: F401
                                        export_otlp)
from specsched.traces.schema import Header, Trace


class OtelLiveTracer(OtelTracer):
    """Live export from a running engine over OTLP/HTTP (protobuf).

    The exporter is `exporter`, else an OTLPSpanExporter for `endpoint` (full URL such as
    http://collector:4318/v1/traces), else one configured by the standard
    OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT/HEADERS/TIMEOUT/COMPRESSION variables. Spans queue
    in a BatchSpanProcessor (at most `max_queue_size`; newer spans are dropped when full) and
    are exported by its thread; each export gives up after `export_timeout_s`; `close()`
    waits at most `shutdown_timeout_s` for the queue to drain.
    """

    def __init__(self, header: Header, exporter: SpanExporter | None = None, *,
                 endpoint: str | None = None, export_timeout_s: float | None = 2.0,
                 max_queue_size: int = 2048, max_export_batch_size: int = 512,
                 schedule_delay_ms: float = 1000.0, shutdown_timeout_s: float = 3.0,
                 **options: Any):
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            env_timeout = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" in os.environ
                           or "OTEL_EXPORTER_OTLP_TIMEOUT" in os.environ)
            exporter = _CircuitBreaker(OTLPSpanExporter(endpoint=endpoint,
                                                        timeout=None if env_timeout else export_timeout_s))
        self._exporter = exporter
        self._processor = BatchSpanProcessor(
            exporter, max_queue_size=max_queue_size, schedule_delay_millis=schedule_delay_ms,
            max_export_batch_size=min(max_export_batch_size, max_queue_size))
        self.shutdown_timeout_s = shutdown_timeout_s
        super().__init__(header, self._processor, **options)

    def _shutdown(self) -> None:
        # The SDK's shutdown drains the queue with no overall deadline (each export may retry
        # until its timeout), so it runs in a helper thread we wait on for a bounded time;
        # past that, shutting the exporter down aborts retries and drops what is left.
        stopper = threading.Thread(target=self.provider.shutdown, daemon=True,
                                   name="specsched-otel-shutdown")
        stopper.start()
        stopper.join(self.shutdown_timeout_s)
        if stopper.is_alive():
            self._exporter.shutdown()
            stopper.join(1.0)


def live_tracer(header: Header, otlp: str | bool | None = None) -> OtelLiveTracer | None:
    """The live export a run asks for: `otlp` a collector's URL, True (the collector the standard
    OTEL_EXPORTER_OTLP_* variables name), False (none), or None (on when those variables name an endpoint)."""
    if otlp is None:
        otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if not otlp:
        return None
    return OtelLiveTracer(header, endpoint=otlp if isinstance(otlp, str) else None)


class _CircuitBreaker(SpanExporter):
    """Wraps a network exporter: after a failed export, batches are dropped without being
    serialized or sent for `cooldown_s`. A dead collector then costs the engine's process no
    serialization work or retries (which, in a Python process, compete for the GIL)."""

    def __init__(self, inner: SpanExporter, cooldown_s: float = 10.0):
        self.inner, self.cooldown_s = inner, cooldown_s
        self._open_until = 0.0
        self.num_dropped = 0

    def export(self, spans):
        if time.monotonic() < self._open_until:
            self.num_dropped += len(spans)
            return SpanExportResult.FAILURE
        result = self.inner.export(spans)
        if result != SpanExportResult.SUCCESS:
            self._open_until = time.monotonic() + self.cooldown_s
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _ChunkedExportProcessor(SpanProcessor):
    """Exports ended spans synchronously in chunks: lossless, for offline export.

    Shutting it down flushes but leaves the exporter (owned by the caller) open.
    """

    def __init__(self, exporter: SpanExporter, chunk_size: int):
        self.exporter, self.chunk_size = exporter, chunk_size
        self._chunk: list[ReadableSpan] = []
        self.num_exported = self.num_failed = 0

    def on_end(self, span: ReadableSpan) -> None:
        self._chunk.append(span)
        if len(self._chunk) >= self.chunk_size:
            self.force_flush()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        chunk, self._chunk = self._chunk, []
        if chunk:
            result = self.exporter.export(chunk)
            if result is SpanExportResult.SUCCESS:
                self.num_exported += len(chunk)
            else:
                self.num_failed += len(chunk)
        return True

    def shutdown(self) -> None:
        self.force_flush()


def export_trace_otel(trace: Trace, span_exporter: SpanExporter, *,
                      chunk_size: int = 512) -> int:
    """Exports a recorded trace through `span_exporter`; returns the number of spans exported.

    Raises RuntimeError when the exporter reported a failure. The exporter is not shut down.
    """
    processor = _ChunkedExportProcessor(span_exporter, chunk_size)
    tracer = OtelTracer(trace.header, processor, shutdown_on_exit=False,
                        clock_offset_ns=epoch_offset_ns(trace.header, trace),
                        max_remembered=1 << 62)
    replay(trace, tracer, close=True)
    if processor.num_failed:
        raise RuntimeError(f"OTel export failed for {processor.num_failed} of "
                           f"{processor.num_failed + processor.num_exported} spans")
    return processor.num_exported
