"""Run metrics (traces/metrics.py) on a hand-computed trace, edge cases and 100k spans."""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsched.traces import MemoryRecorder, SpanRecord, StepRecord, Trace, compute_metrics
from specsched.traces.metrics import PERCENTILES, merge_intervals, percentiles, subtract_intervals
from specsched.traces.schema import Header

MS = 1_000_000  # ns

KEYS = ["requests", "requests_failed", "requests_aborted", "output_tokens", "duration_s", "output_tokens_per_s", "ttft_ms", "tpot_ms",
        "steps", "mean_accept_len", "accept_rate_per_pos", "device_busy_fraction",
        "bubble_fraction", "host_ms_per_step", "draft_len_counts"]


def header() -> Header:
    return Header.create(source="engine", clock="monotonic_ns", model="m", proposer="draft",
                         schedule="overlap", draft_len=3, device={"kind": "cpu", "name": "c"},
                         created_clock_ns=0)


def ms(x: float) -> int:
    return round(x * MS)


def hand_trace() -> Trace:
    """Two requests, five steps. Expected values are worked out in the test below."""
    r = MemoryRecorder(header())
    r.request("A", 0, 10, 9, temperature=0.0)
    r.request("B", ms(1), 5, 8, temperature=0.0)
    # step, kind, [start, end], requests, drafted, accepted, output
    steps = [(1, "prefill", 0, 2, ["A"], [0], [0], [1]),
             (2, "mixed", 2, 4, ["A", "B"], [0, 0], [0, 0], [1, 1]),
             (3, "spec", 4, 6, ["A", "B"], [3, 3], [2, 0], [3, 1]),
             (4, "spec", 6, 8, ["A", "B"], [3, 2], [3, 1], [4, 2]),
             (5, "spec", 8, 10, ["B"], [3], [3], [4])]
    for step, kind, start, end, rids, drafted, accepted, output in steps:
        r.step(step, kind, ms(start), ms(end), rids, [1] * len(rids), [10] * len(rids),
               drafted, accepted, output)
    host = [("schedule", 1, 0, 0.25), ("plan", 1, 0.25, 0.5), ("schedule", 2, 2, 2.25),
            ("plan", 2, 2.25, 2.5), ("schedule", 3, 4, 4.25), ("kv_alloc", 3, 4.25, 4.5),
            ("sync", 3, 4.5, 6), ("schedule", 4, 6, 6.25), ("sync", 4, 6.25, 7.75),
            ("schedule", 5, 8, 8.5)]
    for name, step, start, end in host:
        r.span("host", name, step, ms(start), ms(end))
    device = [("device:main", "prefill", 1, 0.5, 2), ("device:main", "prefill", 2, 2.5, 4),
              ("device:main", "draft", 3, 4.5, 5), ("device:main", "verify", 3, 5, 5.5),
              ("device:main", "accept", 3, 5.5, 6), ("device:draft", "fill", 3, 6, 6.5),
              ("device:main", "draft", 4, 6.25, 7), ("device:main", "verify", 4, 7, 7.75),
              ("device:main", "verify", 5, 8.5, 10), ("device:draft", "fill", 5, 9.5, 10.5)]
    for track, name, step, start, end in device:
        r.span(track, name, step, ms(start), ms(end))
    r.finish("A", ms(8), "length", 9, ms(2))
    r.finish("B", ms(10), "stop", 8, ms(4))
    return r.to_trace()


def test_metrics_on_hand_computed_trace():
    m = compute_metrics(hand_trace())
    assert list(m) == KEYS
    assert m["requests"] == 2 and m["output_tokens"] == 17 and m["steps"] == 5
    assert m["duration_s"] == 0.01  # arrival of A (0) -> finish of B (10 ms)
    assert m["output_tokens_per_s"] == 17 / 0.01
    # ttft: A 2 ms, B 3 ms; linear-interpolated percentiles
    assert m["ttft_ms"] == pytest.approx({"p50": 2.5, "p90": 2.9, "p99": 2.99}, rel=1e-12)
    # tpot: A (8 - 2) / 8 = 0.75 ms, B (10 - 4) / 7 ms
    b = 6 / 7
    assert m["tpot_ms"] == pytest.approx(
        {"p50": (0.75 + b) / 2, "p90": 0.75 + 0.9 * (b - 0.75), "p99": 0.75 + 0.99 * (b - 0.75)},
        rel=1e-12)
    # drafts (drafted, accepted): (3,2) (3,0) (3,3) (2,1) (3,3): 9 accepted over 5 drafts
    assert m["mean_accept_len"] == 2.8
    # k=1: 4 of 5 accepted >= 1; k=2: 3 of 5; k=3: 2 of the 4 drafts with 3 drafted
    assert m["accept_rate_per_pos"] == [0.8, 0.6, 0.5]
    # device union: [0.5,2] [2.5,4] [4.5,7.75] [8.5,10.5] -> clipped to [0,10]: 7.75 ms
    assert m["device_busy_fraction"] == 0.775
    # requests pending over [0, 10]; no device work for 10 - 7.75 = 2.25 ms of it
    assert m["bubble_fraction"] == 0.225
    # host time per stage over 5 steps; the total is the host's work, without its wait on the device
    per_step = m["host_ms_per_step"]
    assert list(per_step) == ["schedule", "kv_alloc", "plan", "sync", "total"]
    assert per_step["schedule"] == 0.3 and per_step["kv_alloc"] == 0.05
    assert per_step["plan"] == 0.1 and per_step["sync"] == 0.6
    assert per_step["total"] == pytest.approx(0.45, rel=1e-12)


