"""The draft-length policy's cost models: per op a non-negative linear cost learned online
from device intervals (see `OnlineCost`; `scheduler/adaptive.py` keeps one per op, `cost_models`),
over the features `FEATURES` reads from a launch's shape."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specsched.scheduler.step_trace import launch_features

# samples an unseeded model needs before it prices anything: one sample's cost goes wholly to
# the free constant (a first fill that caught up a whole prompt priced every later fill as
# that catch-up, and an MTP head's warm-up then never drafted again)
MIN_SAMPLES = 2


@dataclass
class OnlineCost:
    """Non-negative linear cost (ns) of one op, fitted by exponentially weighted ridge
    regression toward `prior` (the seed, or zeros). Each feature is scaled to unit size (its
    largest value seen) so that one ridge weight suits tokens and constants alike: with
    S = diag(scale), A = sum w x x', b = sum w x y, the fit solves
    (A + lam S P S) c = b + lam S P S prior, P = diag(0, 1, 1, ...): the constant is not pulled (a
    forward's fixed cost -- the weights read once -- is what few samples of one shape show best;
    pulling it would hand it to the per-row terms, which then extrapolate to large batches as
    a cost per row that is not there). The draft's constant is pulled (`free_const=False`):
    its cost is per draft step and row-forward, and a run at one D must not book those steps as
    a fixed cost that every other D would pay too.

    A and b are kept as running sums (each sample's weight halves every `half_life` samples),
    so a sample costs two small array updates and a refit one 4 x 4 solve, whatever the
    history: the policy runs on the host between device steps."""

    features: tuple[str, ...]
    prior: np.ndarray | None = None
    lam: float = 0.1
    half_life: float = 32.0  # samples: the fit follows the current load (batch size drifts)
    free_const: bool = True  # the constant is not pulled toward the prior (see the class docstring)
    coef: np.ndarray | None = None
    # the running sums and their bookkeeping (`__post_init__`), not arguments
    _a: np.ndarray = field(init=False, repr=False)
    _b: np.ndarray = field(init=False, repr=False)
    _scale: np.ndarray = field(init=False, repr=False)
    _decay: float = field(init=False, repr=False)
    _pen: np.ndarray = field(init=False, repr=False)
    _n: int = field(default=0, init=False, repr=False)
    _since_fit: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.coef is None and self.prior is not None:
            self.coef = self.prior.copy()
        k = len(self.features)
        self._a, self._b, self._scale = np.zeros((k, k)), np.zeros(k), np.ones(k)
        self._decay = 0.5 ** (1.0 / self.half_life)
        pen = np.full(k, self.lam)
        if self.free_const:
            pen[0] = 0.0  # the constant (FEATURES put it first)
        self._pen = pen

    def add(self, x: np.ndarray, y: float) -> None:
        a, b = self._a, self._b
        a *= self._decay
        a += np.outer(x, x)
        b *= self._decay
        b += x * y
        np.maximum(self._scale, np.abs(x), out=self._scale)
        self._n += 1
        self._since_fit += 1
        if self.coef is None or self._n < 64 or self._since_fit >= 8:  # early samples count most
            self.fit()

    def fit(self) -> None:
        s2 = self._scale * self._scale
        pen = self._pen * s2 + 1e-9 * s2  # lam S P S, and a tiny ridge on every term (solvable)
        prior = self.prior if self.prior is not None else 0.0
        c = np.linalg.solve(self._a + np.diag(pen), self._b + pen * prior)
        self.coef = np.maximum(c, 0.0)
        self._since_fit = 0

    def predict(self, x: np.ndarray) -> float | None:
        return None if self.coef is None else float(max(self.coef @ x, 0.0))

    def state(self) -> dict:
        """What the model has learned, as JSON values (`restore` reads it back): a trace's
        header carries it, so a replay's policy starts where the captured run's stood."""
        return {"coef": None if self.coef is None else self.coef.tolist(), "a": self._a.tolist(),
                "b": self._b.tolist(), "scale": self._scale.tolist(), "n": self._n, "since_fit": self._since_fit}

    def restore(self, state: dict) -> None:
        k = len(self.features)
        a, b, scale = (np.asarray(state[key], dtype=float) for key in ("a", "b", "scale"))
        if a.shape != (k, k) or b.shape != (k,) or scale.shape != (k,):
            raise ValueError(f"a cost model state over {b.shape[0] if b.ndim == 1 else '?'} features, "
                             f"this model has {k} ({', '.join(self.features)})")
        self._a, self._b, self._scale = a, b, scale
        self.coef = None if state["coef"] is None else np.asarray(state["coef"], dtype=float)
        self._n, self._since_fit = int(state["n"]), int(state["since_fit"])

    @property
    def known(self) -> bool:
        """Whether the model prices anything: seeded, or fitted on at least MIN_SAMPLES samples."""
        return self.coef is not None and (self.prior is not None or self._n >= MIN_SAMPLES)

    def at(self, a: float, b: float, c: float, e: float = 0.0) -> float | None:
        """`predict` of (1, a, b, c[, e]) in plain floats (None while not `known`): the policy
        prices every D each step."""
        k = self.__dict__.get("_k")
        if k is None or k[0] is not self.coef:
            if not self.known:
                return None
            k = self.__dict__["_k"] = (self.coef, *map(float, self.coef), 0.0)
        v = k[1] + k[2] * a + k[3] * b + k[4] * c + k[5] * e
        return v if v > 0.0 else 0.0


def seed_coef(profile: dict | None, names: tuple[str, ...], features: tuple[str, ...]) -> np.ndarray | None:
    """A cost model's seed from a cost profile's JSON (`CostProfile.to_json()` or the saved
    file): the coefficients of the first of its device models `names` that it has."""
    if not profile:
        return None
    device = profile.get("device", {})
    for name in names:
        m = device.get(name)
        if m is not None:
            coef = m["coef"] if isinstance(m, dict) else m.coef
            return np.array([float(coef.get(f, 0.0)) for f in features])
    return None


# features of each op's cost model, read from its launch shape (span attributes)
FEATURES = {
    # decode and verify forwards; `verify` (1 for a verify) is the fixed cost a verify adds
    # (its logits at every position, the acceptance's inputs), its slopes shared with a decode
    "target": ("const", "tokens", "requests", "kv_tokens", "verify"),
    # the draft: its KV is read by each forward after the first token (which comes from logits
    # already there), so the KV term is KV tokens x draft steps -- a bare KV term, learned
    # from a warm-up whose one request's KV grew while its D stood, priced a D = 1 draft (no
    # forward at all) by the context length
    "draft": ("const", "draft_steps", "draft_forwards", "draft_kv"),
    "fill": ("const", "tokens", "requests", "kv_tokens"),
}
# a profile's device models that seed them (span names, see scheduler/step_trace.py)
PROFILE_NAMES = {"target": ("verify", "decode"), "draft": ("draft",), "fill": ("draft_fill",)}
LAUNCH_OPS = ("forward", "verify", "draft", "fill")  # the launch ops whose intervals train a model


def launch_model(op: str, attrs: dict) -> str | None:
    """The cost model a completed launch trains: plain decode and verify forwards the target's
    (prefill chunks cost otherwise and are not what the policy chooses between), draft and
    fill their own; None for the rest."""
    if op == "verify" or (op == "forward" and attrs.get("kind") == "decode"):
        return "target"
    return op if op in ("draft", "fill") else None


def op_features(model: str, attrs: dict, op: str = "") -> np.ndarray:
    """`model`'s features of a launch of `op` with shape `attrs` (span attributes)."""
    values = launch_features(attrs)
    values["verify"] = float(op == "verify")
    values["draft_kv"] = values["kv_tokens"] * values["draft_steps"]
    return np.array([values[f] for f in FEATURES[model]])


def cost_models(seed_costs: dict | None) -> dict[str, OnlineCost]:
    """One model per `FEATURES` entry, seeded from a cost profile's JSON if given; the draft's
    constant is pulled toward the seed (see `OnlineCost.free_const`)."""
    return {m: OnlineCost(f, prior=seed_coef(seed_costs, PROFILE_NAMES[m], f), free_const=m != "draft")
            for m, f in FEATURES.items()}


def profile_coef(model: str, coef) -> tuple[str, dict[str, float]]:
    """The inverse of `seed_coef`: `model`'s coefficients as the profile's device model of its
    first `PROFILE_NAMES` op (op, {feature: ns per unit}). The target's verify term joins the
    verify's constant; the draft's KV-by-steps term becomes a KV term (exact for two-token drafts)."""
    c = dict(zip(FEATURES[model], (float(v) for v in coef)))
    c["const"] += c.pop("verify", 0.0)
    if "draft_kv" in c:
        c["kv_tokens"] = c.pop("draft_kv")
    return PROFILE_NAMES[model][0], c
