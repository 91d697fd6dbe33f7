"""The adaptive draft length against every fixed one in the simulator: noise-free scenarios.

On a shared machine one engine run moves by 10-20%, more than the few percent a change to the
draft-length policy makes. This benchmark measures the engine once and then compares in
virtual time: per proposer (draft model and MTP head under `mtp`; with
`--proposers ngram`, the n-gram lookup under `sync`) and capture
concurrency, it runs the engine at every fixed D in 0..max (D = 0: plain decoding under
`plain_overlap`) with traces on the bundled workload of `benchmarks/adaptive.py`, fits one cost
profile from all of them (so every D's shapes are in it), and replays the D = max trace --
whose drafts carry the acceptance of every shorter length -- at each replay concurrency, fixed
D = 0..max and `auto` alike, on the same profile and acceptance. It prints auto / best fixed D
per scenario, their geometric mean and the worst. The policy is the same object the engine
runs, so two checkouts' policies can be compared on the same saved traces (`--traces DIR`).

    python benchmarks/adaptive_sim.py [--traces DIR] [--replay-at 1:1,2,3 4:3,4,5,6,7,8,10,12] [--acceptance bernoulli:0.9]
        [--acceptance 'trace>bernoulli:0.9@8']   # a change of workload after 8 requests
        [--schedule sync]   # every configuration under `sync` (D = 0: plain decoding under `sync`)
        [--seeds 0 1 2]   # each scenario with each seed of the replays' draws (bernoulli acceptance)
        [--ablation]   # also the policy with one rule more or less (benchmarks/RESULTS.md's ablation table)

A probe's outcome is a few draws, so one seed's ratio for a scenario jumps by a few percent
with a small change of the policy; `--seeds` replays every scenario with each seed (the
fixed lengths too) and the summary is over all of them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive import DEFAULT_PROPOSERS, PROPOSERS, configs, workload  # noqa: E402
from common import run  # noqa: E402


def capture(proposer: str, c: int, max_d: int, max_tokens: int, min_requests: int, folder: Path) -> list[Path]:
    """The fixed-D traces of one proposer at concurrency c (captured unless already in `folder`)."""
    from specsched.traces.recorder import write_trace

    paths = []
    for name, cfg in configs(proposer, max_d).items():
        if name == "auto":
            continue
        path = folder / f"{proposer}_c{c}_{name.replace('=', '')}.jsonl"
        if not path.exists():
            _, trace = run(workload(c, max_tokens, min_requests), concurrency=c, warmup=1, trace=True, **cfg)
            write_trace(trace, path)
        paths.append(path)
    return paths


def scenarios(spec: list[str]) -> dict[int, list[int]]:
    """['1:1,2,3', '4:3,4'] -> {1: [1, 2, 3], 4: [3, 4]}: replay concurrencies per capture."""
    out = {}
    for item in spec:
        c, _, at = item.partition(":")
        out[int(c)] = [int(x) for x in at.split(",")] if at else [int(c)]
    return out


def _variants() -> dict:
    """The policy, and it with one rule more or less: `--ablation` replays each (a rule earns its
    lines with 1% of geometric mean over the scenarios)."""
    import numpy as np

    from specsched.scheduler.adaptive import AdaptivePolicy

    class WithOverhead(AdaptivePolicy):
        """+ host time a schedule does not hide: h(D), the median residual of the last 15 steps'
        wall time over their priced device time, plain and speculative steps apart."""

        def _h(self, d: int) -> float:
            r = sorted(self.__dict__.setdefault("residuals", ([], []))[d > 0])
            return r[len(r) // 2] if r else 0.0

        def _step_ns(self, view, use):
            return super()._step_ns(view, use) + np.array([self._h(d) for d in range(len(use))])

        def observe(self, outcome):
            dec = outcome.decision
            if dec is not None and outcome.wall_ns is not None and dec.device_ns is not None:
                ring = self.__dict__.setdefault("residuals", ([], []))[dec.draft_len > 0]
                ring.append(outcome.wall_ns - (dec.device_ns - self._h(dec.draft_len)))
                del ring[:-15]
            super().observe(outcome)

    class WithCatchUp(AdaptivePolicy):
        """+ a lazy proposer's catch-up fill charged to resuming, spread over the steps left."""

        def _step_ns(self, view, use):
            t = super()._step_ns(view, use)
            m = self.costs.models.get("fill")
            if m is not None and view.lag is not None and view.lag.any():
                rows = view.lag > 0
                fill = m.model().predict({"const": 1.0, "requests": float(rows.sum()), "tokens": float(view.lag.sum()),
                             "kv_tokens": float(view.computed[rows].sum()),
                             "padded_attn": float(rows.sum() * view.lag.max() * view.computed.max())})
                for d in range(1, len(use)):
                    t[d] += fill / max(float(np.mean(view.remaining)) / (1 + d / 2), 1)
            return t

    class NoTrim(AdaptivePolicy):
        """- rows drafting only what is worth it: every row drafts min(D, its room)."""

        def _worth(self, reach, draft_lens, rate, probe):
            return draft_lens

    def swap(cls):
        def f(p):
            p.__class__ = cls
        return f

    def no_explore(p):
        p.explore = 0.0

    def engine_wide(p):
        p.accept.shrink = 1e12

    return {"the policy": lambda p: None, "+ unhidden host time": swap(WithOverhead),
            "+ catch-up charge": swap(WithCatchUp), "- rows draft what is worth it": swap(NoTrim),
            "- exploration": no_explore, "- per-request acceptance": engine_wide}


