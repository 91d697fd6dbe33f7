"""Trace capture and the tools that read traces (the leaf package: imports nothing of ours).

Light imports only here; the OpenTelemetry modules (`traces.otel`, `traces.otel_export`)
and the timeline plot (`traces.timeline`) pull in heavy libraries and are imported from
their modules.
"""
from traces.chrome import to_chrome_trace, write_chrome_trace
from traces.hook import NULL_TRACER, MultiTracer, NullTracer, Tracer, replay
from traces.metrics import compute_metrics
from traces.reader import TraceFormatError, iter_records, read_trace
from traces.recorder import MemoryRecorder, TraceRecorder, write_trace
from traces.schema import (FORMAT_VERSION, STAGES, Device, FinishRecord, Header, RequestRecord,
                           SpanRecord, StepRecord, Trace)

__all__ = [
    "FORMAT_VERSION", "STAGES", "Device", "FinishRecord", "Header", "MemoryRecorder",
    "MultiTracer", "NULL_TRACER", "NullTracer", "RequestRecord", "SpanRecord", "StepRecord",
    "Trace", "TraceFormatError", "TraceRecorder", "Tracer", "compute_metrics", "iter_records",
    "read_trace", "replay", "to_chrome_trace", "write_chrome_trace", "write_trace",
]
