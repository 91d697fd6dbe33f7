"""Trace schema (traces/schema.py) and the tracer hook (traces/hook.py)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from specsched.traces import (FORMAT_VERSION, FinishRecord, Header, MemoryRecorder, MultiTracer,
                    NullTracer, RequestRecord, SpanRecord, StepRecord, Trace, Tracer, replay)
from specsched.traces.schema import RECORD_ADAPTER
from specsched.traces.synthetic import synthetic_trace


def make_header(**overrides) -> Header:
    fields = dict(source="engine", clock="monotonic_ns", model="tiny", proposer="draft",
                  schedule="overlap", draft_len=3, device={"kind": "cpu", "name": "host"},
                  max_agreement_len=16, created_clock_ns=1_000)
    fields.update(overrides)
    return Header.create(**fields)


def test_header_create_fills_version_time_and_libraries():
    h = make_header()
    assert h.format_version == FORMAT_VERSION
    assert h.created_unix_s > 1.6e9
    assert h.created_clock_ns == 1_000
    assert "python" in h.library_versions and "pydantic" in h.library_versions
    assert make_header(clock="virtual_ns", created_clock_ns=None).created_clock_ns == 0


@pytest.mark.parametrize("bad, field", [
    ({"schedule": "fancy"}, "schedule"),
    ({"proposer": "oracle"}, "proposer"),
    ({"draft_len": -1}, "draft_len"),
    ({"source": "elsewhere"}, "source"),
])
def test_header_rejects_bad_values(bad, field):
    with pytest.raises(ValidationError) as e:
        make_header(**bad)
    assert e.value.errors()[0]["loc"][0] == field


def test_span_interval_and_track_are_checked():
    SpanRecord(track="device:main", name="verify", step=1, start_ns=5, end_ns=5)
    with pytest.raises(ValidationError) as e:
        SpanRecord(track="host", name="plan", step=1, start_ns=9, end_ns=5)
    err = e.value.errors()[0]
    assert err["loc"] == ("end_ns",) and "before start_ns" in err["msg"]
    with pytest.raises(ValidationError) as e:
        SpanRecord(track="gpu0", name="plan", step=1, start_ns=1, end_ns=2)
    assert e.value.errors()[0]["loc"] == ("track",)


def test_step_lists_must_match_requests_and_accepted_le_drafted():
    ok = dict(step=3, kind="spec", start_ns=0, end_ns=10, request_ids=["a", "b"],
              num_new_tokens=[4, 4], kv_lens=[20, 30], num_drafted=[3, 3],
              num_accepted=[1, 3], num_output=[2, 4])
    StepRecord(**ok)
    with pytest.raises(ValidationError) as e:
        StepRecord(**{**ok, "kv_lens": [20]})
    assert e.value.errors()[0]["loc"] == ("kv_lens",)
    with pytest.raises(ValidationError) as e:
        StepRecord(**{**ok, "num_accepted": [4, 0]})
    assert e.value.errors()[0]["loc"] == ("num_accepted",)


def test_finish_agreement_needs_a_kind_and_binary_values():
    base = dict(request_id="a", finish_ns=10, finish_reason="stop", output_len=3,
                first_token_ns=4, ttft_ns=4)
    FinishRecord(**base, agreement=[1, 0, 1], agreement_kind="teacher_forced")
    with pytest.raises(ValidationError) as e:
        FinishRecord(**base, agreement=[1, 0])
    assert e.value.errors()[0]["loc"] == ("agreement_kind",)
    with pytest.raises(ValidationError):
        FinishRecord(**base, agreement=[1, 2], agreement_kind="teacher_forced")


def test_a_header_of_an_earlier_release_naming_schedule_mtp_reads_as_eager_fill():
    line = make_header(schedule="eager_fill").model_dump_json().replace('"eager_fill"', '"mtp"')
    assert '"schedule":"mtp"' in line
    assert RECORD_ADAPTER.validate_json(line).schedule == "eager_fill"


def test_records_parse_strictly_by_type_and_ignore_unknown_fields():
    rec = RECORD_ADAPTER.validate_json(
        b'{"type":"request","request_id":"r","arrival_ns":5,"prompt_len":3,"max_tokens":4,'
        b'"temperature":0,"top_p":1,"top_k":0,"seed":null,"from_the_future":1}')
    assert isinstance(rec, RequestRecord) and rec.temperature == 0.0
    with pytest.raises(ValidationError) as e:  # strict: no silent "5" -> 5
        RECORD_ADAPTER.validate_json(b'{"type":"span","track":"host","name":"plan",'
                                     b'"step":1,"start_ns":"5","end_ns":6}')
    assert e.value.errors()[0]["loc"] == ("span", "start_ns")
    with pytest.raises(ValidationError):
        rec.arrival_ns = 7  # frozen


def test_trace_helpers():
    trace = synthetic_trace(num_requests=2, max_tokens=4, draft_stream="draft")
    assert trace.start_ns() == 0
    assert trace.end_ns() == max(s.end_ns for s in trace.spans)  # a trailing fill
    assert trace.end_ns() > max(f.finish_ns for f in trace.finishes)
    assert trace.device_tracks() == ["device:draft", "device:main"]
    names = trace.stage_names()
    assert names.index("schedule") < names.index("verify") < names.index("output")


class _Recording:
    enabled = True

    def __init__(self):
        self.calls = []
        self.closed = False

    def request(self, *a, **k):
        self.calls.append(("request", a[0]))

    def span(self, *a, **k):
        self.calls.append(("span", a[1]))

    def step(self, *a, **k):
        self.calls.append(("step", a[0]))

    def finish(self, *a, **k):
        self.calls.append(("finish", a[0]))

    def close(self):
        self.closed = True
        raise OSError("disk full")


def test_null_and_multi_tracer():
    null = NullTracer()
    assert isinstance(null, Tracer) and not null.enabled
    null.span("host", "plan", 1, 0, 1, tokens=3)
    a, b = _Recording(), _Recording()
    multi = MultiTracer(a, null, b)
    assert multi.enabled and multi.tracers == [a, b]
    multi.request("r", 0, 3, 4)
    multi.span("host", "plan", 1, 0, 1)
    assert a.calls == b.calls == [("request", "r"), ("span", "plan")]
    with pytest.raises(OSError):
        multi.close()
    assert a.closed and b.closed  # the second closed although the first raised
    assert not MultiTracer(null).enabled


def test_replay_orders_by_time_known():
    trace = synthetic_trace(num_requests=2, max_tokens=4)
    rec = _Recording()
    replay(trace, rec)
    kinds = [k for k, _ in rec.calls]
    assert kinds.count("span") == len(trace.spans) and kinds.count("step") == len(trace.steps)
    assert kinds[0] == "request" and kinds[-2:] == ["finish", "span"]  # then the fill
    # a step is reported after all of its spans that ended before the step did
    first_step = kinds.index("step")
    assert kinds[:first_step].count("span") >= 4


def test_memory_recorder_to_trace_validates():
    rec = MemoryRecorder(make_header())
    rec.request("r", 0, 3, 4, temperature=0.0)
    rec.span("host", "plan", 1, 0, 10, tokens=3)
    trace = rec.to_trace()
    assert isinstance(trace, Trace) and trace.spans[0].attrs == {"tokens": 3}
    rec.records.append({"type": "span", "track": "host", "name": "x", "step": None,
                        "start_ns": 5, "end_ns": 1, "attrs": {}})
    with pytest.raises(ValidationError):
        rec.to_trace()
