"""A timeline picture of a run: where host and device time goes, and where the device idles.

Why: one glance should show whether CPU work hides behind device work under a schedule.
Lanes: host stages, one per device stream, and a red hatched lane for device idle time
while requests are pending (the bubbles `bubble_fraction` measures). Bars are colored by
stage, step boundaries are dotted lines, the title carries the schedule, proposer, D and
the run's key numbers. Draws on a bare matplotlib Figure (Agg rendering, no pyplot), so it
needs no display and leaves the caller's backend and global figure state alone.

A trace file is read as a stream (production runs are tens of MB): the drawing takes only
`TimelineInputs` -- t0, lanes, the window's spans and steps, bubbles, metrics -- which come
from a `Trace` or from two passes over the file that keep only the window's records.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Iterable

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from specsched.traces.metrics import MetricsAccumulator, bubble_intervals, compute_metrics
from specsched.traces.schema import HOST_TRACK, Header, SpanRecord, StepRecord, Trace, stage_order

STAGE_COLORS = {
    "schedule": "#4e79a7", "kv_alloc": "#76b7b2", "plan": "#59a14f", "prefill": "#b07aa1",
    "decode": "#9c755f", "draft": "#f28e2b", "mtp": "#edc948", "verify": "#e15759",
    "accept": "#ff9da7", "sync": "#bab0ac", "fill": "#f1ce63", "output": "#86bcb6",
}
_EXTRA_COLORS = matplotlib.colormaps["tab20"].colors
IDLE_COLOR = "#d62728"
MAX_STEP_LABELS = 40


def stage_color(name: str) -> str | tuple:
    if name in STAGE_COLORS:
        return STAGE_COLORS[name]
    return _EXTRA_COLORS[sum(map(ord, name)) % len(_EXTRA_COLORS)]


@dataclass
class TimelineInputs:
    """What the drawing needs of a trace: t0, the device lanes, the window, the spans and
    steps overlapping it, the run's device-idle (bubble) intervals and its metrics."""

    header: Header
    t0_ns: int
    device_tracks: list[str]
    start_ns: int
    end_ns: int
    spans: list[SpanRecord]
    steps: list[StepRecord]
    idle: tuple[np.ndarray, np.ndarray]
    metrics: dict[str, Any]


def plot_timeline(trace_or_path: Trace | str | os.PathLike, out_path: str | os.PathLike,
                  steps: tuple[int, int] | None = None) -> str:
    """Draws the trace (or steps first..last inclusive) to `out_path` (.png, .svg, .pdf).

    A trace file is read as a stream (a cut-off last line is dropped with the reader's
    warning): with `steps`, memory is bounded by the window, not the file."""
    if isinstance(trace_or_path, Trace):
        inputs = trace_inputs(trace_or_path, steps)
    else:
        inputs = file_inputs(trace_or_path, steps)
    return _draw(inputs, steps, out_path)


def trace_inputs(trace: Trace, steps: tuple[int, int] | None = None) -> TimelineInputs:
    """What `plot_timeline` draws of an in-memory trace (raises ValueError for a bad window)."""
    start_ns, end_ns = _window(trace, steps)
    return TimelineInputs(
        header=trace.header, t0_ns=trace.start_ns(), device_tracks=trace.device_tracks(),
        start_ns=start_ns, end_ns=end_ns, spans=_overlapping(trace.spans, start_ns, end_ns),
        steps=_overlapping(trace.steps, start_ns, end_ns), idle=bubble_intervals(trace),
        metrics=compute_metrics(trace))


