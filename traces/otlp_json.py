"""OTLP/JSON spans built straight from trace records: offline export of traces of any length.

Why not the OpenTelemetry SDK here (as the live tracer in traces/otel.py does): building an
SDK span, encoding it to protobuf and turning that into JSON costs a few hundred microseconds
a span, so a production-length trace took minutes and gigabytes. A trace that is already
recorded needs none of the SDK's machinery (sampling, processors, context propagation): this
module writes the same spans -- names, attributes, parents, links, events, status, as
`OtelTracer` makes them (tests compare the two) -- as OTLP/JSON dicts, streamed in chunks.

`OtlpJsonTracer` is a `Tracer` hook; every `chunk_size` finished spans it hands one
ExportTraceServiceRequest, as JSON bytes, and its number of spans to `sink`. Stage spans
(most of a trace) are written as JSON text directly; the others go through a dict and orjson. Memory is bounded by the requests in flight,
the stage spans waiting for their step record (at most `max_pending_steps` steps) and the
span contexts remembered for links (at most `max_remembered`).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random
import urllib.error
import urllib.parse
import urllib.request
import uuid
from importlib import metadata
from typing import Any, Callable, Sequence

import orjson

from specsched.traces.hook import feed, replay
from specsched.traces.otel_names import (OPERATION, SpanMapper, _attr, epoch_offset_ns, finish_attributes,
                                         request_attributes, stage_span_name, step_attributes)
from specsched.traces.schema import DEVICE_TRACK_PREFIX, FORMAT_VERSION, Header, Trace

_KIND_INTERNAL = 1  # SpanKind.INTERNAL in OTLP
_FLAGS = 256  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK: the context is known to be local
_STATUS_ERROR = 2


def _value(v: Any) -> dict:
    """An OTLP/JSON AnyValue (int64 as a string, as proto3 JSON writes it). Dispatched on the
    exact type first: it runs for every attribute of every span."""
    t = type(v)
    if t is int:
        return {"intValue": str(v)}
    if t is str:
        return {"stringValue": v}
    if t is float:
        return {"doubleValue": v}
    if t is bool:
        return {"boolValue": v}
    if isinstance(v, bool):
        return {"boolValue": bool(v)}
    if isinstance(v, int):
        return {"intValue": str(int(v))}
    if isinstance(v, float):
        return {"doubleValue": float(v)}
    if isinstance(v, str):
        return {"stringValue": str(v)}
    return {"arrayValue": {"values": [_value(x) for x in v]}}


def _attributes(attrs: dict[str, Any]) -> list[dict]:
    return [{"key": k, "value": _value(v)} for k, v in attrs.items() if v is not None]


_jstr = json.encoder.encode_basestring  # a JSON string literal (C-accelerated)
_STAGE_KEYS: dict[str, str] = {}  # span attribute -> `{"key":"specsched.<attribute>","value":`


def _value_json(v: Any) -> str:
    """`_value(v)` as JSON text."""
    t = type(v)
    if t is int:
        return '{"intValue":"%d"}' % v
    if t is str:
        return '{"stringValue":%s}' % _jstr(v)
    if t is float and math.isfinite(v):
        return '{"doubleValue":%r}' % v
    return orjson.dumps(_value(v)).decode()


def _sdk_version() -> str:
    try:
        return metadata.version("opentelemetry-sdk")
    except metadata.PackageNotFoundError:
        return "unknown"


class OtlpJsonTracer(SpanMapper):
    """The tracer hook writing OTLP/JSON export requests, `chunk_size` spans each, to `sink`."""

    def __init__(self, header: Header, sink: Callable[[bytes, int], None], *, clock_offset_ns: int,
                 chunk_size: int = 1024, max_pending_steps: int = 256, max_remembered: int = 65536):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        super().__init__(max_pending_steps, max_remembered)
        self.header, self.sink, self.chunk_size = header, sink, chunk_size
        self.clock_offset_ns = clock_offset_ns
        self.num_spans = 0
        self._resource = {"attributes": _attributes({
            "telemetry.sdk.language": "python", "telemetry.sdk.name": "opentelemetry",
            "telemetry.sdk.version": _sdk_version(), "service.instance.id": str(uuid.uuid4()),
            "service.name": os.environ.get("OTEL_SERVICE_NAME", "specsched"),
            "specsched.source": header.source, "specsched.schedule": header.schedule,
            "specsched.proposer": header.proposer, "specsched.draft_len": header.draft_len,
            "specsched.model": header.model, "specsched.device.kind": header.device.kind,
            "specsched.device.name": header.device.name})}
        scope = {"name": "specsched.traces", "version": FORMAT_VERSION}
        self._prefix = ('{"resourceSpans":[{"resource":%s,"scopeSpans":[{"scope":%s,"spans":['
                        % (orjson.dumps(self._resource).decode(), orjson.dumps(scope).decode()))
        self._chunk: list[str] = []  # finished spans as JSON text
        # request_id -> (trace_id, span_id, start_ns, attributes) of a request not finished yet
        self._open: dict[str, tuple[str, str, int, dict]] = {}

    # -- the Tracer hook ----------------------------------------------------------------------
    def request(self, request_id: str, arrival_ns: int, prompt_len: int, max_tokens: int,
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                seed: int | None = None, synthetic_acceptance_length: float | None = None,
                synthetic_acceptance_rates: list[float] | None = None) -> None:
        attrs = request_attributes(self.header.model, request_id, prompt_len, max_tokens, temperature,
                                   top_p, top_k, seed)
        self._open[request_id] = (_trace_id(), _span_id(), arrival_ns, attrs)
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
        links = [{"traceId": c[0], "spanId": c[1], "flags": _FLAGS} for c in contexts]
        attrs = step_attributes(step, kind, len(request_ids), num_new_tokens, kv_lens, drafted, accepted,
                                num_output, draft_len, predicted_gain)
        ctx = (_trace_id(), _span_id())
        self._end(ctx, None, "step", start_ns, end_ns, attrs, links=links)
        self._step_known(step, ctx)

    def finish(self, request_id: str, finish_ns: int, finish_reason: str, output_len: int,
               first_token_ns: int | None, ttft_ns: int | None = None,
               agreement: Sequence[int] | None = None, agreement_kind: str | None = None,
               error: str | None = None) -> None:
        self._last_ns = max(self._last_ns, finish_ns)
        opened = self._open.pop(request_id, None)
        if opened is None:  # its request record was never seen: start at the best guess
            start_ns = (first_token_ns - ttft_ns if first_token_ns is not None
                        and ttft_ns is not None else finish_ns)
            opened = (_trace_id(), _span_id(), start_ns, {
                "gen_ai.operation.name": OPERATION, "gen_ai.request.model": self.header.model,
                "specsched.request_id": request_id})
        trace_id, span_id, start_ns, attrs = opened
        attrs.update(finish_attributes(output_len, finish_reason, self._stats.pop(request_id, (0, 0, 0)),
                                       ttft_ns, agreement))
        events = ([{"timeUnixNano": str(first_token_ns + self.clock_offset_ns), "name": "first_token"}]
                  if first_token_ns is not None else [])
        status = {"message": error or "error", "code": _STATUS_ERROR} if finish_reason == "error" else {}
        self._end((trace_id, span_id), None, f"{OPERATION} {self.header.model}", start_ns, finish_ns,
                  attrs, events=events, status=status)
        self._remember(self._request_ctx, request_id, (trace_id, span_id))

    def close(self) -> None:
        """Emits waiting stage spans, ends unfinished requests, hands on the last chunk."""
        if self._closed:
            return
        self._closed = True
        self._drain_pending()
        for trace_id, span_id, start_ns, attrs in self._open.values():
            attrs["specsched.finished"] = False
            self._end((trace_id, span_id), None, f"{OPERATION} {self.header.model}", start_ns,
                      self._last_ns, attrs)
        self._open.clear()
        self._flush()

    # -- spans -----------------------------------------------------------------------------------
    def _end(self, ctx: tuple[str, str], parent: tuple[str, str] | None, name: str, start_ns: int,
             end_ns: int, attrs: dict, *, links: list | None = None, events: list | None = None,
             status: dict | None = None) -> None:
        offset = self.clock_offset_ns
        attributes = _attributes(attrs)
        if parent is None:
            span = {"traceId": ctx[0], "spanId": ctx[1], "name": name, "kind": _KIND_INTERNAL,
                    "startTimeUnixNano": str(start_ns + offset), "endTimeUnixNano": str(end_ns + offset),
                    "attributes": attributes}
        else:
            span = {"traceId": ctx[0], "spanId": ctx[1], "parentSpanId": parent[1], "name": name,
                    "kind": _KIND_INTERNAL, "startTimeUnixNano": str(start_ns + offset),
                    "endTimeUnixNano": str(end_ns + offset), "attributes": attributes}
        if events:
            span["events"] = events
        if links:
            span["links"] = links
        span["status"] = status or {}
        span["flags"] = _FLAGS
        self._append(orjson.dumps(span).decode())

    def _append(self, span_json: str) -> None:
        self._chunk.append(span_json)
        self.num_spans += 1
        if len(self._chunk) >= self.chunk_size:
            self._flush()

    def _flush(self) -> None:
        if self._chunk:
            chunk, self._chunk = self._chunk, []
            self.sink((self._prefix + ",".join(chunk) + "]}]}]}").encode(), len(chunk))

    def _request_context(self, request_id: str) -> tuple[str, str] | None:
        opened = self._open.get(request_id)
        return opened[:2] if opened is not None else self._request_ctx.get(request_id)

    def _emit_stage(self, entry: tuple, parent: tuple[str, str] | None) -> None:
        # the attribute list is built directly (the most frequent span): OtelTracer._emit_stage's
        # attributes, in its order
        track, name, step, start_ns, end_ns, attrs = entry
        out = ['{"key":"specsched.stage","value":{"stringValue":%s}}' % _jstr(name),
               '{"key":"specsched.track","value":{"stringValue":%s}}' % _jstr(track)]
        if step is not None:
            out.append('{"key":"specsched.step","value":{"intValue":"%d"}}' % step)
        if track.startswith(DEVICE_TRACK_PREFIX):
            out.append('{"key":"specsched.device.stream","value":{"stringValue":%s}}'
                       % _jstr(track[len(DEVICE_TRACK_PREFIX):]))
        for key, value in attrs.items():
            value = _attr(value)
            if value is not None:
                head = _STAGE_KEYS.get(key)
                if head is None:
                    head = _STAGE_KEYS[key] = '{"key":%s,"value":' % _jstr(f"specsched.{key}")
                out.append(head + _value_json(value) + "}")
        offset = self.clock_offset_ns
        parent_json = ',"parentSpanId":"%s"' % parent[1] if parent is not None else ""
        self._append('{"traceId":"%s","spanId":"%s"%s,"name":%s,"kind":1,"startTimeUnixNano":"%d",'
                     '"endTimeUnixNano":"%d","attributes":[%s],"status":{},"flags":256}'
                     % (parent[0] if parent is not None else _trace_id(), _span_id(), parent_json,
                        _jstr(stage_span_name(name)), start_ns + offset, end_ns + offset, ",".join(out)))

    def _emit_orphan_step(self, step: int, entries: list[tuple]) -> None:
        """A step whose record never came: a `step` span spanning its stage spans."""
        ctx = (_trace_id(), _span_id())
        self._end(ctx, None, "step", min(e[3] for e in entries), max(e[4] for e in entries),
                  {"specsched.step": step, "specsched.step.complete": False})
        self._remember(self._step_ctx, step, ctx)
        for entry in entries:
            self._emit_stage(entry, ctx)


# Ids need to be unique, not secret: a generator seeded from the OS (again in a forked child,
# which would otherwise repeat its parent's ids) instead of a system call per id.
_ids = random.Random(os.urandom(32))
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def _trace_id() -> str:
    return "%032x" % (_ids.getrandbits(128) or 1)  # an all-zero id is invalid in OTLP


def _span_id() -> str:
    return "%016x" % (_ids.getrandbits(64) or 1)


# -- offline export: to a collector, to a file -------------------------------------------------


class OtlpExportError(RuntimeError):
    """An offline export to a collector stopped: the first batch it could not deliver."""


def check_otlp_url(url: str) -> str:
    """`url` if it is an http(s) URL with a host, else ValueError saying what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host, e.g. "
                         "http://localhost:4318/v1/traces")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as e:
        raise ValueError(f"{url!r}: {e}") from None
    return url


