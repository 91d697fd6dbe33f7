"""The adaptive draft length against every fixed one, on the bundled models and workload.

For each proposer (draft model and MTP head under `mtp`; `--proposers ngram` adds
the n-gram lookup under `sync`: each under its default schedule) and each concurrency
(closed loop; output lengths spread around `--max-tokens`, see `lengths`), engine output
tokens/s of `draft_len="auto"` (up to `--max-draft-len`) and of every fixed D in 0..max (D = 0:
plain decoding under `plain_overlap`, its fastest schedule), in interleaved rounds (each round
runs every configuration once, in a rotated order), medians. Per proposer it prints auto's
ratio to the best fixed D at each concurrency and the geometric mean over the concurrencies of
auto and of each fixed D. Then, per proposer and concurrency, one more auto run with its trace,
replayed by the simulator (`validate`: the trace's own fitted costs): the makespan error, with
the policy deciding in the replay and with each step's D taken from the run
(simulator/follow.py).

    python benchmarks/adaptive.py [--concurrency 1 4 16 64] [--rounds 3] [--max-tokens 32]
    python benchmarks/adaptive.py --replay-only --save-traces DIR   # the replays alone, traces kept
    python benchmarks/adaptive.py --device cuda --attention flashinfer --dtype bfloat16   # on a GPU
    python benchmarks/adaptive.py --baseline ../before   # also `auto` of another checkout's policy
    python benchmarks/adaptive.py --synthetic 1.5 2.5 3.5 transition --proposers mtp   # forced acceptance

With `--synthetic` each setting gets its own table: an acceptance length AL forces every
verify's acceptance to vLLM's minimum-variance rates of that length at the longest D
(`acceptance="synthetic"`; a shorter D keeps the first of those rates; D = 0 runs plain), so the draft length is judged at the acceptance a production model
reaches, not the bundled proposers'; `transition` runs the workload in four phases of 2 x
concurrency requests (at least a quarter of `--min-requests`) whose own acceptance lengths
alternate 1.5, 3.5, 1.5, 3.5 (`synthetic_acceptance_rates` per request, as the bundled
transition workload), what an adaptive draft length must follow. After each such table, where
speculation pays: per concurrency the measured speedup of the best fixed D over plain decoding,
beside the NVIDIA formula's best (`simulator.analysis.formula_speedup`, as `tune` prices it) on
device costs fitted from one traced run at D = 0 and one at the longest D.

With `--baseline CHECKOUT` (e.g. a git worktree of an earlier commit) every round also runs
`auto` with that checkout's code, in a process of its own, in the same rotated order: the
column `auto@base`, and its ratio to the best fixed D next to auto's.

With two rounds or more a second ratio is printed, `held out`: the largest of several noisy
medians overstates the length it picks (the winner's curse: where the fixed lengths are within
the machine's noise of each other, whichever had the luckiest rounds is "best"), so auto over
the best of the medians reads low even for a policy that always ran the truly best length. In
`held out` each round's auto is set against that same round's fixed D ranked best by the
*other* rounds' medians (`held_out_ratio`): the pick is independent of the round it is judged
on, and the pair ran minutes apart. The median over rounds, and the geometric mean of those
over the concurrencies.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_device_options, baseline_env, bundled_items, device_fields, run, run_json  # noqa: E402
from specsched.scheduler.wiring import NATURAL_SCHEDULE  # noqa: E402

PROPOSERS = {k: NATURAL_SCHEDULE[k] for k in ("draft", "mtp", "ngram")}  # each under its default schedule
DEFAULT_PROPOSERS = ["draft", "mtp"]  # the model proposers; `--proposers ngram` adds the lookup


def lengths(max_tokens: int, n: int) -> list[int]:
    """Request i's output length: lo + (37 i mod (hi - lo + 1)) with lo = max_tokens / 2 and
    hi = 3 max_tokens / 2 -- spread around max_tokens, so that requests finish and are admitted
    at different steps as in a served workload (with equal lengths every configuration but
    plain decoding would admit its next requests in a trickle of mixed steps)."""
    lo = max(2, max_tokens // 2)
    hi = max(lo, 3 * max_tokens // 2)
    return [lo + (37 * i) % (hi - lo + 1) for i in range(n)]


def workload(concurrency: int, max_tokens: int, min_requests: int):
    """max(min_requests, 2 x concurrency) requests: the bundled prompts in order (repeated),
    with `lengths`."""
    items = bundled_items(64, max_tokens)
    n = max(min_requests, 2 * concurrency)
    return [replace(items[i % len(items)], params=items[i % len(items)].params.model_copy(update={"max_tokens": t}))
            for i, t in enumerate(lengths(max_tokens, n))]


PHASES = (1.5, 3.5, 1.5, 3.5)  # `transition`'s acceptance lengths, a phase each


def rates(length: float, max_d: int) -> list[float]:
    """The minimum-variance per-position rates of acceptance length `length` at D = max_d."""
    from specsched.scheduler.synthetic import SyntheticAcceptance

    return SyntheticAcceptance(synthetic_acceptance_length=length).rates(max_d).tolist()


def transition_workload(concurrency: int, max_tokens: int, min_requests: int, max_d: int):
    """`workload`'s requests in len(PHASES) phases of max(2 x concurrency, min_requests / 4)
    requests each, every request of phase k with its own synthetic acceptance of length
    PHASES[k] at D = max_d."""
    per = max(2 * concurrency, -(-min_requests // len(PHASES)))
    items = workload(concurrency, max_tokens, per * len(PHASES))[: per * len(PHASES)]
    return [replace(it, params=it.params.model_copy(update={"synthetic_acceptance_rates": rates(PHASES[i // per], max_d)}))
            for i, it in enumerate(items)]


def configs(proposer: str, max_d: int, where: dict | None = None, synthetic: str | None = None) -> dict[str, dict]:
    """EngineConfig fields of each configuration; `where`: the device fields every one shares;
    `synthetic`: an acceptance length every speculative one forces, or "transition" (each
    request's own; the engine's default is the phases' mean)."""
    out = {"D=0": {"proposer": "none", "schedule": "plain_overlap"}}
    for d in range(1, max_d + 1):
        out[f"D={d}"] = {"proposer": proposer, "schedule": PROPOSERS[proposer], "draft_len": d}
    out["auto"] = {"proposer": proposer, "schedule": PROPOSERS[proposer], "draft_len": "auto", "max_draft_len": max_d}
    if synthetic is not None:  # as rates at the longest D, which a shorter one truncates
        length = statistics.mean(PHASES) if synthetic == "transition" else float(synthetic)
        forced = {"acceptance": "synthetic", "synthetic_acceptance_rates": rates(length, max_d)}
        out = {name: cfg | (forced if name != "D=0" else {}) for name, cfg in out.items()}
    return {name: cfg | (where or {}) for name, cfg in out.items()}


def items_for(synthetic: str | None, concurrency: int, max_tokens: int, min_requests: int, max_d: int):
    """The requests one configuration runs at `concurrency`."""
    if synthetic == "transition":
        return transition_workload(concurrency, max_tokens, min_requests, max_d)
    return workload(concurrency, max_tokens, min_requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--max-draft-len", type=int, default=4)
    ap.add_argument("--proposers", nargs="+", choices=list(PROPOSERS), default=DEFAULT_PROPOSERS)
    ap.add_argument("--no-replay", action="store_true", help="skip the simulator's replay of the auto traces")
    ap.add_argument("--replay-only", action="store_true", help="skip the tokens/s table: only the auto runs "
                    "with their traces and the simulator's replays of them")
    ap.add_argument("--save-traces", type=Path, help="write the auto traces to this folder "
                    "(auto_<proposer>_c<concurrency>.jsonl), e.g. to validate them with another checkout")
    ap.add_argument("--baseline", type=Path, help="another checkout whose `auto` runs side by side (auto@base)")
    ap.add_argument("--synthetic", nargs="+", metavar="AL|transition",
                    help="forced acceptance: a table per acceptance length (bonus token counted), and with "
                         "`transition` one for the phased workload")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one run of this configuration, its tok/s as JSON
    add_device_options(ap)
    args = ap.parse_args()
    if args.one:
        one_run(args)
        return
    if min(args.concurrency) < 1 or args.rounds < 1 or args.max_draft_len < 1 or args.max_tokens < 2:
        ap.error("--concurrency, --rounds and --max-draft-len must be >= 1, --max-tokens >= 2")
    if args.replay_only and args.no_replay:
        ap.error("--replay-only and --no-replay leave nothing to run")
    for value in args.synthetic or ():
        try:
            ok = value == "transition" or 1.0 <= float(value) <= args.max_draft_len + 1
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"--synthetic takes acceptance lengths in [1, --max-draft-len + 1] or 'transition', got {value!r}")
    if args.synthetic and args.baseline:
        ap.error("--synthetic and --baseline: run the baseline's policy without --synthetic")
    spread = lengths(args.max_tokens, 1 + 2 * args.max_tokens)
    print(("the auto runs' replays alone" if args.replay_only else
           f"output tokens/s, median of {args.rounds} interleaved rounds")
          + f"; output lengths {min(spread)}..{max(spread)} tokens (see `lengths`)")
    with tempfile.TemporaryDirectory() as tmp:
        report(args, None if args.baseline is None else baseline_env(args.baseline, Path(tmp)))


def report(args, base_env: dict | None) -> None:
    """Every proposer's table and the simulator's replays of its auto runs; `base_env`: the
    environment `--baseline`'s runs take (None: no baseline)."""
    for proposer in args.proposers:
        for synthetic in args.synthetic or [None]:
            report_one(args, proposer, synthetic, base_env)


def report_one(args, proposer: str, synthetic: str | None, base_env: dict | None) -> None:
    """One proposer's table (at one synthetic setting) and the replays of its auto runs."""
    from specsched.simulator.analysis import validate
    from specsched.traces.recorder import write_trace

    cfgs = configs(proposer, args.max_draft_len, device_fields(args), synthetic)
    names = list(cfgs) + ([BASE] if base_env else [])
    table: dict[int, dict[str, float]] = {}
    held: dict[int, dict[str, float | None]] = {}  # auto (and auto@base) / the held-out best fixed D
    for c in [] if args.replay_only else args.concurrency:
        items = items_for(synthetic, c, args.max_tokens, args.min_requests, args.max_draft_len)
        got: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                if name == BASE:
                    got[name].append(baseline_run(args, proposer, c, base_env))
                    continue
                m, _ = run(items, concurrency=c, warmup=1, trace=False, **cfgs[name])
                got[name].append(m["output_tokens_per_s"])
        table[c] = {n: statistics.median(v) for n, v in got.items()}
        held[c] = {n: held_out_ratio(got, n, [f for f in got if f not in AUTOS]) for n in got if n in AUTOS}
    what = "" if synthetic is None else (", synthetic acceptance: transition (AL " + " / ".join(map(str, PHASES))
                                         + ")" if synthetic == "transition" else f", synthetic AL {synthetic}")
    print(f"\n{proposer} ({PROPOSERS[proposer]}{what}):")
    if table:
        print_table(table, names, held)
    if args.no_replay:
        return
    errs, pays = [], []
    for c in args.concurrency:
        items = items_for(synthetic, c, args.max_tokens, args.min_requests, args.max_draft_len)
        _, trace = run(items, concurrency=c, warmup=1, trace=True, **cfgs["auto"])
        if args.save_traces is not None:
            args.save_traces.mkdir(parents=True, exist_ok=True)
            tag = "" if synthetic is None else f"_synthetic_{synthetic}"
            write_trace(trace, args.save_traces / f"auto_{proposer}{tag}_c{c}.jsonl")
        try:
            v = validate(trace, replicates=1)
        except ValueError as exc:
            # e.g. a run whose policy, having learned its costs in the warm-up pass, never
            # drafted in the measured one: no draft launch to fit the replay's costs from
            errs.append(f"c={c}: not replayable ({exc})")
            continue
        counts = v["real"]["draft_len_counts"]
        errs.append(f"c={c}: makespan {v['makespan_err_pct']:+.2f}%, each step's D as captured "
                    f"{v['makespan_err_followed_pct']:+.2f}% (steps by D: "
                    + ", ".join(f"{d}:{n}" for d, n in counts.items()) + ")")
        if synthetic is not None and c in table:
            pays.append(speculation_pays(items, c, table[c], cfgs, args.max_draft_len))
    print("  simulator replaying the auto traces: " + "; ".join(errs))
    if pays:
        print("  where speculation pays (speedup of the best fixed D over D=0): measured; the NVIDIA formula "
              "T_verif(B) AL / (T_verif(B(1+D)) + T_draft) on costs fitted from traced runs at D=0 and the longest D")
        for line in pays:
            print("    " + line)


def speculation_pays(items, c: int, row: dict[str, float], cfgs: dict[str, dict], max_d: int) -> str:
    """One line: at concurrency c, the measured speedup of the best fixed D over plain decoding
    against the NVIDIA formula's best over D = 1..max_d (`formula_speedup`, as `tune` prices it)
    on device costs fitted from two traced runs of the same requests: plain decoding and D = max_d."""
    import numpy as np

    from specsched.simulator.analysis import accept_len, formula_speedup
    from specsched.simulator.fit import fit_profile

    fixed = {int(n[2:]): v for n, v in row.items() if n.startswith("D=")}
    best = max((d for d in fixed if d), key=fixed.get)
    _, plain = run(items, concurrency=c, warmup=1, trace=True, **cfgs["D=0"])
    _, spec = run(items, concurrency=c, warmup=1, trace=True, **cfgs[f"D={max_d}"])
    profile = fit_profile([plain, spec])
    kv_mean = float(np.mean([r.prompt_len for r in spec.requests]))
    h = spec.header
    formula = {d: formula_speedup(profile, h.proposer, h.schedule, c, d, accept_len(spec, d), kv_mean)
               for d in range(1, max_d + 1)}
    pick = max((d for d in formula if formula[d]), key=formula.get, default=None)
    predicted = "-" if pick is None else f"{formula[pick]:.2f}x at D={pick}"
    return (f"c={c}: measured {fixed[best] / fixed[0]:.2f}x at D={best} "
            f"({'pays' if fixed[best] > fixed[0] else 'does not pay'}); formula {predicted}")


BASE = "auto@base"  # the baseline checkout's auto (`--baseline`)
AUTOS = ("auto", BASE)


def held_out_ratio(got: dict[str, list[float]], auto: str, fixed: list[str]) -> float | None:
    """Median over rounds r of `got[auto][r]` / `got[best_r][r]`, where best_r is the fixed
    configuration with the highest median over the rounds other than r (None with one round):
    the best fixed D picked on data independent of the round it is compared in."""
    rounds = len(got[auto])
    if rounds < 2:
        return None
    ratios = []
    for r in range(rounds):
        others = {n: statistics.median(v[:r] + v[r + 1:]) for n, v in got.items() if n in fixed}
        best = max(others, key=others.get)
        ratios.append(got[auto][r] / got[best][r])
    return statistics.median(ratios)


def one_run(args) -> None:
    """`--one NAME`: one run of configuration NAME of the first proposer at the first
    concurrency; its output tokens/s as JSON on the last line (a `--baseline` process)."""
    proposer, c = args.proposers[0], args.concurrency[0]
    cfg = configs(proposer, args.max_draft_len, device_fields(args))[args.one]
    m, _ = run(workload(c, args.max_tokens, args.min_requests), concurrency=c, warmup=1, trace=False, **cfg)
    print(json.dumps(m["output_tokens_per_s"]))


def baseline_run(args, proposer: str, c: int, env: dict) -> float:
    """Tokens/s of `auto` with the baseline checkout's code (this script's `--one` mode)."""
    cmd = [sys.executable, __file__, "--one", "auto", "--proposers", proposer, "--concurrency", str(c),
           "--max-tokens", str(args.max_tokens), "--min-requests", str(args.min_requests),
           "--max-draft-len", str(args.max_draft_len), *sum(([f"--{k}", str(v)] for k, v in device_fields(args).items()), [])]
    return float(run_json(cmd, env, "baseline"))


def print_table(table: dict[int, dict[str, float]], names: list[str],
                held: dict[int, dict[str, float | None]] | None = None) -> None:
    """Tokens/s per concurrency and configuration, auto (and a baseline's) against the best
    fixed D (and, with `held`, against the held-out best: `held_out_ratio`), geomeans."""
    autos = [n for n in AUTOS if n in names]
    held_autos = [n for n in autos if held and all(held[c].get(n) is not None for c in table)]
    print(f"{'concurrency':>11} " + " ".join(f"{n:>9}" for n in names)
          + "".join(f" {n + '/best':>14}" for n in autos) + f" {'best':>6}"
          + "".join(f" {n + '/held out':>18}" for n in held_autos))
    for c, row in table.items():
        fixed = {n: v for n, v in row.items() if n not in autos}
        best = max(fixed, key=fixed.get)
        print(f"{c:>11} " + " ".join(f"{row[n]:>9.1f}" for n in names)
              + "".join(f" {row[n] / fixed[best]:>13.3f}x" for n in autos) + f" {best:>6}"
              + "".join(f" {held[c][n]:>17.3f}x" for n in held_autos))
    geo = {n: statistics.geometric_mean(table[c][n] for c in table) for n in names}
    best_geo = max(v for n, v in geo.items() if n not in autos)
    print(f"{'geomean':>11} " + " ".join(f"{geo[n]:>9.1f}" for n in names)
          + "   " + ", ".join(f"{n} / best fixed geomean: {geo[n] / best_geo:.3f}x" for n in autos)
          + "".join(f", {n} / held-out best, geomean over the concurrencies: "
                    f"{statistics.geometric_mean(held[c][n] for c in table):.3f}x" for n in held_autos))


if __name__ == "__main__":
    main()
