"""Chrome trace event JSON (traces/chrome.py), validated against the event format's schema."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import orjson
import pytest

from specsched.traces import MemoryRecorder, read_trace, to_chrome_trace, write_chrome_trace
from specsched.traces.reader import TraceFormatError
from specsched.traces.schema import Header
from specsched.traces.synthetic import synthetic_trace

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "draft_overlap.jsonl"
_NUM = {"type": "number"}
_ID = {"type": ["integer", "string"]}
_COMMON = {"name": {"type": "string"}, "pid": {"type": "integer"}, "tid": {"type": "integer"},
           "ts": {"type": "number", "minimum": 0}, "cat": {"type": "string"},
           "args": {"type": "object"}}


def _event(ph: str, required: list[str], **props) -> dict:
    return {"if": {"properties": {"ph": {"const": ph}}, "required": ["ph"]},
            "then": {"required": required, "properties": {**_COMMON, **props}}}


# The parts of the Trace Event Format (the JSON Object Format) this exporter uses.
TRACE_EVENT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
        "traceEvents": {"type": "array", "items": {
            "type": "object",
            "required": ["ph", "pid"],
            "properties": {"ph": {"enum": ["X", "M", "s", "f", "C"]}},
            "allOf": [
                _event("X", ["name", "ts", "dur", "pid", "tid"],
                       dur={"type": "number", "minimum": 0}),
                _event("M", ["name", "pid", "args"],
                       name={"enum": ["process_name", "thread_name", "thread_sort_index",
                                      "process_sort_index"]}),
                _event("s", ["name", "cat", "id", "ts", "pid", "tid"], id=_ID),
                _event("f", ["name", "cat", "id", "ts", "pid", "tid", "bp"], id=_ID,
                       bp={"const": "e"}),
                _event("C", ["name", "ts", "pid", "args"],
                       args={"type": "object", "additionalProperties": _NUM}),
            ],
        }},
    },
}


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_requests=3, max_tokens=8, draft_stream="draft", seed=2)


def test_valid_against_trace_event_schema(trace, tmp_path):
    doc = to_chrome_trace(trace)
    jsonschema.Draft202012Validator.check_schema(TRACE_EVENT_SCHEMA)
    jsonschema.validate(doc, TRACE_EVENT_SCHEMA)
    write_chrome_trace(trace, tmp_path / "run.json")
    assert json.loads((tmp_path / "run.json").read_text()) == json.loads(json.dumps(doc))


def test_schema_rejects_broken_events():
    bad = {"traceEvents": [{"ph": "X", "name": "plan", "pid": 1, "tid": 1, "ts": 0}]}
    with pytest.raises(jsonschema.ValidationError, match="'dur' is a required property"):
        jsonschema.validate(bad, TRACE_EVENT_SCHEMA)


def test_lanes_spans_and_times(trace):
    events = to_chrome_trace(trace)["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == {"steps", "host", "device:draft", "device:main"}
    complete = [e for e in events if e["ph"] == "X" and e["cat"] != "step"]
    assert len(complete) == len(trace.spans)
    t0 = trace.start_ns()
    assert min(e["ts"] for e in events if "ts" in e) == 0
    for e, s in zip(complete, trace.spans):
        assert e["tid"] == names[s.track] and e["name"] == s.name
        assert e["ts"] == (s.start_ns - t0) / 1e3 and e["dur"] == (s.end_ns - s.start_ns) / 1e3
        assert e["args"]["step"] == s.step


def encloses(event: dict, ts: float) -> bool:
    return event["ts"] <= ts <= event["ts"] + event["dur"]


def test_flow_arrows_pair_host_launch_with_device_spans(trace):
    events = to_chrome_trace(trace)["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == finishes.keys()
    device_with_launch = [s for s in trace.spans if s.on_device and "launch_id" in s.attrs]
    assert len(finishes) == len(device_with_launch)
    host_tid = next(e["tid"] for e in events if e["ph"] == "M" and e["args"].get("name") == "host")
    slices = [e for e in events if e["ph"] == "X"]
    for flow_id, s in starts.items():
        f = finishes[flow_id]
        assert s["tid"] == host_tid and f["tid"] != host_tid and f["bp"] == "e"
        # each end binds to an enclosing slice on its lane, launched no later than it starts
        src = [x for x in slices if x["tid"] == s["tid"] and encloses(x, s["ts"])]
        dst = [x for x in slices if x["tid"] == f["tid"] and encloses(x, f["ts"])]
        assert src and dst
        assert src[0]["args"]["launch_id"] == dst[0]["args"]["launch_id"]


def test_counters_per_step(trace):
    events = to_chrome_trace(trace)["traceEvents"]
    batch = [e for e in events if e["ph"] == "C" and e["name"] == "batch"]
    spec = [e for e in events if e["ph"] == "C" and e["name"] == "speculation"]
    assert len(batch) == len(spec) == len(trace.steps)
    assert [e["args"]["requests"] for e in batch] == [len(s.request_ids) for s in trace.steps]
    assert [e["args"]["accepted"] for e in spec] == [sum(s.num_accepted) for s in trace.steps]


def test_trace_without_device_spans():
    h = Header.create(source="engine", clock="monotonic_ns", model="m", proposer="none",
                      schedule="sync", draft_len=0, device={"kind": "cpu", "name": "c"})
    r = MemoryRecorder(h)
    r.span("host", "schedule", None, 100, 200, launch_id=1)
    doc = to_chrome_trace(r.to_trace())
    jsonschema.validate(doc, TRACE_EVENT_SCHEMA)
    assert [e["ts"] for e in doc["traceEvents"] if e["ph"] == "X"] == [0.0]


def event_multiset(doc: dict) -> list[bytes]:
    return sorted(orjson.dumps(e, option=orjson.OPT_SORT_KEYS) for e in doc["traceEvents"])


def test_streamed_file_export_has_the_in_memory_events(tmp_path):
    write_chrome_trace(SAMPLE, tmp_path / "streamed.json")
    with open(tmp_path / "streamed.json") as f:
        streamed = json.load(f)
    expected = to_chrome_trace(read_trace(SAMPLE))
    assert any(e["ph"] == "s" for e in expected["traceEvents"])  # flows are compared too
    assert event_multiset(streamed) == event_multiset(expected)
    assert list(streamed) == ["traceEvents", "displayTimeUnit", "otherData"]
    assert {k: v for k, v in streamed.items() if k != "traceEvents"} == \
        {k: v for k, v in expected.items() if k != "traceEvents"}
    jsonschema.validate(streamed, TRACE_EVENT_SCHEMA)


def test_streamed_export_of_a_cut_off_file_warns_and_a_bad_line_leaves_no_file(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    with pytest.warns(UserWarning, match="dropped a truncated final line"):
        write_chrome_trace(cut, tmp_path / "cut.json")
    with pytest.warns(UserWarning):
        expected = to_chrome_trace(read_trace(cut, allow_truncated_tail=True))
    assert event_multiset(json.loads((tmp_path / "cut.json").read_text())) == event_multiset(expected)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:-5] + ["{not json"] + lines[-4:]) + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:"):
        write_chrome_trace(bad, tmp_path / "out.json")
    assert list(tmp_path.glob("out.json*")) == []
