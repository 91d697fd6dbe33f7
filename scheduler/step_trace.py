"""The pipeline's trace bookkeeping: a `launch` span per launch, a `device:<stream>` span per op once its event is
done, one step record when the step's host work ends. Launch shapes travel with every span: cost models are fitted
on their features (`launch_features`) and a paced device times launches by them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from specsched.scheduler.slot_state import SlotTable
from specsched.scheduler.step_batch import StepBatch, computed_now
from specsched.scheduler.protocols import Event
from specsched.traces.schema import RANK_TRACK_PREFIX


@dataclass
class Launch:
    event: Event
    step: int
    op: str
    attrs: dict  # the launch's shape: its spans' attributes
    t_step: int | None = None  # a forward step's start, for its record (written when the launch completes)


LAUNCH_FEATURES = ("const", "tokens", "requests", "kv_tokens", "draft_steps", "draft_forwards", "draft_tokens",
                   "padded_attn")
SHAPE_KEYS = ("tokens", "requests", "kv_tokens", "draft_len", "draft_tokens", "draft_forwards",
              "padded_attn")  # what they read


def draft_counts(attrs: dict) -> tuple[int, int, int]:
    """(draft_steps, draft_forwards, draft_tokens) of a draft launch from its attributes; older traces without them
    fall back to draft_len (the longest row's count), requests and draft_tokens."""
    req = attrs.get("requests", 0)
    nd = attrs.get("draft_len", 0)
    drafted = attrs.get("draft_tokens", req * nd)
    forwards = attrs.get("draft_forwards", max(drafted - req, 0))
    return max(nd - 1, 0), forwards, drafted


def launch_features(attrs: dict) -> dict[str, float]:
    """A launch's (or host stage's) shape as cost features, `LAUNCH_FEATURES`, unpadded."""
    steps, forwards, drafted = draft_counts(attrs)
    return {"const": 1.0, "tokens": float(attrs.get("tokens", 0)), "requests": float(attrs.get("requests", 0)),
            "kv_tokens": float(attrs.get("kv_tokens", 0)), "draft_steps": float(steps),
            "draft_forwards": float(forwards), "draft_tokens": float(drafted),
            "padded_attn": float(attrs.get("padded_attn", 0))}


def device_span_name(op: str, attrs: dict) -> str:
    """A launched op's device span (and cost model) name: a forward's kind (prefill / decode / mixed), else the op."""
    return attrs.get("kind", "forward") if op == "forward" else op


class StepTrace:
    """Launch/device/step records of one pipeline; `now()` is the pipeline's host time."""

    def __init__(self, tracer: Any, now: Callable[[], int], table: SlotTable, *,
                 chosen_draft_lens: bool = False):
        self.tracer = tracer
        self.now = now
        self.table = table  # the scheduler's per-slot counters (a step's rows' KV as it ends)
        # step records carry the policy's D and predicted gain (a fixed D is in the header)
        self.chosen_draft_lens = chosen_draft_lens
        self._unrecorded: list[Launch] = []
        self._steps_done: list[tuple] = []
        self._first_step: int | None = None  # the first step whose launches were recorded

    def launched(self, launch: Launch, t0: int) -> None:
        """The host-side `launch` span; the device span follows once the event is done."""
        launch_id = f"{launch.step}:{launch.op}"
        self.tracer.span("host", "launch", launch.step, t0, self.now(), op=launch.op,
                         launch_id=launch_id, **launch.attrs)
        launch.attrs["launch_id"] = launch_id
        self._unrecorded.append(launch)
        if self._first_step is None:
            self._first_step = launch.step

    def record_device_spans(self, force: bool = False) -> None:
        """Device intervals become `device:<stream>` spans once their events are done."""
        keep = []
        for launch in self._unrecorded:
            ev = launch.event
            if not ev.query():
                if not force:
                    keep.append(launch)
                continue
            if ev.start_ns is None:
                continue
            track = f"device:{ev.stream}"
            attrs = launch.attrs
            try:
                result = ev.synchronize(0)
            except Exception:  # noqa: BLE001 - failed work still occupied the device
                result = None
            comm = getattr(result, "comm", None)
            if comm:  # tensor parallelism: the leader's communication inside the op
                attrs = {**attrs, "tp_broadcast_us": comm[0] / 1e3, "tp_allreduce_us": comm[1] / 1e3}
            for rank, name, step, s0, s1 in getattr(result, "ranks", None) or ():
                if step is not None and step < self._first_step:
                    continue  # a follower's call from before the tracer was on (a warm-up's)
                self.tracer.span(f"{RANK_TRACK_PREFIX}{rank}", name or "call", step, s0, s1, rank=rank)
            sub = getattr(result, "substages", None)
            if sub:
                for sname, s0, s1 in sub:
                    self.tracer.span(track, sname, launch.step, s0, s1, **attrs)
            else:
                self.tracer.span(track, device_span_name(launch.op, attrs), launch.step, ev.start_ns,
                                 ev.end_ns, **attrs)
        self._unrecorded = keep

    def step_done(self, batch: StepBatch, t_step: int, out_counts: list[int], drafted: np.ndarray,
                  accepted: np.ndarray) -> None:
        """Queue the step's record, written when its host work ends (after any fill the schedule waits for)."""
        if self.tracer.enabled:
            self._steps_done.append((batch, t_step, out_counts, drafted, accepted))

    def flush_steps(self) -> None:
        end = self.now()
        for batch, t_step, out_counts, drafted, accepted in self._steps_done:
            kv_lens = computed_now(batch, self.table)  # the rows' target KV as the step ends
            dec = batch.decision if self.chosen_draft_lens else None
            self.tracer.step(
                step=batch.step, kind=batch.kind, start_ns=t_step, end_ns=max(end, t_step),
                request_ids=[r.request_id for r in batch.requests],
                num_new_tokens=(batch.num_new + batch.draft_lens).tolist(),
                kv_lens=np.asarray(kv_lens).tolist(),
                num_drafted=np.asarray(drafted).tolist(), num_accepted=np.asarray(accepted).tolist(),
                num_output=list(out_counts),
                draft_len=None if dec is None else dec.draft_len,
                predicted_gain=None if dec is None else dec.gain,
            )
        self._steps_done.clear()
