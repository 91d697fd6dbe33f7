"""Fabricated, realistic traces for tests, demos and benchmarks of the trace tools.

Why: every trace tool (metrics, exporters, timeline) needs inputs with the structure of a
real run -- staggered arrivals, prefill/mixed/spec steps, host stages, device spans that
overlap the next step's host work under the `overlap` schedule, launch ids, per-position
agreement -- without running a model. Times are made-up constants (virtual clock), and the
run is driven through the `Tracer` hook, so it also exercises the recorders.
"""
from __future__ import annotations

import random
from typing import Any

from specsched.traces.hook import Tracer
from specsched.traces.recorder import MemoryRecorder
from specsched.traces.schema import Header, Trace

US = 1_000  # ns


def synthetic_trace(*, num_requests: int = 4, max_tokens: int = 12, draft_len: int = 3,
                    schedule: str = "overlap", agree_p: float = 0.7,
                    arrival_gap_ns: int = 400 * US, draft_stream: str = "main",
                    seed: int = 0) -> Trace:
    """A validated in-memory trace of a simulated draft-target run (see `drive`)."""
    header = Header.create(
        source="simulator", clock="virtual_ns", model="synthetic-target",
        draft_model="synthetic-draft", proposer="draft", schedule=schedule,
        draft_len=draft_len, device={"kind": "virtual", "name": "synthetic"},
        max_agreement_len=64, engine_config={"max_batch": 8})
    recorder = MemoryRecorder(header)
    drive(recorder, num_requests=num_requests, max_tokens=max_tokens, draft_len=draft_len,
          schedule=schedule, agree_p=agree_p, arrival_gap_ns=arrival_gap_ns,
          draft_stream=draft_stream, seed=seed)
    return recorder.to_trace()


def drive(tracer: Tracer, *, num_requests: int, max_tokens: int, draft_len: int,
          schedule: str, agree_p: float, arrival_gap_ns: int, draft_stream: str,
          seed: int) -> None:
    """Runs a toy scheduler loop on a virtual clock, reporting everything to `tracer`.

    `schedule="overlap"` runs the draft's fill on the device while the host schedules and
    plans the next step; any other value runs the stages in sequence.
    """
    rng = random.Random(seed)
    arrivals = [i * arrival_gap_ns for i in range(num_requests)]
    agreement = {f"r{i}": [int(rng.random() < agree_p) for _ in range(max_tokens)]
                 for i in range(num_requests)}
    state: dict[str, dict[str, Any]] = {}
    t = device_free = 0
    step = launch_id = 0
    draft_track, main_track = f"device:{draft_stream}", "device:main"
    while len(state) < num_requests or any(s["out"] < max_tokens for s in state.values()):
        for i, arrival in enumerate(arrivals):
            rid = f"r{i}"
            if arrival <= t and rid not in state:
                tracer.request(rid, arrival, prompt_len=16 + 4 * i, max_tokens=max_tokens,
                               temperature=0.0, top_p=1.0, top_k=0, seed=None)
                state[rid] = {"out": 0, "kv": 0, "prefilled": False, "first": None}
        active = [r for r, s in state.items() if s["out"] < max_tokens]
        if not active:
            t = min(a for a in arrivals if a > t)
            continue
        step += 1
        launch_id += 1
        prefill = [r for r in active if not state[r]["prefilled"]]
        spec = not prefill and draft_len > 0
        kind = "spec" if spec else ("prefill" if len(prefill) == len(active) else "mixed")
        new_tokens = [16 + 4 * int(r[1:]) if r in prefill else (draft_len + 1 if spec else 1)
                      for r in active]
        start = t
        for name, dur in (("schedule", 40 * US), ("kv_alloc", 25 * US + 5 * US * len(active)),
                          ("plan", 50 * US)):
            attrs = {"launch_id": launch_id} if name == "plan" else {"requests": len(active)}
            tracer.span("host", name, step, t, t + dur, **attrs)
            t += dur
        d = max(t, device_free)
        work = [("draft", draft_track, draft_len * 70 * US)] if spec else []
        work.append(("verify" if spec else kind, main_track,
                     150 * US + 4 * US * sum(new_tokens)))
        if spec:
            work.append(("accept", main_track, 20 * US))
        for name, track, dur in work:
            tracer.span(track, name, step, d, d + dur, launch_id=launch_id,
                        tokens=sum(new_tokens))
            d += dur
        tracer.span("host", "sync", step, t, max(t, d))
        t = max(t, d)
        drafted, accepted, outputs = [], [], []
        for r in active:
            s = state[r]
            n_acc = 0
            if spec:
                while n_acc < draft_len and agreement[r][min(s["out"] + n_acc, max_tokens - 1)]:
                    n_acc += 1
            n_out = min(n_acc + 1, max_tokens - s["out"])
            drafted.append(draft_len if spec else 0)
            accepted.append(n_acc)
            outputs.append(n_out)
            s["out"] += n_out
            s["kv"] += new_tokens[active.index(r)]
            s["prefilled"] = True
        out_dur = 15 * US + 3 * US * len(active)
        launch_id += 1
        tracer.span("host", "output", step, t, t + out_dur, tokens=sum(outputs),
                    launch_id=launch_id)
        fill_start = t + 5 * US
        fill_end = fill_start + 60 * US + 10 * US * sum(accepted)
        tracer.span(draft_track, "fill", step, fill_start, fill_end, launch_id=launch_id,
                    accepted=sum(accepted))
        t += out_dur
        tracer.step(step, kind, start, t, active, new_tokens, [state[r]["kv"] for r in active],
                    drafted, accepted, outputs)
        for r in active:
            s = state[r]
            if s["first"] is None:
                s["first"] = t
            if s["out"] >= max_tokens:
                tracer.finish(r, t, "length", s["out"], s["first"], agreement=agreement[r],
                              agreement_kind="teacher_forced")
        device_free = fill_end
        if schedule != "overlap" and fill_end > t:
            tracer.span("host", "sync", step + 1, t, fill_end)
            t = fill_end
