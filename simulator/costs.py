"""Cost models fitted from traces: how long each device op and host stage takes.

Why: the simulator charges virtual time per launch and per host stage. Each stage gets a
small linear model of the step's shape, fitted by least squares on the spans of captured
traces, with non-negative coefficients (dropping a feature whose coefficient would go
negative and refitting):

    duration_ns = c0 + c_tok * padded(tokens) + c_req * requests + c_kv * kv_tokens
                  (+ c_draft * draft_tokens for the draft op)

`draft_tokens` is the launch's total drafted tokens (rows stop drafting at their own count,
e.g. near max_tokens); traces without it fall back to requests * num_draft.

`padded(tokens)` rounds the token count up to `tile` (1 on CPUs; e.g. 64 on GPUs, whose
matrix instructions pad the token dimension, so cost rises in steps). Two latencies that no
span shows directly are measured too: `launch_latency_ns` (host launch end -> device start
when the device was idle) and `wakeup_ns` (device end -> host sync end); the worker's idle
time between two queued ops is kept per op (replying to one op and unpacking the next costs
what the messages cost; a verify launch's substages count as one op). Fit quality is
reported as MAPE per stage. A profile is saved as JSON and reusable across traces captured
on the same hardware.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FEATURES = ("const", "tokens", "requests", "kv_tokens", "draft_tokens")
HOST_STAGES = ("schedule", "kv_alloc", "plan", "launch", "output")


@dataclass
class StageModel:
    coef: dict[str, float]  # feature -> ns per unit
    mape: float  # mean absolute percentage error on the fitting data, percent
    num_samples: int
    median_ns: float
    cv: float = 0.0  # relative std of the residuals (noise for replicated replays)

    def predict(self, feats: dict[str, float]) -> float:
        terms = self.__dict__.get("_terms")
        if terms is None:  # the non-zero coefficients, once (predict runs per simulated stage)
            terms = self.__dict__["_terms"] = tuple((k, c) for k, c in self.coef.items() if c)
        total = 0.0
        for k, c in terms:
            total += c * feats.get(k, 0.0)
        return total if total > 0.0 else 0.0

    def price(self, attrs: dict, tile: int = 1) -> float:
        """`predict(profile.features(attrs))` without building the features dict: the
        simulator prices every launch and host stage this way."""
        c = self.__dict__.get("_c")
        if c is None:
            c = self.__dict__["_c"] = tuple(self.coef.get(f, 0.0) for f in FEATURES)
        tok = attrs.get("tokens", 0)
        if tile > 1:
            tok = math.ceil(tok / tile) * tile
        req = attrs.get("requests", 0)
        total = c[0] + c[1] * tok + c[2] * req + c[3] * attrs.get("kv_tokens", 0)
        if c[4]:
            total += c[4] * attrs.get("draft_tokens", req * attrs.get("num_draft", 0))
        return total if total > 0.0 else 0.0


@dataclass
class CostProfile:
    device: dict[str, StageModel] = field(default_factory=dict)  # op span name -> model
    host: dict[str, StageModel] = field(default_factory=dict)  # host stage -> model
    launch_latency_ns: float = 0.0
    wakeup_ns: float = 0.0  # device end -> host sync end
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
        tok = float(attrs.get("tokens", 0))
        if padded and self.tile > 1:
            tok = float(np.ceil(tok / self.tile) * self.tile)
        req = float(attrs.get("requests", 0))
        return {"const": 1.0, "tokens": tok, "requests": req,
                "kv_tokens": float(attrs.get("kv_tokens", 0)),
                "draft_tokens": float(attrs.get("draft_tokens", req * attrs.get("num_draft", 0)))}

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

    def model_for(self, name: str) -> StageModel | None:
        """The model that prices op `name` (None if neither it nor a stand-in was fitted)."""
        m = self.device.get(name)
        sib = self.device.get(self.SIBLING.get(name, ""))
        if sib is not None and (m is None or m.num_samples < self.FEW_SAMPLES <= sib.num_samples):
            return sib
        for alt in self.FALLBACK.get(name, ()):
            if m is not None:
                break
            m = self.device.get(alt)
        return m

    def device_ns(self, name: str, attrs: dict) -> float:
        m = self.model_for(name)
        if m is None and name == "accept":
            return 0.0
        if m is None:
            raise KeyError(f"cost profile has no model for device op {name!r} (fitted: {sorted(self.device)})")
        return self._noisy(m, m.price(attrs, self.tile))

    def gap_ns(self, name: str) -> float:
        """Device idle before op `name` when it was queued behind another (the worker replies
        to the previous op, then reads and unpacks this one: a cost that depends on the op)."""
        return self.op_gaps.get(name, self.op_gap_ns)

    def host_ns(self, name: str, attrs: dict) -> float:
        """A host stage's cost; `name` may be qualified (`launch:fill`, `plan:fill`, see
        `host_key`), falling back to the stage's model over all its spans."""
        m = self.host.get(name)
        if m is None and ":" in name:
            m = self.host.get(name.partition(":")[0])
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
        data["device"] = {k: StageModel(**v) for k, v in data.get("device", {}).items()}
        data["host"] = {k: StageModel(**v) for k, v in data.get("host", {}).items()}
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a cost profile: {e}") from None


