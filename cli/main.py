"""The `specsched` command: a thin typer layer over the engine, traces and simulator."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import orjson
import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="specsched: the CPU side of speculative decoding (engine, traces, simulator).")
console = Console(stderr=True)


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2)


def engine_config(**kw):
    from runtime.engine_config import EngineConfig
    from scheduler.errors import ConfigurationError

    config_file = kw.pop("config_file", None)
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        if config_file:
            return EngineConfig.from_file(config_file, **kw)
        return EngineConfig.make(**kw)
    except ConfigurationError as e:
        _fail(str(e))


def _print_json(obj) -> None:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="prompt text"),
    model: Optional[str] = typer.Option(None, help="target checkpoint dir (HF layout); default: bundled"),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    temperature: float = typer.Option(0.0),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], help="stop string (repeatable)"),
    spec: str = typer.Option("none", help="proposer: none|draft|mtp|eagle|ngram"),
    draft_len: Optional[int] = typer.Option(None, "--draft-len"),
    draft: Optional[str] = typer.Option(None, help="draft checkpoint dir"),
    mtp_head: Optional[str] = typer.Option(None, "--mtp-head", help="MTP/EAGLE head dir"),
    schedule: Optional[str] = typer.Option(None),
    config_file: Optional[Path] = typer.Option(None, "--config", help="EngineConfig JSON/YAML"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Generate text from the bundled model (or any HF-layout Llama checkpoint)."""
    import anyio

    from runtime.engine import AsyncEngine
    from scheduler.errors import InvalidRequestError
    from scheduler.sampling_params import SamplingParams

    cfg = engine_config(model=model, proposer=spec, draft_len=draft_len, draft=draft, mtp_head=mtp_head,
                        schedule=schedule, config_file=config_file)
    try:
        params = SamplingParams.make(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, stop=list(stop))
    except InvalidRequestError as e:
        _fail(str(e))

    async def main():
        try:
            engine = AsyncEngine(cfg)
        except Exception as e:  # noqa: BLE001 - checkpoint/config errors are user errors here
            _fail(str(e))
        async with engine:
            ids = engine.validate(prompt, params)
            toks, text, last = [], [], None
            async for out in engine.generate(prompt, params):
                toks += out.token_ids
                text.append(out.text)
                last = out
                if not json_out and out.text:
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
        if json_out:
            _print_json({"prompt_token_ids": ids, "token_ids": toks, "text": "".join(text),
                         "finish_reason": last.finish_reason, "error": last.error,
                         "proposer": cfg.proposer, "draft_len": cfg.draft_len, "spec": last.spec})
        else:
            sys.stdout.write("\n")
            if cfg.proposer != "none" and last.spec.get("drafts"):
                s = last.spec
                console.print(f"[dim]{cfg.proposer} D={cfg.draft_len}: mean acceptance length "
                              f"{s['mean_accept_len']:.2f}, accepted {s['accepted_tokens']}/"
                              f"{s['drafted_tokens']} drafted, per position "
                              f"{[round(x, 2) for x in s['accept_rate_per_pos']]}[/dim]")

    try:
        anyio.run(main)
    except InvalidRequestError as e:
        _fail(str(e))


@app.command()
def demo(
    out: Path = typer.Option(Path("demo_out"), help="output folder"),
    num_requests: int = typer.Option(8, "--num-requests"),
    max_tokens: int = typer.Option(48, "--max-tokens"),
    concurrency: int = typer.Option(4),
) -> None:
    """The main job: every proposer and schedule on the bundled model, traces, simulator check."""
    from cli.demo import run_demo

    t0 = __import__("time").monotonic()
    run_demo(out, num_requests, max_tokens, concurrency, Console())
    console.print(f"[dim]demo took {__import__('time').monotonic() - t0:.0f} s[/dim]")


@app.command("train-models")
def train_models(
    out: Path = typer.Option(Path("runtime/bundled"), help="output dir"),
    target_minutes: float = typer.Option(14.0),
    draft_minutes: float = typer.Option(6.0),
    seed: int = typer.Option(0),
) -> None:
    """Retrain the bundled tokenizer, target and draft (needs the dev extra: transformers)."""
    from runtime.training.bundled import main as train_main

    train_main(out_dir=str(out), target_minutes=target_minutes, draft_minutes=draft_minutes, seed=seed)


