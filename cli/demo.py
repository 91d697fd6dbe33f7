"""`specsched demo`: the main job a newcomer runs first.

Runs plain decoding and every proposer under its natural schedules on the bundled model and
workload, in interleaved rounds (medians; speedups over plain decoding in the same round),
captures a trace of each, validates the simulator on every trace, runs one A/B in
the simulator, and prints one summary table. Traces, timeline pictures and a Chrome/Perfetto
JSON land in the output folder.
"""
from __future__ import annotations

from pathlib import Path

import anyio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specsched.cli.common import narrow_table

# (name, proposer, schedule, draft_len): each proposer at the draft length that ran fastest at
# batch 1 on the bundled family (benchmarks/proposers.py: D = 3 over 4 for the draft model, 3 over
# 1 for the MTP head under `eager_fill`, 2 under `sync`), about as fast as the others at 4 concurrent
# (benchmarks/adaptive.py)
RUNS = [
    ("plain", "none", "plain_overlap", 0),  # plain decoding's default schedule: the speedups' base
    ("plain-sync", "none", "sync", 0),
    ("draft-sync", "draft", "sync", 3),
    ("draft-overlap", "draft", "overlap", 3),
    ("draft-eager_fill", "draft", "eager_fill", 3),
    ("mtp-sync", "mtp", "sync", 2),
    ("mtp-eager_fill", "mtp", "eager_fill", 3),
    ("eagle-sync", "eagle", "sync", 3),
    ("eagle-eager_fill", "eagle", "eager_fill", 3),
    ("ngram-sync", "ngram", "sync", 4),
]


