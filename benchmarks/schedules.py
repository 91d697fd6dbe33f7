"""Schedules side by side on the bundled model, measured in one run:

1. bubble fraction and throughput of `overlap` (draft model, EAGLE tree), `mtp` (draft model,
   MTP head, EAGLE tree) against `sync` with the same proposer, at 8 concurrent requests;
2. speedup over plain decoding at batch 1 and with 8 concurrent requests;
3. tracing overhead: wall time per step with the trace recorder against no tracer.

    python benchmarks/schedules.py [--num-requests 8] [--max-tokens 48] [--rounds 3] [--baseline-family DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import family_kw, med, parse_workload, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="123", help="which parts to run, e.g. 13")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of parts 1 and 2 (each configuration once a "
                    "round, in order); figures are medians over rounds, ratios medians of per-round ratios")
    ap.add_argument("--baseline-family", type=Path, default=None,
                    help="also measure parts 1 and 2 on another model family (target/, draft/, mtp/ as in "
                    "runtime/bundled), in the same rounds")
    args, items = parse_workload(ap, 8, 48)
    families = {"bundled": None} | ({"baseline": args.baseline_family} if args.baseline_family else {})
    if "1" in args.sections:
        schedules_vs_sync(items, args.rounds, families)
    if "2" in args.sections:
        speedup_over_plain(items, args.rounds, families)
    if "3" in args.sections:
        tracing_overhead(items)



def schedules_vs_sync(items, rounds: int, families: dict) -> None:
    print(f"1. schedules at 8 concurrent requests (median of {rounds} round(s))")
    groups = (("none", None, ("sync", "plain_overlap")), ("draft", 3, ("sync", "overlap", "eager_fill")),
              ("mtp", 1, ("sync", "eager_fill")), ("eagle", 3, ("sync", "overlap", "eager_fill")))
    runs: dict = {(f, p, s): [] for f in families for p, _, scheds in groups for s in scheds}
    for _ in range(rounds):
        for f, fam in families.items():
            for proposer, d, schedules in groups:
                for sched in schedules:
                    runs[f, proposer, sched].append(run(items, concurrency=8, proposer=proposer, schedule=sched,
                                                        draft_len=d, **family_kw(fam, proposer))[0])
    for f in families:
        print(f"[{f}]\n{'proposer':<8} {'schedule':<14} {'tok/s':>7} {'bubble':>7} {'vs sync':>8}")
        for proposer, _, schedules in groups:
            base = runs[f, proposer, schedules[0]]
            for sched in schedules:
                ms = runs[f, proposer, sched]
                ratio = med(m["output_tokens_per_s"] / b["output_tokens_per_s"] for m, b in zip(ms, base))
                print(f"{proposer:<8} {sched:<14} {med(m['output_tokens_per_s'] for m in ms):>7.1f} "
                      f"{med(m['bubble_fraction'] for m in ms):>7.3f} {ratio:>7.2f}x")


def speedup_over_plain(items, rounds: int, families: dict) -> None:
    print(f"\n2. speedup over plain decoding (median of {rounds} round(s))")
    configs = (("none", "sync", None), ("draft", "overlap", 3), ("mtp", "eager_fill", 1), ("eagle", "eager_fill", 3),
               ("ngram", "sync", 4))
    for conc in (1, 8):
        runs: dict = {(f, c): [] for f in families for c in configs}
        for _ in range(rounds):
            for f, fam in families.items():
                for c in configs:
                    runs[f, c].append(run(items, concurrency=conc, proposer=c[0], schedule=c[1], draft_len=c[2],
                                          **family_kw(fam, c[0]))[0])
        for f in families:
            plain = runs[f, configs[0]]
            row = [f"[{f}] concurrency {conc}: plain {med(m['output_tokens_per_s'] for m in plain):.1f} tok/s"]
            for c in configs[1:]:
                ratio = med(m["output_tokens_per_s"] / p["output_tokens_per_s"] for m, p in zip(runs[f, c], plain))
                row.append(f"{c[0]}/{c[1]} {ratio:.2f}x")
            print("  " + ", ".join(row))


def tracing_overhead(items) -> None:
    print("\n3. tracing overhead (draft/overlap, 8 concurrent; wall ms per step, 3 alternating pairs)")
    on, off = [], []
    for _ in range(3):
        m, _ = run(items, concurrency=8, proposer="draft", schedule="overlap", draft_len=3, trace=False)
        off.append(m["duration_s"] * 1e3 / m["steps"])
        m, tr = run(items, concurrency=8, proposer="draft", schedule="overlap", draft_len=3)
        on.append(m["duration_s"] * 1e3 / m["steps"])
    print(f"  without tracer {min(off):.2f} ms/step, with recorder {min(on):.2f} ms/step "
          f"(ratio {min(on) / min(off):.3f})")


if __name__ == "__main__":
    main()
