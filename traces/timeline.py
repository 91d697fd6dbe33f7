"""A timeline picture of a run: where host and device time goes, and where the device idles.

Why: one glance should show whether CPU work hides behind device work under a schedule.
Lanes: host stages, one per device stream, and a red hatched lane for device idle time
while requests are pending (the bubbles `bubble_fraction` measures). Bars are colored by
stage, step boundaries are dotted lines, the title carries the schedule, proposer, D and
the run's key numbers. Draws on a bare matplotlib Figure (Agg rendering, no pyplot), so it
needs no display and leaves the caller's backend and global figure state alone.
"""
from __future__ import annotations

import os

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from specsched.traces.metrics import bubble_intervals, compute_metrics
from specsched.traces.schema import HOST_TRACK, Trace, stage_order

STAGE_COLORS = {
    "schedule": "#4e79a7", "kv_alloc": "#76b7b2", "plan": "#59a14f", "prefill": "#b07aa1",
    "decode": "#9c755f", "draft": "#f28e2b", "mtp": "#edc948", "verify": "#e15759",
    "accept": "#ff9da7", "sync": "#bab0ac", "draft_fill": "#f1ce63", "output": "#86bcb6",
}
_EXTRA_COLORS = matplotlib.colormaps["tab20"].colors
IDLE_COLOR = "#d62728"
MAX_STEP_LABELS = 40


def stage_color(name: str) -> str | tuple:
    if name in STAGE_COLORS:
        return STAGE_COLORS[name]
    return _EXTRA_COLORS[sum(map(ord, name)) % len(_EXTRA_COLORS)]


def plot_timeline(trace: Trace, out_path: str | os.PathLike,
                  steps: tuple[int, int] | None = None) -> str:
    """Draws the trace (or steps first..last inclusive) to `out_path` (.png, .svg, .pdf)."""
    start_ns, end_ns = _window(trace, steps)
    t0_ns = trace.start_ns()

    def ms(t_ns: int) -> float:
        return (t_ns - t0_ns) / 1e6

    spans = [s for s in trace.spans if s.end_ns >= start_ns and s.start_ns <= end_ns]
    lanes = [HOST_TRACK, *trace.device_tracks(), "idle"]
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

    idle_s, idle_e = bubble_intervals(trace)
    idle = [(ms(max(s, start_ns)), (min(e, end_ns) - max(s, start_ns)) / 1e6)
            for s, e in zip(idle_s.tolist(), idle_e.tolist()) if e > start_ns and s < end_ns]
    if idle:
        ax.broken_barh(idle, (y_of["idle"] - 0.38, 0.76), facecolors="#fbe3e3",
                       edgecolor=IDLE_COLOR, hatch="////", linewidth=0.6)
        device_rows = [y_of[lane] for lane in lanes[1:-1]]
        if device_rows:
            ax.broken_barh(idle, (min(device_rows) - 0.5, len(device_rows)),
                           facecolors=IDLE_COLOR, alpha=0.08, zorder=0)

    in_window = [s for s in trace.steps if s.end_ns >= start_ns and s.start_ns <= end_ns]
    for s in in_window:
        if s.start_ns >= start_ns:
            ax.axvline(ms(s.start_ns), color="0.5", linestyle=":", linewidth=0.7, zorder=0)
    if len(in_window) <= MAX_STEP_LABELS:
        for s in in_window:
            if s.start_ns >= start_ns:
                ax.text(ms(s.start_ns) + width_ms * 0.002, len(lanes) - 0.45, f"{s.step}",
                        fontsize=7, color="0.35", ha="left", va="bottom", clip_on=True)

    ax.set_yticks([y_of[lane] for lane in lanes])
    ax.set_yticklabels([("device idle\n(requests pending)" if lane == "idle" else lane)
                        for lane in lanes])
    ax.set_ylim(-0.6, len(lanes) - 0.1)
    ax.set_xlim(ms(start_ns), ms(end_ns))
    ax.set_xlabel("time since trace start (ms)" + ("   (dotted lines: step starts, "
                                                  "numbered on top)" if in_window else ""))
    ax.grid(axis="x", color="0.9", linewidth=0.6, zorder=-1)
    ax.set_axisbelow(True)
    ax.set_title(_title(trace, steps), fontsize=10, loc="left")
    handles = [Patch(facecolor=stage_color(s), label=s) for s in stages]
    handles.append(Patch(facecolor="#fbe3e3", edgecolor=IDLE_COLOR, hatch="////",
                         label="device idle, requests pending"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.09 - 0.12 / len(lanes)),
              ncol=min(len(handles), 7), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out_path, dpi=130)
    return os.fspath(out_path)


def _window(trace: Trace, steps: tuple[int, int] | None) -> tuple[int, int]:
    if steps is None:
        return trace.start_ns(), max(trace.end_ns(), trace.start_ns() + 1)
    first, last = steps
    if first > last:
        raise ValueError(f"steps=({first}, {last}): first step is after last step")
    chosen = [s for s in trace.steps if first <= s.step <= last]
    if not chosen:
        known = sorted(s.step for s in trace.steps)
        have = f"steps {known[0]}..{known[-1]}" if known else "no step records"
        raise ValueError(f"no steps in {first}..{last}; the trace has {have}")
    start_ns = min(s.start_ns for s in chosen)
    end_ns = max(max(s.end_ns for s in chosen),
                 max((s.end_ns for s in trace.spans
                      if s.step is not None and first <= s.step <= last), default=0))
    return start_ns, max(end_ns, start_ns + 1)


def _title(trace: Trace, steps: tuple[int, int] | None) -> str:
    h, m = trace.header, compute_metrics(trace)

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