def fit_stage(rows: list[dict], durations: list[float], features: tuple[str, ...]) -> StageModel:
    y = np.asarray(durations, dtype=np.float64)
    X = np.asarray([[r.get(f, 0.0) for f in features] for r in rows], dtype=np.float64)
    active = [i for i in range(len(features)) if features[i] == "const" or np.ptp(X[:, i]) > 0]
    if len(y) < 3 * len(active):
        # too few samples for a multi-feature fit (e.g. two prefills): a cost proportional to
        # the tokens when they vary, else a constant
        tok = features.index("tokens") if "tokens" in features else None
        active = [tok] if tok is not None and np.ptp(X[:, tok]) > 0 else [0]
    coef = np.zeros(len(features))
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        neg = [a for a, c in zip(active, sol) if c < 0 and features[a] != "const"]
        if not neg:
            coef[active] = sol
            break
        active.remove(min(neg, key=lambda a: sol[active.index(a)]))
    if coef[0] < 0:
        coef[0] = 0.0
        rest = [a for a in active if a != 0]
        if rest:
            sol, *_ = np.linalg.lstsq(X[:, rest], y, rcond=None)
            coef[rest] = np.maximum(sol, 0.0)
    pred = np.maximum(X @ coef, 0.0)
    rel = (y - pred) / np.maximum(pred, 1.0)
    mape = float(np.mean(np.abs(pred - y) / np.maximum(y, 1.0)) * 100) if len(y) else 0.0
    return StageModel({f: float(c) for f, c in zip(features, coef)}, mape, len(y),
                      float(np.median(y)) if len(y) else 0.0, float(np.std(rel)) if len(y) > 1 else 0.0)


def host_key(name: str, attrs: dict) -> str:
    """The host model a stage's span is fitted under: a launch by its op (packing a fill's
    message costs more than a draft's), the fill's plan apart from the step's plan."""
    if name == "launch" and "op" in attrs:
        return f"launch:{attrs['op']}"
    if name == "plan" and attrs.get("kind") == "fill":
        return "plan:fill"
    return name


TILES = (1, 8, 16, 32, 64, 128)