def test_bubble_counts_only_time_with_pending_requests():
    r = MemoryRecorder(header())
    r.request("A", 0, 1, 1)
    r.request("B", ms(10), 1, 1)
    r.span("device:main", "decode", 1, ms(1), ms(2))  # A pending [0, 4): idle 3 of 4 ms
    r.span("device:main", "decode", 2, ms(10), ms(12))  # B pending [10, 12): busy
    r.finish("A", ms(4), "stop", 1, ms(2))
    r.finish("B", ms(12), "abort", 1, ms(12))
    m = compute_metrics(r.to_trace())
    assert m["bubble_fraction"] == 3 / 6
    assert m["device_busy_fraction"] == 3 / 12
    assert m["tpot_ms"] == {"p50": None, "p90": None, "p99": None}
    assert m["mean_accept_len"] is None and m["accept_rate_per_pos"] == []
    assert m["host_ms_per_step"] == {"total": 0.0}


def test_unfinished_request_is_pending_until_trace_end():
    r = MemoryRecorder(header())
    r.request("A", 0, 1, 5)
    r.span("host", "schedule", None, ms(1), ms(5))
    m = compute_metrics(r.to_trace())
    assert m["requests"] == 0 and m["duration_s"] == 0.0
    assert m["output_tokens_per_s"] is None and m["device_busy_fraction"] is None
    assert m["bubble_fraction"] == 1.0


def test_failed_and_aborted_requests_are_counted_by_finish_reason():
    r = MemoryRecorder(header())
    for i, reason in enumerate(["length", "error", "abort", "error", "stop"]):
        r.request(f"r{i}", ms(i), 3, 8)
        r.finish(f"r{i}", ms(10 + i), reason, 2, ms(5 + i), error="boom" if reason == "error" else None)
    m = compute_metrics(r.to_trace())
    assert (m["requests"], m["requests_failed"], m["requests_aborted"]) == (5, 2, 1)


def test_empty_trace_has_all_keys():
    m = compute_metrics(Trace(header=header()))
    assert list(m) == KEYS and m["ttft_ms"]["p99"] is None and m["bubble_fraction"] is None


intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=12).map(
    lambda xs: (np.array([s for s, _ in xs], dtype=np.int64),
                np.array([s + d for s, d in xs], dtype=np.int64)))


def covered(starts, ends) -> set[int]:
    return {t for s, e in zip(starts.tolist(), ends.tolist()) for t in range(s, e)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_interval_arithmetic_matches_brute_force(a, b):
    ms_, me = merge_intervals(*a)
    assert covered(ms_, me) == covered(*a)
    assert np.all(ms_[1:] > me[:-1]) and np.all(me > ms_)  # disjoint, non-touching, non-empty
    ds, de = subtract_intervals(ms_, me, *merge_intervals(*b))
    assert covered(ds, de) == covered(*a) - covered(*b)


def test_fast_on_100k_spans():
    n_steps, per_step = 10_000, 10
    trace = Trace(header=header())
    for i in range(n_steps):
        t = i * 1000
        trace.steps.append(StepRecord.model_construct(
            type="step", step=i, kind="spec", start_ns=t, end_ns=t + 1000,
            request_ids=["a", "b"], num_new_tokens=[4, 4], kv_lens=[9, 9],
            num_drafted=[3, 3], num_accepted=[i % 4, 1], num_output=[1, 2]))
        for j in range(per_step):
            track = "host" if j < 5 else "device:main"
            trace.spans.append(SpanRecord.model_construct(
                type="span", track=track, name=f"s{j}", step=i, start_ns=t + 90 * j,
                end_ns=t + 90 * j + 80, attrs={}))
    started = time.perf_counter()
    m = compute_metrics(trace)
    elapsed = time.perf_counter() - started
    assert m["steps"] == n_steps and len(m["host_ms_per_step"]) == 6
    assert elapsed < 5.0, f"compute_metrics took {elapsed:.2f}s on 100k spans"


@settings(max_examples=300, deadline=None, database=None)
@given(values=st.lists(st.one_of(st.integers(0, 10**12), st.floats(0, 1e12)), min_size=1, max_size=60),
       qs=st.lists(st.floats(0, 100), max_size=4))
def test_percentiles_equal_numpy_bit_for_bit(values, qs):
    qs = tuple(PERCENTILES) + tuple(qs)
    expected = np.percentile(np.asarray(values, dtype=np.float64), qs).tolist()
    assert percentiles(values, qs) == expected
