"""Cost models: how long each device op and host stage takes, as a function of its shape.

Why: the simulator charges virtual time per launch and per host stage. Each stage has a
small non-negative linear model of the step's shape (fitted from traces by
`specsched.simulator.fit`):

    duration_ns = c0 + c_tok * padded(tokens) + c_req * requests + c_kv * kv_tokens
                  + c_attn * padded_attn

(`padded_attn` = requests x the longest row's query tokens x the longest row's KV: the work of
an attention that pads every row to the longest, as the torch backend does; a chunked
prefill among decodes costs that, not its tokens. Host stages leave it out; a device whose
attention does not pad fits it near zero), and for the draft op, which samples each row's
first draft token from logits the fill already computed and then runs one proposer forward
per further token,

    duration_ns = c0 + c_step * draft_steps + c_fwd * draft_forwards + c_kv * kv_tokens

with `draft_steps` = the longest row's draft count - 1 (forward passes) and
`draft_forwards` = the sum over rows of (draft count - 1) (row-forwards: rows stop drafting
at their own count, e.g. near max_tokens). Counting forwards rather than drafted tokens is
what lets a trace captured at one draft length price another (measured on the bundled draft
model, fitted at D=4: D=1 1.1 ms vs 0.6 measured, D=2 5.3 vs 5.2; per drafted token it was
4.0 and 7.1). Profiles saved with the older `draft_tokens` feature still price with it.
`padded(tokens)` rounds the token count up to `tile` (1 on CPUs; e.g. 64 on GPUs, whose
matrix instructions pad the token dimension, so cost rises in steps). Latencies no span
shows directly complete the profile: launch latency, wake-up after a sync, the device's idle
time between queued ops (per op), host time between steps, and a closed-loop client's
resubmission time. A profile is saved as JSON and reusable across traces captured on the
same hardware.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specsched.scheduler.cost_model import DRAFT_FEATURES, OP_FEATURES, LinearModel
from specsched.scheduler.step_trace import LAUNCH_FEATURES, launch_features

FEATURES = LAUNCH_FEATURES
SHAPE_FEATURES = FEATURES[:4]  # host stages
# device ops: the draft's and every other op's features, one table with the adaptive draft
# length's cost models (scheduler/cost_model.py)
assert OP_FEATURES[:4] == SHAPE_FEATURES
HOST_STAGES = ("schedule", "kv_alloc", "plan", "launch", "output", "draft")  # draft: a lookup on the host
_PER_OP_LATENCIES = {"launch lead": "launch_leads", "wake-up": "wakeups", "queue gap": "op_gaps"}


_FILL = {"draft_fill": "fill"}


def device_features(op: str) -> tuple[str, ...]:
    """The features a device op's model is fitted on."""
    return DRAFT_FEATURES if op == "draft" else OP_FEATURES


@dataclass
class StageModel(LinearModel):
    """A fitted stage's cost model (`LinearModel.price`, the policy's too) and its fit's quality."""

    mape: float = 0.0  # mean absolute percentage error on the fitting data, percent
    num_samples: int = 0
    median_ns: float = 0.0
    cv: float = 0.0  # relative std of the residuals (noise for replicated replays)