def choose_tile(dev_rows: dict[str, list[tuple[dict, float]]], min_gain: float = 0.1) -> int:
    """The token tile that explains the device ops best: each candidate refits every op seen
    often (>= 20 spans) at varied token counts (>= 3) and sums the relative residuals; a tile
    above 1 must cut that sum by `min_gain` (a CPU's linear costs should not pick up a tile
    from noise, nor from a handful of prefills that any model fits)."""
    err = {}
    for t in TILES:
        probe = CostProfile(tile=t)
        total = 0.0
        for name, rows in dev_rows.items():
            if len(rows) < 20 or len({a.get("tokens", 0) for a, _ in rows}) < 3:
                continue
            feats = [probe.features(a) for a, _ in rows]
            ys = np.array([d for _, d in rows], dtype=np.float64)
            m = fit_stage(feats, list(ys), FEATURES if name == "draft" else FEATURES[:4])
            pred = np.array([m.predict(f) for f in feats])
            total += float((np.abs(ys - pred) / np.maximum(ys, 1.0)).sum())
        err[t] = total
    best = min(err, key=lambda t: (err[t], t))
    return best if best == 1 or err[best] <= (1 - min_gain) * err[1] else 1


def _device_ops(dev_spans: list) -> list[list]:
    """One [start, end, name, launch id] interval per launch, in start order: a verify
    launch's substages (verify, accept) occupy the device as one op."""
    ops: dict = {}
    for s in dev_spans:
        key = s.attrs.get("launch_id") or id(s)
        if key in ops:
            ops[key][1] = max(ops[key][1], s.end_ns)
        else:
            ops[key] = [s.start_ns, s.end_ns, s.name, key]
    return sorted(ops.values())


def _op_gaps(ops: list[list], launches: dict) -> list[tuple[str, int]]:
    """(op, idle before it) for ops launched before the previous op ended: they ran back to
    back, so their spacing is the device's own per-op overhead."""
    out = []
    for a, b in zip(ops, ops[1:]):
        ln = launches.get(b[3])
        if ln is not None and ln.end_ns <= a[1] and b[0] >= a[1]:
            out.append((b[2], b[0] - a[1]))
    return out


def _launch_latencies(dev_spans: list, launches: dict) -> list[int]:
    """Launch span end -> device start, for ops launched onto an idle device."""
    out, prev_end = [], None
    for s in dev_spans:
        ln = launches.get(s.attrs.get("launch_id"))
        if ln is not None and (prev_end is None or prev_end <= ln.end_ns) and s.name != "accept":
            out.append(s.start_ns - ln.end_ns)
        prev_end = s.end_ns if prev_end is None else max(prev_end, s.end_ns)
    return out


def _wakeups(spans: list, dev_spans: list) -> list[int]:
    """Device end -> host sync end, for syncs during which a device op of their step ended."""
    ends: dict = {}
    for s in dev_spans:
        ends.setdefault(s.step, []).append(s.end_ns)
    out = []
    for s in spans:
        if s.track == "host" and s.name == "sync":
            cands = [e for e in ends.get(s.step, []) if s.start_ns <= e <= s.end_ns]
            if cands:
                out.append(s.end_ns - max(cands))
    return out


def _between_steps(tr) -> list[int]:
    """Host time between consecutive steps that no span covers (event-loop bookkeeping)."""
    steps = sorted(tr.steps, key=lambda s: s.start_ns)
    host_spans = sorted((s.start_ns, s.end_ns) for s in tr.spans if s.track == "host")
    starts = np.array([a for a, _ in host_spans], dtype=np.int64)
    out = []
    for a, b in zip(steps, steps[1:]):
        gap = b.start_ns - a.end_ns
        if gap < 0:
            continue
        i0, i1 = np.searchsorted(starts, [a.end_ns, b.start_ns])
        covered = sum(min(e, b.start_ns) - s0 for s0, e in host_spans[i0:i1])
        out.append(max(0, gap - covered))
    return out


