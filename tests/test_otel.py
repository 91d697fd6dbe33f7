"""OpenTelemetry export (traces/otel.py, traces/otel_export.py): offline, live, OTLP/HTTP on the wire, OTLP/JSON."""
from __future__ import annotations

import base64
import socket
import statistics
import time

import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from specsched.traces import MemoryRecorder, Trace, Tracer
from pathlib import Path

from specsched.traces.otel_export import (OtelLiveTracer, OtlpExportError, check_otlp_url, export_otel_json,
                                          export_otlp, export_trace_otel)
from specsched.traces.reader import read_trace
from specsched.traces.schema import Header
from specsched.traces.synthetic import synthetic_trace
from tests.otlp_collector import Collector, JsonCollector, serve

SAMPLES = Path(__file__).resolve().parents[1] / "traces" / "samples"
EPOCH_NS = 1_700_000_000 * 10**9
CLOCK0_NS = 5_000
OFFSET_NS = EPOCH_NS - CLOCK0_NS


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch):
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(key, raising=False)


def header() -> Header:
    h = Header.create(source="engine", clock="monotonic_ns", model="tiny-llama",
                      proposer="draft", schedule="overlap", draft_len=3,
                      device={"kind": "cpu", "name": "host-process"})
    return h.model_copy(update={"created_unix_s": EPOCH_NS / 1e9, "created_clock_ns": CLOCK0_NS})


def feed(tracer) -> None:
    """Two requests, a prefill step and a spec step; B ends with an error."""
    tracer.request("A", 10_000, 7, 5, temperature=0.5, top_p=0.9, top_k=20, seed=3)
    tracer.request("B", 12_000, 4, 6, temperature=0.0)
    tracer.span("host", "schedule", 1, 20_000, 21_000, requests=2)
    tracer.span("device:main", "prefill", 1, 21_500, 30_000, launch_id=1, tokens=11)
    tracer.step(1, "prefill", 20_000, 31_000, ["A", "B"], [7, 4], [7, 4], [0, 0], [0, 0],
                [1, 1])
    tracer.span("host", "plan", 2, 31_000, 32_000, launch_id=2)
    for name, start, end in (("draft", 32_000, 35_000), ("verify", 35_000, 39_000),
                             ("accept", 39_000, 40_000)):
        tracer.span("device:main", name, 2, start, end, launch_id=2)
    tracer.span("host", "sync", 2, 32_000, 40_000)
    tracer.step(2, "spec", 31_000, 41_000, ["A", "B"], [4, 4], [11, 8], [3, 3], [2, 1],
                [3, 2])
    tracer.finish("A", 41_000, "length", 4, 31_000, ttft_ns=21_000)
    tracer.finish("B", 41_500, "error", 3, 31_000, ttft_ns=19_000, error="boom")
    tracer.span("device:main", "fill", 2, 41_000, 45_000, launch_id=3)


def hand_trace() -> Trace:
    r = MemoryRecorder(header())
    feed(r)
    return r.to_trace()


