"""validate, A/B and tune: the questions the simulator answers from one trace.

validate  replay under the captured configuration; error against what was measured, overall
          and per stage (total time of each device op and host stage). Step
          times are compared two ways: step by step (step k of the replay against step k of
          the run: bounded below by the run-to-run noise of the machine, which a simulator
          with deterministic costs cannot predict) and as distributions (the median and p90
          step time of the run against those of `replicates` replays whose costs carry the
          fitted residual noise, pooled: a deterministic replay has no tail to compare).
ab        two configurations on the same workload and acceptance draws (paired), replicated
          with the cost models' residual noise; bootstrap confidence intervals on the
          differences; "no difference" when an interval spans zero.
tune      sweep the draft length per batch-size regime; simulated speedup over plain
          decoding next to the formula T_verif(B)·AL / (T_verif(B·(1+r·D)) + T_draft(B, D)),
          r the share of rows asked for drafts that drafted any (1 but for n-gram misses).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from specsched.scheduler import wiring
from specsched.simulator.acceptance import draft_rate, synthetic_of
from specsched.simulator.costs import CostProfile, host_key
from specsched.simulator.fit import fit_profile
from specsched.simulator.replay import ReplayConfig, replay
from specsched.simulator.sweep import fan_out
from specsched.traces.metrics import compute_metrics
from specsched.traces.names import Schedule


def _pct(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return abs(sim - real) / abs(real) * 100.0


def _noisy_step_times(shared: tuple, r: int) -> list[int]:
    """Step durations of replicate r (costs with the fitted residual noise, seed r)."""
    trace, profile = shared
    sim = replay(trace, profile.with_noise(r), ReplayConfig(seed=r))[1]
    return [s.end_ns - s.start_ns for s in sim.steps]


def validate(trace, profile: CostProfile | None = None, *, replicates: int = 5, jobs: int | str = 1) -> dict:
    """`jobs`: processes the noisy replicates fan out over, or "ray" (results do not depend on it)."""
    profile = profile or fit_profile([trace])
    real = compute_metrics(trace)
    sim_m, sim = replay(trace, profile, ReplayConfig())
    rs = sorted(trace.steps, key=lambda s: s.step)
    ss = sorted(sim.steps, key=lambda s: s.step)
    n = min(len(rs), len(ss))
    errs = np.array([_pct(b.end_ns - b.start_ns, a.end_ns - a.start_ns) or 0.0 for a, b in zip(rs[:n], ss[:n])])
    rt = np.array([s.end_ns - s.start_ns for s in rs], dtype=float)
    noisy = fan_out(_noisy_step_times, (trace, profile), range(replicates), jobs=jobs)
    st = np.array([d for times in noisy for d in times] if noisy else [s.end_ns - s.start_ns for s in sim.steps],
                  dtype=float)
    out = {
        "steps_real": len(rs), "steps_sim": len(ss),
        "step_time_err_pct": {"p50": float(np.median(errs)) if n else None,
                              "p90": float(np.percentile(errs, 90)) if n else None},
        "step_time_dist_err_pct": {q: _pct(float(np.percentile(st, p)), float(np.percentile(rt, p))) if n else None
                                   for q, p in (("p50", 50), ("p90", 90))},
        "makespan_err_pct": _pct(sim_m["duration_s"], real["duration_s"]),
        # an adaptive trace: the replay's draft lengths taken from the run (simulator/follow.py),
        # which the cost models alone answer for; None for a fixed draft length
        "makespan_err_followed_pct": (_pct(replay(trace, profile, ReplayConfig(follow_choices=True))[0]["duration_s"],
                                           real["duration_s"])
                                      if trace.header.engine_config.get("draft_len") == "auto" else None),
        "output_tokens_per_s_err_pct": _pct(sim_m["output_tokens_per_s"], real["output_tokens_per_s"]),
        "ttft_err_pct": {k: _pct(sim_m["ttft_ms"][k], real["ttft_ms"][k]) for k in ("p50", "p99")},
        "tpot_err_pct": {k: _pct(sim_m["tpot_ms"][k], real["tpot_ms"][k]) for k in ("p50", "p99")},
        "bubble_fraction_err_pp": (abs(sim_m["bubble_fraction"] - real["bubble_fraction"]) * 100
                                   if sim_m["bubble_fraction"] is not None and real["bubble_fraction"] is not None else None),
        "fit_mape_pct": profile.mape(),
        "stand_ins": sim.header.extra.get("stand_ins", {}),
        "stages": _stage_comparison(trace, sim),
        "real": real, "sim": sim_m,
    }
    return out


def _stage_totals_ms(trace) -> dict[str, float]:
    """Total time per stage: device ops by name, host stages by their cost-model key (launch
    and plan per op, as fitted), syncs by the op they wait for."""
    out: dict[str, float] = {}
    for s in trace.spans:
        if s.on_rank_lane:
            continue  # a follower rank's intervals: inside the leader's, which are compared
        if s.track == "host":
            key = f"sync:{s.attrs.get('op', '')}" if s.name == "sync" else host_key(s.name, s.attrs)
            key = f"host:{key}"
        else:
            key = f"device:{s.name}"
        out[key] = out.get(key, 0.0) + (s.end_ns - s.start_ns) / 1e6
    return out


def _stage_comparison(trace, sim) -> dict[str, dict]:
    """Where the time goes, measured against simulated: what `validate` shows per stage."""
    real, simulated = _stage_totals_ms(trace), _stage_totals_ms(sim)
    return {k: {"measured_ms": real.get(k, 0.0), "simulated_ms": simulated.get(k, 0.0),
                "err_pct": _pct(simulated.get(k, 0.0), real.get(k))}
            for k in sorted(set(real) | set(simulated))}


def _bootstrap_ci(diffs: np.ndarray, rng: np.random.Generator, n: int = 4000, level: float = 0.95) -> tuple[float, float, float]:
    if len(diffs) == 0:
        return (float("nan"),) * 3
    means = rng.choice(diffs, size=(n, len(diffs)), replace=True).mean(axis=1)
    lo, hi = np.percentile(means, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(diffs.mean()), float(lo), float(hi)


def _per_request(trace) -> tuple[dict, dict]:
    ttft, tpot = {}, {}
    req = {r.request_id: r for r in trace.requests}
    for f in trace.finishes:
        r = req.get(f.request_id)
        if r is None or f.first_token_ns is None:
            continue
        ttft[f.request_id] = (f.first_token_ns - r.arrival_ns) / 1e6
        if f.output_len > 1:
            tpot[f.request_id] = (f.finish_ns - f.first_token_ns) / 1e6 / (f.output_len - 1)
    return ttft, tpot


def _ab_pair(shared: tuple, r_seed: int) -> tuple:
    """One replicate: A and B with the same cost noise and acceptance draws (seed r_seed);
    their metrics, per-request latencies, stand-ins and decode batch sizes."""
    trace, profile, a, b = shared
    ma, ta = replay(trace, profile.with_noise(r_seed), replace(a, seed=r_seed))
    mb, tb = replay(trace, profile.with_noise(r_seed), replace(b, seed=r_seed))
    return (ma, mb, _per_request(ta), _per_request(tb), (ta.header.extra["stand_ins"], tb.header.extra["stand_ins"]),
            (decode_batch_sizes(ta), decode_batch_sizes(tb)))


def ab(trace, a: ReplayConfig, b: ReplayConfig, *, profile: CostProfile | None = None,
       replicates: int = 10, seed: int = 0, on_replicate=None, jobs: int | str = 1) -> dict:
    """`on_replicate(done, total)` is called after each replicate pair (progress bars);
    `jobs`: processes the replicates fan out over, or "ray" (results do not depend on it)."""
    if replicates < 1:
        raise ValueError(f"replicates must be >= 1, got {replicates}")
    profile = profile or fit_profile([trace])
    rng = np.random.default_rng(seed)
    thr, ttft_d, tpot_d = [], [], []
    ma = mb = None
    pairs = fan_out(_ab_pair, (trace, profile, a, b), [seed * 1000 + r for r in range(replicates)],
                    jobs=jobs, on_done=on_replicate)
    ran = [[], []]  # each variant's decode batch sizes over the replicates
    for ma, mb, (fa, ga), (fb, gb), stand_ins, sizes in pairs:
        for seen, r in zip(ran, sizes):
            seen += batch_span(r) or []
        thr.append(mb["output_tokens_per_s"] - ma["output_tokens_per_s"])
        ttft_d += [fb[k] - fa[k] for k in fa if k in fb]
        tpot_d += [gb[k] - ga[k] for k in ga if k in gb]
    res = {}
    for name, diffs in (("output_tokens_per_s", thr), ("ttft_ms", ttft_d), ("tpot_ms", tpot_d)):
        mean, lo, hi = _bootstrap_ci(np.asarray(diffs, dtype=float), rng)
        if lo <= 0 <= hi:
            verdict = "no difference"
        else:
            better = (mean > 0) if name == "output_tokens_per_s" else (mean < 0)
            verdict = "B better" if better else "A better"
        res[name] = {"diff_mean": mean, "ci95": [lo, hi], "verdict": verdict}
    # what each variant priced with stand-ins (the last replicate's; see VirtualDevice.stand_ins), and the smallest and
    # largest decode batch each ran (the trace's: what its costs were fitted on)
    return {"a": ma, "b": mb, "diff_b_minus_a": res, "replicates": replicates,
            "stand_ins": {"a": stand_ins[0], "b": stand_ins[1]},
            "decode_batch_sizes": {"trace": batch_span(decode_batch_sizes(trace)),
                                   **{v: [min(s), max(s)] if s else None for v, s in zip("ab", ran)}}}


def accept_len(trace, d: int) -> float | None:
    """Mean accepted length per step at draft length d, from per-position agreement -- or, for
    a trace captured with synthetic acceptance, from its definition (1 + the sum of its first d
    rates; where requests had their own, per step: their tokens over the steps they take)."""
    forced, own = synthetic_of(trace)
    if forced is not None:
        if not own:
            return 1 + float(forced.rates(d).sum())
        out = {f.request_id: f.output_len for f in trace.finishes}
        reqs = sorted(trace.requests, key=lambda r: r.arrival_ns)
        tokens = np.array([out.get(r.request_id, r.max_tokens) for r in reqs], dtype=float)
        lengths = np.array([1 + (own.get(i) or forced).rates(d).sum() for i in range(len(reqs))])
        return float(tokens.sum() / (tokens / lengths).sum())
    vals = []
    for f in trace.finishes:
        ag = f.agreement
        if not ag:
            continue
        pos = 0
        while pos < len(ag):
            a = 0
            while a < d and pos + a < len(ag) and ag[pos + a]:
                a += 1
            vals.append(1 + a)
            pos += a + 1
    return float(np.mean(vals)) if vals else None


PLAIN_AHEAD = Schedule.PLAIN_OVERLAP.value  # tune's candidate of plain decoding one step ahead


def decode_batch_sizes(trace) -> range:
    """The rows of the trace's decode and speculative steps, smallest to largest (empty without such steps): where
    costs fitted on it price a step without extrapolating."""
    sizes = [len(st.request_ids) for st in trace.steps if st.kind in ("spec", "decode")]
    return range(min(sizes), max(sizes) + 1) if sizes else range(0)


def batch_span(sizes: range) -> list[int] | None:
    """[smallest, largest] of a range of batch sizes, None if it is empty (as results and notes give them)."""
    return [sizes.start, sizes.stop - 1] if sizes else None


def tune(traces, *, profile: CostProfile | list[CostProfile] | None = None, draft_lens: list[int] | None = None,
         concurrencies: list[int] | None = None, on_replay=None, jobs: int | str = 1) -> dict:
    """Sweep the draft length of each trace's proposer per concurrency (one trace per
    proposer: the sweep covers every proposer a trace exists for). Each trace replays with
    its own costs -- fitted on itself unless `profile` gives one per trace (a "draft" op
    costs what *its* proposer costs) -- and speedups are over plain decoding replayed from
    that trace under `sync`; plain decoding under `plain_overlap` is a row of its own (a candidate: on a host-bound
    device running plain steps one ahead may beat every draft length). `on_replay(done, total)` is called after every
    replay (progress bars); `jobs`: processes the replays fan out over, or "ray" (results do not depend on it).
    Returns {"rows": one per (trace, concurrency, configuration), "best": per concurrency the fastest (proposer,
    schedule, D) -- plain decoding under `sync` where nothing beats it}."""
    traces = list(traces) if isinstance(traces, (list, tuple)) else [traces]
    if not traces:
        raise ValueError("tune needs at least one trace")
    if isinstance(profile, (list, tuple)):
        profiles = list(profile)
    else:
        profiles = [profile] * (len(traces) if profile is None else 1)
    if len(profiles) != len(traces):
        raise ValueError("give one cost profile per trace (or none: each trace is fitted on itself)")
    seen = {}
    for tr in traces:
        p = tr.header.proposer
        if p == "none":
            raise ValueError(f"{tr.path or 'trace'}: tune needs speculative traces (their acceptance "
                             "data picks the draft length); this one decodes plainly")
        if p in seen:
            raise ValueError(f"two traces for proposer {p!r} ({seen[p] or '<memory>'}, {tr.path or '<memory>'}): give one trace per proposer")
        seen[p] = tr.path
    concurrencies = concurrencies or [1, 4, 16]
    if min(concurrencies) < 1 or (draft_lens is not None and (not draft_lens or min(draft_lens) < 1)):
        raise ValueError(f"tune needs concurrencies >= 1 and draft lengths >= 1 (got {concurrencies}, {draft_lens})")
    lens = [draft_lens or list(range(1, max(1, min(8, tr.header.max_agreement_len or 8)) + 1)) for tr in traces]
    profiles = [prof or fit_profile([tr]) for tr, prof in zip(traces, profiles)]
    # every replay of the sweep: per trace and concurrency, plain decoding (under sync, then one step ahead), then
    # each D, then the adaptive draft length up to the longest D (linear proposers: a tree's shape is fixed)
    tasks = [(i, c, d) for i, ds in enumerate(lens) for c in concurrencies
             for d in [0, PLAIN_AHEAD, *ds, *(["auto"] if traces[i].header.proposer != "eagle" else [])]]
    results = dict(zip(tasks, fan_out(_tune_replay, (traces, profiles, lens), tasks, jobs=jobs, on_done=on_replay)))
    rows = []
    for i, (tr, prof, ds) in enumerate(zip(traces, profiles, lens)):
        rows += _tune_rows(tr, prof, ds, concurrencies, lambda c, d: results[(i, c, d)])
    # the fastest per concurrency, plain decoding under sync (1.0x by definition) among them: nothing else may pay
    best = {str(c): {"proposer": "none", "schedule": "sync", "draft_len": 0, "sim_speedup": 1.0} for c in concurrencies}
    for r in rows:
        key = str(r["concurrency"])
        if r.get("sim_speedup", 0) > best[key]["sim_speedup"]:
            best[key] = {k: r[k] for k in ("proposer", "schedule", "draft_len", "sim_speedup")}
    return {"rows": rows, "best": best}


def _tune_replay(shared: tuple, task: tuple[int, int, int | str]) -> dict:
    """Metrics of one replay of tune's sweep: trace i at concurrency c, plain decoding under sync for
    d = 0 and one step ahead for d = PLAIN_AHEAD, the adaptive draft length (up to the sweep's longest D)
    for d = "auto"; a configuration the replay rejects comes back as {"error": message}."""
    traces, profiles, lens = shared
    i, c, d = task
    if d == 0 or d == PLAIN_AHEAD:
        cfg = ReplayConfig(proposer="none", schedule="sync" if d == 0 else d, draft_len=0, concurrency=c)
        return replay(traces[i], profiles[i], cfg)[0]  # plain decoding: errors propagate
    try:
        cfg = ReplayConfig(draft_len=d, concurrency=c, max_draft_len=max(lens[i]) if d == "auto" else None)
        return replay(traces[i], profiles[i], cfg)[0]
    except (KeyError, ValueError) as e:
        return {"error": str(e)}


def formula_speedup(profile: CostProfile, proposer: str, schedule: str, c: int, d: int, al: float | None,
                    kv_mean: float, drawn: float = 1.0) -> float | None:
    """The NVIDIA criterion T_verif(B) AL / (T_verif(B(1 + D)) + T_draft(B, D)) on `profile`'s
    device costs: c rows of `kv_mean` KV tokens drafting d each (`drawn`: the share that draft at
    all), AL their mean acceptance length. None without a decode price or an AL."""
    verify_name = "verify" if "verify" in profile.device else "decode"
    base = {"requests": c, "kv_tokens": c * kv_mean}
    t1 = profile.device_ns("decode", base | {"tokens": c})  # falls back to the verify model
    tv = profile.device_ns(verify_name, base | {"tokens": c * (1 + d * drawn)})
    td = 0.0
    if "draft" in profile.device:
        td += profile.device_ns("draft", base | {"tokens": c * d, "draft_len": d})  # every row drafts d
    if "fill" in profile.device:
        # a fill over the verify window (an MTP head; a draft model under eager_fill) covers the
        # whole verify batch; another, the accepted path plus the bonus token: AL per row on average
        window = wiring.proposer_spec(proposer, max(d, 1), schedule=schedule).fill_same_batch
        td += profile.device_ns("fill", base | {"tokens": c * (1 + d) if window else c * (al or 1.0)})
    return (t1 * al / (tv + td)) if (t1 and al) else None


def _tune_rows(trace, profile: CostProfile, draft_lens: list[int], concurrencies: list[int], metrics) -> list[dict]:
    """Tune's rows for one trace; `metrics(c, d)` is the replay at concurrency c and draft
    length d (0: plain decoding under sync, PLAIN_AHEAD: one step ahead)."""
    h = trace.header
    kv_mean = float(np.mean([r.prompt_len for r in trace.requests])) if trace.requests else 64.0
    captured = decode_batch_sizes(trace)  # what the costs were fitted on: another concurrency extrapolates them
    # rows verify what they drafted: a lookup that finds nothing (n-gram) verifies its last token
    drawn = draft_rate(trace)
    rows = []
    for c in concurrencies:
        plain = metrics(c, 0)
        ahead = metrics(c, PLAIN_AHEAD)
        rows.append({"proposer": "none", "schedule": PLAIN_AHEAD, "concurrency": c, "draft_len": 0,
                     "extrapolated": c not in captured, "sim_tokens_per_s": ahead["output_tokens_per_s"],
                     "sim_speedup": ahead["output_tokens_per_s"] / plain["output_tokens_per_s"],
                     "mean_accept_len": None, "formula_speedup": None})
        if h.proposer != "eagle":
            m = metrics(c, "auto")
            row = {"proposer": h.proposer, "schedule": h.schedule, "concurrency": c, "draft_len": "auto",
                   "extrapolated": c not in captured}
            rows.append(row | m if "error" in m else row | {
                "sim_tokens_per_s": m["output_tokens_per_s"],
                "sim_speedup": m["output_tokens_per_s"] / plain["output_tokens_per_s"],
                "mean_accept_len": m["mean_accept_len"], "formula_speedup": None,
                "draft_len_counts": m["draft_len_counts"]})
        for d in draft_lens:
            row = {"proposer": h.proposer, "schedule": h.schedule, "concurrency": c, "draft_len": d,
                   "extrapolated": c not in captured}
            m = metrics(c, d)
            if "error" in m:
                rows.append(row | m)
                continue
            al = accept_len(trace, d) or m["mean_accept_len"]
            formula = formula_speedup(profile, h.proposer, h.schedule, c, d, al, kv_mean, drawn)
            rows.append(row | {
                "sim_tokens_per_s": m["output_tokens_per_s"],
                "sim_speedup": m["output_tokens_per_s"] / plain["output_tokens_per_s"],
                "mean_accept_len": al, "formula_speedup": formula,
            })
    return rows
