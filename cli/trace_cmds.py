"""Trace commands: stats, export (Chrome/Perfetto, OpenTelemetry), timeline pictures."""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Optional

import typer

from specsched.cli.common import (_fail, _metrics_table, _print_json, acceptance_note, app, check_otlp_option,
                                  check_output_path, console, synthetic_summary, user_errors)


@app.command()
@user_errors
def stats(trace: Path, json_out: bool = typer.Option(False, "--json")) -> None:
    """Metrics of a trace (the same keys as `bench --json`)."""
    from specsched.traces.metrics import compute_metrics_file

    _check_readable(trace)
    with _truncation_note(trace):
        m = compute_metrics_file(trace)  # streamed: memory bounded whatever the file's length
    from specsched.traces.reader import iter_records

    header = next(iter_records(trace, allow_truncated_tail=True))
    if json_out:
        forced = synthetic_summary(header.engine_config, header.extra)
        if forced:  # the acceptance figures were forced: the JSON says so as the table does
            m["synthetic_acceptance"] = forced
        _print_json(m)
    else:
        _metrics_table(str(trace), [(trace.name, m)])
        note = acceptance_note(header.engine_config, header.extra)
        if note:
            console.print(note)


@app.command()
@user_errors
def export(
    trace: Path,
    chrome: Optional[Path] = typer.Option(None, help="Chrome/Perfetto trace JSON"),
    otel_json: Optional[Path] = typer.Option(None, "--otel-json", help="OTLP/JSON file"),
    otlp: Optional[str] = typer.Option(None, help="OTLP/HTTP endpoint, e.g. http://localhost:4318/v1/traces"),
) -> None:
    """Export a trace to Perfetto / chrome://tracing or OpenTelemetry."""
    from specsched.traces.otlp_json import OtlpExportError, export_otel_json, export_otlp

    if not (chrome or otel_json or otlp):
        _fail("choose at least one of --chrome, --otel-json, --otlp")
    check_output_path(chrome, "--chrome")
    check_output_path(otel_json, "--otel-json")
    check_otlp_option(otlp)
    _check_readable(trace)
    if chrome:
        from specsched.traces.chrome import write_chrome_trace

        with _truncation_note(trace):
            write_chrome_trace(trace, chrome)  # streamed: memory bounded whatever the file's length
        console.print(f"wrote {chrome} (open it in https://ui.perfetto.dev or chrome://tracing)")
    # OpenTelemetry exports stream the file: memory stays bounded whatever its length
    if otel_json:
        n = export_otel_json(trace, otel_json)
        console.print(f"wrote {n} spans to {otel_json}")
    if otlp:
        try:
            n = export_otlp(trace, otlp)
        except OtlpExportError as e:  # the collector refused, failed or did not answer
            _fail(f"--otlp {otlp}: {e}")
        console.print(f"sent {n} spans to {otlp}")


@contextlib.contextmanager
def _truncation_note(trace: Path):
    """A streamed read of a file whose last line is cut off (a killed run) says so once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    if any("truncated final line" in str(w.message) for w in caught):
        console.print(f"[yellow]note:[/] {trace}: the last line is cut off (the run was interrupted?); "
                      "read the records before it")


def _check_readable(trace: Path) -> None:
    """A trace that is not there, or has no valid header, fails before any output is made."""
    from specsched.traces.reader import TraceFormatError, iter_records

    try:
        next(iter_records(trace))
    except (TraceFormatError, OSError) as e:
        _fail(str(e))


@app.command()
@user_errors
def timeline(
    trace: Path,
    out: Path = typer.Option(Path("timeline.png"), "-o", "--out"),
    steps: Optional[str] = typer.Option(None, help="window of steps A:B"),
) -> None:
    """A picture of host and device lanes over a window of steps."""
    from specsched.traces.timeline import plot_timeline

    window = _parse_steps(steps) if steps else None
    check_output_path(out, "--out")
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = out.suffix.lstrip(".").lower()
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        _fail(f"--out {out}: unknown picture format {fmt!r}; use one of {', '.join(sorted(supported))}")
    from specsched.traces.reader import TraceFormatError

    try:
        with _truncation_note(trace):
            plot_timeline(trace, out, steps=window)  # streamed: memory bounded by the window
    except TraceFormatError:
        raise  # a bad trace line: user_errors names the file and line
    except ValueError as e:  # e.g. a window of steps the trace does not have
        _fail(f"--steps {steps} ({e})" if steps else str(e))
    console.print(f"wrote {out}")


def _parse_steps(steps: str) -> tuple[int, int]:
    """`--steps A:B` as (A, B), checked before any work: step numbers count from 0 and the
    window runs forward. (The messages never put ':' right after the value: rich would turn
    e.g. `-3:-1:` into an emoji.)"""
    try:
        a, b = steps.split(":")
        first, last = int(a), int(b)
    except ValueError:
        _fail("--steps takes A:B (two step numbers)")
    if first < 0 or last < 0:
        _fail(f"--steps {steps} has a negative step number; steps count from 0")
    if first > last:
        _fail(f"--steps {steps} is reversed: first step is after last step; use {last}:{first}")
    return first, last
