"""Does `tune` pick the right draft length? Simulated speedups against measured ones.

One trace is captured at the largest draft length (`--capture-len`); `tune` replays it at
every draft length of `--draft-lens` and predicts each one's speedup over plain decoding.
Then the engine really runs plain decoding and every draft length on the same workload
(interleaved over `--rounds`, medians), and the two are printed side by side with the draft
length each picks.

    python benchmarks/tune_accuracy.py [--proposer draft] [--schedule sync] [--capture-len 4]
        [--draft-lens 1 2 3 4] [--concurrency 4] [--rounds 2] [--num-requests 8] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import parse_workload, run  # noqa: E402

from specsched.simulator.analysis import tune  # noqa: E402
from specsched.simulator.sweep import available_cpus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proposer", default="draft")
    ap.add_argument("--schedule", default="sync")
    ap.add_argument("--capture-len", type=int, default=4, help="draft length of the captured trace")
    ap.add_argument("--draft-lens", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="real runs per configuration (medians)")
    args, items = parse_workload(ap, 8, 48)
    if max(args.draft_lens) > args.capture_len:
        ap.error("--draft-lens must not exceed --capture-len (acceptance is replayed from the capture)")

    _, trace = run(items, concurrency=args.concurrency, proposer=args.proposer,
                   schedule=args.schedule, draft_len=args.capture_len)
    sim = {r["draft_len"]: r for r in tune(trace, draft_lens=args.draft_lens,
                                           concurrencies=[args.concurrency], jobs=available_cpus())["rows"]}

    configs = [("none", "sync", 0)] + [(args.proposer, args.schedule, d) for d in args.draft_lens]
    tps: dict[int, list[float]] = {d: [] for _, _, d in configs}
    for r in range(args.rounds):
        for proposer, schedule, d in (configs if r % 2 == 0 else configs[::-1]):
            m, _ = run(items, concurrency=args.concurrency, proposer=proposer, schedule=schedule,
                       draft_len=d, trace=False)
            tps[d].append(m["output_tokens_per_s"])
    plain = statistics.median(tps[0])

    print(f"{args.proposer}/{args.schedule}, captured at D={args.capture_len}, concurrency "
          f"{args.concurrency}, {args.num_requests} requests x {args.max_tokens} tokens, "
          f"{args.rounds} real runs per configuration")
    print(f"{'D':>3} {'sim speedup':>12} {'measured':>9} {'error':>7} {'sim AL':>7}")
    measured = {}
    for d in args.draft_lens:
        measured[d] = statistics.median(tps[d]) / plain
        s = sim[d]["sim_speedup"]
        print(f"{d:>3} {s:>11.3f}x {measured[d]:>8.3f}x {abs(s / measured[d] - 1) * 100:>6.1f}% "
              f"{sim[d]['mean_accept_len']:>7.2f}")
    best_sim = max(args.draft_lens, key=lambda d: sim[d]["sim_speedup"])
    best_real = max(args.draft_lens, key=lambda d: measured[d])
    print(f"best draft length: simulated D={best_sim}, measured D={best_real}"
          + ("" if best_sim == best_real else
             f" (measured speedup at the simulated pick: {measured[best_sim]:.3f}x vs {measured[best_real]:.3f}x)"))


if __name__ == "__main__":
    main()
