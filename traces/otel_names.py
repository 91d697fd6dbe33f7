"""Names and conventions shared by every OpenTelemetry export path (SDK-based or not).

Why a module of its own: the offline OTLP/JSON export (traces/otlp_json.py) needs these but
not the OpenTelemetry SDK, whose import alone costs a large part of a short export.
"""
from __future__ import annotations

import time
from typing import Any

import orjson

from specsched.traces.schema import Header, Trace

SPEC_STAGES = frozenset({"draft", "verify", "accept", "draft_fill", "mtp"})
OPERATION = "text_completion"


def stage_span_name(stage: str) -> str:
    return f"spec.{stage}" if stage in SPEC_STAGES else stage


def _attr(value: Any) -> Any:
    """An OTel attribute value (primitives or homogeneous lists; others as JSON), or None."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and all(
            type(v) is type(value[0]) and isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY, default=str).decode()


def epoch_offset_ns(header: Header, trace: Trace | None) -> int:
    """epoch_ns - trace_clock_ns: from the header's anchor, else assume the header was
    created at the first record (offline) or now (live, monotonic clock)."""
    created_ns = round(header.created_unix_s * 1e9)
    if header.created_clock_ns is not None:
        return created_ns - header.created_clock_ns
    if trace is not None:
        return created_ns - trace.start_ns()
    if header.clock == "monotonic_ns":
        return time.time_ns() - time.monotonic_ns()
    return created_ns