def _client_latencies(tr) -> list[int]:
    """Closed-loop traces: how long a client takes from the pipeline's first wait after a
    request finished (when the finished request's client first gets to run) to the next
    request's arrival -- reading the output, submitting, tokenizing. Host time the replay's
    clients spend as busy time."""
    conc = (tr.header.extra.get("workload") or {}).get("concurrency")
    if not conc:
        return []
    finishes = sorted(f.finish_ns for f in tr.finishes)
    waits = sorted(s.start_ns for s in tr.spans if s.track == "host" and s.name == "sync")
    out = []
    for a in sorted(r.arrival_ns for r in tr.requests)[conc:]:
        i = bisect.bisect_right(finishes, a)
        if i == 0:
            continue
        j = bisect.bisect_left(waits, finishes[i - 1])
        if j < len(waits) and waits[j] <= a:
            out.append(a - waits[j])
    return out


def fit_profile(traces: list, *, tile: int | str = "auto") -> CostProfile:
    """Fit every device op and host stage seen in `traces` (engine traces). `tile`: the
    token tile device kernels pad to, or "auto" to pick it from the traces (`choose_tile`)."""
    if tile != "auto" and (not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile must be a positive integer or 'auto', got {tile!r}")
    prof = CostProfile(tile=1)
    dev_rows: dict[str, list] = {}
    host_rows: dict[str, list] = {}  # by host_key
    all_rows: dict[str, list] = {}  # by stage: the fallback for keys with too few spans
    launch_lat, wakeups, overheads, client_lat = [], [], [], []
    gaps: list[tuple[str, int]] = []
    for tr in traces:
        prof.source.append(tr.path or "<memory>")
        prof.serialize_streams = tr.header.device.kind in ("host", "cpu")
        launches = {}
        for s in tr.spans:
            dur = float(s.end_ns - s.start_ns)
            if s.track == "host":
                if s.name in HOST_STAGES:
                    row = (prof.features(s.attrs, padded=False), dur)
                    host_rows.setdefault(host_key(s.name, s.attrs), []).append(row)
                    all_rows.setdefault(s.name, []).append(row)
                if s.name == "launch" and "launch_id" in s.attrs:
                    launches[s.attrs["launch_id"]] = s
            else:
                dev_rows.setdefault(s.name, []).append((s.attrs, dur))
        dev_spans = sorted((s for s in tr.spans if s.track != "host"), key=lambda s: s.start_ns)
        gaps += _op_gaps(_device_ops(dev_spans), launches)
        launch_lat += _launch_latencies(dev_spans, launches)
        wakeups += _wakeups(tr.spans, dev_spans)
        overheads += _between_steps(tr)
        client_lat += _client_latencies(tr)
    prof.tile = choose_tile(dev_rows) if tile == "auto" else tile
    for name, rows in dev_rows.items():
        feats = FEATURES if name == "draft" else FEATURES[:4]
        prof.device[name] = fit_stage([prof.features(a) for a, _ in rows], [d for _, d in rows], feats)
    for name, rows in all_rows.items():
        if name not in host_rows:
            host_rows[name] = rows  # e.g. `launch`: every span has an op; this prices new ops
    for name, rows in host_rows.items():
        if ":" in name and len(rows) < 3:
            continue  # too few for a model of its own: the stage's model prices it
        prof.host[name] = fit_stage([r for r, _ in rows], [d for _, d in rows], FEATURES[:4])
    prof.launch_latency_ns = max(0.0, float(np.mean(launch_lat))) if launch_lat else 0.0
    prof.wakeup_ns = float(np.mean(wakeups)) if wakeups else 0.0
    prof.step_overhead_ns = float(np.mean(overheads)) if overheads else 0.0
    prof.client_latency_ns = float(np.median(client_lat)) if client_lat else 0.0
    prof.op_gap_ns = float(np.mean([g for _, g in gaps])) if gaps else 0.0
    by_op: dict[str, list[int]] = {}
    for name, g in gaps:
        by_op.setdefault(name, []).append(g)
    prof.op_gaps = {k: float(np.mean(v)) for k, v in by_op.items() if len(v) >= 3}
    return prof
