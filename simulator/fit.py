"""Fitting a CostProfile from engine traces.

Why: costs come from what the hardware did, not from a spec sheet. Every device op and host
stage seen in the traces gets its linear model (`specsched.simulator.costs`) by least squares on its
spans, with non-negative coefficients (a feature whose coefficient would go negative is
dropped and the rest refitted); host stages are kept per op where they differ (`host_key`).
Latencies that no span shows directly are measured from span pairs: launch start -> device
start on an idle device, device end -> sync end, the device's idle time between ops queued
back to back (a verify launch's substages count as one op), uncovered host time between
steps, and in closed-loop traces a client's finish -> resubmission time. The token tile
device kernels pad to is chosen from the traces (`choose_tile`). Fit quality is MAPE per
stage.
"""
from __future__ import annotations

import bisect

import numpy as np

from specsched.scheduler.adaptive import current_state
from specsched.scheduler.step_trace import SHAPE_KEYS
from specsched.simulator.costs import HOST_STAGES, SHAPE_FEATURES, CostProfile, StageModel, device_features, host_key


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
            m = fit_stage(feats, list(ys), device_features(name))
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


def _launch_leads(dev_spans: list, launches: dict) -> list[tuple[str, int]]:
    """(launch op, launch span start -> device start), for ops launched onto an idle device."""
    out, prev_end = [], None
    for s in dev_spans:
        ln = launches.get(s.attrs.get("launch_id"))
        if ln is not None and (prev_end is None or prev_end <= ln.start_ns) and s.name != "accept":
            out.append((ln.attrs.get("op", ""), s.start_ns - ln.start_ns))
        prev_end = s.end_ns if prev_end is None else max(prev_end, s.end_ns)
    return out


def _wakeups(spans: list, dev_spans: list) -> list[tuple[str, int]]:
    """(op, device end -> host sync end), for syncs during which a device op of their step
    ended."""
    ends: dict = {}
    for s in dev_spans:
        ends.setdefault(s.step, []).append(s.end_ns)
    out = []
    for s in spans:
        if s.track == "host" and s.name == "sync":
            cands = [e for e in ends.get(s.step, []) if s.start_ns <= e <= s.end_ns]
            if cands:
                out.append((s.attrs.get("op", ""), s.end_ns - max(cands)))
    return out


