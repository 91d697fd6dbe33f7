"""Schedules side by side on the bundled model, measured in one run:

1. bubble fraction and throughput of `overlap` (draft model) and `mtp` (MTP head) against
   `sync` with the same proposer, at 8 concurrent requests;
2. speedup over plain decoding at batch 1 and with 8 concurrent requests;
3. tracing overhead: wall time per step with the trace recorder against no tracer.

    python benchmarks/schedules.py [--num-requests 8] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import parse_workload, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="123", help="which parts to run, e.g. 13")
    args, items = parse_workload(ap, 8, 48)

    if "1" in args.sections:
        schedules_vs_sync(items)
    if "2" in args.sections:
        speedup_over_plain(items)
    if "3" in args.sections:
        tracing_overhead(items)


def schedules_vs_sync(items) -> None:
    print("1. schedules at 8 concurrent requests")
    print(f"{'proposer':<8} {'schedule':<14} {'tok/s':>7} {'bubble':>7} {'vs sync':>8}")
    for proposer, d, schedules in (("none", None, ("sync", "plain_overlap")), ("draft", 3, ("sync", "overlap")),
                                   ("mtp", 1, ("sync", "mtp"))):
        base = None
        for sched in schedules:
            m, _ = run(items, concurrency=8, proposer=proposer, schedule=sched, draft_len=d)
            base = base or m["output_tokens_per_s"]
            print(f"{proposer:<8} {sched:<14} {m['output_tokens_per_s']:>7.1f} {m['bubble_fraction']:>7.3f} "
                  f"{m['output_tokens_per_s'] / base:>7.2f}x")



def speedup_over_plain(items) -> None:
    print("\n2. speedup over plain decoding")
    for conc in (1, 8):
        plain, _ = run(items, concurrency=conc, proposer="none", schedule="sync")
        row = [f"concurrency {conc}: plain {plain['output_tokens_per_s']:.1f} tok/s"]
        for proposer, sched, d in (("draft", "overlap", 3), ("mtp", "mtp", 1), ("ngram", "sync", 4)):
            m, _ = run(items, concurrency=conc, proposer=proposer, schedule=sched, draft_len=d)
            row.append(f"{proposer}/{sched} {m['output_tokens_per_s'] / plain['output_tokens_per_s']:.2f}x")
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
