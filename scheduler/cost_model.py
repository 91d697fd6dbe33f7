"""Device cost models of a step's launches: one non-negative `LinearModel` per op, which every reader prices with (the
adaptive draft length, the simulator's virtual device and host costs, `tune`). ns is linear in a launch's features: a
forward or a fill over `OP_FEATURES`, the draft over `DRAFT_FEATURES` (rows stop drafting at their own count; a step's
first token comes from logits already there). `OnlineModel` fits one from device intervals as they arrive.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specsched.scheduler.step_trace import LAUNCH_FEATURES, device_span_name, draft_counts, launch_features

OP_FEATURES = ("const", "tokens", "requests", "kv_tokens", "padded_attn")
DRAFT_FEATURES = ("const", "draft_steps", "draft_forwards", "kv_tokens")
TARGET_FEATURES = OP_FEATURES + ("verify",)  # decodes and verifies: one model, a verify's own term


@dataclass
class LinearModel:
    """A launch's (or host stage's) cost: ns = sum of coef[f] * feature f, floored at 0."""

    coef: dict[str, float]  # feature -> ns per unit

    def price(self, attrs: dict, tile: int = 1) -> float:
        """The cost of a launch of shape `attrs`; `tile` pads the token count up to a multiple (GPU matrix tiles)."""
        c = self.__dict__.get("_c")
        if c is None:  # the coefficients in LAUNCH_FEATURES order, once (priced per simulated launch)
            c = self.__dict__["_c"] = tuple(self.coef.get(f, 0.0) for f in LAUNCH_FEATURES)
        tok = attrs.get("tokens", 0)
        if tile > 1:
            tok = math.ceil(tok / tile) * tile
        total = c[0] + c[1] * tok + c[2] * attrs.get("requests", 0) + c[3] * attrs.get("kv_tokens", 0)
        if c[4] or c[5] or c[6]:
            steps, forwards, drafted = draft_counts(attrs)
            total += c[4] * steps + c[5] * forwards + c[6] * drafted
        if c[7]:
            total += c[7] * attrs.get("padded_attn", 0)
        return total if total > 0.0 else 0.0

    def predict(self, feats: dict[str, float]) -> float:
        """The cost from features (`launch_features`, or any the coefficients name)."""
        total = sum(c * feats.get(f, 0.0) for f, c in self.coef.items() if c)
        return total if total > 0.0 else 0.0

    def price_rows(self, features: tuple[str, ...], x: np.ndarray) -> np.ndarray:
        """[n] costs of n shapes given as rows of `features` ([n, len(features)])."""
        cache = self.__dict__.setdefault("_rows", {})  # features -> coefficient vector
        v = cache.get(features)
        if v is None:
            v = cache[features] = np.array([self.coef.get(f, 0.0) for f in features])
        return np.maximum(x @ v, 0.0)


class OnlineModel:
    """Exponentially weighted least squares (a sample's weight halves every `half_life` samples) over features scaled
    to their largest value seen, with a small ridge toward `prior` (a seed profile's coefficients, or zeros); negative
    coefficients are dropped and the rest refitted. Refitted lazily, when priced after new samples."""

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
        self._dirty, self._fitted = False, 0
        self._set(self.prior)

    @property
    def known(self) -> bool:
        return self.seeded or self.n >= 2  # an unseeded model prices once it has two samples

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
        self._set(np.maximum(coef, 0.0) / s)
        self._dirty, self._fitted = False, self.n

    def _set(self, coef: np.ndarray) -> None:
        self.coef = coef  # [k] ns per unit of each feature
        self._model = LinearModel(dict(zip(self.features, coef.tolist())))

    def model(self) -> LinearModel:
        """The fit as of now (refitted if due)."""
        if self._dirty and self.n:
            self._fit()
        return self._model


class StepCosts:
    """A decode-only step's device time at each draft length: target forward (decode or verify), draft (`draft_op`)
    and fill (`has_fill`: over the verify window with `window_fill`, else the accepted tokens), one `OnlineModel` per
    op, seeded from a cost profile's JSON (`seed`). With `cold_first_launch` an op's first interval is no sample."""

    def __init__(self, *, draft_op: bool, has_fill: bool, window_fill: bool, seed: dict | None = None,
                 cold_first_launch: bool = False):
        dev = (seed or {}).get("device", {})

        # decode and verify share one forward model, a verify's extra cost (logits at every position, acceptance) a
        # term of its own, so the decode's price is known once verifies ran (a profile seeds it from its verify model)
        target = dict((dev.get("verify") or {}).get("coef") or {})
        if target:
            target["verify"] = 0.0
        self.models = {"target": OnlineModel(TARGET_FEATURES, target or None)}
        if draft_op:
            self.models["draft"] = OnlineModel(DRAFT_FEATURES, (dev.get("draft") or {}).get("coef"))
        if has_fill:
            # (a profile of the previous trace format names it draft_fill)
            self.models["fill"] = OnlineModel(OP_FEATURES, (dev.get("fill") or dev.get("draft_fill") or {}).get("coef"))
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
        if m is not None and name not in self.cold:
            m.add(feats, ns)
        self.cold.discard(name)

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
        t = self.models["target"].model().price_rows(TARGET_FEATURES, np.column_stack([fwd, verify]))
        if "draft" in self.models:
            # (const, draft_steps, draft_forwards, kv_tokens)
            feats = np.stack([np.ones_like(d), np.maximum(d - 1, 0), np.maximum(use - 1, 0).sum(axis=1), kv], axis=1)
            t += verify * self.models["draft"].model().price_rows(DRAFT_FEATURES, feats)
        if "fill" in self.models:
            # over the verify window, or the accepted tokens (about half the drafts)
            fill = fwd if self.window_fill else np.column_stack([fwd[:, :1], n + 0.5 * drafted, fwd[:, 2:]])
            t += verify * self.models["fill"].model().price_rows(OP_FEATURES, fill)
        return t

    def per_draft_ns(self) -> float:
        """What one more draft of one row costs: a verify position (a token and a KV token), a
        draft forward, and a fill position where the fill covers the verify window."""
        terms = [("target", ("tokens", "kv_tokens")), ("draft", ("draft_forwards",))]
        if self.window_fill:
            terms.append(("fill", ("tokens", "kv_tokens")))
        return sum(self.models[name].model().coef[f] for name, feats in terms if name in self.models for f in feats)

    def state(self) -> dict:
        return {k: {"coef": dict(zip(m.features, m.coef.tolist())), "n": m.n} for k, m in self.models.items()}

    def restore(self, state: dict) -> None:
        for k, m in self.models.items():
            s = state.get(k)
            if s:
                m._set(np.array([s["coef"].get(f, 0.0) for f in m.features]))
                m.prior, m.seeded, m._dirty = m.coef.copy(), True, False
