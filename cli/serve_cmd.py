"""`specsched serve`: the engine behind an OpenAI-compatible HTTP server (runtime/server/)."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer

from specsched.cli.common import (LOAD_FORMAT, SCHEDULE_HELP, SPECULATIVE_CONFIG, MAX_NUM_SEQS, MAX_MODEL_LEN, DTYPE, MAX_NUM_BATCHED_TOKENS, WORKER_MALLOC, WORKER_OPENMP, WORKER_LINEAR, WORKER_OPS, ENFORCE_EAGER, CUDA_GRAPH_SIZES, _fail, app,
                                  check_otlp_option, check_output_path, console, engine_config, parse_draft_len, user_errors)
from specsched.traces.names import PROPOSERS


@app.command()
@user_errors
def serve(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", help="target checkpoint dir, as `vllm serve "
                                              "MODEL` (or --model); default: bundled"),
    host: str = typer.Option("127.0.0.1", help="bind address (default: loopback only)"),
    port: int = typer.Option(8000),
    model: Optional[str] = typer.Option(None, help="target checkpoint dir (HF layout); default: bundled"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="the name clients "
                                                    "pass as `model` (default: the --model as given)"),
    spec: Optional[str] = typer.Option(None, help=f"proposer: {'|'.join(PROPOSERS)}"),
    draft_len: Optional[str] = typer.Option(None, "--draft-len", help="D, or 'auto'"),
    max_draft_len: Optional[int] = typer.Option(None, "--max-draft-len", help="with --draft-len auto"),
    draft: Optional[str] = typer.Option(None, help="draft checkpoint dir"),
    mtp_head: Optional[str] = typer.Option(None, "--mtp-head", help="MTP/EAGLE head dir"),
    schedule: Optional[str] = typer.Option(None, help=SCHEDULE_HELP),
    tp: Optional[int] = typer.Option(None, "--tp", "--tensor-parallel-size", help="tensor-parallel size"),
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
    trace: Optional[Path] = typer.Option(None, help="record the served requests' trace (JSONL), as bench --trace"),
    otlp: Optional[str] = typer.Option(None, help="export spans live over OTLP/HTTP to this URL, as bench --otlp "
                                       "(default: on when OTEL_EXPORTER_OTLP_ENDPOINT is set)"),
    shutdown_timeout: float = typer.Option(10.0, "--shutdown-timeout", min=0.0, help="on SIGTERM/SIGINT: "
                                           "seconds in-flight requests may finish before they are aborted"),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice", help="answer chat requests with "
                                                 "tools and tool_choice 'auto' (needs --tool-call-parser), as vLLM"),
    tool_call_parser: Optional[str] = typer.Option(None, "--tool-call-parser", help="the model's tool-call format, "
                                                   "for --enable-auto-tool-choice: hermes|llama3_json"),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="a Jinja chat template, or a file "
                                                "holding one, instead of the model's (tokenizer_config.json)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECSCHED_API_KEY", help="answer /v1 requests "
                                          "only with `Authorization: Bearer KEY`, as vLLM's --api-key"),
) -> None:
    """Serve the engine over HTTP: OpenAI's /v1/completions and /v1/chat/completions (streaming
    too), /v1/models, vLLM's /tokenize and /detokenize, /health and Prometheus /metrics."""
    import anyio
    import uvicorn

    from specsched.runtime import bundled
    from specsched.runtime.bench import make_header, model_label
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.server.app import build_app
    from specsched.runtime.server.chat import chat_template_of
    from specsched.runtime.server.metrics import ServerMetrics
    from specsched.traces.hook import MultiTracer
    from specsched.traces.otel_export import live_tracer
    from specsched.traces.recorder import TraceRecorder

    if model_arg is not None and model is not None and model_arg != model:
        _fail(f"two models: {model_arg!r} and --model {model!r}; give one")
    model = model if model is not None else model_arg
    if not 0 < port < 65536:
        raise typer.BadParameter(f"--port must be in 1..65535, got {port}")
    check_output_path(trace, "--trace")
    check_otlp_option(otlp)
    tool_parser = None
    if enable_auto_tool_choice:
        from specsched.runtime.server.tool_parsers import make_parser

        if tool_call_parser is None:
            raise typer.BadParameter("--enable-auto-tool-choice needs --tool-call-parser (hermes|llama3_json)")
        try:
            tool_parser = make_parser(tool_call_parser)
        except ValueError as e:
            raise typer.BadParameter(f"--tool-call-parser: {e}")
    elif tool_call_parser is not None:
        raise typer.BadParameter("--tool-call-parser is used with --enable-auto-tool-choice")
    cfg = engine_config(model=model, proposer=spec, draft_len=parse_draft_len(draft_len), max_draft_len=max_draft_len,
                        draft=draft, mtp_head=mtp_head, schedule=schedule, tensor_parallel_size=tp,
                        config_file=config_file, speculative_config=speculative_config, load_format=load_format,
                        worker_malloc=worker_malloc, worker_openmp=worker_openmp, worker_linear=worker_linear,
                        worker_ops=worker_ops,
                        enforce_eager=enforce_eager, cuda_graph_sizes=cuda_graph_sizes,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, dtype=dtype)
    name = served_model_name or (cfg.model if cfg.model else model_label(str(bundled.target_dir())))
    template, whose = chat_template_of(cfg.model or bundled.target_dir()), "the model's chat_template (tokenizer_config.json)"
    if chat_template is not None:
        template, whose = _chat_template_arg(chat_template)
    if template is not None:
        import jinja2.sandbox

        try:
            jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template)
        except jinja2.TemplateError as e:
            _fail(f"{whose} does not compile: {e}")

    async def main() -> None:
        recorder = live = None
        metrics = ServerMetrics(name)  # also the engine's tracer: it counts each verify step
        async with AsyncEngine(cfg, tracer=metrics) as engine:
            header = make_header(cfg, engine, workload={"server": True})
            if trace:
                recorder = TraceRecorder(str(trace), header)
            live = live_tracer(header, otlp)
            if recorder is not None or live is not None:
                engine.set_tracer(MultiTracer(metrics, *(t for t in (recorder, live) if t is not None)))
            server = uvicorn.Server(uvicorn.Config(build_app(engine, name, template, metrics, tool_parser, api_key), host=host, port=port,
                                                   log_level="warning", timeout_graceful_shutdown=shutdown_timeout,
                                                   lifespan="off"))
            console.print(f"specsched: serving {name!r} on http://{host}:{port} (OpenAI API under /v1)")
            try:
                await server.serve()
            finally:
                console.print("specsched: stopping: requests still in flight are aborted")
        for t in (recorder, live):  # after the engine: every request's finish is recorded
            if t is not None:
                t.close()  # the live exporter's drain is bounded: a dead collector cannot hold the exit

    # uvicorn re-raises the signal that stopped it once it has shut down; a no-op handler makes
    # that a clean exit (status 0) instead of a kill by the signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    anyio.run(main)


def _chat_template_arg(value: str) -> tuple[str, str]:
    """--chat-template's template and how to name it: a file's text, or the value itself if it is a template."""
    try:
        if Path(value).is_file():
            return Path(value).read_text(), value
    except OSError:  # a template too long for a file name
        pass
    if "{" not in value:
        raise typer.BadParameter(f"--chat-template {value!r}: no such file, and not a Jinja template")
    return value, "--chat-template"