def export_otlp(trace: Trace | str | os.PathLike, endpoint: str, *, timeout_s: float = 10.0,
                chunk_size: int = 512) -> int:
    """Sends a recorded trace (a Trace, or a trace file, streamed) to an OTLP/HTTP collector
    as OTLP/JSON (`Content-Type: application/json`, which OTLP/HTTP receivers accept next to
    protobuf); returns the number of spans sent.

    Batches go one at a time with no retries: the first one refused, answered with an error
    status or not answered within `timeout_s` raises OtlpExportError, naming it and how many
    spans were delivered before it. A bad URL raises ValueError before anything is sent.
    """
    check_otlp_url(endpoint)
    sent = [0, 0]  # batches, spans

    def post(body: bytes, spans: int) -> None:
        http = urllib.request.Request(endpoint, data=body, method="POST",
                                      headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(http, timeout=timeout_s) as reply:
                reply.read()
        except urllib.error.HTTPError as e:
            reason = f"the collector answered {e.code} {e.reason}"
        except (urllib.error.URLError, OSError) as e:
            why = e.reason if isinstance(e, urllib.error.URLError) else e
            reason = f"no answer within {timeout_s:g} s" if isinstance(why, TimeoutError) else str(why)
        else:
            sent[0] += 1
            sent[1] += spans
            return
        raise OtlpExportError(f"batch {sent[0] + 1} ({spans} spans) was not delivered to {endpoint}: "
                              f"{reason}; {sent[1]} spans were delivered before it")

    _export_json(trace, post, chunk_size)
    return sent[1]


def export_otel_json(trace: Trace | str | os.PathLike, path: str | os.PathLike, *,
                     chunk_size: int = 1024) -> int:
    """Writes the export as OTLP/JSON: one ExportTraceServiceRequest per line (the format
    of the OpenTelemetry Collector's file exporter / otlpjsonfile receiver). `trace` is a
    Trace, or a trace file, read as a stream: memory stays bounded whatever its length.
    Returns the number of spans written."""
    with open(path, "wb") as f:
        def write(body: bytes, _spans: int) -> None:
            f.write(body)
            f.write(b"\n")

        return _export_json(trace, write, chunk_size)


def _export_json(trace: Trace | str | os.PathLike, sink, chunk_size: int) -> int:
    if isinstance(trace, Trace):
        tracer = OtlpJsonTracer(trace.header, sink, chunk_size=chunk_size, max_remembered=1 << 62,
                                clock_offset_ns=epoch_offset_ns(trace.header, trace))
        replay(trace, tracer, close=True)
        return tracer.num_spans
    from specsched.traces.reader import iter_records

    records = iter_records(trace, allow_truncated_tail=True)
    header = next(records)
    if header.created_clock_ns is not None:
        offset = epoch_offset_ns(header, None)
    else:  # anchored at the first record's time, as for an in-memory trace
        offset = round(header.created_unix_s * 1e9) - _first_ns(trace)
    tracer = OtlpJsonTracer(header, sink, chunk_size=chunk_size, clock_offset_ns=offset)
    feed(records, tracer)
    tracer.close()
    return tracer.num_spans


def _first_ns(path: str | os.PathLike) -> int:
    """The earliest timestamp in a trace file (`Trace.start_ns` without loading the trace)."""
    from specsched.traces.reader import iter_records

    times = [r.arrival_ns if r.type == "request" else r.start_ns if r.type in ("span", "step")
             else r.finish_ns for r in itertools.islice(iter_records(path, allow_truncated_tail=True), 1, None)]
    return min(times, default=0)