def run_demo(out_dir: Path, num_requests: int, max_tokens: int, concurrency: int, console: Console,
             rounds: int = 3) -> list[dict]:
    """Every run `rounds` times, interleaved (each round runs them all in order), so that a
    machine whose speed drifts over a minute moves every run alike: a run's figures are medians
    over rounds and its speedup the median of its ratio to plain decoding in the same round.
    The traces, their simulator check and pictures are the last round's."""
    from specsched.runtime import bundled
    from specsched.runtime.bench import run_workload
    from specsched.runtime.engine_config import EngineConfig
    from specsched.runtime.workload import load_workload
    from specsched.simulator.analysis import ab, validate
    from specsched.simulator.replay import ReplayConfig
    from specsched.simulator.sweep import available_cpus
    from specsched.traces.chrome import write_chrome_trace
    from specsched.traces.timeline import plot_timeline

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    out_dir.mkdir(parents=True, exist_ok=True)
    items = load_workload(bundled.workload_path(), limit=num_requests, max_tokens=max_tokens)
    runs = [r for r in RUNS if r[1] not in ("mtp", "eagle") or (bundled.mtp_dir() / "config.json").exists()]
    skipped = [r[0] for r in RUNS if r not in runs]
    measured: dict[str, list[dict]] = {name: [] for name, *_ in runs}
    errors: dict[str, list[str]] = {name: [] for name, *_ in runs}
    cfgs = {name: EngineConfig.make(proposer=proposer, schedule=schedule, draft_len=d or None)
            for name, proposer, schedule, d in runs}
    traces = {}
    jobs = available_cpus()  # the simulator's replicates fan out over the CPUs
    columns = (TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        tasks = {name: progress.add_task(name, total=len(items) * rounds) for name, *_ in runs}
        for _ in range(rounds):
            for name, cfg in cfgs.items():
                path = out_dir / f"trace_{name}.jsonl"
                metrics, trace, outs = anyio.run(lambda: run_workload(
                    cfg, items, concurrency=concurrency, warmup=1, trace_path=str(path),
                    on_done=lambda: progress.advance(tasks[name])))
                trace.path = str(path)
                traces[name] = trace
                measured[name].append(metrics)
                errors[name] += [o.error for o in outs if o is not None and o.finish_reason == "error"]
    figures = aggregate(measured, base=runs[0][0])
    rows = []
    for name, *_ in runs:
        v = validate(traces[name], jobs=jobs)
        plot_timeline(traces[name], out_dir / f"timeline_{name}.png", steps=_window(traces[name]))
        rows.append({"run": name, "draft_len": cfgs[name].draft_len, **figures[name], "rounds": measured[name],
                     "requests": sum(m["requests"] for m in measured[name]),
                     "sim_makespan_err_pct": v["makespan_err_pct"],
                     "sim_step_err_pct": v["step_time_err_pct"]["p50"], "errors": errors[name]})
    write_chrome_trace(traces["draft-overlap"], out_dir / "draft-overlap.chrome.json")
    ab_res = ab(traces["draft-sync"], ReplayConfig(schedule="sync"), ReplayConfig(schedule="overlap"), replicates=6,
                jobs=jobs)
    _summary(console, rows, ab_res, out_dir, skipped, rounds)
    return rows


def aggregate(measured: dict[str, list[dict]], base: str) -> dict[str, dict]:
    """Per run, from its metrics in each round (`measured[run][i]`: round i): the medians of
    tokens/s, p50 TTFT and TPOT and the bubble over rounds, the mean acceptance length (the same
    tokens every round under greedy decoding: the last round's), and `speedup`, the median over
    rounds of its tokens/s over `base`'s in the same round."""
    from statistics import median

    out = {}
    for name, ms in measured.items():
        al = ms[-1].get("mean_accept_len")
        out[name] = {
            "tok_s": median(m["output_tokens_per_s"] for m in ms),
            "ttft_ms": median(m["ttft_ms"]["p50"] for m in ms),
            "tpot_ms": median(m["tpot_ms"]["p50"] for m in ms),
            "bubble": median(m["bubble_fraction"] for m in ms),
            "mean_accept_len": al,
            "speedup": median(m["output_tokens_per_s"] / b["output_tokens_per_s"]
                              for m, b in zip(ms, measured[base])),
        }
    return out


def _window(trace) -> tuple[int, int] | None:
    steps = sorted(s.step for s in trace.steps if s.kind in ("spec", "decode"))
    if len(steps) < 4:
        return None
    mid = steps[len(steps) // 2]
    return (mid, mid + 6)


def _summary(console: Console, rows: list[dict], ab_res: dict, out_dir: Path, skipped: list[str],
             rounds: int) -> None:
    # fits an 80-column terminal: no column that may wrap or collapse
    t = narrow_table("specsched demo: bundled model, default workload (measured on this machine, "
                     f"median of {rounds} round{'s' if rounds > 1 else ''})")
    t.add_column("run", no_wrap=True)
    t.add_column("D", justify="right", no_wrap=True, min_width=1)
    for col in ("tok/s", "TTFT", "TPOT", "AL", "bubble", "speedup", "sim err"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        al = r["mean_accept_len"]
        t.add_row(r["run"], str(r["draft_len"] or "-"), f"{r['tok_s']:.1f}", f"{r['ttft_ms']:.1f}",
                  f"{r['tpot_ms']:.2f}", f"{al:.2f}" if al else "-", f"{r['bubble']:.2f}", f"{r['speedup']:.2f}x",
                  f"{r['sim_makespan_err_pct']:.1f}%")
    console.print(t)
    console.print("D: draft length (an EAGLE tree's depth); TTFT/TPOT: p50 ms; AL: mean acceptance length; "
                  "bubble: device idle while requests pend; speedup: tokens/s over plain in the same round; "
                  "sim err: simulator makespan error replaying the last round's run")
    d = ab_res["diff_b_minus_a"]["output_tokens_per_s"]
    console.print(f"A/B in the simulator on the draft-sync trace, A = sync, B = overlap: tokens/s B - A = "
                  f"{d['diff_mean']:+.1f} (95% CI {d['ci95'][0]:+.1f} .. {d['ci95'][1]:+.1f}): {d['verdict']}")
    if skipped:
        console.print(f"[yellow]skipped (no bundled head yet): {', '.join(skipped)}[/yellow]")
    console.print(f"\nEverything is in {out_dir}/:")
    console.print("  trace_*.jsonl      traces: `specsched stats|validate|replay|timeline|export TRACE`")
    console.print("  timeline_*.png     host and device lanes of a window of steps (idle device hatched)")
    console.print("  draft-overlap.chrome.json  open in https://ui.perfetto.dev or chrome://tracing")
