"""The `specsched` command: a thin typer layer over the engine, traces and simulator.

Commands live by topic: running the engine here, trace tools in cli/trace_cmds.py, the
simulator in cli/sim_cmds.py, the HTTP server in cli/serve_cmd.py, training the bundled models and
heads in cli/train_cmds.py; importing those modules registers their commands on `app`.
"""
from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from specsched.cli.common import (LOAD_FORMAT, SCHEDULE_HELP, SPECULATIVE_CONFIG, MAX_NUM_SEQS, MAX_MODEL_LEN, DTYPE, MAX_NUM_BATCHED_TOKENS, WORKER_MALLOC, WORKER_OPENMP, WORKER_LINEAR, WORKER_OPS, ENFORCE_EAGER, CUDA_GRAPH_SIZES,
                                  _fail,
                                  _metrics_table, _print_json, acceptance_note, app, check_otlp_option, check_output_path, console,
                                  engine_config, fail_if_requests_failed, parse_draft_len, synthetic_summary,
                                  user_errors)
from specsched.traces.names import PROPOSERS

def _schema_arg(value: str | None):
    """--json-schema: a file holding a JSON schema, or the schema's JSON itself."""
    if value is None:
        return None
    text = Path(value).read_text() if not value.lstrip().startswith("{") and Path(value).is_file() else value
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        _fail(f"--json-schema: not a JSON schema file or JSON ({e})")


