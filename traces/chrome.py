"""Chrome trace event JSON: open a run in Perfetto UI (ui.perfetto.dev) or chrome://tracing.

Why: Perfetto is the tool people already use to read GPU/CPU timelines; its JSON importer
needs no plugin. Layout: one process; thread lanes "steps" (one slice per scheduler step),
"host" and one per device stream; complete events ("X") for spans; flow arrows from the host
span that launched work to each device span sharing its `attrs["launch_id"]`; counters
("C") for batch size and drafted/accepted tokens per step. Times are microseconds relative
to the trace's first timestamp (the JSON format's unit); `displayTimeUnit` is ms.
"""
from __future__ import annotations

import os
from typing import Any

import orjson

from specsched.traces.schema import HOST_TRACK, SpanRecord, Trace

PID = 1
STEPS_TID = 1
HOST_TID = 2


def to_chrome_trace(trace: Trace) -> dict[str, Any]:
    """The trace as a Chrome trace event format JSON object (`{"traceEvents": [...]}`)."""
    t0_ns = trace.start_ns()
    h = trace.header

    def us(t_ns: int) -> float:
        return (t_ns - t0_ns) / 1e3

    tids = {HOST_TRACK: HOST_TID}
    for i, track in enumerate(trace.device_tracks()):
        tids[track] = HOST_TID + 1 + i
    process = f"specsched {h.source}: {h.model} ({h.schedule}, {h.proposer}, D={h.draft_len})"
    events: list[dict[str, Any]] = [_meta("process_name", 0, name=process)]
    for lane, tid in [("steps", STEPS_TID), *tids.items()]:
        events.append(_meta("thread_name", tid, name=lane))
        events.append(_meta("thread_sort_index", tid, sort_index=tid))

    for s in trace.steps:
        events.append({"ph": "X", "name": f"step {s.step} ({s.kind})", "cat": "step",
                       "pid": PID, "tid": STEPS_TID, "ts": us(s.start_ns),
                       "dur": (s.end_ns - s.start_ns) / 1e3,
                       "args": {"step": s.step, "kind": s.kind, "requests": s.request_ids,
                                "num_new_tokens": s.num_new_tokens,
                                "num_drafted": s.num_drafted, "num_accepted": s.num_accepted}})
        ts = us(s.start_ns)
        events.append({"ph": "C", "name": "batch", "pid": PID, "ts": ts,
                       "args": {"requests": len(s.request_ids),
                                "tokens": sum(s.num_new_tokens)}})
        events.append({"ph": "C", "name": "speculation", "pid": PID, "ts": ts,
                       "args": {"drafted": sum(s.num_drafted),
                                "accepted": sum(s.num_accepted)}})

    launches: dict[Any, SpanRecord] = {}
    for s in trace.spans:
        events.append({"ph": "X", "name": s.name, "cat": "device" if s.on_device else "host",
                       "pid": PID, "tid": tids[s.track], "ts": us(s.start_ns),
                       "dur": (s.end_ns - s.start_ns) / 1e3,
                       "args": {"step": s.step, **s.attrs}})
        launch_id = s.attrs.get("launch_id")
        if launch_id is not None and not s.on_device:
            previous = launches.get(launch_id)
            if previous is None or s.end_ns >= previous.end_ns:
                launches[launch_id] = s
    flow_id = 0
    for s in trace.spans:
        source = launches.get(s.attrs.get("launch_id")) if s.on_device else None
        if source is None:
            continue
        flow_id += 1
        common = {"name": "launch", "cat": "launch", "id": flow_id, "pid": PID}
        events.append({**common, "ph": "s", "tid": tids[source.track],
                       "ts": us((source.start_ns + source.end_ns) // 2)})
        events.append({**common, "ph": "f", "bp": "e", "tid": tids[s.track],
                       "ts": us((s.start_ns + s.end_ns) // 2)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format_version": h.format_version, "source": h.source,
                          "model": h.model, "schedule": h.schedule, "proposer": h.proposer,
                          "draft_len": h.draft_len, "clock": h.clock,
                          "t0_ns": t0_ns}}


def write_chrome_trace(trace: Trace, path: str | os.PathLike) -> None:
    with open(path, "wb") as f:
        f.write(orjson.dumps(to_chrome_trace(trace), option=orjson.OPT_SERIALIZE_NUMPY))


def _meta(kind: str, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": PID, "tid": tid, "args": args}
