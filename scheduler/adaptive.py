"""Adaptive draft length: the D of each decode step, chosen from live acceptance and costs.

Why: a fixed D is right for one load only. Speculation pays at batch 1 and stops paying as
the batch grows (the verify costs B·(1+D) target tokens), and acceptance differs between
requests and along a request. Before each decode-only step this policy picks D in
{0, 1, ..., max_draft_len} maximizing the expected output tokens per second of the batch,

    rate(D) = sum_i E_i[emitted | D] / (h + T_draft(B, D) + T_verify(B·(1+D)) + T_fill(B, D)),

the criterion of the NVIDIA write-up (speedup = T(B)·AL / (T(B·(1+D)) + T_draft(B, D))) with
a learned step overhead h. D = 0 is a plain decode step (no draft, no verify width): speculation
off. It is pure numpy, so the same object runs in the engine and in the simulator (it is inside
the pipeline), and its inputs are what the pipeline already has:

- **Acceptance**, per request and draft position: p[i, k] = P(draft k accepted | k-1 were),
  smoothed (EWMA) from each verify's (drafted, accepted); a new request starts from the
  engine-wide estimate (itself an EWMA over all rows, starting at `prior`). Then
  E_i[emitted | D] = 1 + sum_{j<=D} prod_{k<=j} p[i, k], capped by the tokens the request has
  left. A request whose drafts keep failing drafts less (see `choose`).
- **Step time**, from the device events' start/end stamps of the launches the pipeline makes:
  a small non-negative linear model per op (a target forward over (tokens, requests, KV
  tokens); the draft over (draft steps, row-forwards, KV tokens); the proposer's fill),
  refitted as samples arrive, ridge-regularized toward its seed -- a fitted cost profile
  (`seed_costs`, the simulator's JSON format) or none -- so a few samples cannot swing it.
  h is the smoothed residual of the steps' measured wall time over their predicted device
  time (host work a schedule does not hide).
- **Exploration**: every `explore_every`-th decision tries one length above the best (D = 1
  when speculation is off), so a stale estimate cannot keep speculation off, or short,
  forever.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# features of each op's cost model, read from its launch shape (span attributes)
FEATURES = {
    "target": ("const", "tokens", "requests", "kv_tokens"),  # decode / verify forwards
    "draft": ("const", "draft_steps", "draft_forwards", "kv_tokens"),
    "fill": ("const", "tokens", "requests", "kv_tokens"),
}
# a profile's device models that seed them (span names, see scheduler/step_trace.py)
PROFILE_NAMES = {"target": ("verify", "decode"), "draft": ("draft",), "fill": ("draft_fill",)}


def _features(model: str, attrs: dict) -> np.ndarray:
    nd = attrs.get("num_draft", 0)
    values = {"const": 1.0, "tokens": attrs.get("tokens", 0), "requests": attrs.get("requests", 0),
              "kv_tokens": attrs.get("kv_tokens", 0), "draft_steps": max(nd - 1, 0),
              "draft_forwards": attrs.get("draft_forwards", 0)}
    return np.array([float(values[f]) for f in FEATURES[model]])


@dataclass
class OnlineCost:
    """Non-negative linear cost (ns) of one op, refitted on its last `window` samples by
    ridge regression toward `prior` (the seed, or zeros): (X'X + lam I) c = X'y + lam prior."""

    features: tuple[str, ...]
    prior: np.ndarray | None = None
    window: int = 256
    lam: float = 1.0
    coef: np.ndarray | None = None
    _x: list = field(default_factory=list)
    _y: list = field(default_factory=list)
    _since_fit: int = 0

    def __post_init__(self) -> None:
        if self.coef is None and self.prior is not None:
            self.coef = self.prior.copy()

    def add(self, x: np.ndarray, y: float) -> None:
        self._x.append(x)
        self._y.append(y)
        if len(self._x) > self.window:
            del self._x[0], self._y[0]
        self._since_fit += 1
        if self.coef is None or self._since_fit >= 8:
            self.fit()

    def fit(self) -> None:
        x, y = np.array(self._x), np.array(self._y)
        # scale each feature to unit size so one ridge weight suits tokens and constants alike
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)
        xs = x / scale
        prior = (self.prior * scale) if self.prior is not None else np.zeros(x.shape[1])
        a = xs.T @ xs + self.lam * np.eye(x.shape[1])
        c = np.linalg.solve(a, xs.T @ y + self.lam * prior)
        self.coef = np.maximum(c, 0.0) / scale
        self._since_fit = 0

    def predict(self, x: np.ndarray) -> float | None:
        return None if self.coef is None else float(max(self.coef @ x, 0.0))


@dataclass
class Decision:
    draft_len: int  # the step's D
    num_draft: np.ndarray  # [B] tokens each row drafts (<= draft_len)
    rows: int  # rows the step serves (the token budget holds B·(1 + D))
    gain: float | None  # predicted tokens/s at D over D = 0 (None before any cost is known)
    explored: bool = False
    device_ns: float | None = None  # the step's predicted device time


class DraftLenPolicy:
    """See the module docstring. `kv_ahead`: the proposer's fill after a plain decode covers
    1 + kv_ahead tokens per row; `fill_same_batch`: its fill after a verify covers the verify
    batch (an MTP head), else the accepted tokens (a draft model); `has_fill`: it has one."""

    def __init__(self, max_draft_len: int, *, has_fill: bool, kv_ahead: int = 0, fill_same_batch: bool = False,
                 prior: float = 0.7, smoothing: float = 0.3, global_smoothing: float = 0.05,
                 explore_every: int = 16, seed_costs: dict | None = None, slots: int = 64):
        if max_draft_len < 1:
            raise ValueError(f"an adaptive draft length needs max_draft_len >= 1, got {max_draft_len}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior acceptance must be in [0, 1], got {prior}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        self.max_draft_len = max_draft_len
        self.has_fill, self.kv_ahead, self.fill_same_batch = has_fill, kv_ahead, fill_same_batch
        self.smoothing, self.global_smoothing = smoothing, global_smoothing
        self.explore_every = explore_every
        self.global_accept = np.full(max_draft_len, prior)  # engine-wide p[k]
        self.accept = np.tile(self.global_accept, (slots, 1))  # [slots, Dmax] per request
        self.costs = {m: OnlineCost(f, prior=_seed(seed_costs, m)) for m, f in FEATURES.items()}
        self.overhead_ns = 0.0  # h
        self.decisions = 0
        self.last: Decision | None = None

    # -- acceptance -----------------------------------------------------------------------
    def start(self, slot: int) -> None:
        """A request took `slot`: its estimates start from the engine-wide ones."""
        if slot >= self.accept.shape[0]:
            self.accept = np.concatenate([self.accept, np.tile(self.global_accept, (slot + 1, 1))])
        self.accept[slot] = self.global_accept

    def observe_verify(self, slots: np.ndarray, num_draft: np.ndarray, accepted: np.ndarray) -> None:
        """Each row drafted num_draft and had `accepted` accepted: positions 1..accepted were
        accepted, position accepted + 1 (if drafted) rejected, later ones unobserved."""
        d = np.minimum(np.asarray(num_draft, dtype=np.int64), self.max_draft_len)
        a = np.minimum(np.asarray(accepted, dtype=np.int64), d)
        if not d.size or not d.any():
            return
        k = np.arange(1, self.max_draft_len + 1)
        seen = k[None, :] <= np.minimum(a + 1, d)[:, None]  # [B, Dmax]
        hit = (k[None, :] <= a[:, None]).astype(float)
        p = self.accept[slots]
        self.accept[slots] = np.where(seen, (1 - self.smoothing) * p + self.smoothing * hit, p)
        n = seen.sum(axis=0)
        mean = np.where(n > 0, (hit * seen).sum(axis=0) / np.maximum(n, 1), self.global_accept)
        self.global_accept = np.where(n > 0, (1 - self.global_smoothing) * self.global_accept
                                      + self.global_smoothing * mean, self.global_accept)

    # -- costs ----------------------------------------------------------------------------
    def observe_launch(self, op: str, attrs: dict, duration_ns: int) -> None:
        """A completed launch's device interval: `op` is the launch op (forward, draft,
        verify, fill), `attrs` its shape. Plain decode and verify forwards train the target's
        model (prefill chunks cost otherwise and are not what this policy chooses between)."""
        if op == "verify" or (op == "forward" and attrs.get("kind") == "decode"):
            model = "target"
        elif op in ("draft", "fill"):
            model = op
        else:
            return
        self.costs[model].add(_features(model, attrs), float(duration_ns))

    def observe_step(self, wall_ns: int) -> None:
        """The last decided step took `wall_ns` (schedule to output): h follows the part of it
        the predicted device time does not explain."""
        last = self.last
        if last is None or last.rows == 0 or last.device_ns is None:
            return
        resid = max(wall_ns - last.device_ns, 0.0)
        self.overhead_ns = 0.8 * self.overhead_ns + 0.2 * resid

    def _cost(self, model: str, **attrs: Any) -> float | None:
        return self.costs[model].predict(_features(model, attrs))

    def step_ns(self, rows: int, d: int, num_draft: np.ndarray, kv_tokens: int) -> float | None:
        """Predicted device time of a step of `rows` at D = d (None while a needed model is
        unknown)."""
        if d == 0:
            parts = [self._cost("target", tokens=rows, requests=rows, kv_tokens=kv_tokens + rows)]
            if self.has_fill:
                parts.append(self._cost("fill", tokens=rows * (1 + self.kv_ahead), requests=rows,
                                        kv_tokens=kv_tokens + rows))
        else:
            width = 1 + d
            parts = [self._cost("draft", num_draft=d, draft_forwards=int(np.maximum(num_draft - 1, 0).sum()),
                                requests=rows, kv_tokens=kv_tokens),
                     self._cost("target", tokens=rows * width, requests=rows, kv_tokens=kv_tokens + rows * width)]
            if self.has_fill:
                # a head's fill covers the verify batch; a draft model's the last accepted
                # token and the bonus (it wrote its drafts' KV while drafting)
                fill = rows * width if self.fill_same_batch else rows * (1 + self.kv_ahead)
                parts.append(self._cost("fill", tokens=fill, requests=rows, kv_tokens=kv_tokens + rows * width))
        if any(p is None for p in parts):
            return None
        return float(sum(parts))

    # -- the decision ---------------------------------------------------------------------
    def choose(self, slots: np.ndarray, remaining: np.ndarray, computed: np.ndarray, budget: int) -> Decision:
        """D for a decode-only step over the rows `slots` (in order; `remaining`: output
        tokens each has left, `computed`: its KV tokens), within a token budget that holds
        B·(1 + D) verify tokens; and how many tokens each served row drafts."""
        self.decisions += 1
        n = len(slots)
        p = self.accept[slots]  # [n, Dmax]
        reach = np.cumprod(p, axis=1)  # P(draft j accepted), j = 1..Dmax
        gain = np.cumsum(reach, axis=1)
        cap = np.clip(remaining - 1, 0, self.max_draft_len)  # drafts a row may still use
        best = None
        rates: dict[int, float] = {}
        for d in range(self.max_draft_len + 1):
            rows = min(n, budget // (1 + d))
            if rows == 0:
                continue
            use = np.minimum(cap[:rows], d)
            expected = rows + float(np.take_along_axis(gain[:rows], np.maximum(use - 1, 0)[:, None], 1)[:, 0]
                                    @ (use > 0))
            t = self.step_ns(rows, d, use, int(computed[:rows].sum()))
            if t is None:
                continue
            rate = expected / (self.overhead_ns + t)
            rates[d] = rate
            if best is None or rate > rates[best]:
                best = d
        explored = False
        if best is None:  # no cost model yet: speculate fully, which teaches every model
            best = self.max_draft_len
        elif self.decisions % self.explore_every == 0 and best < self.max_draft_len:
            best, explored = best + 1, True
        rows = min(n, budget // (1 + best))
        num_draft = np.minimum(cap[:rows], best)
        if best >= 1 and rates.get(best) is not None:
            num_draft = self._per_row(num_draft, reach[:rows], rates[best])
        if best >= 1 and not num_draft.any():
            best = 0  # nobody drafts: a plain decode step
            rows = min(n, budget)
            num_draft = np.zeros(rows, dtype=np.int64)
        gain_over_plain = rates[best] / rates[0] if best in rates and rates.get(0) else None
        dec = Decision(best, num_draft.astype(np.int64), rows, gain_over_plain, explored,
                       self.step_ns(rows, best, num_draft, int(computed[:rows].sum())))
        self.last = dec
        return dec

    def _per_row(self, num_draft: np.ndarray, reach: np.ndarray, rate: float) -> np.ndarray:
        """A row's j-th draft (j >= 2: one more proposer forward for it) is kept while the
        tokens it is expected to add, reach[j], are worth its cost at the step's rate; a
        request whose drafts keep failing thus drafts one token (from logits already there)."""
        m = self.costs["draft"]
        if m.coef is None:
            return num_draft
        per_forward = float(m.coef[FEATURES["draft"].index("draft_forwards")])
        worth = reach >= rate * per_forward  # [B, Dmax]
        worth[:, 0] = True
        keep = np.cumprod(worth, axis=1).sum(axis=1)  # leading positions worth drafting
        return np.minimum(num_draft, keep)


def _seed(profile: dict | None, model: str) -> np.ndarray | None:
    """A model's coefficients from a cost profile's JSON (`CostProfile.to_json()` or the
    saved file): the first of its device models that prices this op."""
    if not profile:
        return None
    device = profile.get("device", {})
    for name in PROFILE_NAMES[model]:
        m = device.get(name)
        if m is not None:
            coef = m["coef"] if isinstance(m, dict) else m.coef
            return np.array([float(coef.get(f, 0.0)) for f in FEATURES[model]])
    return None