def use_variant(change) -> None:
    """Replays in this process (and its forks) build the adaptive draft length changed by `change`."""
    from specsched.scheduler import wiring

    make = getattr(wiring.draft_len_policy, "__wrapped__", wiring.draft_len_policy)

    def changed(spec, **kw):
        p = make(spec, **kw)
        change(p)
        return p

    changed.__wrapped__ = make
    wiring.draft_len_policy = changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, help="folder for the fixed-D traces (reused when present)")
    ap.add_argument("--replay-at", nargs="+", default=["1:1,2,3", "4:3,4,5,6,7,8,10,12"],
                    help="CAPTURE:REPLAY,REPLAY...: capture concurrency and the concurrencies it is replayed at")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-draft-len", type=int, default=4)
    ap.add_argument("--proposers", nargs="+", choices=list(PROPOSERS), default=DEFAULT_PROPOSERS)
    ap.add_argument("--acceptance", default="trace", help="the replays' acceptance: trace (the captured "
                    "agreement), rates, bernoulli:ALPHA (e.g. a proposer on which speculation pays), or A>B@N: a "
                    "change of workload, the first N requests A, the rest B (e.g. trace>bernoulli:0.9@8)")
    ap.add_argument("--schedule", choices=["natural", "sync"], default="natural",
                    help="natural: each proposer's own schedule, D = 0 under plain_overlap; sync: all under sync")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="replay every scenario with each of these seeds (the replays' random draws)")
    ap.add_argument("--ablation", action="store_true",
                    help="also replay `auto` with one rule of the policy more or less, and print each variant's "
                         "geometric mean")
    args = ap.parse_args()
    if args.max_draft_len < 1 or args.max_tokens < 2:
        ap.error("--max-draft-len must be >= 1 and --max-tokens >= 2")
    from tempfile import mkdtemp

    from specsched.simulator.fit import fit_profile
    from specsched.simulator.replay import ReplayConfig, replay
    from specsched.traces.reader import read_trace

    folder = args.traces or Path(mkdtemp(prefix="adaptive_sim_"))
    folder.mkdir(parents=True, exist_ok=True)
    plan, dmax = scenarios(args.replay_at), args.max_draft_len
    names = [f"D={d}" for d in range(dmax + 1)]
    print(f"simulated output tokens/s; traces in {folder}")
    print(f"{'scenario':>16} " + " ".join(f"{n:>8}" for n in names) + f" {'auto':>8} {'auto/best':>10} {'best':>6}")
    ratios = []
    variants = _variants() if args.ablation else {}
    by_variant: dict[str, list[float]] = {name: [] for name in variants}
    sched = "sync" if args.schedule == "sync" else None  # None: the trace's (the proposer's own)
    plain = "sync" if args.schedule == "sync" else "plain_overlap"
    for proposer in args.proposers:
        for c, at in plan.items():
            paths = capture(proposer, c, dmax, args.max_tokens, args.min_requests, folder)
            traces = [read_trace(p) for p in paths]
            profile = fit_profile(traces)
            longest = traces[-1]  # D = max: its drafts carry every shorter length's acceptance
            for cc, seed in ((cc, seed) for cc in at for seed in args.seeds):
                row = {}
                for d in range(dmax + 1):
                    cfg = (ReplayConfig(proposer="none", schedule=plain, draft_len=0, concurrency=cc, seed=seed) if d == 0
                           else ReplayConfig(draft_len=d, concurrency=cc, acceptance=args.acceptance, schedule=sched,
                                             seed=seed))
                    row[f"D={d}"] = replay(longest, profile, cfg)[0]["output_tokens_per_s"]
                auto = replay(longest, profile, ReplayConfig(draft_len="auto", max_draft_len=dmax, concurrency=cc,
                                                             acceptance=args.acceptance, schedule=sched,
                                                             seed=seed))[0]["output_tokens_per_s"]
                best = max(row, key=row.get)
                ratios.append(auto / row[best])
                for name, change in variants.items():
                    use_variant(change)
                    got = replay(longest, profile, ReplayConfig(draft_len="auto", max_draft_len=dmax, concurrency=cc,
                                                                acceptance=args.acceptance, schedule=sched,
                                                                seed=seed))[0]["output_tokens_per_s"]
                    by_variant[name].append(got / row[best])
                use_variant(lambda p: None)
                label = f"{proposer} {c}->{cc}" + (f" s{seed}" if len(args.seeds) > 1 else "")
                print(f"{label:>16} " + " ".join(f"{row[n]:>8.1f}" for n in names)
                      + f" {auto:>8.1f} {auto / row[best]:>9.3f}x {best:>6}")
    geo = statistics.geometric_mean(ratios)
    over = (f"{len(ratios)} scenarios" if len(args.seeds) == 1
            else f"{len(ratios) // len(args.seeds)} scenarios x {len(args.seeds)} seeds")
    print(f"auto / best fixed D over {over}: geomean {geo:.3f}x, worst {min(ratios):.3f}x, "
          f"{sum(r < 0.97 for r in ratios)} below 0.97x")
    for name, got in by_variant.items():
        print(f"ablation: {name:<30} geomean {statistics.geometric_mean(got):.3f}x, worst {min(got):.3f}x")


if __name__ == "__main__":
    main()