def file_inputs(path: str | os.PathLike, steps: tuple[int, int] | None = None) -> TimelineInputs:
    """`trace_inputs` of a trace file, streamed: pass 1 gathers the metrics, bubbles, lanes
    and window; pass 2 keeps the spans and steps in the window. Without a window the whole
    run is drawn, so pass 1 keeps every span and step instead."""
    from specsched.traces.reader import iter_records

    finder, acc, tracks = _WindowFinder(steps), MetricsAccumulator(), set()
    whole_run: list[Any] = []
    records = iter_records(path, allow_truncated_tail=True)
    header = next(records)
    for rec in records:
        acc.add(rec)
        finder.add(rec)
        if rec.type == "span" and rec.on_device:
            tracks.add(rec.track)
        if steps is None and rec.type in ("span", "step"):
            whole_run.append(rec)
    t0_ns = acc.start_ns or 0
    start_ns, end_ns = finder.window(t0_ns, acc.end_ns or 0)
    drawn = whole_run if steps is None else (
        r for r in itertools.islice(iter_records(path, allow_truncated_tail=True), 1, None)
        if r.type in ("span", "step"))
    kept = _overlapping(drawn, start_ns, end_ns)
    return TimelineInputs(
        header=header, t0_ns=t0_ns, device_tracks=sorted(tracks), start_ns=start_ns,
        end_ns=end_ns, spans=[r for r in kept if r.type == "span"],
        steps=[r for r in kept if r.type == "step"], idle=acc.bubble_intervals(),
        metrics=acc.metrics())


def _overlapping(records: Iterable[Any], start_ns: int, end_ns: int) -> list[Any]:
    return [r for r in records if r.end_ns >= start_ns and r.start_ns <= end_ns]


