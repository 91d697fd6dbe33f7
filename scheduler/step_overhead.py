"""The draft-length policy's step overhead h per draft length: the part of a step's wall
time its predicted device time does not explain (see `StepOverhead`; `scheduler/adaptive.py`
keeps one)."""
from __future__ import annotations

import numpy as np

MIN_OVERHEAD_SAMPLES = 4  # steps at a D before its own overhead estimate replaces the pooled one
OVERHEAD_WINDOW = 15  # steps whose median residual is the overhead (per D, and over every D)


class StepOverhead:
    """h per D: host work a schedule does not hide (a plain decode step launches one op, a
    speculative one three) and, signed, the bias of the device models at that D. Each is the
    median of the last OVERHEAD_WINDOW residuals (wall - predicted device time) at that D: it
    follows the load, and one step stalled by the machine (a descheduled process, a garbage
    collection) does not move it."""

    def __init__(self, max_draft_len: int, plain_hidden: bool = False):
        # plain steps launched one step ahead (`plain_hidden`) hide their host work behind the
        # device: their h is the device model's bias alone, nothing like a speculative step's
        self.plain_hidden = plain_hidden
        self.pooled = 0.0  # h over every D (every speculative D where plain steps hide theirs)
        self.by_d = np.zeros(max_draft_len + 1)
        self.samples = np.zeros(max_draft_len + 1, dtype=np.int64)
        self.residuals_by_d: list[list[float]] = [[] for _ in range(max_draft_len + 1)]
        self.residuals: list[float] = []

    def _in_pool(self, d: int) -> bool:
        """Whether steps at D = d lend to the pool and borrow from it."""
        return d > 0 or not self.plain_hidden

    def observe(self, d: int, resid: float) -> None:
        pooled = self._in_pool(d)
        for ring in (self.residuals_by_d[d], self.residuals) if pooled else (self.residuals_by_d[d],):
            ring.append(resid)
            if len(ring) > OVERHEAD_WINDOW:
                del ring[0]
        self.by_d[d] = _median(self.residuals_by_d[d])
        if pooled:
            self.pooled = _median(self.residuals)
        self.samples[d] += 1

    def at(self, d: int) -> float:
        """h at D = d: its own estimate once it has `MIN_OVERHEAD_SAMPLES` steps, else the
        smaller of the pooled one and its own so far -- optimistic while a length is barely
        tried, so that it is tried until its own estimate holds (the pooled one mixes in the
        other lengths' host work, which a plain step does not have). Where plain steps hide
        their host work, a plain step borrows nothing (0, its own so far if smaller) and lends
        nothing: its ~0 would price every barely tried length as almost free."""
        n = self.samples[d]
        if n >= MIN_OVERHEAD_SAMPLES:
            return float(self.by_d[d])
        pool = self.pooled if self._in_pool(d) else 0.0
        return min(pool, float(self.by_d[d])) if n else pool


def _median(values: list[float]) -> float:
    """The median of a few floats, without a numpy call (the policy runs between steps)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
