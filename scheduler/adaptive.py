"""The adaptive draft length: each decode-only step's D by the goodput criterion.

Speculation pays at batch 1 and stops paying as the batch grows (the verify costs B·(1 + D) target tokens), and
acceptance differs between requests. Before each decode-only step the policy picks D in {0, ..., max_draft_len}
maximizing the batch's expected output tokens per second,

    rate(D) = sum_i (1 + E[accepted_i | d_i]) / (T_target(B, D) + T_draft(B, D) + T_fill(B, D)),

NVIDIA's criterion T(B)·AL / (T(B(1 + D)) + T_draft(B, D)) with the proposer's fill; d_i = min(D, tokens row i has
room for); D = 0 is a plain step. Each row then drafts only the leading positions worth their cost (`_worth`).

- Acceptance: p[i, k] = P(draft k accepted | k - 1 were), per request, shrunk toward an engine-wide estimate; a
  verify counts positions up to the accepted count accepted, the next one rejected;
  E[accepted_i | d] = sum_{j <= d} prod_{k <= j} p[i, k].
- Costs: one non-negative linear model per device op, fitted online from device intervals, priced on launch shapes.
- Exploration: every step adds `explore` of its predicted time to a budget; whenever that covers the dearest length's
  step, the step probes the highest-rated length other than the best, every acceptance read one standard error up,
  and pays its predicted time from the budget, so a stale estimate cannot keep speculation off, or short, for ever.

Unhidden host time and a lazy proposer's catch-up fill are not priced: neither gained 1% in the simulator's scenarios.
The state a trace's header carries is versioned.
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.cost_model import StepCosts
from specsched.scheduler.draft_policy import Decision, StepOutcome, StepView

STATE_FORMAT = 3  # `AdaptivePolicy.state`'s layout (format 1: the policy of earlier releases)


def current_state(state: dict) -> dict | None:
    """A saved state in this release's layout (format 2 named the fill's model `draft_fill`);
    None for another format (format 1: another policy)."""
    if state.get("format") == 2:
        costs = {("fill" if k == "draft_fill" else k): v for k, v in (state.get("costs") or {}).items()}
        state = {**state, "format": STATE_FORMAT, "costs": costs}
    return state if state.get("format") == STATE_FORMAT else None


class Acceptance:
    """Per-position acceptance: engine-wide counts (an exponentially weighted mean started at `prior`) and per-slot
    counts fading by `decay` a verify, the engine-wide estimate weighing `shrink` observations in each slot's."""

    def __init__(self, max_draft_len: int, slots: int, prior: float = 0.7, decay: float = 0.85,
                 shrink: float = 4.0, prior_weight: float = 8.0, min_weight: float = 0.02):
        self.k = np.arange(1, max_draft_len + 1)
        self.hits, self.seen = np.full(max_draft_len, prior * prior_weight), np.full(max_draft_len, prior_weight)
        self.mine = np.zeros((slots, 2, max_draft_len))  # per slot: hits, seen
        self.decay, self.shrink, self.min_weight = decay, shrink, min_weight

    def start(self, slot: int) -> None:
        if slot >= len(self.mine):
            self.mine = np.concatenate([self.mine, np.zeros((slot + 1 - len(self.mine),) + self.mine.shape[1:])])
        self.mine[slot] = 0.0

    def of(self, slots: np.ndarray, z: float = 0.0) -> np.ndarray:
        """[n, Dmax] p[i, k]; `z` standard errors of the engine-wide estimate higher."""
        g = self.hits / self.seen  # the engine-wide estimate
        if z:
            g = np.minimum(g + z * np.sqrt(g * (1.0 - g) / self.seen), 1.0)
        m = self.mine[slots]
        return (self.shrink * g + m[:, 0]) / (self.shrink + m[:, 1])

    def observe(self, slots, drafted, accepted, live) -> None:
        d = np.minimum(drafted, len(self.k))
        seen = self.k[None, :] <= np.minimum(accepted + 1, d)[:, None]
        hit = self.k[None, :] <= np.minimum(accepted, d)[:, None]
        if not seen.any():
            return
        own = slots[live]
        fade = np.where(seen[live], self.decay, 1.0)
        self.mine[own, 0] = self.mine[own, 0] * fade + hit[live]
        self.mine[own, 1] = self.mine[own, 1] * fade + seen[live]
        n = seen.sum(axis=0)
        # a running mean until a step weighs less than `min_weight`, then an EWMA over steps
        w = np.where(n > 0, np.maximum(n / (self.seen + n), self.min_weight), 0.0)
        mean = hit.sum(axis=0) / np.maximum(n, 1)
        p = self.hits / self.seen
        self.seen = self.seen + n
        self.hits = self.seen * (p + w * (mean - p))