@dataclass
class CostProfile:
    device: dict[str, StageModel] = field(default_factory=dict)  # op span name -> model
    host: dict[str, StageModel] = field(default_factory=dict)  # host stage -> model
    # host launch *start* -> device start on an idle device (all ops): measured from the
    # start because the device can start while the host is still in its launch span (it
    # was descheduled after writing the message, say), which an end-based latency misses
    launch_lead_ns: float = 0.0
    wakeup_ns: float = 0.0  # device end -> host sync end (all ops)
    # the same by launch op (forward, draft, verify, fill) where a trace shows >= 3: a
    # verify's bigger message and result cost more both ways than a draft's or a fill's
    launch_leads: dict[str, float] = field(default_factory=dict)
    wakeups: dict[str, float] = field(default_factory=dict)
    step_overhead_ns: float = 0.0  # host time per step not covered by any stage span
    client_latency_ns: float = 0.0  # closed loop: a finished request's client -> next submission
    op_gap_ns: float = 0.0  # device idle between two queued ops (worker reads/replies)
    op_gaps: dict[str, float] = field(default_factory=dict)  # the same, by the op that follows
    tile: int = 1
    serialize_streams: bool = True  # one worker process runs every stream in order
    source: list[str] = field(default_factory=list)
    noise_seed: int | None = None  # set for a replicate: durations get the fitted residual noise

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.noise_seed) if self.noise_seed is not None else None

    def with_noise(self, seed: int | None) -> "CostProfile":
        return CostProfile.from_json(self.to_json() | {"noise_seed": seed})

    def _noisy(self, m: StageModel, value: float) -> float:
        if self._rng is None or m.cv <= 0:
            return value
        return value * float(np.clip(1.0 + m.cv * self._rng.standard_normal(), 0.2, 3.0))

    # -- prediction -----------------------------------------------------------------------------
    def features(self, attrs: dict, padded: bool = True) -> dict[str, float]:
        feats = launch_features(attrs)
        if padded and self.tile > 1:
            feats["tokens"] = float(np.ceil(feats["tokens"] / self.tile) * self.tile)
        return feats

    # A replay may run an op the captured trace never had (plain decoding replayed from a
    # speculative trace): a target forward over N tokens costs the same whichever op it is.
    FALLBACK = {"decode": ("verify", "mixed", "prefill"), "verify": ("mixed", "decode", "prefill"),
                "mixed": ("prefill", "verify", "decode"), "prefill": ("mixed", "verify", "decode")}
    # The two one-token-per-row forwards are interchangeable, so one fitted on a handful of
    # samples (the single plain decode step of a speculative trace: a constant that ignores
    # the batch) gives way to the other when that one is well sampled. Prefill and mixed
    # forwards are not: a few prefill samples still price prefills better than a decode model.
    SIBLING = {"decode": "verify", "verify": "decode"}
    FEW_SAMPLES = 8

    def priced_as(self, name: str) -> str | None:
        """The fitted op whose model prices op `name`: itself, or a stand-in (None if neither
        it nor a stand-in was fitted)."""
        m = self.device.get(name)
        sib_name = self.SIBLING.get(name, "")
        sib = self.device.get(sib_name)
        if sib is not None and (m is None or m.num_samples < self.FEW_SAMPLES <= sib.num_samples):
            return sib_name
        if m is not None:
            return name
        return next((alt for alt in self.FALLBACK.get(name, ()) if alt in self.device), None)

    def model_for(self, name: str) -> StageModel | None:
        """The model that prices op `name` (None if neither it nor a stand-in was fitted)."""
        key = self.priced_as(name)
        return None if key is None else self.device[key]

    def device_ns(self, name: str, attrs: dict, cache: dict | None = None) -> float:
        """Device op `name`'s duration for shape `attrs`; `cache`: a run's own dict in which
        the op's model is looked up once (the profile does not change during a run, and the
        simulator prices every launch)."""
        if cache is None:
            m = self.model_for(name)
        else:
            try:
                m = cache[name]
            except KeyError:
                m = cache[name] = self.model_for(name)
        if m is None and name == "accept":
            return 0.0
        if m is None:
            raise KeyError(f"cost profile has no model for device op {name!r} (fitted: {sorted(self.device)})")
        return self._noisy(m, m.price(attrs, self.tile))

    def launch_lead_for(self, op: str) -> float:
        return self.launch_leads.get(op, self.launch_lead_ns)

    def wakeup_for(self, op: str) -> float:
        return self.wakeups.get(op, self.wakeup_ns)

    def stand_in(self, latency: str, key: str) -> bool:
        """Whether `latency` ("launch lead", "wake-up" or "queue gap") of op `key` is a
        stand-in: a profile fitted from traces has no value of its own for the op (its traces
        never showed it, or fewer than 3 times: an overlap trace never waits on a draft), so
        the mean over the ops they did show prices it. A profile made by hand (no `source`)
        sets the overall latencies on purpose: nothing is a stand-in there."""
        return bool(self.source) and key not in getattr(self, _PER_OP_LATENCIES[latency])

    def gap_ns(self, name: str) -> float:
        """Device idle before op `name` when it was queued behind another (the worker replies
        to the previous op, then reads and unpacks this one: a cost that depends on the op)."""
        return self.op_gaps.get(name, self.op_gap_ns)

    def host_model(self, name: str) -> StageModel | None:
        """The model of host stage `name`; a qualified name (`launch:fill`, `plan:fill`, see
        `host_key`) falls back to the stage's model over all its spans."""
        m = self.host.get(name)
        if m is None and ":" in name:
            m = self.host.get(name.partition(":")[0])
        return m

    def host_ns(self, name: str, attrs: dict, model: StageModel | None = None) -> float:
        """A host stage's cost (0 for a stage the profile has no model for); `model`: the
        stage's `host_model`, where the caller keeps it."""
        m = model or self.host_model(name)
        return 0.0 if m is None else self._noisy(m, m.price(attrs))

    def mape(self) -> dict[str, float]:
        out = {f"device:{k}": v.mape for k, v in self.device.items()}
        out.update({f"host:{k}": v.mape for k, v in self.host.items()})
        return out

    # -- persistence ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("noise_seed", None)
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def from_json(cls, data: dict) -> "CostProfile":
        data = dict(data)
        if "launch_latency_ns" in data:  # profiles saved before launch leads: end-based
            launch = data.get("host", {}).get("launch", {})
            data["launch_lead_ns"] = data.pop("launch_latency_ns") + launch.get("median_ns", 0.0)
            data.pop("launch_latencies", None)
        # profiles saved before format 2.0 of traces name the proposer's fill `draft_fill`
        data["device"] = {_FILL.get(k, k): StageModel(**v) for k, v in data.get("device", {}).items()}
        data["op_gaps"] = {_FILL.get(k, k): v for k, v in data.get("op_gaps", {}).items()}
        data["host"] = {k: StageModel(**v) for k, v in data.get("host", {}).items()}
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        """A profile from its file, or a shipped one by name (simulator/profiles)."""
        from specsched.simulator.profiles import profile_path

        path = profile_path(path)
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a cost profile: {e}") from None


def host_key(name: str, attrs: dict) -> str:
    """The host model a stage's span is fitted under: a launch by its op (packing a fill's
    message costs more than a draft's), a fill's plan and a verify planned on its own (after
    drafts that may come out short) apart from the step's plan."""
    if name == "launch" and "op" in attrs:
        return f"launch:{attrs['op']}"
    if name == "plan":
        kind = attrs.get("kind")
        if kind == "fill" or kind == "verify":
            return f"plan:{kind}"
    return name
