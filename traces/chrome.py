"""Chrome trace event JSON: open a run in Perfetto UI (ui.perfetto.dev) or chrome://tracing.

Why: Perfetto is the tool people already use to read GPU/CPU timelines; its JSON importer
needs no plugin. Layout: one process; thread lanes "steps" (one slice per scheduler step),
"host" and one per device stream; complete events ("X") for spans; flow arrows from the host
span that launched work to each device span sharing its `attrs["launch_id"]`; counters
("C") for batch size and drafted/accepted tokens per step. Times are microseconds relative
to the trace's first timestamp (the JSON format's unit); `displayTimeUnit` is ms.

A trace file is exported in two streaming passes (production runs are tens of MB): the first
gathers what events need up front (t0, the device lanes, each launch's host span), the
second writes the events one at a time, so memory grows with the launches, not the file.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Iterable, Iterator

import orjson

from specsched.traces.schema import HOST_TRACK, Header, SpanRecord, StepRecord, Trace

PID = 1
STEPS_TID = 1
HOST_TID = 2

Launch = tuple[str, int, int]  # (track, start_ns, end_ns) of the host span that launched work


class _Layout:
    """What the events need before the first one is written, gathered record by record:
    t0 (`Trace.start_ns`), the device lanes, and per launch id the latest-ending host span
    carrying it (ties: the later record)."""

    def __init__(self) -> None:
        self.t0_ns: int | None = None
        self.device_tracks: set[str] = set()
        self.launches: dict[Any, Launch] = {}

    def add(self, rec: Any) -> None:
        start_ns = rec.arrival_ns if rec.type == "request" else getattr(rec, "start_ns", None)
        if start_ns is not None and (self.t0_ns is None or start_ns < self.t0_ns):
            self.t0_ns = start_ns
        if rec.type != "span":
            return
        if rec.on_device:
            self.device_tracks.add(rec.track)
            return
        launch_id = rec.attrs.get("launch_id")
        if launch_id is not None:
            previous = self.launches.get(launch_id)
            if previous is None or rec.end_ns >= previous[2]:
                self.launches[launch_id] = (rec.track, rec.start_ns, rec.end_ns)

    def tids(self) -> dict[str, int]:
        tids = {HOST_TRACK: HOST_TID}
        for i, track in enumerate(sorted(self.device_tracks)):
            tids[track] = HOST_TID + 1 + i
        return tids


def to_chrome_trace(trace: Trace) -> dict[str, Any]:
    """The trace as a Chrome trace event format JSON object (`{"traceEvents": [...]}`)."""
    layout = _trace_layout(trace)
    events = _events(trace.header, layout, itertools.chain(trace.steps, trace.spans))
    return {"traceEvents": list(events), **_trailer(trace.header, layout)}


def write_chrome_trace(trace_or_path: Trace | str | os.PathLike, path: str | os.PathLike) -> None:
    """Writes the Chrome trace JSON of a `Trace`, or of a trace file read as a stream (a cut-off
    last line is dropped with the reader's warning). The output appears only when complete."""
    if isinstance(trace_or_path, Trace):
        header, layout = trace_or_path.header, _trace_layout(trace_or_path)
        records: Iterable[Any] = itertools.chain(trace_or_path.steps, trace_or_path.spans)
    else:
        header, layout = _file_layout(trace_or_path)
        records = itertools.islice(_read(trace_or_path), 1, None)
    _write_json(path, _events(header, layout, records), _trailer(header, layout))


def _trace_layout(trace: Trace) -> _Layout:
    layout = _Layout()
    for rec in itertools.chain(trace.requests, trace.steps, trace.spans):
        layout.add(rec)
    return layout


def _file_layout(trace_path: str | os.PathLike) -> tuple[Header, _Layout]:
    records = _read(trace_path)
    header, layout = next(records), _Layout()
    for rec in records:
        layout.add(rec)
    return header, layout


def _read(trace_path: str | os.PathLike) -> Iterator[Any]:
    from specsched.traces.reader import iter_records

    return iter_records(trace_path, allow_truncated_tail=True)


def _events(h: Header, layout: _Layout, records: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """Every event: lane metadata, then per step its slice and counters, per span its slice
    and, for a device span whose launch is known, its flow arrow (ids in span order)."""
    tids = layout.tids()
    t0_ns = layout.t0_ns or 0
    process = f"specsched {h.source}: {h.model} ({h.schedule}, {h.proposer}, D={h.draft_len})"
    yield _meta("process_name", 0, name=process)
    for lane, tid in [("steps", STEPS_TID), *tids.items()]:
        yield _meta("thread_name", tid, name=lane)
        yield _meta("thread_sort_index", tid, sort_index=tid)
    flow_ids = itertools.count(1)
    for rec in records:
        if rec.type == "step":
            yield from _step_events(rec, t0_ns)
        elif rec.type == "span":
            yield _span_event(rec, tids, t0_ns)
            source = layout.launches.get(rec.attrs.get("launch_id")) if rec.on_device else None
            if source is not None:
                yield from _flow_events(next(flow_ids), source, rec, tids, t0_ns)


def _step_events(s: StepRecord, t0_ns: int) -> list[dict[str, Any]]:
    ts = (s.start_ns - t0_ns) / 1e3
    return [{"ph": "X", "name": f"step {s.step} ({s.kind})", "cat": "step",
             "pid": PID, "tid": STEPS_TID, "ts": ts, "dur": (s.end_ns - s.start_ns) / 1e3,
             "args": {"step": s.step, "kind": s.kind, "requests": s.request_ids,
                      "num_new_tokens": s.num_new_tokens,
                      "num_drafted": s.num_drafted, "num_accepted": s.num_accepted}},
            {"ph": "C", "name": "batch", "pid": PID, "ts": ts,
             "args": {"requests": len(s.request_ids), "tokens": sum(s.num_new_tokens)}},
            {"ph": "C", "name": "speculation", "pid": PID, "ts": ts,
             "args": {"drafted": sum(s.num_drafted), "accepted": sum(s.num_accepted)}}]


def _span_event(s: SpanRecord, tids: dict[str, int], t0_ns: int) -> dict[str, Any]:
    return {"ph": "X", "name": s.name, "cat": "device" if s.on_device else "host",
            "pid": PID, "tid": tids[s.track], "ts": (s.start_ns - t0_ns) / 1e3,
            "dur": (s.end_ns - s.start_ns) / 1e3, "args": {"step": s.step, **s.attrs}}


def _flow_events(flow_id: int, source: Launch, s: SpanRecord, tids: dict[str, int],
                 t0_ns: int) -> list[dict[str, Any]]:
    track, start_ns, end_ns = source
    common = {"name": "launch", "cat": "launch", "id": flow_id, "pid": PID}
    return [{**common, "ph": "s", "tid": tids[track], "ts": ((start_ns + end_ns) // 2 - t0_ns) / 1e3},
            {**common, "ph": "f", "bp": "e", "tid": tids[s.track],
             "ts": ((s.start_ns + s.end_ns) // 2 - t0_ns) / 1e3}]


def _trailer(h: Header, layout: _Layout) -> dict[str, Any]:
    return {"displayTimeUnit": "ms",
            "otherData": {"format_version": h.format_version, "source": h.source,
                          "model": h.model, "schedule": h.schedule, "proposer": h.proposer,
                          "draft_len": h.draft_len, "clock": h.clock,
                          "t0_ns": layout.t0_ns or 0}}


def _write_json(path: str | os.PathLike, events: Iterator[dict[str, Any]],
                trailer: dict[str, Any]) -> None:
    """`{"traceEvents": [...], **trailer}` written one event at a time, to a sibling file
    that replaces `path` once complete (a trace error mid-way leaves no half file)."""
    tmp = f"{os.fspath(path)}.partial"
    try:
        with open(tmp, "wb") as f:
            f.write(b'{"traceEvents":[')
            for i, event in enumerate(events):  # one event in memory at a time
                if i:
                    f.write(b",")
                f.write(orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY))
            f.write(b"]," + orjson.dumps(trailer, option=orjson.OPT_SERIALIZE_NUMPY)[1:])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _meta(kind: str, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": PID, "tid": tid, "args": args}
