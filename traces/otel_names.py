"""Names and conventions shared by every OpenTelemetry export path (SDK-based or not).

Why a module of its own: the offline OTLP/JSON export (traces/otlp_json.py) needs these but
not the OpenTelemetry SDK, whose import alone costs a large part of a short export.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

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


def request_attributes(model: str | None, request_id: str, prompt_len: int, max_tokens: int,
                       temperature: float, top_p: float, top_k: int, seed: int | None) -> dict[str, Any]:
    """A request span's attributes at its start (gen_ai semantic conventions)."""
    attrs = {"gen_ai.operation.name": OPERATION, "gen_ai.request.model": model,
             "gen_ai.usage.input_tokens": prompt_len, "gen_ai.request.max_tokens": max_tokens,
             "gen_ai.request.temperature": temperature, "gen_ai.request.top_p": top_p,
             "specsched.request_id": request_id}
    if top_k > 0:
        attrs["gen_ai.request.top_k"] = top_k
    if seed is not None:
        attrs["gen_ai.request.seed"] = seed
    return attrs


def step_attributes(step: int, kind: str, num_requests: int, num_new_tokens: Sequence[int],
                    kv_lens: Sequence[int], drafted: Sequence[int], accepted: Sequence[int],
                    num_output: Sequence[int] | None) -> dict[str, Any]:
    attrs = {"specsched.step": step, "specsched.step.kind": kind, "specsched.batch_size": num_requests,
             "specsched.num_new_tokens": sum(num_new_tokens), "specsched.kv_tokens": sum(kv_lens),
             "specsched.num_drafted": sum(drafted), "specsched.num_accepted": sum(accepted)}
    if num_output is not None:
        attrs["specsched.num_output"] = sum(num_output)
    return attrs


def finish_attributes(output_len: int, finish_reason: str, stats: Sequence[int], ttft_ns: int | None,
                      agreement: Sequence[int] | None) -> dict[str, Any]:
    """What a request span gains at its finish; `stats` is (steps, drafted, accepted)."""
    steps, drafted, accepted = stats
    attrs = {"gen_ai.usage.output_tokens": output_len, "gen_ai.response.finish_reasons": [finish_reason],
             "specsched.num_steps": steps, "specsched.num_drafted": drafted,
             "specsched.num_accepted": accepted}
    if ttft_ns is not None:
        attrs["gen_ai.server.time_to_first_token"] = ttft_ns / 1e9
    if agreement is not None:
        attrs["specsched.agreement_rate"] = sum(agreement) / max(len(agreement), 1)
    if finish_reason == "error":
        attrs["error.type"] = "error"
    return attrs


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