@app.command()
@user_errors
def generate(
    prompt: str = typer.Argument(..., help="prompt text"),
    model: Optional[str] = typer.Option(None, help="target checkpoint dir (HF layout); default: bundled"),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    temperature: float = typer.Option(0.0),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    min_p: float = typer.Option(0.0, "--min-p", help="drop tokens below this share of the most likely's probability"),
    seed: Optional[int] = typer.Option(None),
    stop: list[str] = typer.Option([], help="stop string (repeatable)"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty",
                                             help="divide the positive logits of prompt and output tokens by this"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty",
                                            help="subtract this per occurrence of a token in the output"),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty",
                                           help="subtract this from tokens the output holds"),
    json_schema: Optional[str] = typer.Option(None, "--json-schema",
                                              help="structured output: a JSON schema (a file, or the JSON itself)"),
    regex: Optional[str] = typer.Option(None, help="structured output: a regular expression the text matches"),
    choice: list[str] = typer.Option([], help="structured output: one of these strings (repeatable)"),
    spec: Optional[str] = typer.Option(None, help=f"proposer: {'|'.join(PROPOSERS)} (default: the "
                                       "--config file's, else none)"),
    draft_len: Optional[str] = typer.Option(None, "--draft-len", help="D, or 'auto': chosen per step "
                                            "(up to --max-draft-len, default 4)"),
    draft: Optional[str] = typer.Option(None, help="draft checkpoint dir"),
    mtp_head: Optional[str] = typer.Option(None, "--mtp-head", help="MTP/EAGLE head dir"),
    schedule: Optional[str] = typer.Option(None, help=SCHEDULE_HELP),
    tp: Optional[int] = typer.Option(None, "--tp", "--tensor-parallel-size", help="tensor-parallel size: shard the target over N "
                                     "worker processes (default 1)"),
    config_file: Optional[Path] = typer.Option(None, "--config", help="EngineConfig JSON/YAML"),
    load_format: Optional[str] = LOAD_FORMAT,
    speculative_config: Optional[str] = SPECULATIVE_CONFIG,
    worker_malloc: Optional[str] = WORKER_MALLOC,
    worker_openmp: Optional[str] = WORKER_OPENMP,
    worker_linear: Optional[str] = WORKER_LINEAR,
    worker_ops: Optional[str] = WORKER_OPS,
    enforce_eager: bool = ENFORCE_EAGER,
    cuda_graph_sizes: Optional[str] = CUDA_GRAPH_SIZES,
    max_num_seqs: Optional[int] = MAX_NUM_SEQS,
    max_model_len: Optional[int] = MAX_MODEL_LEN,
    dtype: Optional[str] = DTYPE,
    max_num_batched_tokens: Optional[int] = MAX_NUM_BATCHED_TOKENS,
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Generate text from the bundled model (or any HF-layout Llama checkpoint)."""
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.scheduler.errors import InvalidRequestError
    from specsched.scheduler.sampling_params import SamplingParams

    cfg = engine_config(model=model, proposer=spec, draft_len=parse_draft_len(draft_len), draft=draft,
                        mtp_head=mtp_head, schedule=schedule, tensor_parallel_size=tp, config_file=config_file,
                        speculative_config=speculative_config, load_format=load_format,
                        worker_malloc=worker_malloc, worker_openmp=worker_openmp, worker_linear=worker_linear,
                        worker_ops=worker_ops,
                        enforce_eager=enforce_eager, cuda_graph_sizes=cuda_graph_sizes,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, dtype=dtype)
    structured = {k: v for k, v in (("json", _schema_arg(json_schema)), ("regex", regex), ("choice", list(choice)))
                  if v}
    try:
        params = SamplingParams.make(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, min_p=min_p, seed=seed, stop=list(stop),
                                     repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                                     presence_penalty=presence_penalty, structured_outputs=structured or None)
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
            if cfg.proposer != "none" and last.finish_reason != "error" and last.spec.get("drafts"):
                s = last.spec
                console.print(f"[dim]{cfg.proposer} D={cfg.draft_len}: mean acceptance length "
                              f"{s['mean_accept_len']:.2f}, accepted {s['accepted_tokens']}/"
                              f"{s['drafted_tokens']} drafted, per position "
                              f"{[round(x, 2) for x in s['accept_rate_per_pos']]}[/dim]")
        return last

    last = anyio.run(main)  # a request the engine rejects: `user_errors` reports it
    fail_if_requests_failed([last.error] if last.finish_reason == "error" else [], 1)


@app.command()
def demo(
    out: Path = typer.Option(Path("demo_out"), help="output folder"),
    num_requests: int = typer.Option(8, "--num-requests", min=1),
    max_tokens: int = typer.Option(48, "--max-tokens", min=3, help="output tokens a request (a speculative run "
                                   "drafts for a request with at least 2 tokens left)"),
    concurrency: int = typer.Option(4, min=1),
    rounds: int = typer.Option(3, min=1, help="interleaved rounds of every run; figures are medians over them"),
) -> None:
    """The main job: every proposer and schedule on the bundled model, traces, simulator check."""
    from specsched.cli.demo import run_demo

    logging.getLogger("specsched").setLevel(logging.WARNING)  # dozens of engines: no start-up line each
    t0 = __import__("time").monotonic()
    rows = run_demo(out, num_requests, max_tokens, concurrency, Console(), rounds)
    console.print(f"[dim]demo took {__import__('time').monotonic() - t0:.0f} s[/dim]")
    fail_if_requests_failed([e for r in rows for e in r["errors"]], sum(r["requests"] for r in rows))


def _workload(workload: str, num_requests: Optional[int], max_tokens: Optional[int], temperature: Optional[float]):
    from specsched.runtime.bundled import transition_workload_path, workload_path
    from specsched.runtime.workload import load_workload
    from specsched.scheduler.errors import InvalidRequestError

    path = {"default": workload_path, "transition": transition_workload_path}.get(workload, lambda: Path(workload))()
    try:
        return load_workload(path, limit=num_requests, max_tokens=max_tokens, temperature=temperature)
    except InvalidRequestError as e:
        _fail(str(e))


@app.command()
@user_errors
def bench(
    model: Optional[str] = typer.Option(None),
    draft: Optional[str] = typer.Option(None),
    mtp_head: Optional[str] = typer.Option(None, "--mtp-head"),
    workload: str = typer.Option("default", help="'default' (bundled prompts), 'transition' (the same in four "
                                 "phases of synthetic acceptance, AL 1.5 / 3.5 / 1.5 / 3.5) or a JSONL file"),
    num_requests: Optional[int] = typer.Option(None, "--num-requests"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="override every request's max_tokens"),
    temperature: Optional[float] = typer.Option(None, help="override every request's temperature"),
    concurrency: Optional[int] = typer.Option(None, help="closed loop: requests in flight"),
    rate: Optional[float] = typer.Option(None, help="open loop: requests per second"),
    spec: Optional[str] = typer.Option(None, help=f"proposer: {'|'.join(PROPOSERS)} (default: the "
                                       "--config file's, else none)"),
    draft_len: Optional[str] = typer.Option(None, "--draft-len", help="D, or 'auto': chosen per step "
                                            "(up to --max-draft-len, default 4)"),
    max_draft_len: Optional[int] = typer.Option(None, "--max-draft-len", help="with --draft-len auto"),
    profile: Optional[Path] = typer.Option(None, "--profile", help="with --draft-len auto: a cost profile "
                                           "(fit-profile's JSON, or a shipped profile's name) seeding its "
                                           "step-time models"),
    schedule: Optional[str] = typer.Option(None, help=SCHEDULE_HELP),
    tp: Optional[int] = typer.Option(None, "--tp", "--tensor-parallel-size", help="tensor-parallel size: shard the target over N "
                                     "worker processes (default 1)"),
    warmup: int = typer.Option(1),
    trace: Optional[Path] = typer.Option(None, help="write the run's trace (JSONL)"),
    compare_plain: bool = typer.Option(False, "--compare-plain", help="also run plain decoding (its default schedule, plain_overlap); add speedup_vs_plain"),
    otlp: Optional[str] = typer.Option(None, help="export spans live over OTLP/HTTP to this URL "
                                       "(default: on when OTEL_EXPORTER_OTLP_ENDPOINT is set)"),
    config_file: Optional[Path] = typer.Option(None, "--config"),
    load_format: Optional[str] = LOAD_FORMAT,
    speculative_config: Optional[str] = SPECULATIVE_CONFIG,
    worker_malloc: Optional[str] = WORKER_MALLOC,
    worker_openmp: Optional[str] = WORKER_OPENMP,
    worker_linear: Optional[str] = WORKER_LINEAR,
    worker_ops: Optional[str] = WORKER_OPS,
    enforce_eager: bool = ENFORCE_EAGER,
    cuda_graph_sizes: Optional[str] = CUDA_GRAPH_SIZES,
    max_num_seqs: Optional[int] = MAX_NUM_SEQS,
    max_model_len: Optional[int] = MAX_MODEL_LEN,
    dtype: Optional[str] = DTYPE,
    max_num_batched_tokens: Optional[int] = MAX_NUM_BATCHED_TOKENS,
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="drive a running OpenAI-compatible server "
                                           "at this URL (e.g. http://127.0.0.1:8000) over streaming HTTP "
                                           "instead of an embedded engine"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="with --endpoint: the `model` each request names"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Run a workload through the engine, or over HTTP against a server (--endpoint); metrics
    from the run's own trace, or as the client saw them."""
    import anyio
    from rich.progress import Progress

    from specsched.runtime.bench import run_workload

    for option, value, low in (("--num-requests", num_requests, 1), ("--max-tokens", max_tokens, 1),
                               ("--concurrency", concurrency, 1), ("--warmup", warmup, 0)):
        if value is not None and value < low:
            _fail(f"{option} must be >= {low}, got {value}")
    if rate is not None and not rate > 0:
        _fail(f"--rate must be > 0 requests per second, got {rate}")
    if rate is not None and concurrency is not None:
        _fail("--concurrency (closed loop) and --rate (open loop) exclude each other: choose one")
    check_output_path(trace, "--trace")
    if endpoint is not None:
        engine_only = {"--model": model, "--draft": draft, "--mtp-head": mtp_head, "--spec": spec,
                       "--draft-len": draft_len, "--max-draft-len": max_draft_len, "--profile": profile,
                       "--schedule": schedule, "--tp": tp, "--trace": trace, "--compare-plain": compare_plain or None,
                       "--otlp": otlp, "--config": config_file, "--load-format": load_format,
                       "--speculative-config": speculative_config, "--worker-malloc": worker_malloc,
                       "--worker-openmp": worker_openmp, "--worker-linear": worker_linear, "--worker-ops": worker_ops, "--enforce-eager": enforce_eager or None,
                       "--cuda-graph-sizes": cuda_graph_sizes, "--max-num-seqs": max_num_seqs, "--max-model-len": max_model_len, "--dtype": dtype,
                       "--max-num-batched-tokens": max_num_batched_tokens}
        given = [k for k, v in engine_only.items() if v is not None]
        if given:
            _fail(f"{', '.join(given)} configure an embedded engine; with --endpoint the server's own engine "
                  "runs (pass them to `specsched serve`)")
        return _bench_endpoint(endpoint, _workload(workload, num_requests, max_tokens, temperature),
                               concurrency, rate, warmup, served_model_name, json_out)
    if served_model_name is not None:
        _fail("--served-model-name goes with --endpoint")
    check_otlp_option(otlp)
    cfg = engine_config(model=model, draft=draft, mtp_head=mtp_head, proposer=spec,
                        draft_len=parse_draft_len(draft_len), max_draft_len=max_draft_len,
                        draft_profile=_profile_file(profile), schedule=schedule,
                        tensor_parallel_size=tp, config_file=config_file, speculative_config=speculative_config,
                        load_format=load_format, worker_malloc=worker_malloc, worker_openmp=worker_openmp, worker_linear=worker_linear,
                        worker_ops=worker_ops,
                        enforce_eager=enforce_eager, cuda_graph_sizes=cuda_graph_sizes,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, dtype=dtype)
    items = _workload(workload, num_requests, max_tokens, temperature)
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.workload import check_workload
    from specsched.scheduler.wiring import NATURAL_SCHEDULE

    check_workload(items, AsyncEngine(cfg).validate)  # every prompt fits the model, before any run
    if concurrency is None and rate is None:
        concurrency = 1
    plain = {"proposer": "none", "draft_len": 0, "schedule": NATURAL_SCHEDULE["none"]}  # plain decoding's default
    runs = [("plain", cfg.model_copy(update=plain))] if compare_plain else []
    runs.append((f"{cfg.proposer}/{cfg.schedule}/D={cfg.draft_len}", cfg))
    results, errors, completed, interrupted = [], [], [0], []

    async def run_all(progress) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, tg.cancel_scope, interrupted)
            for name, c in runs:
                task = progress.add_task(name, total=len(items))

                def done(task=task) -> None:
                    progress.advance(task)
                    completed[0] += 1

                m, _, outs = await run_workload(
                    c, items, concurrency=concurrency, rate_qps=rate, warmup=warmup,
                    trace_path=str(trace) if (trace and c is cfg) else None,
                    otlp=otlp if c is cfg else False, on_done=done)
                results.append((name, m))
                errors.extend(o.error for o in outs if o is not None and o.finish_reason == "error")
            tg.cancel_scope.cancel()  # stops the signal watcher

    with Progress(console=console, transient=True, disable=json_out) as progress:
        anyio.run(run_all, progress)
    if interrupted:
        # the interpreter's last collections would rescan the whole run's heap: about a second
        # between the summary and the exit, for nothing
        __import__("gc").freeze()
        signum = interrupted[0]
        console.print(f"interrupted by {signal.Signals(signum).name}: {completed[0]} of "
                      f"{len(items) * len(runs)} requests completed"
                      + (f"; the trace in {trace} is readable to its last record" if trace else ""))
        raise typer.Exit(128 + signum)
    final = results[-1][1]
    if compare_plain:
        final["speedup_vs_plain"] = final["output_tokens_per_s"] / results[0][1]["output_tokens_per_s"]
    own = sum(it.params.synthetic() is not None for it in items)
    note = acceptance_note(cfg.model_dump(), own=own)
    if json_out:
        forced = synthetic_summary(cfg.model_dump(), own=own)
        if forced:  # the acceptance figures were forced: the JSON says so as the table does
            final["synthetic_acceptance"] = forced
        _print_json(final)
    else:
        _metrics_table("bench", results)
        if note:
            console.print(note)
        if trace:
            console.print(f"trace written to {trace}")
    fail_if_requests_failed(errors, len(items) * len(runs))