def _between_steps(tr) -> list[int]:
    """Host time between consecutive steps that no span covers (event-loop bookkeeping). A gap in which the engine had
    no request to serve counts from the arrival that ended it: the wait for work is the workload's, not the host's."""
    steps = sorted(tr.steps, key=lambda s: s.start_ns)
    host_spans = sorted((s.start_ns, s.end_ns) for s in tr.spans if s.track == "host")
    starts = np.array([a for a, _ in host_spans], dtype=np.int64)
    arrivals = sorted(r.arrival_ns for r in tr.requests)
    finishes = sorted(f.finish_ns for f in tr.finishes)
    out = []
    for a, b in zip(steps, steps[1:]):
        t0 = a.end_ns
        arrived = bisect.bisect_right(arrivals, t0)
        if arrived == bisect.bisect_right(finishes, t0):  # nothing to serve: idle until the next arrival
            if arrived == len(arrivals) or arrivals[arrived] > b.start_ns:
                continue
            t0 = arrivals[arrived]
        gap = b.start_ns - t0
        if gap < 0:
            continue
        i0, i1 = np.searchsorted(starts, [t0, b.start_ns])
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
    launch_lead, wakeups, overheads, client_lat = [], [], [], []
    gaps: list[tuple[str, int]] = []
    for tr in traces:
        prof.source.append(tr.path or "<memory>")
        prof.serialize_streams = tr.header.device.kind in ("host", "cpu")
        launches = {}
        for s in tr.spans:
            dur = float(s.end_ns - s.start_ns)
            if s.track == "host":
                if s.name in HOST_STAGES:
                    row = (_features(prof, tr, s), dur)
                    host_rows.setdefault(host_key(s.name, s.attrs), []).append(row)
                    all_rows.setdefault(s.name, []).append(row)
                if s.name == "launch" and "launch_id" in s.attrs:
                    launches[s.attrs["launch_id"]] = s
            elif not s.on_rank_lane:  # a follower rank's lane: the leader's spans already wait for it
                _features(prof, tr, s)  # checked here: a shape attribute that is not a number
                dev_rows.setdefault(s.name, []).append((s.attrs, dur))
        dev_spans = sorted((s for s in tr.spans if s.track != "host" and not s.on_rank_lane),
                           key=lambda s: s.start_ns)
        gaps += _op_gaps(_device_ops(dev_spans), launches)
        launch_lead += _launch_leads(dev_spans, launches)
        wakeups += _wakeups(tr.spans, dev_spans)
        overheads += _between_steps(tr)
        client_lat += _client_latencies(tr)
    prof.tile = choose_tile(dev_rows) if tile == "auto" else tile
    for name, rows in dev_rows.items():
        prof.device[name] = fit_stage([prof.features(a) for a, _ in rows], [d for _, d in rows],
                                      device_features(name))
    for name, rows in all_rows.items():
        if name not in host_rows:
            host_rows[name] = rows  # e.g. `launch`: every span has an op; this prices new ops
    for name, rows in host_rows.items():
        if ":" in name and len(rows) < 3:
            continue  # too few for a model of its own: the stage's model prices it
        prof.host[name] = fit_stage([r for r, _ in rows], [d for _, d in rows], SHAPE_FEATURES)
    prof.launch_lead_ns = max(0.0, float(np.mean([v for _, v in launch_lead]))) if launch_lead else 0.0
    prof.wakeup_ns = float(np.mean([v for _, v in wakeups])) if wakeups else 0.0
    prof.launch_leads = {k: max(0.0, m) for k, m in _means_by_key(launch_lead).items()}
    prof.wakeups = _means_by_key(wakeups)
    prof.step_overhead_ns = float(np.mean(overheads)) if overheads else 0.0
    prof.client_latency_ns = float(np.median(client_lat)) if client_lat else 0.0
    prof.op_gap_ns = float(np.mean([g for _, g in gaps])) if gaps else 0.0
    prof.op_gaps = _means_by_key(gaps)
    _ops_from_policy(prof, traces)
    return prof


def _ops_from_policy(prof: CostProfile, traces: list) -> None:
    """Device ops no trace ran, priced by the cost models of an adaptive run's policy (the
    state its header carries, learned in the run's warm-up: one model per device op over the
    profile's own features, scheduler/cost_model.py). Why: at a load where speculation does not
    pay the policy drafts nothing, so the trace has no draft, verify or fill span, and a replay
    whose policy drafts after all must price them. Such a model's fit error is unknown (mape 0).
    A state of another format (an earlier release's policy) prices nothing."""
    for tr in traces:
        state = current_state(tr.header.extra.get("draft_policy") or {"format": 0})
        if state is None:
            continue
        for name, model in (state.get("costs") or {}).items():
            if not model.get("n"):
                continue
            # the target model prices decodes and, with its verify term, verifies
            ops = {"decode": 0.0, "verify": float(model["coef"].get("verify", 0.0))} if name == "target" else {name: 0.0}
            for op, extra in ops.items():
                if op in prof.device:
                    continue
                coef = {f: float(model["coef"].get(f, 0.0)) for f in device_features(op)}
                coef["const"] += extra
                prof.device[op] = StageModel(coef=coef, mape=0.0, num_samples=int(model["n"]), median_ns=coef["const"])
                prof.source.append(f"{tr.path or '<memory>'} (the run's draft-length policy: {op})")


def _features(prof: CostProfile, tr, span) -> dict[str, float]:
    """A span's cost features, or a ValueError naming the trace, the span and the attribute
    that is not a number."""
    try:
        return prof.features(span.attrs, padded=False)
    except (TypeError, ValueError):
        bad = {k: v for k, v in span.attrs.items()
               if k in SHAPE_KEYS and (isinstance(v, bool) or not isinstance(v, (int, float)))}
        raise ValueError(f"{tr.path or 'trace'}: {span.track} span {span.name!r} of step {span.step}: "
                         f"shape attribute(s) {bad} not a number") from None


def _means_by_key(pairs: list[tuple[str, float]], min_samples: int = 3) -> dict[str, float]:
    """Mean value per key, for keys with at least `min_samples` values."""
    by_key: dict[str, list[float]] = {}
    for k, v in pairs:
        if k:
            by_key.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in by_key.items() if len(v) >= min_samples}
