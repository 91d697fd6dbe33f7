"""Replay simulator CPU cost: ms of CPU per simulated step at 4, 64 and 256 concurrent requests.

Replays a draft-model trace under the `overlap` schedule at D=4 with the public API
(`specsched.simulator.replay.replay`), the cost profile fitted (`fit_profile`) on
`traces/samples/draft_overlap.jsonl` (6 requests of 48 tokens, captured on the bundled
models). A concurrency no larger than the sample's 6 requests replays the sample itself, closed
loop at that concurrency; a larger one replays a workload of 2 x concurrency requests made of
copies of the sample's requests (prompt and output lengths, sampling, and the teacher-forced
agreement the `trace` acceptance replays), with the same fitted profile and engine settings
(seats raised to the concurrency where the trace's `max_num_seqs` is lower, and the KV pool to
hold every seat's longest request, so that the replay measures steps, not preemptions).
`--requests N --output-len L` replays N copies each generating L tokens instead (a synthetic or
Bernoulli acceptance: the sample's agreement covers its own lengths only). Trace loading,
fitting and building the workload are done before timing; `time.process_time` covers the
`replay` call alone, and the step count is that of the simulated trace. The real-time ratio is
the simulated makespan (first arrival -> last finish, virtual time) over the replay's wall
time. Each figure is the best of at least `--repeats` replays, more while they have taken less
than `--min-seconds` of CPU, after one untimed warm-up replay.

    python benchmarks/simulator_speed.py [--concurrency 4 64 256] [--repeats 5] [--min-seconds 1]
                                         [--acceptance synthetic:2.5]   # default: trace
    python benchmarks/simulator_speed.py --concurrency 256 --requests 1280 --output-len 128 \
                                         --acceptance synthetic:2.5   # a serving-sized workload
    python benchmarks/simulator_speed.py --baseline ../before   # side by side with another checkout
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_side_by_side_options, best_of, side_by_side  # noqa: E402

from specsched.scheduler.proposer import RULES, ProposerKind  # noqa: E402
from specsched.simulator.fit import fit_profile  # noqa: E402
from specsched.simulator.replay import ReplayConfig, replay  # noqa: E402
from specsched.traces.reader import read_trace  # noqa: E402
from specsched.traces.schema import Trace  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "samples" / "draft_overlap.jsonl"


def workload(sample: Trace, num_requests: int, output_len: int | None = None) -> Trace:
    """`num_requests` requests (and their finish records) copied round-robin from `sample`,
    in the sample's arrival order, with unique ids; each generating `output_len` tokens if
    given (without the sample's agreement, which covers its own lengths)."""
    reqs = sorted(sample.requests, key=lambda r: r.arrival_ns)
    fin = {f.request_id: f for f in sample.finishes}
    out = Trace(header=sample.header, path=sample.path)
    t0 = reqs[0].arrival_ns
    for i in range(num_requests):
        r = reqs[i % len(reqs)]
        rid = f"{r.request_id}.{i // len(reqs)}"
        length = {} if output_len is None else {"max_tokens": output_len}
        out.add(r.model_copy(update={"request_id": rid, "arrival_ns": t0 + i, **length}))
        done = {} if output_len is None else {"output_len": output_len, "agreement": None}
        out.add(fin[r.request_id].model_copy(update={"request_id": rid, **done}))
    return out


def case(sample: Trace, concurrency: int, acceptance: str = "trace", num_requests: int | None = None,
         output_len: int | None = None) -> tuple[Trace, ReplayConfig]:
    """The trace and replay configuration measured at `concurrency`: the sample itself up to
    its size, else `num_requests` (2 x concurrency by default) copies of its requests."""
    if concurrency <= len(sample.requests) and num_requests is None and output_len is None:
        return sample, ReplayConfig(concurrency=concurrency, acceptance=acceptance)
    trace = workload(sample, num_requests or 2 * concurrency, output_len)
    engine = sample.header.engine_config
    overrides = {"max_num_seqs": concurrency} if concurrency > int(engine.get("max_num_seqs", 64)) else {}
    page = int(engine.get("page_size", 16))
    models = 1 + (RULES[ProposerKind(engine.get("proposer", "none"))].kv_model is not None)
    longest = max(r.prompt_len + r.max_tokens for r in trace.requests) + int(engine.get("draft_len", 0)) + 1
    pages = concurrency * models * -(-longest // page) + 1
    if pages > int(engine.get("num_pages", 4096)):
        overrides["num_pages"] = pages
    return trace, ReplayConfig(concurrency=concurrency, engine_overrides=overrides, acceptance=acceptance)


def measure(concurrencies: list[int], repeats: int, min_seconds: float, acceptance: str = "trace",
            num_requests: int | None = None, output_len: int | None = None) -> list[dict[str, float]]:
    sample = read_trace(SAMPLE)
    profile = fit_profile([sample])
    cases = [case(sample, c, acceptance, num_requests, output_len) for c in concurrencies]
    warm_trace, warm_cfg = case(sample, min(4, len(sample.requests)), acceptance)
    replay(warm_trace, profile, warm_cfg)  # warm-up, untimed
    out = []
    for c, (trace, cfg) in zip(concurrencies, cases):
        cpu, wall, done, (metrics, _) = best_of(lambda: replay(trace, profile, cfg), repeats, min_seconds)
        steps = metrics["steps"]
        out.append({"concurrency": c, "requests": len(trace.requests), "steps": steps,
                    "cpu_ms_per_step": cpu / steps * 1e3, "realtime_x": metrics["duration_s"] / wall,
                    "makespan_s": metrics["duration_s"], "cpu_s": cpu, "wall_s": wall, "replays": done})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--repeats", type=int, default=5, help="replays per concurrency, at least (best of)")
    ap.add_argument("--min-seconds", type=float, default=1.0,
                    help="more replays per concurrency until they have taken this much CPU time")
    ap.add_argument("--acceptance", default="trace", help="the replays' acceptance (`specsched replay --acceptance`)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per replay (default: the sample up to its size, else 2 x concurrency)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens each request generates (default: as sampled)")
    add_side_by_side_options(ap)
    args = ap.parse_args()
    if min(args.concurrency) < 1 or args.repeats < 1 or args.rounds < 1 or args.min_seconds < 0:
        ap.error("--concurrency, --repeats and --rounds must be >= 1, --min-seconds >= 0")
    if (args.requests is not None and args.requests < 1) or (args.output_len is not None and args.output_len < 1):
        ap.error("--requests and --output-len must be >= 1")
    if args.output_len is not None and args.acceptance in ("trace", "rates"):
        ap.error("--output-len needs --acceptance synthetic:... or bernoulli:... (the sample's agreement "
                 "covers its own output lengths)")
    size = (args.requests, args.output_len)
    if args.json:
        print(json.dumps(measure(args.concurrency, args.repeats, args.min_seconds, args.acceptance, *size)))
        return
    if args.baseline is None:
        print(f"best of >= {args.repeats} replays and >= {args.min_seconds:g} s CPU per row; draft / overlap, D=4; "
              f"acceptance {args.acceptance}")
        print(f"{'concurrency':>11} {'requests':>8} {'steps':>6} {'ms CPU/step':>11} {'real-time':>10}")
        for m in measure(args.concurrency, args.repeats, args.min_seconds, args.acceptance, *size):
            print(f"{m['concurrency']:>11} {m['requests']:>8} {m['steps']:>6} {m['cpu_ms_per_step']:>11.3f} "
                  f"{m['realtime_x']:>9.1f}x")
        return
    cmd = [sys.executable, __file__, "--json", "--repeats", str(args.repeats),
           "--min-seconds", str(args.min_seconds), "--concurrency", *map(str, args.concurrency)]
    if args.acceptance != "trace":  # (a baseline from before the option replays the trace's own)
        cmd += ["--acceptance", args.acceptance]
    for flag, value in (("--requests", args.requests), ("--output-len", args.output_len)):
        if value is not None:
            cmd += [flag, str(value)]
    runs = side_by_side(cmd, args.baseline, args.rounds)
    print(f"median of {args.rounds} alternating rounds, each row the best of >= {args.repeats} replays and "
          f">= {args.min_seconds:g} s CPU; draft / overlap, D=4; acceptance {args.acceptance}; "
          "ratio = this / baseline")
    print(f"{'concurrency':>11} {'steps':>7} {'base ms':>8} {'this ms':>8} {'ratio':>6} "
          f"{'base RT':>8} {'this RT':>8} {'ratio':>6}   (ms CPU per simulated step; RT: real-time ratio)")
    for i, c in enumerate(args.concurrency):
        med = {key: {name: statistics.median(run[i][key] for run in runs[name]) for name in runs}
               for key in ("steps", "cpu_ms_per_step", "realtime_x")}
        steps, cpu, rt = med["steps"], med["cpu_ms_per_step"], med["realtime_x"]
        shown = f"{steps['this']:.0f}" if steps["this"] == steps["baseline"] else \
            f"{steps['baseline']:.0f}/{steps['this']:.0f}"
        print(f"{c:>11} {shown:>7} {cpu['baseline']:>8.3f} {cpu['this']:>8.3f} {cpu['this'] / cpu['baseline']:>5.2f}x "
              f"{rt['baseline']:>7.1f}x {rt['this']:>7.1f}x {rt['this'] / rt['baseline']:>5.2f}x")


if __name__ == "__main__":
    main()
