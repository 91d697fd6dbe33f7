"""Simulator fidelity and speed on the bundled model, captured and replayed in one run.

For each pair of schedules (draft model: sync and overlap; MTP head: sync and mtp) it runs
the engine `--rounds` times per schedule, alternating A B B A A B ..., so slow drift of a
shared machine hits both schedules alike, and reports:

- validate: each trace replayed under its own configuration with costs fitted on that trace
  (median over the rounds of the step-by-step error, the step-time distribution error, the
  makespan, tokens/s and bubble errors);
- the noise floor: the same step-by-step and makespan comparison between two *real* runs of
  the same configuration -- what no simulator with deterministic costs can beat;
- cross-schedule prediction: costs fitted on the traces of one schedule, the other schedule
  replayed and compared with its measured median makespan, and whether the simulator ranks
  the two schedules in the measured order; next to it the device idle time per speculative
  step, predicted and measured -- what the schedule itself changes, free of how fast the
  device happened to run in each round;
- speed: the measured run's duration over the replay's CPU time (the replay alone, best of
  3; fitting a profile is done once per machine and reused; CPU time, because wall time on a
  shared machine includes other tenants' work), per schedule and, with `--speed-concurrency`,
  for larger batches (the replay's cost per step hardly grows with the batch, a CPU
  forward's does).

With `--paced FACTOR` every run uses a paced device (`specsched.runtime.devices.paced`): the real ops
run, then the worker sleeps until each op took FACTOR times what a profile fitted on one
unpaced calibration run prices it at. Device speed then no longer drifts between steps or
runs, so the errors left are the simulator's own (host stages, launches and syncs still run
for real); the table's floors show how much of the unpaced errors was the machine's.

    python benchmarks/simulator_fidelity.py [--num-requests 8] [--max-tokens 48] [--concurrency 4]
        [--rounds 3] [--speed-concurrency 16 32] [--paced 2.0]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bundled_items, parse_workload, run  # noqa: E402

from specsched.runtime.devices.paced import PACE_FEATURES, paced_ns  # noqa: E402
from specsched.simulator.analysis import validate  # noqa: E402
from specsched.simulator.sweep import available_cpus  # noqa: E402
from specsched.simulator.fit import fit_profile  # noqa: E402
from specsched.simulator.replay import ReplayConfig, replay  # noqa: E402


def step_match_err(a, b) -> float:
    """Median step-by-step |error| % of run b against run a."""
    ra = sorted(a.steps, key=lambda s: s.step)
    rb = sorted(b.steps, key=lambda s: s.step)
    n = min(len(ra), len(rb))
    e = [abs((y.end_ns - y.start_ns) - (x.end_ns - x.start_ns)) / (x.end_ns - x.start_ns) * 100
         for x, y in zip(ra[:n], rb[:n])]
    return float(np.median(e)) if e else float("nan")


def idle_per_step_ms(trace) -> float:
    """Mean device idle per speculative step (step time minus device busy time): what a
    schedule changes, apart from how fast the device itself ran that run."""
    busy: dict[int, int] = {}
    for s in trace.spans:
        if s.track != "host":
            busy[s.step] = busy.get(s.step, 0) + s.end_ns - s.start_ns
    steps = [s for s in trace.steps if s.kind == "spec"]
    return float(np.mean([(s.end_ns - s.start_ns) - busy.get(s.step, 0) for s in steps])) / 1e6 if steps else float("nan")


def pace_from_profile(profile, factor: float) -> dict:
    """A paced device's op durations: `factor` x the fitted device models (a verify launch is
    paced as a whole: its verify and accept models summed)."""
    pace = {}
    for name, m in profile.device.items():
        if name == "accept":
            continue
        coef = dict(m.coef)
        if name == "verify" and "accept" in profile.device:
            for f, c in profile.device["accept"].coef.items():
                coef[f] = coef.get(f, 0.0) + c
        pace[name] = {f: factor * c for f, c in coef.items() if c and f in PACE_FEATURES}
    return pace


def paced_engine(pace: dict):
    """An AsyncEngine class whose worker is paced by `pace`."""
    from specsched.runtime.devices import WorkerSpec
    from specsched.runtime.engine import AsyncEngine

    class PacedEngine(AsyncEngine):
        def worker_spec(self):
            return WorkerSpec("specsched.runtime.devices.paced:PacedWorker", {"inner": super().worker_spec(), "pace": pace})

    return PacedEngine


def overrun_pct(trace, pace: dict) -> float:
    """% of device launches that took over 0.5 ms longer than their pace (ran late)."""
    ops: dict = {}
    for s in trace.spans:
        if s.track != "host" and "launch_id" in s.attrs:
            o = ops.setdefault(s.attrs["launch_id"], [s.start_ns, s.end_ns, s.name, s.attrs])
            o[0], o[1] = min(o[0], s.start_ns), max(o[1], s.end_ns)
    late = sum(1 for a, b, name, attrs in ops.values() if b - a > paced_ns(pace, name, attrs) + 500_000)
    return 100.0 * late / max(len(ops), 1)


def replay_speed(trace, profile, duration_s: float, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        replay(trace, profile)
        best = min(best, time.process_time() - t0)
    return duration_s / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="engine runs per schedule (>= 2 for the noise floor)")
    ap.add_argument("--pairs", nargs="*", default=["draft:sync:overlap:3", "mtp:sync:eager_fill:1"],
                    help="proposer:scheduleA:scheduleB:D")
    ap.add_argument("--speed-concurrency", type=int, nargs="*", default=[16, 32],
                    help="also time replays of draft/overlap runs at these concurrencies (2x requests)")
    ap.add_argument("--paced", type=float, default=0.0, metavar="FACTOR",
                    help="run on a paced device: ops take FACTOR x their fitted cost (0: off)")
    args, items = parse_workload(ap, 8, 48)
    if args.paced and args.paced < 1.0:
        ap.error("--paced must be >= 1 (a pace below the real cost cannot be kept)")
    print(f"{args.num_requests} requests x {args.max_tokens} tokens, concurrency {args.concurrency}, "
          f"{args.rounds} rounds per schedule (medians over rounds)"
          + (f", paced device at {args.paced}x the fitted costs" if args.paced else ""))
    head = (f"{'trace':<14} {'step err p50':>12} {'p90':>6} {'dist p50':>8} {'dist p90':>8} {'makespan':>8} "
            f"{'tok/s':>6} {'bubble pp':>9} | {'floor step':>10} {'floor mksp':>10} | {'x real time':>11}")
    print(head)
    for pair in args.pairs:
        proposer, sa, sb, d = pair.split(":")
        factory = pace = None
        if args.paced:  # calibrate: one unpaced run prices every op the pair launches
            _, cal = run(items, concurrency=args.concurrency, proposer=proposer, schedule=sa, draft_len=int(d))
            pace = pace_from_profile(fit_profile([cal]), args.paced)
            factory = paced_engine(pace)
        runs: dict[str, list] = {sa: [], sb: []}
        for r in range(args.rounds):
            for sched in ((sa, sb) if r % 2 == 0 else (sb, sa)):
                runs[sched].append(run(items, concurrency=args.concurrency, proposer=proposer,
                                       schedule=sched, draft_len=int(d), engine_factory=factory))
        measured, profiles = {}, {}
        for sched in (sa, sb):
            ms = [m for m, _ in runs[sched]]
            trs = [tr for _, tr in runs[sched]]
            measured[sched] = statistics.median(m["duration_s"] for m in ms)
            profiles[sched] = fit_profile(trs)
            vs = [validate(tr, jobs=available_cpus()) for tr in trs]

            def med(f):
                vals = [f(v) for v in vs]
                return statistics.median(x for x in vals if x is not None) if any(x is not None for x in vals) else float("nan")

            floor_step = statistics.median(step_match_err(trs[i], trs[i + 1]) for i in range(len(trs) - 1)) \
                if len(trs) > 1 else float("nan")
            durs = [m["duration_s"] for m in ms]
            floor_mk = statistics.median(abs(durs[i + 1] - durs[i]) / durs[i] * 100 for i in range(len(durs) - 1)) \
                if len(durs) > 1 else float("nan")
            speed = replay_speed(trs[0], fit_profile([trs[0]]), ms[0]["duration_s"])
            print(f"{proposer + '/' + sched:<14} {med(lambda v: v['step_time_err_pct']['p50']):>11.2f}% "
                  f"{med(lambda v: v['step_time_err_pct']['p90']):>5.1f}% "
                  f"{med(lambda v: v['step_time_dist_err_pct']['p50']):>7.2f}% "
                  f"{med(lambda v: v['step_time_dist_err_pct']['p90']):>7.2f}% "
                  f"{med(lambda v: v['makespan_err_pct']):>7.2f}% "
                  f"{med(lambda v: v['output_tokens_per_s_err_pct']):>5.2f}% "
                  f"{med(lambda v: v['bubble_fraction_err_pp']):>9.2f} | "
                  f"{floor_step:>9.2f}% {floor_mk:>9.2f}% | {speed:>10.0f}x")
            if pace is not None:
                print(f"  paced device: {statistics.median(overrun_pct(tr, pace) for tr in trs):.1f}% of "
                      f"{proposer}/{sched} launches ran over their pace (median over rounds)")
        sim = {}
        for src, dst in ((sa, sb), (sb, sa)):
            trace = runs[src][0][1]
            pred, pred_tr = replay(trace, profiles[src], ReplayConfig(schedule=dst))
            own, _ = replay(trace, profiles[src], ReplayConfig(schedule=src))
            sim[src] = (own["duration_s"], pred["duration_s"])
            err = abs(pred["duration_s"] - measured[dst]) / measured[dst] * 100
            idle_real = statistics.median(idle_per_step_ms(tr) for _, tr in runs[dst])
            print(f"  predict {proposer}/{dst} from the {src} traces: makespan {pred['duration_s']:.3f} s vs "
                  f"measured median {measured[dst]:.3f} s ({err:.2f}% error); device idle per step "
                  f"{idle_per_step_ms(pred_tr):.2f} ms vs {idle_real:.2f} ms")
        faster_real = sa if measured[sa] < measured[sb] else sb
        faster_sim = sa if sim[sa][0] < sim[sa][1] else sb
        print(f"  measured faster: {faster_real} ({max(measured.values()) / min(measured.values()):.3f}x); "
              f"simulator ranks them {'the same' if faster_real == faster_sim else 'DIFFERENTLY'}")
    for conc in args.speed_concurrency:
        m, tr = run(bundled_items(2 * conc, args.max_tokens), concurrency=conc, proposer="draft",
                    schedule="overlap", draft_len=3)
        speed = replay_speed(tr, fit_profile([tr]), m["duration_s"])
        print(f"replay speed, draft/overlap at concurrency {conc}: {m['duration_s'] / len(tr.steps) * 1e3:.1f} ms "
              f"per real step, {speed:.0f}x real time")


if __name__ == "__main__":
    main()
