"""Device cost models of a step's launches: one non-negative linear model per op, fitted online.

Why: the adaptive draft length prices a step at every D before it runs. Each op's device time
is linear in its launch shape, over the features the simulator's profiles use
(scheduler/step_trace.py `launch_features`): a target forward or a fill over (const, tokens,
requests, kv_tokens, padded_attn) -- decodes and verifies in one target model with a verify's
extra cost a term of its own --, the draft over (const, draft_steps, draft_forwards,
kv_tokens) -- rows stop drafting at their own count, and a step's first token comes from logits
already there. `OnlineModel` fits one from device intervals as they arrive; `StepCosts` prices
a step's launches with them.
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.step_trace import device_span_name, launch_features

OP_FEATURES = ("const", "tokens", "requests", "kv_tokens", "padded_attn")
DRAFT_FEATURES = ("const", "draft_steps", "draft_forwards", "kv_tokens")
TARGET_FEATURES = OP_FEATURES + ("verify",)  # decodes and verifies: one model, a verify's own term
MIN_SAMPLES = 2  # samples an unseeded model needs before it prices anything


class OnlineModel:
    """Exponentially weighted least squares (each sample's weight halves every `half_life`
    samples) over features scaled to their largest value seen, a small ridge toward `prior`
    (a seed profile's coefficients, or zeros); negative coefficients are dropped and the rest
    refitted. Refitted lazily, when priced after new samples."""

    def __init__(self, features: tuple[str, ...], prior: dict | None = None, half_life: float = 64.0,
                 ridge: float = 1e-3):
        self.features = features
        k = len(features)
        self.prior = np.array([float((prior or {}).get(f, 0.0)) for f in features])
        self.seeded = prior is not None
        self.a, self.b = np.zeros((k, k)), np.zeros(k)
        self.scale = np.ones(k)
        self.decay = 0.5 ** (1.0 / half_life)
        self.ridge, self.n = ridge, 0
        self.coef = self.prior.copy()
        self._dirty, self._fitted = False, 0

    @property
    def known(self) -> bool:
        return self.seeded or self.n >= MIN_SAMPLES

    def add(self, feats: dict, ns: float) -> None:
        """A sample: the launch's features (`launch_features`) and its device time."""
        x = np.array([feats.get(f, 0.0) for f in self.features])
        self.scale = np.maximum(self.scale, np.abs(x))
        self.a = self.a * self.decay + np.outer(x, x)
        self.b = self.b * self.decay + x * ns
        self.n += 1
        # refitted when priced after new samples: after each of the first 8, then once an eighth
        # more (at least every 8th): early samples move the fit most, and a fit is a small solve
        self._dirty = self.n <= 8 or 8 * (self.n - self._fitted) >= min(self.n, 64)

    def _fit(self) -> None:
        s = self.scale
        a = self.a / np.outer(s, s)
        lam = self.ridge * max(float(np.trace(a)), 1.0)
        b = self.b / s + lam * self.prior * s
        active = np.ones(len(s), dtype=bool)
        for _ in range(len(s)):
            sub = np.linalg.solve(a[np.ix_(active, active)] + lam * np.eye(int(active.sum())), b[active])
            coef = np.zeros(len(s))
            coef[active] = sub
            if (coef >= 0).all():
                break
            active &= coef > 0
        self.coef = np.maximum(coef, 0.0) / s
        self._dirty, self._fitted = False, self.n

    def coefficients(self) -> np.ndarray:
        """[k] ns per unit of each feature (refitted if due)."""
        if self._dirty and self.n:
            self._fit()
        return self.coef

    def ns(self, feats: dict) -> float:
        return float(sum(c * feats.get(f, 0.0) for f, c in zip(self.features, self.coefficients())))


class StepCosts:
    """A decode-only step's device time at a draft length: the target forward (a plain decode,
    or the verify of each row's drafts), the proposer's draft launch (`draft_op`) and its fill
    (`has_fill`: over the verify window -- `window_fill` -- or the accepted tokens), priced by
    one `OnlineModel` per launch op (seeded from a cost profile's JSON, `seed`). On a device whose
    first launch of an op pays one-off costs (`cold_first_launch`: allocations, kernel loads) that
    interval is not a sample."""

    def __init__(self, *, draft_op: bool, has_fill: bool, window_fill: bool, seed: dict | None = None,
                 cold_first_launch: bool = False):
        dev = (seed or {}).get("device", {})

        def model(name, feats):
            return OnlineModel(feats, (dev.get(name) or {}).get("coef"))

        # a decode and a verify are the same forward over their tokens; a verify's extra cost (its
        # logits at every position, acceptance) is a term of its own, so the decode's price is
        # known once verifies ran (a profile seeds it from its verify model)
        target = dict((dev.get("verify") or {}).get("coef") or {})
        if target:
            target["verify"] = 0.0
        self.models = {"target": OnlineModel(TARGET_FEATURES, target or None)}
        if draft_op:
            self.models["draft"] = model("draft", DRAFT_FEATURES)
        if has_fill:
            self.models["fill"] = model("fill", OP_FEATURES)
        self.window_fill = window_fill
        self.cold = set(self.models) if cold_first_launch else set()  # ops whose first launch is still to come

    @property
    def known(self) -> bool:
        return all(m.known for m in self.models.values())

    def observe(self, op: str, attrs: dict, ns: float) -> None:
        name = device_span_name(op, attrs)
        feats = launch_features(attrs)
        if name in ("decode", "verify"):
            name, feats["verify"] = "target", float(name == "verify")
        m = self.models.get(name)
        if m is not None and name in self.cold:
            self.cold.discard(name)
        elif m is not None:
            m.add(feats, ns)

    def step_ns(self, computed: np.ndarray, use: np.ndarray) -> np.ndarray:
        """[1 + Dmax] the step's device time at each D, row i drafting use[D, i] tokens there."""
        n = len(computed)
        drafted = use.sum(axis=1).astype(float)  # [1 + Dmax]
        d = np.arange(len(use), dtype=float)
        kv = float(computed.sum()) + n + drafted
        # (const, tokens, requests, kv_tokens, padded_attn): the decode (D = 0) or the verify
        fwd = np.stack([np.ones_like(d), n + drafted, np.full_like(d, n), kv,
                        n * (1 + d) * (float(computed.max(initial=0)) + 1 + d)], axis=1)
        verify = (d > 0).astype(float)
        t = np.column_stack([fwd, verify]) @ self.models["target"].coefficients()
        if "draft" in self.models:
            # (const, draft_steps, draft_forwards, kv_tokens)
            feats = np.stack([np.ones_like(d), np.maximum(d - 1, 0), np.maximum(use - 1, 0).sum(axis=1), kv], axis=1)
            t += verify * (feats @ self.models["draft"].coefficients())
        if "fill" in self.models:
            # over the verify window, or the accepted tokens (about half the drafts)
            fill = fwd if self.window_fill else np.column_stack([fwd[:, :1], n + 0.5 * drafted, fwd[:, 2:]])
            t += verify * (fill @ self.models["fill"].coefficients())
        return t

    def per_draft_ns(self) -> float:
        """What one more draft of one row costs: a verify position (a token and a KV token), a
        draft forward, and a fill position where the fill covers the verify window."""
        def slope(name, *feats):
            m = self.models.get(name)
            if m is None:
                return 0.0
            coef = m.coefficients()
            return sum(float(coef[m.features.index(f)]) for f in feats)
        t = slope("target", "tokens", "kv_tokens") + slope("draft", "draft_forwards")
        return t + (slope("fill", "tokens", "kv_tokens") if self.window_fill else 0.0)

    def state(self) -> dict:
        return {k: {"coef": dict(zip(m.features, m.coef.tolist())), "n": m.n} for k, m in self.models.items()}

    def restore(self, state: dict) -> None:
        for k, m in self.models.items():
            s = state.get(k)
            if s:
                m.coef = np.array([s["coef"].get(f, 0.0) for f in m.features])
                m.prior, m.seeded, m._dirty = m.coef.copy(), True, False
