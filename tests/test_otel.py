"""OpenTelemetry export (traces/otel.py, traces/otel_export.py): offline, live, OTLP/HTTP on the wire, OTLP/JSON."""
from __future__ import annotations

import http.server
import socket
import statistics
import threading
import time

import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from specsched.traces import MemoryRecorder, Trace, Tracer
from specsched.traces.otel_export import OtelLiveTracer, export_otel_json, export_otlp, export_trace_otel
from specsched.traces.schema import Header
from specsched.traces.synthetic import synthetic_trace

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
    tracer.span("device:main", "draft_fill", 2, 41_000, 45_000, launch_id=3)


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
                          "spec.draft", "spec.verify", "spec.accept", "sync", "spec.draft_fill"}
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
    for name in ("plan", "spec.draft", "spec.verify", "spec.accept", "sync", "spec.draft_fill"):
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


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self):  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers.get("Content-Type"), body))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode", ["live", "offline"])
def test_export_over_otlp_http_protobuf(mode):
    _Collector.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        if mode == "live":
            tracer = OtelLiveTracer(header(), endpoint=url, schedule_delay_ms=10)
            feed(tracer)
            tracer.close()
        else:
            assert export_otlp(hand_trace(), url, chunk_size=5) == 12
            assert len(_Collector.received) == 3
    finally:
        server.shutdown()
        server.server_close()
    assert _Collector.received
    names, attrs = [], {}
    for path, content_type, body in _Collector.received:
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


def test_offline_export_to_dead_collector_raises():
    with pytest.raises(RuntimeError, match="OTel export failed for 12 of 12 spans"):
        export_otlp(hand_trace(), f"http://127.0.0.1:{_closed_port()}/v1/traces", timeout_s=0.5)
