"""Chrome trace event JSON (traces/chrome.py), validated against the event format's schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specsched.traces import MemoryRecorder, to_chrome_trace, write_chrome_trace
from specsched.traces.schema import Header
from specsched.traces.synthetic import synthetic_trace

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
