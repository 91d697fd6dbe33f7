"""Host cost of the adaptive draft length: scheduler CPU per step, `auto` at D = 0 against plain decoding.

Where no draft length pays (a fast device, a host-bound step), `draft_len="auto"` should run
plain steps as cheaply as plain decoding does: the policy's work between steps -- choosing D,
feeding its cost models the device intervals, its step-overhead estimate -- is host time that
a host-bound step pays in full (and on a GPU it contends for the GIL with the dispatch
thread). This benchmark prices that work in the simulator, which runs the same scheduler and
policy code: it replays `benchmarks/simulator_speed.py`'s workload of the draft sample
(copies of `traces/samples/draft_overlap.jsonl`'s requests of 48 tokens: 2 per concurrent
seat, at least 8) at each concurrency, once as plain decoding under `plain_overlap` and once with the
draft model under `overlap` at `draft_len="auto"` with acceptance `bernoulli:0.05` (drafts
almost never accepted: the policy keeps D = 0), and prints `time.process_time` per simulated
step of each (best of `--repeats` replays after an untimed one) and their difference.

    python benchmarks/policy_overhead.py [--concurrency 1 16] [--repeats 7]
    python benchmarks/policy_overhead.py --baseline ../before   # side by side with another checkout
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_side_by_side_options, best_of, side_by_side  # noqa: E402
from simulator_speed import SAMPLE, workload  # noqa: E402

from specsched.simulator.fit import fit_profile  # noqa: E402
from specsched.simulator.replay import ReplayConfig, replay  # noqa: E402
from specsched.traces.reader import read_trace  # noqa: E402


def configs(concurrency: int) -> dict[str, ReplayConfig]:
    return {"plain": ReplayConfig(proposer="none", schedule="plain_overlap", draft_len=0, concurrency=concurrency),
            "auto": ReplayConfig(draft_len="auto", max_draft_len=4, concurrency=concurrency,
                                 acceptance="bernoulli:0.05")}


def measure(concurrencies: list[int], repeats: int) -> list[dict]:
    sample = read_trace(SAMPLE)
    profile = fit_profile([sample])
    out = []
    for c in concurrencies:
        trace = workload(sample, max(8, 2 * c))
        row: dict = {"concurrency": c}
        for name, cfg in configs(c).items():
            replay(trace, profile, cfg)  # warm-up, untimed
            best, _, _, (metrics, simulated) = best_of(lambda: replay(trace, profile, cfg), repeats)
            row[f"{name}_ms"] = best / metrics["steps"] * 1e3
            row[f"{name}_steps"] = metrics["steps"]
            if name == "auto":
                chosen = [s.draft_len for s in simulated.steps if s.draft_len is not None]
                row["auto_plain_share"] = sum(d == 0 for d in chosen) / max(len(chosen), 1)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=7, help="replays per configuration (best of)")
    add_side_by_side_options(ap)
    args = ap.parse_args()
    if min(args.concurrency) < 1 or args.repeats < 1 or args.rounds < 1:
        ap.error("--concurrency, --repeats and --rounds must be >= 1")
    if args.json:
        print(json.dumps(measure(args.concurrency, args.repeats)))
        return
    head = "ms of scheduler CPU per simulated step (process_time, best of %d replays); draft model, " \
           "auto with acceptance bernoulli:0.05" % args.repeats
    if args.baseline is None:
        print(head)
        print(f"{'concurrency':>11} {'steps':>6} {'plain':>7} {'auto':>7} {'auto-plain':>10} {'auto D=0':>9}")
        for m in measure(args.concurrency, args.repeats):
            print(f"{m['concurrency']:>11} {m['auto_steps']:>6} {m['plain_ms']:>7.3f} {m['auto_ms']:>7.3f} "
                  f"{m['auto_ms'] - m['plain_ms']:>10.3f} {m['auto_plain_share']:>8.0%}")
        return
    cmd = [sys.executable, __file__, "--json", "--repeats", str(args.repeats),
           "--concurrency", *map(str, args.concurrency)]
    runs = side_by_side(cmd, args.baseline, args.rounds)
    print(head + f"; median of {args.rounds} alternating rounds")
    print(f"{'concurrency':>11} {'base plain':>10} {'base auto':>9} {'base extra':>10} {'this plain':>10} "
          f"{'this auto':>9} {'this extra':>10} {'extra ratio':>11}")
    for i, c in enumerate(args.concurrency):
        med = {name: {k: statistics.median(run[i][k] for run in runs[name]) for k in ("plain_ms", "auto_ms")}
               for name in runs}
        extra = {name: statistics.median(run[i]["auto_ms"] - run[i]["plain_ms"] for run in runs[name])
                 for name in runs}
        print(f"{c:>11} {med['baseline']['plain_ms']:>10.3f} {med['baseline']['auto_ms']:>9.3f} "
              f"{extra['baseline']:>10.3f} {med['this']['plain_ms']:>10.3f} {med['this']['auto_ms']:>9.3f} "
              f"{extra['this']:>10.3f} {extra['this'] / extra['baseline']:>10.2f}x")


if __name__ == "__main__":
    main()