def _profile_file(profile: Path | None) -> str | None:
    """`--profile`: a cost profile's file, or a shipped profile's by name (simulator/profiles)."""
    if profile is None:
        return None
    from specsched.simulator.profiles import profile_path

    try:
        return str(profile_path(profile))
    except ValueError as e:
        _fail(f"--profile: {e}")


def _bench_endpoint(url: str, items, concurrency, rate, warmup: int, model: str | None, json_out: bool) -> None:
    """`bench --endpoint`: the workload over streaming HTTP; the table and keys of the embedded bench."""
    import anyio
    import httpx
    from rich.progress import Progress

    from specsched.runtime.server.client import run_endpoint

    if not url.startswith(("http://", "https://")):
        _fail(f"--endpoint {url!r}: expected an http:// or https:// URL")
    own = [it.source or str(i) for i, it in enumerate(items) if it.params.synthetic() is not None]
    if own:
        _fail(f"--endpoint: workload requests with their own synthetic acceptance ({own[0]}) cannot go over "
              "OpenAI's API; configure the server's engine instead")
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=5.0).raise_for_status()
    except httpx.HTTPError as e:
        _fail(f"--endpoint {url}: the server does not answer /health ({e})")
    if concurrency is None and rate is None:
        concurrency = 1
    with Progress(console=console, transient=True, disable=json_out) as progress:
        task = progress.add_task(url, total=len(items))
        metrics, records = anyio.run(lambda: run_endpoint(url, items, concurrency=concurrency, rate_qps=rate,
                                                          warmup=warmup, model=model,
                                                          on_done=lambda: progress.advance(task)))
    if json_out:
        _print_json(metrics)
    else:
        _metrics_table("bench", [(url, metrics)])
        console.print(f"ITL p50 {metrics['itl_ms']['p50'] or 0:.2f} ms, p99 {metrics['itl_ms']['p99'] or 0:.2f} ms "
                      "(client-side, between streamed chunks)")
    fail_if_requests_failed([r.error for r in records if r is not None and r.finish_reason == "error"], len(items))


async def _stop_on_signal(scope, received: list[int]) -> None:
    """SIGINT or SIGTERM cancels the run: the engine aborts what is in flight and closes its
    worker, the streamed trace keeps every record so far, and the command exits 128 + signal."""
    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            received.append(signum)
            scope.cancel()
            return


from specsched.cli import trace_cmds, sim_cmds, serve_cmd, train_cmds  # noqa: E402  (importing them registers their commands)

_COMMAND_MODULES = (trace_cmds, sim_cmds, serve_cmd, train_cmds)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
