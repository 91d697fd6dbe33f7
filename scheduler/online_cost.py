"""The draft-length policy's cost models: per op a non-negative linear cost learned online
from device intervals (see `OnlineCost`; `scheduler/adaptive.py` keeps one per op, `cost_models`),
over the features `FEATURES` reads from a launch's shape."""
from __future__ import annotations

import numpy as np

from specsched.scheduler.step_trace import draft_counts

# samples an unseeded model needs before it prices anything: one sample's cost goes wholly to
# the free constant (a first fill that caught up a whole prompt priced every later fill as
# that catch-up, and an MTP head's warm-up then never drafted again)
MIN_SAMPLES = 2
# a model is refitted once the samples since its last fit reach 1 / REFIT_SHARE of all its
# samples, and at least every REFIT_MAX_GAP samples (see `OnlineCost.add`)
REFIT_SHARE = 8
REFIT_MAX_GAP = 8


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

    A and b are running sums (each sample's weight halves every `half_life` samples), so the
    history costs nothing. The policy runs on the host between device steps, where a plain
    step leaves least room, so a sample is only queued (`add`): the queue is folded into the
    sums in one array operation, and the model refitted (one small solve), when the
    coefficients are next read with `refit` allowed -- after every sample of the first 8, then
    after every (n / 8)-th (early samples move the fit most), from the 64th sample on after
    every 8th. The policy allows it where it weighs the lengths and where it takes a step's
    residual, not where it holds D = 0."""

    def __init__(self, features: tuple[str, ...], prior: np.ndarray | None = None, lam: float = 0.1,
                 half_life: float = 32.0, free_const: bool = True, coef: np.ndarray | None = None,
                 pull: dict[str, float] | None = None):
        self.features = features
        self.prior = prior
        self.lam = lam
        self.half_life = half_life  # samples: the fit follows the current load (batch size drifts)
        self.free_const = free_const  # the constant is not pulled toward the prior (see above)
        self._coef = prior.copy() if coef is None and prior is not None else coef
        k = len(features)
        self._ab = np.zeros((k, k + 1))  # [A b]: the weighted sums of x x' and x y
        self._scale = np.ones(k)
        self._decay = 0.5 ** (1.0 / half_life)
        pen = np.full(k, lam)
        for name, times in (pull or {}).items():  # terms pulled harder toward the prior (see `PULL`)
            pen[features.index(name)] *= times
        if free_const:
            pen[0] = 0.0  # the constant (FEATURES put it first)
        self._pen = pen + 1e-9  # and a tiny ridge on every term (solvable)
        self._n = 0
        self._since_fit = 0
        self._queue: list[tuple[np.ndarray, float]] = []  # samples not yet in the sums, oldest first
        self._stale = False  # a refit is due before the coefficients are read
        self._k: tuple | None = None  # `at`'s coefficients as floats, with the array they came from

    def add(self, x, y: float) -> None:
        """Queue a sample: features `x` (`FEATURES` order), cost `y` ns."""
        self._queue.append((x, y))
        self._n += 1
        self._since_fit += 1
        # early samples move the fit most: a refit after each of the first REFIT_SHARE samples,
        # then once the new ones are 1 / REFIT_SHARE of them, at least every REFIT_MAX_GAP
        if self._coef is None or self._since_fit >= min(REFIT_MAX_GAP, 1 + self._n // REFIT_SHARE):
            self._stale = True

    def _fold(self) -> None:
        """The queued samples into the running sums: with z = (x, y), [A b] <- d^m [A b] +
        sum_i d^(m-1-i) x_i z_i' (A and b are views of one matrix: one product a fold)."""
        q, self._queue = self._queue, []
        if not q:
            return
        z = np.array([(*x, y) for x, y in q], dtype=float)  # [m, k + 1], oldest first
        k = len(self.features)
        if len(q) > 1:
            w = self._decay ** np.arange(len(q) - 1, -1, -1, dtype=float)
            self._ab *= self._decay ** len(q)
            self._ab += (z[:, :k] * w[:, None]).T @ z
        else:
            self._ab *= self._decay
            self._ab += np.multiply.outer(z[0, :k], z[0])
        np.maximum(self._scale, np.abs(z[:, :k]).max(axis=0), out=self._scale)

    def fit(self) -> None:
        self._fold()
        pen = self._pen * (self._scale * self._scale)  # lam S P S
        prior = self.prior if self.prior is not None else 0.0
        a = self._a + np.diag(pen)
        c = np.linalg.solve(a, self._b + pen * prior)
        self._coef = np.maximum(c, 0.0)
        self._since_fit = 0
        self._stale = False

    @property
    def _a(self) -> np.ndarray:
        return self._ab[:, :-1]

    @property
    def _b(self) -> np.ndarray:
        return self._ab[:, -1]

    @property
    def coef(self) -> np.ndarray | None:
        """The fitted coefficients (refitted first if samples since call for it)."""
        if self._stale:
            self.fit()
        return self._coef

    def predict(self, x: np.ndarray) -> float | None:
        coef = self.coef
        return None if coef is None else float(max(coef @ x, 0.0))

    def state(self) -> dict:
        """What the model has learned, as JSON values (`restore` reads it back): a trace's
        header carries it, so a replay's policy starts where the captured run's stood."""
        coef = self.coef
        self._fold()
        return {"features": list(self.features), "coef": None if coef is None else coef.tolist(),
                "a": self._a.tolist(), "b": self._b.tolist(), "scale": self._scale.tolist(), "n": self._n,
                "since_fit": self._since_fit}

    def restore(self, state: dict) -> None:
        k = len(self.features)
        if "features" in state and list(state["features"]) != list(self.features):
            raise ValueError(f"a cost model state over ({', '.join(state['features'])}), "
                             f"this model has ({', '.join(self.features)})")
        a, b, scale = (np.asarray(state[key], dtype=float) for key in ("a", "b", "scale"))
        if a.shape != (k, k) or b.shape != (k,) or scale.shape != (k,):
            raise ValueError(f"a cost model state over {b.shape[0] if b.ndim == 1 else '?'} features, "
                             f"this model has {k} ({', '.join(self.features)})")
        self._ab, self._scale = np.concatenate([a, b[:, None]], axis=1), scale
        self._coef = None if state["coef"] is None else np.asarray(state["coef"], dtype=float)
        self._n, self._since_fit = int(state["n"]), int(state["since_fit"])
        self._queue, self._stale = [], False

    @property
    def known(self) -> bool:
        """Whether the model prices anything: seeded, or fitted on at least MIN_SAMPLES samples."""
        return self.coef is not None and self._priced()

    def _priced(self) -> bool:
        """Whether the coefficients as last fitted price anything (`known` without a refit)."""
        return self._coef is not None and (self.prior is not None or self._n - self._since_fit >= MIN_SAMPLES)

    def at(self, a: float, b: float, c: float, e: float = 0.0, refit: bool = True) -> float | None:
        """`predict` of (1, a, b, c[, e]) in plain floats (None while not `known`): the policy
        prices every D each step. `refit=False` prices with the coefficients as last fitted,
        leaving a due refit to the next read that allows one (a solve costs ~70 us: the policy
        refits when it weighs the lengths or takes a step's residual, not in a held D = 0)."""
        if self._stale and (refit or not self._priced()):
            self.fit()
        k = self._k
        if k is None or k[0] is not self._coef:
            if not self._priced():
                return None
            k = self._k = (self._coef, *map(float, self._coef), 0.0)
        v = k[1] + k[2] * a + k[3] * b + k[4] * c + k[5] * e
        return v if v > 0.0 else 0.0


def seed_coef(profile: dict | None, names: tuple[str, ...], features: tuple[str, ...]) -> np.ndarray | None:
    """A cost model's seed from a cost profile's JSON (`CostProfile.to_json()` or the saved
    file): the coefficients of the first of its device models `names` that it has (a draft's
    row-forwards as its rows past one a step, each step one row's forward more)."""
    if not profile:
        return None
    device = profile.get("device", {})
    for name in names:
        m = device.get(name)
        if m is not None:
            coef = dict(m["coef"] if isinstance(m, dict) else m.coef)
            if "draft_extra_rows" in features:
                row = float(coef.get("draft_forwards", 0.0))
                coef |= {"draft_extra_rows": row, "draft_steps": float(coef.get("draft_steps", 0.0)) + row}
            return np.array([float(coef.get(f, 0.0)) for f in features])
    return None


# features of each op's cost model, read from its launch shape (span attributes)
FEATURES = {
    # decode and verify forwards; `verify` (1 for a verify) is the fixed cost a verify adds
    # (its logits at every position, the acceptance's inputs), its slopes shared with a decode
    "target": ("const", "tokens", "requests", "kv_tokens", "verify"),
    # the draft: a step (one forward over its rows) reads the proposer's weights once, and each
    # row beyond the first adds its own work -- so its rows past one a step (`draft_extra_rows`,
    # row-forwards minus steps), not all its row-forwards: at batch 1 (a warm-up) row-forwards
    # equal steps, the two terms were one, and split evenly they priced a 12-row draft at 3x
    # its cost (17.9 ms for 5.6) and kept speculation off. Its KV is read by each forward after
    # the first token (which comes from logits already there), so the KV term is KV tokens x
    # draft steps -- a bare KV term, learned from a warm-up whose one request's KV grew while
    # its D stood, priced a D = 1 draft (no forward at all) by the context length
    "draft": ("const", "draft_steps", "draft_extra_rows", "draft_kv"),
    "fill": ("const", "tokens", "requests", "kv_tokens"),
}
# terms pulled toward the prior this many times harder than the others: the draft's KV read is
# second order where speculation is decided (one-token forwards of a small proposer: a head's
# forward over 160 KV tokens costs what one over 16 does, within noise), and a warm-up's few
# launches over short prompts, their noise read as a slope, priced a 3-token draft at 160 KV
# tokens at twice its cost and kept speculation off; many launches over varied contexts (a
# long-context batch on a GPU) still show a real slope. Its constant 3 times: a draft of one
# token makes no forward (only the launch), and a run at one D cannot tell a constant from its
# steps -- split evenly, a warm-up at D = 4 priced a one-token draft at half a 4-token one
PULL = {"draft": {"const": 3.0, "draft_kv": 100.0}}
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


def draft_terms(steps: float, forwards: float) -> tuple[float, float]:
    """(steps, rows past one a step) of a draft of `steps` forward steps and `forwards`
    row-forwards in all: the draft model's step and row features (`FEATURES["draft"]`)."""
    return steps, max(forwards - steps, 0)


def op_features(model: str, attrs: dict, op: str = "") -> tuple[float, ...]:
    """`model`'s features (`FEATURES[model]`, in order) of a launch of `op` with shape `attrs`
    (span attributes), read straight from them: the policy reads every completed launch's."""
    if model == "draft":
        steps, forwards, _ = draft_counts(attrs)
        return (1.0, *map(float, draft_terms(steps, forwards)), float(attrs.get("kv_tokens", 0) * steps))
    shape = (1.0, float(attrs.get("tokens", 0)), float(attrs.get("requests", 0)), float(attrs.get("kv_tokens", 0)))
    return shape + (float(op == "verify"),) if model == "target" else shape


def cost_models(seed_costs: dict | None) -> dict[str, OnlineCost]:
    """One model per `FEATURES` entry, seeded from a cost profile's JSON if given; the draft's
    constant is pulled toward the seed (see `OnlineCost.free_const`)."""
    return {m: OnlineCost(f, prior=seed_coef(seed_costs, PROFILE_NAMES[m], f), free_const=m != "draft",
                          pull=PULL.get(m)) for m, f in FEATURES.items()}


def profile_coef(model: str, coef) -> tuple[str, dict[str, float]]:
    """The inverse of `seed_coef`: `model`'s coefficients as the profile's device model of its
    first `PROFILE_NAMES` op (op, {feature: ns per unit}). The target's verify term joins the
    verify's constant; the draft's rows past one a step become its row-forwards (a step's cost
    then less one row's), its KV-by-steps term a KV term (exact for two-token drafts)."""
    c = dict(zip(FEATURES[model], (float(v) for v in coef)))
    c["const"] += c.pop("verify", 0.0)
    if "draft_extra_rows" in c:
        c["draft_forwards"] = c.pop("draft_extra_rows")
        c["draft_steps"] -= c["draft_forwards"]
    if "draft_kv" in c:
        c["kv_tokens"] = c.pop("draft_kv")
    return PROFILE_NAMES[model][0], c


def current_state(model: str, state: dict) -> dict:
    """`model`'s saved cost state over today's `FEATURES` (`OnlineCost.restore` reads it): a
    draft's saved before the states named their features is converted (`legacy_draft_state`)."""
    return legacy_draft_state(state) if model == "draft" and "features" not in state else state


def legacy_draft_state(state: dict) -> dict:
    """A draft cost model's state saved over (const, draft_steps, draft_forwards, draft_kv) --
    before its rows past one a step replaced its row-forwards (`FEATURES`) -- over today's
    features: with x' = M x (extra rows = forwards - steps), A' = M A M', b' = M b and
    c' = M^-T c, so it prices every launch as it did."""
    m = np.eye(4)
    m[2, 1] = -1.0
    out = dict(state)
    out["a"] = (m @ np.asarray(state["a"], dtype=float) @ m.T).tolist()
    out["b"] = (m @ np.asarray(state["b"], dtype=float)).tolist()
    if state.get("coef") is not None:
        out["coef"] = (np.linalg.inv(m).T @ np.asarray(state["coef"], dtype=float)).tolist()
    # the extra rows' largest value is at most the row-forwards' (the features' scales)
    out["features"] = list(FEATURES["draft"])
    return out