def _draw(inputs: TimelineInputs, steps: tuple[int, int] | None,
          out_path: str | os.PathLike) -> str:
    start_ns, end_ns, t0_ns, spans = inputs.start_ns, inputs.end_ns, inputs.t0_ns, inputs.spans

    def ms(t_ns: int) -> float:
        return (t_ns - t0_ns) / 1e6

    lanes = [HOST_TRACK, *inputs.device_tracks, "idle"]
    y_of = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    fig = Figure(figsize=(14, 1.1 * len(lanes) + 2.4))
    ax = fig.subplots()
    width_ms = max(ms(end_ns) - ms(start_ns), 1e-6)

    stages = stage_order({s.name for s in spans})
    for stage in stages:
        for lane in lanes[:-1]:
            bars = [(ms(max(s.start_ns, start_ns)), (min(s.end_ns, end_ns) - max(s.start_ns,
                     start_ns)) / 1e6) for s in spans if s.name == stage and s.track == lane]
            if bars:
                ax.broken_barh(bars, (y_of[lane] - 0.38, 0.76), facecolors=stage_color(stage),
                               edgecolor="white", linewidth=0.4)
                for x, w in bars:
                    if w > width_ms * 0.03:
                        ax.text(x + w / 2, y_of[lane], stage, ha="center", va="center",
                                fontsize=7, clip_on=True)

    idle_s, idle_e = inputs.idle
    idle = [(ms(max(s, start_ns)), (min(e, end_ns) - max(s, start_ns)) / 1e6)
            for s, e in zip(idle_s.tolist(), idle_e.tolist()) if e > start_ns and s < end_ns]
    if idle:
        ax.broken_barh(idle, (y_of["idle"] - 0.38, 0.76), facecolors="#fbe3e3",
                       edgecolor=IDLE_COLOR, hatch="////", linewidth=0.6)
        device_rows = [y_of[lane] for lane in lanes[1:-1]]
        if device_rows:
            ax.broken_barh(idle, (min(device_rows) - 0.5, len(device_rows)),
                           facecolors=IDLE_COLOR, alpha=0.08, zorder=0)

    in_window = inputs.steps
    for s in in_window:
        if s.start_ns >= start_ns:
            ax.axvline(ms(s.start_ns), color="0.5", linestyle=":", linewidth=0.7, zorder=0)
    if len(in_window) <= MAX_STEP_LABELS:
        for s in in_window:
            if s.start_ns >= start_ns:
                # an adaptive draft length's choice marks its step: "12 D=3"
                label = f"{s.step}" if s.draft_len is None else f"{s.step} D={s.draft_len}"
                ax.text(ms(s.start_ns) + width_ms * 0.002, len(lanes) - 0.45, label,
                        fontsize=7, color="0.35", ha="left", va="bottom", clip_on=True)

    ax.set_yticks([y_of[lane] for lane in lanes])
    ax.set_yticklabels([("device idle\n(requests pending)" if lane == "idle" else lane)
                        for lane in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.1)
    ax.set_xlim(ms(start_ns), ms(end_ns))
    ax.set_xlabel("time since trace start (ms)" + ("   (dotted lines: step starts, "
                                                  "numbered on top" + (", D: the step's chosen draft length" if any(
                                                      s.draft_len is not None for s in in_window) else "")
                                                  + ")" if in_window else ""))
    ax.grid(axis="x", color="0.9", linewidth=0.6, zorder=-1)
    ax.set_axisbelow(True)
    ax.set_title(_title(inputs.header, inputs.metrics, steps), fontsize=10, loc="left")
    handles = [Patch(facecolor=stage_color(s), label=s) for s in stages]
    handles.append(Patch(facecolor="#fbe3e3", edgecolor=IDLE_COLOR, hatch="////",
                         label="device idle, requests pending"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.09 - 0.12 / len(lanes)),
              ncol=min(len(handles), 7), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out_path, dpi=130)
    return os.fspath(out_path)


def _window(trace: Trace, steps: tuple[int, int] | None) -> tuple[int, int]:
    finder = _WindowFinder(steps)
    for rec in itertools.chain(trace.steps, trace.spans):
        finder.add(rec)
    return finder.window(trace.start_ns(), trace.end_ns())


class _WindowFinder:
    """The time range of steps first..last, gathered record by record: their steps' start to
    the last end of those steps and of spans tagged with them (a late draft fill)."""

    def __init__(self, steps: tuple[int, int] | None):
        if steps is not None and steps[0] > steps[1]:
            raise ValueError(f"steps=({steps[0]}, {steps[1]}): first step is after last step")
        self.steps = steps
        self.start_ns: int | None = None  # of the chosen steps
        self.end_ns = 0
        self.known: tuple[int, int] | None = None  # lowest and highest step number seen

    def add(self, rec: Any) -> None:
        if self.steps is None or rec.type not in ("step", "span") or rec.step is None:
            return
        first, last = self.steps
        if rec.type == "step":
            lo, hi = self.known or (rec.step, rec.step)
            self.known = (min(lo, rec.step), max(hi, rec.step))
            if first <= rec.step <= last:
                self.start_ns = rec.start_ns if self.start_ns is None else min(self.start_ns, rec.start_ns)
        if first <= rec.step <= last:
            self.end_ns = max(self.end_ns, rec.end_ns)

    def window(self, trace_start_ns: int, trace_end_ns: int) -> tuple[int, int]:
        """(start_ns, end_ns), given the trace's first and last timestamps."""
        if self.steps is None:
            return trace_start_ns, max(trace_end_ns, trace_start_ns + 1)
        if self.start_ns is None:
            have = f"steps {self.known[0]}..{self.known[1]}" if self.known else "no step records"
            raise ValueError(f"no steps in {self.steps[0]}..{self.steps[1]}; the trace has {have}")
        return self.start_ns, max(self.end_ns, self.start_ns + 1)


def _title(h: Header, m: dict[str, Any], steps: tuple[int, int] | None) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    where = f"steps {steps[0]}..{steps[1]}" if steps else "all steps"
    return (f"{h.model} ({h.source})  ·  schedule {h.schedule}  ·  proposer {h.proposer}"
            f"  ·  D={h.draft_len}  ·  {where}\n"
            f"whole run: {fmt(m['output_tokens_per_s'], ',.0f')} output tok/s  ·  "
            f"mean accept len {fmt(m['mean_accept_len'], '.2f')}  ·  "
            f"bubble {fmt(m['bubble_fraction'], '.1%')}  ·  "
            f"device busy {fmt(m['device_busy_fraction'], '.1%')}  ·  "
            f"{m['steps']} steps, {m['requests']} requests")
