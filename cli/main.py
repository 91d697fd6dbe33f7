"""The `specsched` command: a thin typer layer over the engine, traces and simulator."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import orjson
import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
