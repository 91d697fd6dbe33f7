"""Trace commands: stats, export (Chrome/Perfetto, OpenTelemetry), timeline pictures."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specsched.cli.common import _fail, _metrics_table, _print_json, _read_trace, app, check_output_path, console, user_errors


@app.command()
@user_errors
def stats(trace: Path, json_out: bool = typer.Option(False, "--json")) -> None:
    """Metrics of a trace (the same keys as `bench --json`)."""
    from specsched.traces.metrics import compute_metrics

    m = compute_metrics(_read_trace(trace))
    if json_out:
        _print_json(m)
    else:
        _metrics_table(str(trace), [(trace.name, m)])


@app.command()
@user_errors
def export(
    trace: Path,
    chrome: Optional[Path] = typer.Option(None, help="Chrome/Perfetto trace JSON"),
    otel_json: Optional[Path] = typer.Option(None, "--otel-json", help="OTLP/JSON file"),
    otlp: Optional[str] = typer.Option(None, help="OTLP/HTTP endpoint, e.g. http://localhost:4318/v1/traces"),
) -> None:
    """Export a trace to Perfetto / chrome://tracing or OpenTelemetry."""
    if not (chrome or otel_json or otlp):
        _fail("choose at least one of --chrome, --otel-json, --otlp")
    check_output_path(chrome, "--chrome")
    check_output_path(otel_json, "--otel-json")
    tr = _read_trace(trace)
    if chrome:
        from specsched.traces.chrome import write_chrome_trace

        write_chrome_trace(tr, chrome)
        console.print(f"wrote {chrome} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if otel_json:
        from specsched.traces.otel_export import export_otel_json

        export_otel_json(tr, otel_json)
        console.print(f"wrote {otel_json}")
    if otlp:
        from specsched.traces.otel_export import export_otlp

        try:
            n = export_otlp(tr, otlp)
        except RuntimeError as e:  # the collector refused or was not there
            _fail(f"--otlp {otlp}: {e}")
        console.print(f"sent {n} spans to {otlp}")


@app.command()
@user_errors
def timeline(
    trace: Path,
    out: Path = typer.Option(Path("timeline.png"), "-o", "--out"),
    steps: Optional[str] = typer.Option(None, help="window of steps A:B"),
) -> None:
    """A picture of host and device lanes over a window of steps."""
    from specsched.traces.timeline import plot_timeline

    window = None
    if steps:
        try:
            a, b = steps.split(":")
            window = (int(a), int(b))
        except ValueError:
            _fail("--steps takes A:B (two step numbers)")
    check_output_path(out, "--out")
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = out.suffix.lstrip(".").lower()
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        _fail(f"--out {out}: unknown picture format {fmt!r}; use one of {', '.join(sorted(supported))}")
    tr = _read_trace(trace)
    try:
        plot_timeline(tr, out, steps=window)
    except ValueError as e:  # e.g. a window of steps the trace does not have
        _fail(f"--steps {steps}: {e}" if steps else str(e))
    console.print(f"wrote {out}")