@app.command("train-mtp")
def train_mtp_cmd(
    target: Path = typer.Option(..., help="target checkpoint dir (HF layout)"),
    out: Path = typer.Option(..., help="output dir for the head"),
    steps: Optional[int] = typer.Option(None, help="fixed optimizer steps (default: a time budget)"),
    minutes: float = typer.Option(6.0, help="time budget when --steps is not given"),
    no_norms: bool = typer.Option(False, "--no-norms", help="EAGLE-style head without the restored RMSNorms"),
    ablation: bool = typer.Option(False, help="also train the other variant and record both in the card"),
    threads: int = typer.Option(1, help="torch threads (1 is fastest on a shared 2-core machine)"),
    seed: int = typer.Option(0),
) -> None:
    """Train an MTP head on a target's hidden states (computed with specsched's own forward)."""
    from runtime.training.mtp import train_mtp

    report = train_mtp(target, out, steps, minutes=minutes, norms=not no_norms, ablation=ablation,
                       seed=seed, num_threads=threads)
    _print_json(report)


def _read_trace(path: Path):
    from traces.reader import TraceFormatError, read_trace

    try:
        return read_trace(path)
    except (TraceFormatError, OSError) as e:
        _fail(str(e))


def _workload(workload: str, num_requests: Optional[int], max_tokens: Optional[int], temperature: Optional[float]):
    from runtime.bundled import workload_path
    from runtime.workload import load_workload
    from scheduler.errors import InvalidRequestError

    path = workload_path() if workload == "default" else Path(workload)
    try:
        return load_workload(path, limit=num_requests, max_tokens=max_tokens, temperature=temperature)
    except InvalidRequestError as e:
        _fail(str(e))


def _metrics_table(title: str, rows: list[tuple[str, dict]]) -> None:
    from rich.table import Table

    t = Table(title=title)
    for col in ("run", "tok/s", "TTFT p50 ms", "TPOT p50 ms", "mean AL", "bubble", "host ms/step", "speedup"):
        t.add_column(col, justify="right")
    for name, m in rows:
        al = m.get("mean_accept_len")
        t.add_row(name, f"{m['output_tokens_per_s']:.1f}", f"{m['ttft_ms']['p50']:.1f}",
                  f"{(m['tpot_ms']['p50'] or 0):.2f}", f"{al:.2f}" if al else "-",
                  f"{m['bubble_fraction']:.3f}" if m.get("bubble_fraction") is not None else "-",
                  f"{m['host_ms_per_step'].get('total', 0):.2f}",
                  f"{m['speedup_vs_plain']:.2f}x" if m.get("speedup_vs_plain") else "-")
    Console().print(t)


