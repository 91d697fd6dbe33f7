"""Timeline picture (traces/timeline.py)."""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
import pytest

from specsched.traces import MemoryRecorder, read_trace
from specsched.traces.schema import Header
from specsched.traces.synthetic import synthetic_trace
from specsched.traces.timeline import _window, file_inputs, plot_timeline, stage_color, trace_inputs

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "draft_overlap.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_requests=4, max_tokens=10, draft_stream="draft")


def test_whole_run_and_step_window(trace, tmp_path):
    whole = plot_timeline(trace, tmp_path / "whole.png")
    assert whole == str(tmp_path / "whole.png")
    width, height = png_size(tmp_path / "whole.png")
    assert width > 1000 and height > 400
    plot_timeline(trace, tmp_path / "window.svg", steps=(4, 6))
    svg = (tmp_path / "window.svg").read_text()
    assert "device idle" in svg and "schedule overlap" in svg and "D=3" in svg


def test_window_covers_the_steps_and_their_late_spans(trace):
    start_ns, end_ns = _window(trace, (4, 6))
    steps = [s for s in trace.steps if 4 <= s.step <= 6]
    assert start_ns == steps[0].start_ns
    late_fill = max(s.end_ns for s in trace.spans if s.step == 6)
    assert end_ns == max(steps[-1].end_ns, late_fill) and late_fill > steps[-1].end_ns


def test_bad_step_window(trace, tmp_path):
    with pytest.raises(ValueError, match=r"no steps in 500\.\.600; the trace has steps 1\.\."):
        plot_timeline(trace, tmp_path / "x.png", steps=(500, 600))
    with pytest.raises(ValueError, match="first step is after last step"):
        plot_timeline(trace, tmp_path / "x.png", steps=(6, 4))


def test_host_only_trace_and_unknown_stage(tmp_path):
    h = Header.create(source="engine", clock="monotonic_ns", model="m", proposer="none",
                      schedule="sync", draft_len=0, device={"kind": "cpu", "name": "c"})
    r = MemoryRecorder(h)
    r.span("host", "schedule", 1, 0, 1_000)
    r.span("host", "tokenize", 1, 1_000, 3_000)
    plot_timeline(r.to_trace(), tmp_path / "host.png")
    assert png_size(tmp_path / "host.png")[0] > 1000
    assert stage_color("tokenize") == stage_color("tokenize") != stage_color("schedule")


def assert_same_inputs(streamed, in_memory) -> None:
    a, b = dataclasses.asdict(streamed), dataclasses.asdict(in_memory)
    for (a_s, a_e), (b_s, b_e) in [(a.pop("idle"), b.pop("idle"))]:
        assert np.array_equal(a_s, b_s) and np.array_equal(a_e, b_e)
    assert a == b


@pytest.mark.parametrize("window", [(20, 26), None], ids=["window", "whole-run"])
def test_streamed_file_draws_the_in_memory_inputs(tmp_path, window):
    streamed, in_memory = file_inputs(SAMPLE, window), trace_inputs(read_trace(SAMPLE), window)
    assert streamed.spans and streamed.steps and len(streamed.idle[0])
    if window:
        assert len(streamed.spans) < len(read_trace(SAMPLE).spans)  # only the window is kept
    assert_same_inputs(streamed, in_memory)
    plot_timeline(SAMPLE, tmp_path / "streamed.png", steps=window)
    assert png_size(tmp_path / "streamed.png")[0] > 1000


def test_streamed_bad_window_says_what_the_trace_has(tmp_path):
    with pytest.raises(ValueError, match=r"no steps in 5000\.\.6000; the trace has steps \d+\.\.\d+$"):
        plot_timeline(SAMPLE, tmp_path / "x.png", steps=(5000, 6000))
    with pytest.raises(ValueError, match="first step is after last step"):
        plot_timeline(tmp_path / "not_read.jsonl", tmp_path / "x.png", steps=(6, 4))
    assert not (tmp_path / "x.png").exists()
