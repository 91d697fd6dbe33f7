"""A simulator sweep in one process against the same sweep fanned out over processes.

`ab` (paired replicates) and `tune` (draft length x concurrency grid) on one trace, each run
with `jobs=1` and with `--jobs` worker processes, alternating over `--rounds`; prints the wall
time of each, the median ratio serial / fanned out, and whether the results are identical
(they must be: every replay is seeded on its own).

    python benchmarks/sweep_fanout.py [--trace traces/samples/draft_sync.jsonl]
        [--replicates 12] [--rounds 3] [--jobs N (default: the available CPUs)]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specsched.simulator.analysis import ab, tune
from specsched.simulator.fit import fit_profile
from specsched.simulator.replay import ReplayConfig
from specsched.simulator.sweep import available_cpus
from specsched.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=ROOT / "traces" / "samples" / "draft_sync.jsonl")
    ap.add_argument("--replicates", type=int, default=12, help="ab replicate pairs")
    ap.add_argument("--draft-lens", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=available_cpus())
    args = ap.parse_args()
    trace = read_trace(args.trace)
    profile = fit_profile([trace])
    sweeps = {
        "ab": lambda jobs: ab(trace, ReplayConfig(schedule="sync"), ReplayConfig(schedule="overlap"),
                              profile=profile, replicates=args.replicates, jobs=jobs),
        "tune": lambda jobs: tune(trace, profile=profile, draft_lens=args.draft_lens,
                                  concurrencies=args.concurrencies, jobs=jobs),
    }
    print(f"{args.trace.name}: {len(trace.steps)} steps; {args.jobs} jobs against 1, {args.rounds} rounds")
    print(f"{'sweep':6} {'replays':>7} {'1 job s':>8} {f'{args.jobs} jobs s':>9} {'ratio':>6}  identical")
    for name, sweep in sweeps.items():
        serial, fanned, ratios, same = [], [], [], True
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            r1 = sweep(1)
            t1 = time.perf_counter()
            rj = sweep(args.jobs)
            t2 = time.perf_counter()
            serial.append(t1 - t0)
            fanned.append(t2 - t1)
            ratios.append((t1 - t0) / (t2 - t1))
            same &= json.dumps(r1, sort_keys=True) == json.dumps(rj, sort_keys=True)
        replays = 2 * args.replicates if name == "ab" else len(args.concurrencies) * (1 + len(args.draft_lens))
        print(f"{name:6} {replays:>7} {statistics.median(serial):>8.2f} {statistics.median(fanned):>9.2f} "
              f"{statistics.median(ratios):>5.2f}x  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
