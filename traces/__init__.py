"""Trace capture and the tools that read traces (the leaf package: imports nothing of ours).

Light imports only here; the OpenTelemetry modules (`specsched.traces.otel`, `specsched.traces.otel_export`)
and the timeline plot (`specsched.traces.timeline`) pull in heavy libraries and are imported from
their modules.
"""
from specsched.traces.chrome import to_chrome_trace, write_chrome_trace
from specsched.traces.hook import NULL_TRACER, MultiTracer, NullTracer, Tracer, replay
from specsched.traces.metrics import compute_metrics
from specsched.traces.reader import TraceFormatError, iter_records, read_trace
from specsched.traces.recorder import MemoryRecorder, TraceRecorder, write_trace
from specsched.traces.schema import (FORMAT_VERSION, STAGES, Device, FinishRecord, Header, RequestRecord,
                           SpanRecord, StepRecord, Trace)

__all__ = [
    "FORMAT_VERSION", "STAGES", "Device", "FinishRecord", "Header", "MemoryRecorder",
    "MultiTracer", "NULL_TRACER", "NullTracer", "RequestRecord", "SpanRecord", "StepRecord",
    "Trace", "TraceFormatError", "TraceRecorder", "Tracer", "compute_metrics", "iter_records",
    "read_trace", "replay", "to_chrome_trace", "write_chrome_trace", "write_trace",
]