class AdaptivePolicy:
    """A `DraftPolicy` choosing D by the goodput criterion; `first_draft_len` is D while a launch's cost is still
    unknown (speculating teaches every model)."""

    adaptive = True
    pauses = True

    def __init__(self, max_draft_len: int, costs: StepCosts, *, slots: int = 64, explore: float = 0.05,
                 first_draft_len: int = 2, prior: float = 0.7):
        if max_draft_len < 1:
            raise ValueError(f"an adaptive draft length needs max_draft_len >= 1, got {max_draft_len}")
        self.max_draft_len, self.costs = max_draft_len, costs
        self.accept = Acceptance(max_draft_len, slots, prior=prior)
        self.explore, self.budget = explore, 0.0
        self.first_draft_len = min(first_draft_len, max_draft_len)
        self.last: Decision | None = None

    def start(self, slot: int) -> None:
        self.accept.start(slot)

    def warmed_up(self) -> None:
        self.last = None

    def _rates(self, view: StepView, use: np.ndarray, reach: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rate, predicted step ns) at each D from reach [rows, Dmax] = P(draft k made and accepted); rate nan where a
        cost is unknown."""
        gain = np.concatenate([np.zeros((len(reach), 1)), np.cumsum(reach, axis=1)], axis=1)
        rows = np.arange(len(reach))
        emitted = (1.0 + gain[rows[None, :], use]).sum(axis=1)  # [1 + Dmax]
        ns = self._step_ns(view, use)
        return emitted / ns, ns

    def _step_ns(self, view: StepView, use: np.ndarray) -> np.ndarray:  # [1 + Dmax] at each D
        return np.maximum(self.costs.step_ns(view.computed, use), 1.0)

    def choose(self, view: StepView) -> Decision:
        n = len(view.slots)
        room = np.minimum(np.maximum(view.remaining - 1, 0), self.max_draft_len)
        ds = np.arange(self.max_draft_len + 1)
        rows_at = np.minimum(n, view.budget // (1 + ds))
        keep = int(rows_at[-1])  # every length is priced over the rows the longest one holds
        sl = slice(0, keep)
        use = np.minimum(room[None, sl], ds[:, None])  # [1 + Dmax, rows] drafts per row
        sub = view if keep == n else StepView(view.slots[sl], view.remaining[sl], view.computed[sl], view.budget,
                                              None if view.lag is None else view.lag[sl])
        reach = np.cumprod(self.accept.of(sub.slots), axis=1)
        rate, ns = self._rates(sub, use, reach)
        explored = False
        if not self.costs.known or not np.isfinite(rate).all():
            best = self.first_draft_len
        else:
            best = int(np.argmax(rate))
            self.budget += self.explore * ns[best]
            if ns.max() <= self.budget:  # a probe is paid its whole step: at most `explore` of the time
                optimistic, _ = self._rates(sub, use, np.cumprod(self.accept.of(sub.slots, z=1.0), axis=1))
                optimistic[best] = -np.inf
                probe = int(np.argmax(optimistic))
                self.budget -= ns[probe]
                best, explored = probe, True
        rows = int(rows_at[best])
        draft_lens = np.minimum(room[:rows], best).astype(np.int64)
        if best and np.isfinite(rate[best]):
            draft_lens = self._worth(reach[:rows], draft_lens, rate[best], explored)
        if best and not draft_lens.any():
            best, rows = 0, min(n, view.budget)
            draft_lens = np.zeros(rows, dtype=np.int64)
        gain = float(rate[best] / rate[0]) if np.isfinite(rate).all() and rate[0] > 0 else None
        self.last = Decision(best, draft_lens, rows, gain, explored, float(ns[best]))
        return self.last

    def _worth(self, reach: np.ndarray, draft_lens: np.ndarray, rate: float, probe: bool) -> np.ndarray:
        """Each row's drafts cut to the leading positions with P(reached and accepted) >= rate x one more draft's cost,
        so a request whose drafts keep failing stops costing the batch -- except in a probe (it finds out whether they
        still fail)."""
        if probe:
            return draft_lens
        worth = reach >= rate * self.costs.per_draft_ns()
        return np.minimum(draft_lens, np.cumprod(worth, axis=1).sum(axis=1))

    def observe(self, outcome: StepOutcome) -> None:
        v = outcome.verify
        if v is not None:
            self.accept.observe(v.slots, v.drafted, v.accepted, v.live)
        for op, attrs, ns in outcome.launches:
            self.costs.observe(op, attrs, ns)

    def state(self) -> dict:
        """What it has learned, as JSON values: engine-wide acceptance and the cost models."""
        return {"format": STATE_FORMAT, "max_draft_len": self.max_draft_len, "hits": self.accept.hits.tolist(),
                "seen": self.accept.seen.tolist(), "costs": self.costs.state()}

    def restore(self, state: dict) -> None:
        """Continue from `state`; ValueError naming the format or draft length it does not fit."""
        fmt, state = state.get("format", 1), current_state(state)
        if state is None:
            raise ValueError(f"a draft-length policy state of format {fmt}; this release reads formats 2 "
                             f"and {STATE_FORMAT} (replay from a cold policy instead)")
        if state.get("max_draft_len") != self.max_draft_len:
            raise ValueError(f"a draft-length policy state for max_draft_len={state.get('max_draft_len')}, "
                             f"this policy has {self.max_draft_len}")
        self.accept.hits, self.accept.seen = np.asarray(state["hits"]), np.asarray(state["seen"])
        self.costs.restore(state["costs"])

