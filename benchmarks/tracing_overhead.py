"""Cost of the tracer hook per span, side by side: null vs memory vs file vs live OTel.

Why: the hook sits in the engine's step loop; this says what recording costs relative to
not recording, measured in one run on the same machine. Also times reading the file back
and computing metrics from it.

    python benchmarks/tracing_overhead.py [--spans 200000]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specsched.traces import MemoryRecorder, NullTracer, TraceRecorder, compute_metrics, read_trace
from specsched.traces.otel_export import OtelLiveTracer
from specsched.traces.schema import Header


def header() -> Header:
    return Header.create(source="engine", clock="monotonic_ns", model="bench", proposer="draft",
                         schedule="overlap", draft_len=3, device={"kind": "cpu", "name": "c"})


def per_span_ns(tracer, num_spans: int, *, guarded: bool = True) -> float:
    """Mean ns per recorded span; a step record every 10 spans, as in an engine step."""
    started = time.perf_counter_ns()
    for i in range(num_spans):
        if not guarded or tracer.enabled:
            tracer.span("host", "plan", i // 10, i * 100, i * 100 + 50, tokens=32, launch_id=i)
        if i % 10 == 9 and tracer.enabled:
            tracer.step(i // 10, "spec", i * 100 - 900, i * 100 + 50, ["a", "b"], [4, 4],
                        [100, 120], [3, 3], [2, 1], [3, 2])
    return (time.perf_counter_ns() - started) / num_spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=200_000)
    args = parser.parse_args()
    n = args.spans
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        rows = [("null tracer, guarded call site", per_span_ns(NullTracer(), n)),
                ("null tracer, unguarded call", per_span_ns(NullTracer(), n, guarded=False)),
                ("MemoryRecorder", per_span_ns(MemoryRecorder(header()), n))]
        recorder = TraceRecorder(path, header())
        rows.append(("TraceRecorder (JSONL file)", per_span_ns(recorder, n)))
        started = time.perf_counter_ns()
        recorder.close()
        close_ms = (time.perf_counter_ns() - started) / 1e6
        otel = OtelLiveTracer(header(), InMemorySpanExporter(), max_queue_size=1 << 20)
        rows.append(("OtelLiveTracer (in-memory exporter)", per_span_ns(otel, n // 10)))
        otel.close()
        # a dead collector (nothing listens on the port): span calls must cost the same
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dead = OtelLiveTracer(header(), endpoint=f"http://127.0.0.1:{port}/v1/traces", export_timeout_s=0.2,
                              shutdown_timeout_s=1.0)
        rows.append(("OtelLiveTracer (dead collector)", per_span_ns(dead, n // 10)))
        started = time.perf_counter_ns()
        dead.close()
        dead_close_ms = (time.perf_counter_ns() - started) / 1e6
        base = rows[0][1]
        print(f"{n} spans, one step record per 10 spans")
        print(f"{'tracer':40s} {'ns/span':>10s} {'x null':>10s}")
        for name, ns in rows:
            print(f"{name:40s} {ns:10.0f} {ns / base:10.1f}")
        print(f"dead-collector tracer close: {dead_close_ms:.0f} ms (bounded by shutdown_timeout_s)")
        size_mb = os.path.getsize(path) / 1e6
        started = time.perf_counter()
        trace = read_trace(path)
        read_s = time.perf_counter() - started
        started = time.perf_counter()
        compute_metrics(trace)
        metrics_s = time.perf_counter() - started
        print(f"recorder close: {close_ms:.1f} ms; file {size_mb:.1f} MB; "
              f"read_trace {read_s:.2f} s ({read_s / (n * 1.1) * 1e6:.1f} us/line); "
              f"compute_metrics {metrics_s:.2f} s")


if __name__ == "__main__":
    main()
