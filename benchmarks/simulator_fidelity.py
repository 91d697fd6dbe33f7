"""Simulator fidelity and speed on the bundled model, captured and replayed in one run.

For each schedule (draft model: sync and overlap; MTP head: sync and mtp) it captures a
trace, replays it under its own configuration (`validate`) and prints the per-step and
makespan errors; it predicts `overlap` from the `sync` trace and the reverse (costs fitted on
the source trace only) and compares with the measured runs, including whether the simulator
ranks the schedules in the measured order; and it times the replay against the real run.

    python benchmarks/simulator_fidelity.py [--num-requests 8] [--max-tokens 48] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bundled_items, run  # noqa: E402

from simulator.analysis import validate  # noqa: E402
from simulator.costs import fit_profile  # noqa: E402
from simulator.replay import ReplayConfig, replay  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pairs", nargs="*", default=["draft:sync:overlap:3", "mtp:sync:mtp:1"],
                    help="proposer:scheduleA:scheduleB:D")
    args = ap.parse_args()
    items = bundled_items(args.num_requests, args.max_tokens)
    print(f"{args.num_requests} requests x {args.max_tokens} tokens, concurrency {args.concurrency}")
    print(f"{'trace':<16} {'step err p50':>12} {'p90':>7} {'makespan':>9} {'tok/s':>7} {'bubble pp':>9} {'x real time':>11}")
    for pair in args.pairs:
        proposer, sa, sb, d = pair.split(":")
        traces, measured = {}, {}
        for sched in (sa, sb):
            m, tr = run(items, concurrency=args.concurrency, proposer=proposer, schedule=sched, draft_len=int(d))
            traces[sched], measured[sched] = tr, m
            t0 = time.perf_counter()
            v = validate(tr)
            sim_s = time.perf_counter() - t0
            print(f"{proposer + '/' + sched:<16} {v['step_time_err_pct']['p50']:>11.2f}% "
                  f"{v['step_time_err_pct']['p90']:>6.1f}% {v['makespan_err_pct']:>8.2f}% "
                  f"{v['output_tokens_per_s_err_pct']:>6.2f}% {v['bubble_fraction_err_pp'] or 0:>9.2f} "
                  f"{m['duration_s'] / sim_s:>10.0f}x")
        for src, dst in ((sa, sb), (sb, sa)):
            pred, _ = replay(traces[src], fit_profile([traces[src]]), ReplayConfig(schedule=dst))
            real = measured[dst]
            err = abs(pred["duration_s"] - real["duration_s"]) / real["duration_s"] * 100
            print(f"  predict {proposer}/{dst} from the {src} trace: makespan {pred['duration_s']:.3f} s vs "
                  f"measured {real['duration_s']:.3f} s ({err:.2f}% error)")
        order_real = measured[sa]["duration_s"] < measured[sb]["duration_s"]
        pa, _ = replay(traces[sa], fit_profile([traces[sa]]))
        pb, _ = replay(traces[sa], fit_profile([traces[sa]]), ReplayConfig(schedule=sb))
        order_sim = pa["duration_s"] < pb["duration_s"]
        faster = sa if order_real else sb
        print(f"  measured faster: {faster}; simulator ranks them {'the same' if order_real == order_sim else 'DIFFERENTLY'}")


if __name__ == "__main__":
    main()
