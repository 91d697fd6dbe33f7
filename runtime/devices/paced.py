"""A worker whose ops take a set time: a device of steady speed, for checking the simulator.

Why: on a shared machine the device's own speed drifts from step to step (other tenants,
caches, clocks), so a replay with deterministic costs cannot match a real run step by step
better than two real runs match each other. Pacing separates the two: the real op runs (real
tokens, real KV, lossless outputs), then the worker sleeps until the op has taken exactly
its paced duration, a linear function of the launch's shape (the features the simulator's
cost models use). Runs on a paced device keep every host-side effect of the real engine --
stages, launches, syncs, the schedule's overlap -- with device durations that repeat, so
what a replay still gets wrong there is the simulator's error, not the machine's noise.

A pace must exceed what the op really takes (`benchmarks/simulator_fidelity.py --paced`
sets it from a fitted profile times a headroom factor); an op that overruns its pace simply
ends late (the benchmark counts those from the trace).

    spec = WorkerSpec("specsched.runtime.devices.paced:PacedWorker",
                      {"inner": engine.worker_spec(), "pace": {"verify": {"const": 4e6, "tokens": 2e5}}})
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from specsched.runtime.devices.spec import WorkerSpec
from specsched.scheduler.step_trace import LAUNCH_FEATURES, device_span_name, launch_features

PACE_FEATURES = LAUNCH_FEATURES  # the simulator's cost features (unpadded)


def paced_ns(pace: dict[str, dict[str, float]], name: str, attrs: dict) -> int:
    """Duration in ns of device op `name` (its span name) with shape `attrs`; 0 when the pace
    has no entry for it (the op runs at its own speed)."""
    coef = pace.get(name)
    if not coef:
        return 0
    feats = launch_features(attrs)
    return max(0, int(sum(c * feats.get(f, 0.0) for f, c in coef.items())))


class PacedWorker:
    """Runs `inner`'s ops, then sleeps until each took its paced duration (see module doc).

    pace: {device span name: {feature: ns per unit}} over `PACE_FEATURES`; a verify launch is
    paced as a whole: its first substage (verify) stretches, the accept substage keeps its real
    length.
    """

    def __init__(self, inner: WorkerSpec | dict, pace: dict[str, dict[str, float]]):
        if isinstance(inner, dict):
            inner = WorkerSpec(**inner)
        for name, coef in pace.items():
            unknown = set(coef) - set(PACE_FEATURES)
            if unknown:
                raise ValueError(f"pace for {name!r}: unknown features {sorted(unknown)}; "
                                 f"use {PACE_FEATURES}")
        self.inner = inner.build()
        self.pace = pace

    def execute(self, op: str, batch: Any) -> Any:
        t0 = time.monotonic_ns()
        result = self.inner.execute(op, batch)
        shape = getattr(batch, "shape", None)
        if shape is None:
            return result  # not a pipeline launch (ping, agreement): unpaced
        attrs = shape.attrs()
        subs = getattr(result, "substages", None)
        if subs:  # the op's span is its substages': the pace counts from the first one
            t0 = subs[0][1]
        end = t0 + paced_ns(self.pace, device_span_name(op, attrs), attrs)
        now = time.monotonic_ns()
        if now >= end and not subs:
            return result
        # an op with substages that overran its pace is still restamped to end now: its
        # substages alone may span less than the pace although the op as a whole took longer
        while now < end:  # sleep overshoots by tens of us; the last stretch is polled
            left = end - now
            time.sleep((left - 200_000) / 1e9 if left > 300_000 else 0)
            now = time.monotonic_ns()
        if subs:  # the first substage stretches; the rest keep their lengths, ending now
            t = now - sum(b - a for _, a, b in subs[1:])
            stamps = [(subs[0][0], subs[0][1], t)]
            for name, a, b in subs[1:]:
                stamps.append((name, t, t + b - a))
                t += b - a
            result = replace(result, substages=tuple(stamps))
        return result
