"""Per proposer at batch 1 on the bundled workload: mean acceptance length, acceptance per
draft position, tokens/s and speedup over plain decoding measured in the same run, next to the
analytic bound E / (c_verify + c_draft) from the same traces: E = tokens emitted per
speculative step (AL where every step drafts; less where a lookup finds nothing to draft),
c_verify = the mean verify time per speculative step / the plain decode time, c_draft = the
proposer's mean device time per speculative step / the plain decode time.

The bound prices device time only, so a schedule that hides host work (`overlap`, `mtp`) beats
it against plain decoding under `sync`, which hides none; the `same` column is each
configuration's speedup over plain decoding that hides host work alike (`plain_overlap` for
`overlap` and `mtp`, `sync` for `sync`), the figure to hold against the bound.

    python benchmarks/proposers.py [--num-requests 6] [--max-tokens 64] [--rounds 3] [--baseline-family DIR]
                                   [--temperature T]

With `--temperature` every request is sampled (seeded by its position, past any EOS to its
`--max-tokens`), plain decoding included; a sampled row's acceptance is random, so its AL and
speedups vary between configurations more than greedy ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bundled_items, family_kw, med, median_span_ms, parse_workload, run  # noqa: E402

PROPOSERS = [("draft", "overlap", 3), ("draft", "eager_fill", 3), ("draft", "overlap", 4), ("mtp", "eager_fill", 1),
             ("mtp", "eager_fill", 3), ("mtp", "sync", 2), ("eagle", "sync", 3), ("eagle", "overlap", 3), ("eagle", "eager_fill", 3),
             ("ngram", "sync", 4)]
PLAIN, PLAIN_OVERLAP = ("none", "sync", 0), ("none", "plain_overlap", 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="proposer names to run")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (plain, then each proposer); "
                    "every figure is the median over rounds")
    ap.add_argument("--baseline-family", type=Path, default=None,
                    help="another model family (target/, draft/, mtp/ as in runtime/bundled) measured in the "
                    "same rounds, side by side")
    ap.add_argument("--temperature", type=float, default=None, help="sample every request at this temperature")
    args, items = parse_workload(ap, 6, 64)
    if args.temperature is not None:  # seeded by position, so that every round draws alike
        items = [dataclasses.replace(it, params=it.params.model_copy(update={"seed": i, "ignore_eos": True}))
                 for i, it in enumerate(bundled_items(args.num_requests, args.max_tokens, args.temperature))]
    configs = [c for c in PROPOSERS if not args.only or c[0] in args.only]
    families = {"bundled": None} | ({"baseline": args.baseline_family} if args.baseline_family else {})
    runs: dict = {(f, c): [] for f in families for c in [PLAIN, PLAIN_OVERLAP, *configs]}
    for _ in range(args.rounds):
        for f, c in runs:
            m, tr = run(items, proposer=c[0], schedule=c[1], draft_len=c[2] or None, **family_kw(families[f], c[0]))
            runs[f, c].append((m, tr))
    speedups = {f: table(f, runs, configs, args.rounds) for f in families}
    if len(families) > 1:
        print("\nspeedup over plain decoding, side by side (medians of per-round ratios):")
        for c in configs:
            name = f"{c[0]}/{c[1]} D={c[2]}"
            print(f"{name:<22} bundled {speedups['bundled'][c]:.2f}x  baseline {speedups['baseline'][c]:.2f}x")


def table(family: str, runs: dict, configs: list, rounds: int) -> dict:
    """Print one family's table; returns its speedup per configuration."""
    plain_runs = runs[family, PLAIN]
    plain = [m["output_tokens_per_s"] for m, _ in plain_runs]
    ahead = [m["output_tokens_per_s"] for m, _ in runs[family, PLAIN_OVERLAP]]
    t_decode = med(median_span_ms(tr, "decode") for _, tr in plain_runs)
    print(f"[{family}] plain: {med(plain):.1f} tok/s, plain_overlap {med(ahead):.1f} tok/s "
          f"({med(a / p for a, p in zip(ahead, plain)):.2f}x), target decode {t_decode:.2f} ms "
          f"(median of {rounds} round(s))")
    print(f"{'proposer':<22} {'AL':>5} {'per-position acceptance':<28} {'tok/s':>7} {'speedup':>8} {'same':>6} "
          f"{'bound':>7}")
    out = {}
    for c in configs:
        proposer, schedule, d = c
        rs = runs[family, c]
        per_step = [spec_step_means(tr) for _, tr in rs]
        emitted, t_verify, t_prop = (med(x[k] for x in per_step) for k in range(3))
        al = med(m["mean_accept_len"] or 1.0 for m, _ in rs)
        # no speculative step (a sampled request may end at its first token): no bound
        bound = emitted / ((t_verify + t_prop) / t_decode) if t_verify + t_prop > 0 else float("nan")
        per_pos = ", ".join(f"{med(m['accept_rate_per_pos'][k] for m, _ in rs):.2f}"
                            for k in range(min(6, len(rs[0][0]["accept_rate_per_pos"]))))
        # each round's speedup against that round's plain run, then the median
        out[c] = med(m["output_tokens_per_s"] / p for (m, _), p in zip(rs, plain))
        same = med(m["output_tokens_per_s"] / p for (m, _), p in zip(rs, plain if schedule == "sync" else ahead))
        print(f"{proposer + '/' + schedule + ' D=' + str(d):<22} {al:>5.2f} {per_pos:<28} "
              f"{med(m['output_tokens_per_s'] for m, _ in rs):>7.1f} {out[c]:>7.2f}x {same:>5.2f}x {bound:>6.2f}x")
    return out


def spec_step_means(trace) -> tuple[float, float, float]:
    """(tokens emitted, verify ms, proposer ms: its draft and fill) per speculative step of
    a batch-1 trace, means over the run."""
    steps = {s.step: s for s in trace.steps if s.kind == "spec"}
    if not steps:
        return 1.0, 0.0, 0.0
    ms = {"verify": 0.0, "draft": 0.0, "fill": 0.0}
    for s in trace.spans:
        if s.step in steps and s.name in ms and s.track.startswith("device:"):
            ms[s.name] += (s.end_ns - s.start_ns) / 1e6
    n = len(steps)
    return (sum(sum(s.num_output) for s in steps.values()) / n, ms["verify"] / n,
            (ms["draft"] + ms["fill"]) / n)


if __name__ == "__main__":
    main()