def by_name(spans) -> dict:
    out: dict = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def check_export(spans) -> None:
    named = by_name(spans)
    assert set(named) == {"text_completion tiny-llama", "step", "schedule", "prefill", "plan",
                          "spec.draft", "spec.verify", "spec.accept", "sync", "spec.fill"}
    requests = {s.attributes["specsched.request_id"]: s
                for s in named["text_completion tiny-llama"]}
    a, b = requests["A"], requests["B"]
    assert a.attributes["gen_ai.operation.name"] == "text_completion"
    assert a.attributes["gen_ai.request.model"] == "tiny-llama"
    assert a.attributes["gen_ai.usage.input_tokens"] == 7
    assert a.attributes["gen_ai.usage.output_tokens"] == 4
    assert a.attributes["gen_ai.request.max_tokens"] == 5
    assert a.attributes["gen_ai.request.temperature"] == 0.5
    assert a.attributes["gen_ai.request.top_k"] == 20 and a.attributes["gen_ai.request.seed"] == 3
    assert tuple(a.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert a.attributes["gen_ai.server.time_to_first_token"] == pytest.approx(21e-6)
    assert a.attributes["specsched.num_drafted"] == 3
    assert a.attributes["specsched.num_accepted"] == 2
    assert (a.start_time, a.end_time) == (10_000 + OFFSET_NS, 41_000 + OFFSET_NS)
    assert [(e.name, e.timestamp) for e in a.events] == [("first_token", 31_000 + OFFSET_NS)]
    assert a.parent is None and a.status.status_code == StatusCode.UNSET
    assert b.status.status_code == StatusCode.ERROR and b.status.description == "boom"
    assert b.attributes["error.type"] == "error"

    steps = {s.attributes["specsched.step"]: s for s in named["step"]}
    assert (steps[2].start_time, steps[2].end_time) == (31_000 + OFFSET_NS, 41_000 + OFFSET_NS)
    assert steps[2].attributes["specsched.num_accepted"] == 3
    assert steps[2].attributes["specsched.step.kind"] == "spec"
    linked = {link.context.span_id for link in steps[2].links}
    assert linked == {a.context.span_id, b.context.span_id}
    for name in ("plan", "spec.draft", "spec.verify", "spec.accept", "sync", "spec.fill"):
        (stage,) = named[name]
        assert stage.parent.span_id == steps[2].context.span_id, name
        assert stage.context.trace_id == steps[2].context.trace_id, name
    verify = named["spec.verify"][0]
    assert (verify.start_time, verify.end_time) == (35_000 + OFFSET_NS, 39_000 + OFFSET_NS)
    assert verify.attributes["specsched.device.stream"] == "main"
    assert verify.attributes["specsched.launch_id"] == 2
    assert named["prefill"][0].parent.span_id == steps[1].context.span_id
    assert named["schedule"][0].attributes["specsched.requests"] == 2


def test_offline_export_names_attributes_parentage_links_times():
    exporter = InMemorySpanExporter()
    assert export_trace_otel(hand_trace(), exporter, chunk_size=4) == 12
    check_export(exporter.get_finished_spans())
    assert exporter.export([]).name == "SUCCESS"  # the caller's exporter is left open


def test_live_tracer_matches_offline_export():
    exporter = InMemorySpanExporter()
    tracer = OtelLiveTracer(header(), exporter, schedule_delay_ms=10)
    assert isinstance(tracer, Tracer)
    feed(tracer)
    tracer.close()
    check_export(exporter.get_finished_spans())


def test_live_tracer_ends_unfinished_requests_and_orphan_steps():
    exporter = InMemorySpanExporter()
    tracer = OtelLiveTracer(header(), exporter, max_pending_steps=2)
    tracer.request("A", 1_000, 3, 4)
    for step in (1, 2, 3, 4):  # stage spans whose step record never comes
        tracer.span("host", "plan", step, step * 100_000, step * 100_000 + 50)
    tracer.close()
    named = by_name(exporter.get_finished_spans())
    (request,) = named["text_completion tiny-llama"]
    assert request.attributes["specsched.finished"] is False
    assert request.end_time == 400_050 + OFFSET_NS
    steps = {s.attributes["specsched.step"]: s for s in named["step"]}
    assert sorted(steps) == [1, 2, 3, 4] and not steps[1].attributes["specsched.step.complete"]
    for plan in named["plan"]:
        parent = steps[plan.attributes["specsched.step"]]
        assert plan.parent.span_id == parent.context.span_id
        assert (parent.start_time, parent.end_time) == (plan.start_time, plan.end_time)


def test_otlp_json_file(tmp_path):
    trace = synthetic_trace(num_requests=3, max_tokens=6)
    count = export_otel_json(trace, tmp_path / "run.otlp.jsonl", chunk_size=16)
    lines = (tmp_path / "run.otlp.jsonl").read_bytes().splitlines()
    assert len(lines) == -(-count // 16)
    spans = [span for line in lines for rs in orjson.loads(line)["resourceSpans"]
             for ss in rs["scopeSpans"] for span in ss["spans"]]
    assert len(spans) == count
    for span in spans:
        assert len(span["traceId"]) == 32 and len(span["spanId"]) == 16
        int(span["traceId"], 16), int(span["spanId"], 16)
        assert int(span["endTimeUnixNano"]) >= int(span["startTimeUnixNano"])
        for link in span.get("links", []):
            assert len(link["spanId"]) == 16
    ids = {s["spanId"] for s in spans}
    assert all(s["parentSpanId"] in ids for s in spans if "parentSpanId" in s)


def test_live_export_over_otlp_http_protobuf():
    server, url = serve(Collector)
    try:
        tracer = OtelLiveTracer(header(), endpoint=url, schedule_delay_ms=10)
        feed(tracer)
        tracer.close()
    finally:
        server.shutdown()
        server.server_close()
    assert Collector.received
    names, attrs = [], {}
    for path, content_type, body in Collector.received:
        assert path == "/v1/traces" and content_type == "application/x-protobuf"
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            resource = {kv.key: kv.value for kv in rs.resource.attributes}
            assert resource["service.name"].string_value == "specsched"
            assert resource["specsched.schedule"].string_value == "overlap"
            for ss in rs.scope_spans:
                for span in ss.spans:
                    names.append(span.name)
                    attrs[span.name] = {kv.key: kv.value for kv in span.attributes}
    assert len(names) == 12 and names.count("text_completion tiny-llama") == 2
    assert attrs["spec.verify"]["specsched.device.stream"].string_value == "main"
    assert attrs["step"]["specsched.step.kind"].string_value in ("prefill", "spec")


def test_offline_export_over_otlp_http_json():
    server, url = serve(JsonCollector)
    try:
        assert export_otlp(hand_trace(), url, chunk_size=5) == 12
    finally:
        server.shutdown()
        server.server_close()
    assert len(JsonCollector.received) == 3  # 12 spans in batches of 5
    spans = []
    for path, content_type, body in JsonCollector.received:
        assert path == "/v1/traces" and content_type == "application/json"
        (rs,) = orjson.loads(body)["resourceSpans"]
        resource = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
        assert resource["service.name"] == {"stringValue": "specsched"}
        assert resource["specsched.draft_len"] == {"intValue": "3"}
        spans += rs["scopeSpans"][0]["spans"]
    assert _normalized(spans) == _normalized(_sdk_json(hand_trace()))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_calls(tracer, num_steps: int) -> list[float]:
    """Per-call seconds of span() calls that create SDK spans at once (their step is known)."""
    durations = []
    for step in range(num_steps):
        t = step * 10_000
        tracer.step(step, "decode", t, t + 9_000, ["A"], [1], [5], num_output=[1])
        for k in range(5):
            started = time.perf_counter()
            tracer.span("device:main", "verify", step, t + k * 1_000, t + k * 1_000 + 900,
                        tokens=4)
            durations.append(time.perf_counter() - started)
    return durations


@pytest.mark.parametrize("collector", ["refusing", "silent"])
def test_dead_collector_costs_the_caller_nothing(collector):
    """A closed port (connection refused) or a socket that never answers (read timeout)."""
    options = dict(export_timeout_s=0.5, shutdown_timeout_s=1.0, max_queue_size=256,
                   max_export_batch_size=64, schedule_delay_ms=5)
    baseline = OtelLiveTracer(header(), InMemorySpanExporter(), **options)
    base = _record_calls(baseline, 400)
    baseline.close()
    with socket.socket() as silent:
        if collector == "silent":
            silent.bind(("127.0.0.1", 0))
            silent.listen(64)  # the kernel accepts connections; nobody ever reads or replies
            port = silent.getsockname()[1]
        else:
            port = _closed_port()
        dead = OtelLiveTracer(header(), endpoint=f"http://127.0.0.1:{port}/v1/traces",
                              **options)
        dead.request("A", 0, 3, 4)
        calls = _record_calls(dead, 400)
        started = time.perf_counter()
        dead.close()
        close_s = time.perf_counter() - started
    median_us, base_us = statistics.median(calls) * 1e6, statistics.median(base) * 1e6
    assert median_us < 3 * base_us + 50, (median_us, base_us)
    assert median_us < 500, median_us  # microseconds, not an export round trip
    assert close_s < 4.0, close_s  # bounded by shutdown_timeout_s, not by retries


def test_offline_export_to_a_refusing_collector_stops_at_the_first_batch():
    started = time.perf_counter()
    with pytest.raises(OtlpExportError, match=r"batch 1 \(5 spans\) was not delivered .*refused; "
                       r"0 spans were delivered before it"):
        export_otlp(hand_trace(), f"http://127.0.0.1:{_closed_port()}/v1/traces", timeout_s=0.5, chunk_size=5)
    assert time.perf_counter() - started < 1.0  # no retries


def test_offline_export_to_a_silent_collector_stops_after_one_timeout():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel accepts connections; nobody ever reads or replies
        started = time.perf_counter()
        with pytest.raises(OtlpExportError, match=r"batch 1 .* no answer within 0.3 s"):
            export_otlp(synthetic_trace(num_requests=8, max_tokens=16),
                        f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces", timeout_s=0.3, chunk_size=8)
        assert time.perf_counter() - started < 1.5


@pytest.mark.parametrize("url", ["notaurl", "ftp://host/v1/traces", "http:///v1/traces", "http://host:port/"])
def test_otlp_url_is_checked_before_sending(url):
    with pytest.raises(ValueError, match="not an http\\(s\\) URL|port"):
        check_otlp_url(url)
    with pytest.raises(ValueError):
        export_otlp(hand_trace(), url)


# -- the OTLP/JSON encoder against the SDK ----------------------------------------------------


def _sdk_json(trace: Trace) -> list[dict]:
    """The spans the OpenTelemetry SDK makes of `trace`, as OTLP/JSON (ids in hex)."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    exporter = InMemorySpanExporter()
    export_trace_otel(trace, exporter, chunk_size=10**9)
    message = MessageToDict(encode_spans(exporter.get_finished_spans()), use_integers_for_enums=True)
    spans = [span for rs in message["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]]
    for span in spans:
        for node in [span, *span.get("links", [])]:
            for key in ("traceId", "spanId", "parentSpanId"):
                if key in node:
                    node[key] = base64.b64decode(node[key]).hex()
    return spans


def _normalized(spans: list[dict]) -> list[dict]:
    """Random trace and span ids replaced by their order of first appearance."""
    names: dict[str, str] = {}

    def rename(value: str) -> str:
        return names.setdefault(value, f"id{len(names)}")

    out = []
    for span in spans:
        span = orjson.loads(orjson.dumps(span))
        for node in [span, *span.get("links", [])]:
            for key in ("traceId", "spanId", "parentSpanId"):
                if key in node:
                    node[key] = rename(node[key])
        out.append(span)
    return out


@pytest.mark.parametrize("make", [
    hand_trace,
    lambda: synthetic_trace(num_requests=5, max_tokens=7),
    lambda: read_trace(SAMPLES / "mtp_mtp.jsonl"),
])
def test_json_encoder_writes_what_the_sdk_writes(make, tmp_path):
    trace = make()
    count = export_otel_json(trace, tmp_path / "a.jsonl", chunk_size=10**9)
    (line,) = (tmp_path / "a.jsonl").read_bytes().splitlines()
    (rs,) = orjson.loads(line)["resourceSpans"]
    ours = rs["scopeSpans"][0]["spans"]
    assert count == len(ours)
    assert _normalized(ours) == _normalized(_sdk_json(trace))
    resource = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
    assert set(resource) >= {"service.name", "telemetry.sdk.version", "specsched.schedule"}


def test_streamed_file_export_equals_the_in_memory_one(tmp_path):
    src = SAMPLES / "draft_overlap.jsonl"
    n_file = export_otel_json(src, tmp_path / "file.jsonl", chunk_size=64)
    n_mem = export_otel_json(read_trace(src), tmp_path / "mem.jsonl", chunk_size=64)

    def spans(path):
        return [s for line in path.read_bytes().splitlines()
                for s in orjson.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]]

    a, b = spans(tmp_path / "file.jsonl"), spans(tmp_path / "mem.jsonl")
    assert n_file == n_mem == len(a) > 500
    key = lambda s: (s["name"], s["startTimeUnixNano"], s["endTimeUnixNano"])  # noqa: E731
    strip = lambda s: {k: v for k, v in s.items() if k not in ("traceId", "spanId", "parentSpanId", "links")}  # noqa: E731
    assert sorted(map(strip, a), key=key) == sorted(map(strip, b), key=key)
