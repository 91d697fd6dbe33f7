"""What every `specsched` command module shares: the typer app, errors, JSON output,
trace loading and the metrics table."""
from __future__ import annotations

import sys
from pathlib import Path

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


def _read_trace(path: Path):
    from traces.reader import TraceFormatError, read_trace

    try:
        return read_trace(path)
    except (TraceFormatError, OSError) as e:
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