@app.command()
def bench(
    model: Optional[str] = typer.Option(None),
    draft: Optional[str] = typer.Option(None),
    mtp_head: Optional[str] = typer.Option(None, "--mtp-head"),
    workload: str = typer.Option("default", help="'default' (bundled prompts) or a JSONL file"),
    num_requests: Optional[int] = typer.Option(None, "--num-requests"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="override every request's max_tokens"),
    temperature: Optional[float] = typer.Option(None, help="override every request's temperature"),
    concurrency: Optional[int] = typer.Option(None, help="closed loop: requests in flight"),
    rate: Optional[float] = typer.Option(None, help="open loop: requests per second"),
    spec: str = typer.Option("none", help="proposer: none|draft|mtp|eagle|ngram"),
    draft_len: Optional[int] = typer.Option(None, "--draft-len"),
    schedule: Optional[str] = typer.Option(None),
    warmup: int = typer.Option(1),
    trace: Optional[Path] = typer.Option(None, help="write the run's trace (JSONL)"),
    compare_plain: bool = typer.Option(False, "--compare-plain", help="also run plain decoding; add speedup_vs_plain"),
    otlp: Optional[str] = typer.Option(None, help="export spans live over OTLP/HTTP to this URL "
                                       "(default: on when OTEL_EXPORTER_OTLP_ENDPOINT is set)"),
    config_file: Optional[Path] = typer.Option(None, "--config"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Run a workload through the engine; metrics from the run's own trace."""
    import anyio
    from rich.progress import Progress

    from runtime.bench import run_workload

    cfg = engine_config(model=model, draft=draft, mtp_head=mtp_head, proposer=spec, draft_len=draft_len,
                        schedule=schedule, config_file=config_file)
    items = _workload(workload, num_requests, max_tokens, temperature)
    if concurrency is None and rate is None:
        concurrency = 1
    results = []
    runs = [("plain", cfg.model_copy(update={"proposer": "none", "draft_len": 0, "schedule": "sync"}))] if compare_plain else []
    runs.append((f"{cfg.proposer}/{cfg.schedule}/D={cfg.draft_len}", cfg))
    with Progress(console=console, transient=True, disable=json_out) as progress:
        for name, c in runs:
            task = progress.add_task(name, total=len(items))
            m, _, _ = anyio.run(lambda: run_workload(
                c, items, concurrency=concurrency, rate_qps=rate, warmup=warmup,
                trace_path=str(trace) if (trace and c is cfg) else None, otlp=otlp if c is cfg else False,
                on_done=lambda: progress.advance(task)))
            results.append((name, m))
    final = results[-1][1]
    if compare_plain:
        final["speedup_vs_plain"] = final["output_tokens_per_s"] / results[0][1]["output_tokens_per_s"]
    if json_out:
        _print_json(final)
    else:
        _metrics_table("bench", results)
        if trace:
            console.print(f"trace written to {trace}")


@app.command()
def stats(trace: Path, json_out: bool = typer.Option(False, "--json")) -> None:
    """Metrics of a trace (the same keys as `bench --json`)."""
    from traces.metrics import compute_metrics

    m = compute_metrics(_read_trace(trace))
    if json_out:
        _print_json(m)
    else:
        _metrics_table(str(trace), [(trace.name, m)])


@app.command()
def export(
    trace: Path,
    chrome: Optional[Path] = typer.Option(None, help="Chrome/Perfetto trace JSON"),
    otel_json: Optional[Path] = typer.Option(None, "--otel-json", help="OTLP/JSON file"),
    otlp: Optional[str] = typer.Option(None, help="OTLP/HTTP endpoint, e.g. http://localhost:4318/v1/traces"),
) -> None:
    """Export a trace to Perfetto / chrome://tracing or OpenTelemetry."""
    tr = _read_trace(trace)
    if not (chrome or otel_json or otlp):
        _fail("choose at least one of --chrome, --otel-json, --otlp")
    if chrome:
        from traces.chrome import write_chrome_trace

        write_chrome_trace(tr, chrome)
        console.print(f"wrote {chrome} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if otel_json:
        from traces.otel import export_otel_json

        export_otel_json(tr, otel_json)
        console.print(f"wrote {otel_json}")
    if otlp:
        from traces.otel import export_otlp

        n = export_otlp(tr, otlp)
        console.print(f"sent {n} spans to {otlp}")


@app.command()
def timeline(
    trace: Path,
    out: Path = typer.Option(Path("timeline.png"), "-o", "--out"),
    steps: Optional[str] = typer.Option(None, help="window of steps A:B"),
) -> None:
    """A picture of host and device lanes over a window of steps."""
    from traces.timeline import plot_timeline

    window = None
    if steps:
        try:
            a, b = steps.split(":")
            window = (int(a), int(b))
        except ValueError:
            _fail("--steps takes A:B (two step numbers)")
    plot_timeline(_read_trace(trace), out, steps=window)
    console.print(f"wrote {out}")


def _replay_config(schedule, spec, draft_len, acceptance, rate_scale, concurrency, seed=0):
    from simulator.replay import ReplayConfig

    return ReplayConfig(schedule=schedule, proposer=spec, draft_len=draft_len, acceptance=acceptance,
                        rate_scale=rate_scale, concurrency=concurrency, seed=seed)


def _profile(trace_obj, profile_path: Optional[Path]):
    from simulator.costs import CostProfile, fit_profile

    if profile_path is not None and profile_path.exists():
        try:
            return CostProfile.load(profile_path)
        except ValueError as e:
            _fail(str(e))
    return fit_profile([trace_obj])


@app.command("replay")
def replay_cmd(
    trace: Path,
    schedule: Optional[str] = typer.Option(None),
    spec: Optional[str] = typer.Option(None),
    draft_len: Optional[int] = typer.Option(None, "--draft-len"),
    rate_scale: float = typer.Option(1.0, "--rate-scale"),
    concurrency: Optional[int] = typer.Option(None),
    acceptance: str = typer.Option("trace", help="trace | rates | bernoulli:ALPHA"),
    profile: Optional[Path] = typer.Option(None, help="cost profile JSON (default: fit from the trace)"),
    trace_out: Optional[Path] = typer.Option(None, "--trace", help="write the simulated trace"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a trace in virtual time under another schedule / proposer / draft length."""
    from simulator.replay import replay
    from traces.recorder import write_trace

    tr = _read_trace(trace)
    try:
        m, sim = replay(tr, _profile(tr, profile), _replay_config(schedule, spec, draft_len, acceptance, rate_scale, concurrency))
    except (ValueError, KeyError) as e:
        _fail(str(e))
    if trace_out:
        write_trace(sim, trace_out)
    if json_out:
        _print_json(m)
    else:
        _metrics_table(f"replay of {trace.name}", [("simulated", m)])


@app.command()
def validate(
    trace: Path,
    profile: Optional[Path] = typer.Option(None),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a trace under its own configuration; error against the measured run."""
    from simulator.analysis import validate as run_validate

    tr = _read_trace(trace)
    res = run_validate(tr, _profile(tr, profile))
    if json_out:
        _print_json(res)
        return
    from rich.table import Table

    t = Table(title=f"simulator fidelity on {trace.name}")
    t.add_column("metric")
    t.add_column("error", justify="right")
    t.add_row("per-step time, median |err|", f"{res['step_time_err_pct']['p50']:.2f}%")
    t.add_row("per-step time, p90 |err|", f"{res['step_time_err_pct']['p90']:.2f}%")
    for k, label in (("p50", "median"), ("p90", "p90")):
        t.add_row(f"step time {label} (distribution)", f"{res['step_time_dist_err_pct'][k]:.2f}%")
    t.add_row("makespan", f"{res['makespan_err_pct']:.2f}%")
    t.add_row("output tokens/s", f"{res['output_tokens_per_s_err_pct']:.2f}%")
    for k in ("p50", "p99"):
        t.add_row(f"TTFT {k}", f"{res['ttft_err_pct'][k]:.2f}%")
        v = res["tpot_err_pct"][k]
        t.add_row(f"TPOT {k}", f"{v:.2f}%" if v is not None else "-")
    v = res["bubble_fraction_err_pp"]
    t.add_row("bubble fraction", f"{v:.2f} pp" if v is not None else "-")
    Console().print(t)


@app.command()
def ab(
    trace: Path,
    a: str = typer.Option(..., "--a", help="variant A, e.g. 'schedule=sync' or 'draft_len=3,schedule=overlap'"),
    b: str = typer.Option(..., "--b", help="variant B"),
    replicates: int = typer.Option(10),
    profile: Optional[Path] = typer.Option(None),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """A/B two configurations on the same workload and acceptance draws, with bootstrap CIs."""
    from simulator.analysis import ab as run_ab
    from simulator.replay import ReplayConfig

    def parse(text: str) -> ReplayConfig:
        kw = {}
        for part in filter(None, text.split(",")):
            k, _, v = part.partition("=")
            k = {"spec": "proposer", "draft-len": "draft_len"}.get(k.strip(), k.strip())
            if k not in ("schedule", "proposer", "draft_len", "acceptance", "rate_scale", "concurrency"):
                _fail(f"unknown A/B field {k!r}")
            kw[k] = int(v) if k in ("draft_len", "concurrency") else float(v) if k == "rate_scale" else v
        return ReplayConfig(**kw)

    tr = _read_trace(trace)
    try:
        res = run_ab(tr, parse(a), parse(b), profile=_profile(tr, profile), replicates=replicates)
    except (ValueError, KeyError) as e:
        _fail(str(e))
    if json_out:
        _print_json(res)
        return
    from rich.table import Table

    t = Table(title=f"A: {a}   B: {b}   ({replicates} replicates)")
    for col in ("metric", "A", "B", "B - A (95% CI)", "verdict"):
        t.add_column(col)
    for key, label in (("output_tokens_per_s", "tokens/s"), ("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms")):
        d = res["diff_b_minus_a"][key]
        va = res["a"][key] if key == "output_tokens_per_s" else res["a"][key]["p50"]
        vb = res["b"][key] if key == "output_tokens_per_s" else res["b"][key]["p50"]
        t.add_row(label, f"{va:.2f}", f"{vb:.2f}", f"{d['diff_mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]", d["verdict"])
    Console().print(t)


@app.command()
def tune(
    trace: Path,
    profile: Optional[Path] = typer.Option(None),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Sweep the draft length per batch-size regime; simulated speedup next to the formula."""
    from simulator.analysis import tune as run_tune

    tr = _read_trace(trace)
    try:
        res = run_tune(tr, profile=_profile(tr, profile))
    except (ValueError, KeyError) as e:
        _fail(str(e))
    if json_out:
        _print_json(res)
        return
    from rich.table import Table

    t = Table(title=f"draft length sweep on {trace.name}")
    for col in ("concurrency", "D", "mean AL", "sim speedup", "formula speedup"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        if "error" in r:
            continue
        t.add_row(str(r["concurrency"]), str(r["draft_len"]), f"{r['mean_accept_len']:.2f}",
                  f"{r['sim_speedup']:.2f}x", f"{r['formula_speedup']:.2f}x" if r["formula_speedup"] else "-")
    Console().print(t)
    console.print(f"best D per concurrency: {res['best']}")


@app.command("fit-profile")
def fit_profile_cmd(traces: list[Path], out: Path = typer.Option(..., "-o", "--out")) -> None:
    """Fit a cost profile (JSON) from engine traces of one machine; prints MAPE per stage."""
    from simulator.costs import fit_profile

    prof = fit_profile([_read_trace(t) for t in traces])
    prof.save(out)
    for k, v in sorted(prof.mape().items()):
        console.print(f"{k:24s} MAPE {v:6.2f}%")
    console.print(f"wrote {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
