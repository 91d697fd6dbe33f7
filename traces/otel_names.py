"""Names and conventions shared by every OpenTelemetry export path (SDK-based or not).

Why a module of its own: the offline OTLP/JSON export (traces/otlp_json.py) needs these but
not the OpenTelemetry SDK, whose import alone costs a large part of a short export.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Sequence

import orjson

from specsched.traces.schema import Header, Trace

SPEC_STAGES = frozenset({"draft", "verify", "accept", "fill", "mtp"})
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


class SpanMapper:
    """What both OpenTelemetry mappers (SDK spans, `OtelTracer`; OTLP/JSON text, `OtlpJsonTracer`)
    keep while records stream by: stage spans waiting for their step's record (at most
    `max_pending_steps` steps), per-request step/draft/accept counts, and the span contexts of
    finished requests and steps (at most `max_remembered` each) for links and parents.
    Subclasses emit: `_emit_stage(entry, parent_ctx)`, `_emit_orphan_step(step, entries)`,
    and `_request_context(request_id)` for a request's span context (open or finished)."""

    enabled = True

    def __init__(self, max_pending_steps: int, max_remembered: int) -> None:
        self._max_pending_steps, self._max_remembered = max_pending_steps, max_remembered
        self._stats: dict[str, list[int]] = {}  # request_id -> [steps, drafted, accepted]
        self._request_ctx: OrderedDict[str, Any] = OrderedDict()  # finished requests, for links
        self._step_ctx: OrderedDict[int, Any] = OrderedDict()
        self._pending: OrderedDict[int, list[tuple]] = OrderedDict()  # step -> stage spans
        self._last_ns = 0
        self._closed = False

    def span(self, track: str, name: str, step: int | None, start_ns: int, end_ns: int,
             **attrs: Any) -> None:
        self._last_ns = max(self._last_ns, end_ns)
        entry = (track, name, step, start_ns, end_ns, attrs)
        if step is None or step in self._step_ctx:
            self._emit_stage(entry, self._step_ctx.get(step))
            return
        self._pending.setdefault(step, []).append(entry)
        if len(self._pending) > self._max_pending_steps:
            self._emit_orphan_step(*self._pending.popitem(last=False))

    def _tally(self, request_ids: Sequence[str], num_drafted: Sequence[int] | None,
               num_accepted: Sequence[int] | None) -> tuple[list[int], list[int], list[Any]]:
        """A step's per-row drafted and accepted counts (zeros when absent), added to each
        request's counts, and the span contexts of its requests (for links)."""
        drafted = list(num_drafted) if num_drafted is not None else [0] * len(request_ids)
        accepted = list(num_accepted) if num_accepted is not None else [0] * len(request_ids)
        contexts = []
        for rid, d, a in zip(request_ids, drafted, accepted):
            ctx = self._request_context(rid)
            if ctx is not None:
                contexts.append(ctx)
            stats = self._stats.get(rid)
            if stats is not None:
                stats[0] += 1
                stats[1] += d
                stats[2] += a
        return drafted, accepted, contexts

    def _step_known(self, step: int, ctx: Any) -> None:
        """The step's span exists: remember it and emit the stage spans that waited for it."""
        self._remember(self._step_ctx, step, ctx)
        for entry in self._pending.pop(step, ()):
            self._emit_stage(entry, ctx)

    def _drain_pending(self) -> None:
        while self._pending:
            self._emit_orphan_step(*self._pending.popitem(last=False))

    def _remember(self, cache: OrderedDict, key: Any, value: Any) -> None:
        cache[key] = value
        if len(cache) > self._max_remembered:
            cache.popitem(last=False)

    def _emit_stage(self, entry: tuple, parent_ctx: Any) -> None:
        raise NotImplementedError

    def _emit_orphan_step(self, step: int, entries: list[tuple]) -> None:
        raise NotImplementedError

    def _request_context(self, request_id: str) -> Any:
        raise NotImplementedError


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
                    num_output: Sequence[int] | None, draft_len: int | None = None,
                    predicted_gain: float | None = None) -> dict[str, Any]:
    attrs = {"specsched.step": step, "specsched.step.kind": kind, "specsched.batch_size": num_requests,
             "specsched.num_new_tokens": sum(num_new_tokens), "specsched.kv_tokens": sum(kv_lens),
             "specsched.num_drafted": sum(drafted), "specsched.num_accepted": sum(accepted)}
    if num_output is not None:
        attrs["specsched.num_output"] = sum(num_output)
    if draft_len is not None:  # chosen by the adaptive draft length
        attrs["specsched.draft_len"] = draft_len
    if predicted_gain is not None:
        attrs["specsched.predicted_gain"] = predicted_gain
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
