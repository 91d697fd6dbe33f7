"""What every `specsched` command module shares: the typer app, errors, JSON output,
trace loading and the metrics table."""
from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import orjson
import typer
from rich.console import Console

from specsched.traces.names import SCHEDULE_ALIASES, SCHEDULES

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="specsched: the CPU side of speculative decoding (engine, traces, simulator).")
console = Console(stderr=True)

SCHEDULE_HELP = (f"{'|'.join(SCHEDULES)} (default: the proposer's natural one; "
                 + ", ".join(f"{old!r} = {new!r}" for old, new in SCHEDULE_ALIASES.items()) + ")")


# options the commands that run an engine share (generate, bench, serve)
LOAD_FORMAT = typer.Option(None, "--load-format", help="auto | dummy: random weights from config.json alone "
                           "(--model may name a shipped shape: llama-3.2-1b, llama-3.1-8b)")
WORKER_MALLOC = typer.Option(None, "--worker-malloc", help="the worker process's allocator: auto (tcmalloc "
                             "where installed) | system | a library's path")
WORKER_OPENMP = typer.Option(None, "--worker-openmp", help="the worker process's OpenMP runtime: system "
                             "(torch's) | auto (Intel's libiomp5 where installed) | a library's path")
WORKER_OPS = typer.Option(None, "--worker-ops", help="the worker's float32 RMSNorm, RoPE and SiLU-and-multiply: "
                          "auto (in C where a compiler builds runtime/cpu_kernels.c) | torch")
WORKER_LINEAR = typer.Option(None, "--worker-linear", help="the worker's float32 linear layers: auto (weights "
                             "also packed for the C kernel or oneDNN) | torch (F.linear alone)")
ENFORCE_EAGER = typer.Option(False, "--enforce-eager", help="every step at its own shape: no CUDA graphs "
                             "(nor their padded shapes)")
CUDA_GRAPH_SIZES = typer.Option(None, "--cuda-graph-sizes", help="pad steps of uniform rows to these row counts, "
                                "the CUDA graphs' capture sizes, e.g. 1,2,4,8 (on a CPU the padded shapes run "
                                "eagerly)")
SPECULATIVE_CONFIG = typer.Option(None, "--speculative-config", help="vLLM's speculative config as JSON, e.g. "
                                  "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
MAX_NUM_SEQS = typer.Option(None, "--max-num-seqs", min=1, help="requests a step may hold, as vLLM's (default 64)")
DTYPE = typer.Option(None, "--dtype", help="the models' weights and activations: float32 (default) | bfloat16")
MAX_MODEL_LEN = typer.Option(None, "--max-model-len", min=2, help="the longest sequence (prompt and output) served, "
                             "as vLLM's (default: the model's max_position_embeddings)")
MAX_NUM_BATCHED_TOKENS = typer.Option(None, "--max-num-batched-tokens", min=1, help="tokens a step may compute, "
                                      "1 + D a verifying row, as vLLM's (default 2048)")


@app.callback()
def _start_up_lines() -> None:
    """The engine's start-up line (the worker's libraries) on stderr, as `specsched: ...`."""
    log = logging.getLogger("specsched")
    if not any(isinstance(h, _StderrLines) for h in log.handlers):
        log.addHandler(_StderrLines())
        log.setLevel(logging.INFO)


class _StderrLines(logging.Handler):
    """Each record as one `specsched: ...` line on the sys.stderr of the moment."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(f"specsched: {record.getMessage()}\n")


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2)


def fail_if_requests_failed(errors: list[str], total: int) -> None:
    """After a command's normal output: requests that ended in `error` (a failed device op, a
    crashed worker) end it with exit status 1 and one line on stderr saying how many failed
    and the first error. Exit status 2 stays for input errors."""
    if errors:
        console.print(f"[red]error:[/red] {len(errors)} of {total} requests failed; first error: {errors[0]}")
        raise typer.Exit(1)


def _user_error_types() -> tuple[type, ...]:
    """Errors a user's input causes (a bad request, config, checkpoint, trace, a path that is
    not there): reported as one line, never a traceback. Classes of modules not imported
    yet cannot have been raised, so they are not imported for the check."""
    from specsched.scheduler.errors import ConfigurationError, InvalidRequestError
    from specsched.scheduler.protocols import DeviceError

    types: list[type] = [InvalidRequestError, ConfigurationError, DeviceError, OSError]
    for module, name in (("specsched.runtime.checkpoint", "CheckpointError"), ("specsched.traces.reader", "TraceFormatError")):
        if module in sys.modules:
            types.append(getattr(sys.modules[module], name))
    return tuple(types)


def _first_leaf(exc: BaseException, types: tuple[type, ...]) -> BaseException | None:
    """`exc` if it is one of `types`, else the first such error inside an exception group
    (a task group wraps what a request or the engine raised)."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _first_leaf(sub, types)
            if found is not None:
                return found
        return None
    return exc if isinstance(exc, types) else None


def user_errors(fn):
    """Decorates a command: an error caused by its input ends it with `error: <message>` and
    exit status 2 -- also when an anyio task group wrapped it -- instead of a traceback."""
    import click

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised unless it is a user error
            leaf = _first_leaf(e, (click.exceptions.Exit, click.ClickException))
            if leaf is e:
                raise
            if leaf is not None:
                raise leaf from None  # an Exit (from _fail) raised inside a task group
            err = _first_leaf(e, _user_error_types())
            if err is None:
                raise
            _fail(str(err) or type(err).__name__)

    return wrapper


def check_output_path(path: Path | None, option: str) -> None:
    """Fail before any work when an output file cannot be written where it is asked for (a
    run that fails only at its end loses the run)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        _fail(f"{option} {path}: is a directory, not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        _fail(f"{option} {path}: folder {parent} does not exist")


def int_or_word(option: str, value: str | None, word: str, what: str = "a non-negative integer") -> int | str | None:
    """An option that takes a non-negative integer or one word ('auto', 'ray'); a clear error
    naming the option otherwise."""
    if value is None or value == word:
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        _fail(f"{option} must be {what} or {word!r}, got {value!r}")
    return n


def parse_draft_len(value: str | None) -> int | str | None:
    """--draft-len: a non-negative integer or 'auto'."""
    return int_or_word("--draft-len", value, "auto")


def engine_config(**kw):
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.errors import ConfigurationError

    config_file = kw.pop("config_file", None)
    if kw.pop("enforce_eager", None):
        kw["cuda_graphs"] = False
    sizes = kw.pop("cuda_graph_sizes", None)
    if sizes is not None:
        try:
            kw["cuda_graph_sizes"] = [int(s) for s in sizes.split(",")]
        except ValueError:
            _fail(f"--cuda-graph-sizes {sizes!r}: expected row counts separated by commas, e.g. 1,2,4,8")
        kw.setdefault("cuda_graphs", True)
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
    """A trace file, or a one-line error naming the file, line and field. A run that was
    killed mid-write leaves a cut-off last line: the records before it are read, with a note."""
    import warnings

    from specsched.traces.reader import TraceFormatError, read_trace

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the note below says it once, in plain words
            trace = read_trace(path, allow_truncated_tail=True)
    except (TraceFormatError, OSError) as e:
        _fail(str(e))
    if trace.truncated:
        console.print(f"[yellow]note:[/] {path}: the last line is cut off (the run was interrupted?); "
                      "read the records before it")
    return trace


def check_otlp_option(otlp: str | None) -> None:
    """An `--otlp` URL checked before anything runs: one `error:` line naming the problem."""
    if otlp:
        from specsched.traces.otlp_json import check_otlp_url

        try:
            check_otlp_url(otlp)
        except ValueError as e:
            _fail(f"--otlp: {e}")


def narrow_table(title: str):
    """A rich Table that spends no width on rules or edges (the padding between columns collapsed), for tables that
    must fit an 80-column terminal."""
    from rich import box
    from rich.table import Table

    return Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)


def _metrics_table(title: str, rows: list[tuple[str, dict]]) -> None:
    # fits 80 columns with a run's name of up to 24 characters; the numbers' headers take two lines
    t = narrow_table(title)
    t.add_column("run", justify="right", min_width=min(24, max((len(name) for name, _ in rows), default=3)))
    for col in ("tok/s", "TTFT\np50 ms", "TPOT\np50 ms", "mean\nAL", "bubble", "host\nms/step", "speedup"):
        t.add_column(col, justify="right", no_wrap=True)
    for name, m in rows:
        al = m.get("mean_accept_len")
        t.add_row(name, _num(m["output_tokens_per_s"], ".1f"), _num(m["ttft_ms"]["p50"], ".1f"),
                  _num(m["tpot_ms"]["p50"], ".2f"), f"{al:.2f}" if al else "-",
                  f"{m['bubble_fraction']:.3f}" if m.get("bubble_fraction") is not None else "-",
                  f"{m['host_ms_per_step'].get('total', 0):.2f}" if m.get("host_ms_per_step") is not None else "-",
                  f"{m['speedup_vs_plain']:.2f}x" if m.get("speedup_vs_plain") else "-")
    Console().print(t)
    for name, m in rows:
        counts = m.get("draft_len_counts")
        if counts:  # the adaptive draft length's choices
            total = sum(counts.values())
            shares = ", ".join(f"D={d}: {n} ({100 * n / total:.0f}%)" for d, n in counts.items())
            Console().print(f"{name}: steps by chosen draft length: {shares}")


def acceptance_note(engine_config: dict, extra: dict | None = None, own: int = 0) -> str | None:
    """"acceptance: synthetic (...)" for a run whose acceptance was forced (an engine's
    `acceptance="synthetic"`, or a replay's `--acceptance synthetic:...`), else None: its
    acceptance figures are what was asked for, not what a proposer reached. `own`: how many
    requests set their own (the workload's `synthetic_acceptance_*`)."""
    c = engine_config or {}
    if c.get("acceptance") == "synthetic":
        length, rates = c.get("synthetic_acceptance_length"), c.get("synthetic_acceptance_rates")
        what = f"AL {length:g}" if length is not None else "rates " + ", ".join(f"{r:g}" for r in rates or ())
        mine = f"; {own} requests their own" if own else ""
        return f"acceptance: synthetic ({what}{', independent' if c.get('synthetic_acceptance_independent') else ''}{mine})"
    simulated = (extra or {}).get("acceptance")
    if isinstance(simulated, str) and "synthetic:" in simulated:
        return f"acceptance: {simulated} (simulated)"
    return None


def synthetic_summary(engine_config: dict, extra: dict | None = None, own: int | None = None) -> dict | None:
    """The `synthetic_acceptance` key of `bench --json` and `stats --json`: what a run's forced
    acceptance was (None for a run that was not forced): the engine's setting, or a replay's."""
    c = engine_config or {}
    out: dict | None = None
    if c.get("acceptance") == "synthetic":
        out = {"length": c.get("synthetic_acceptance_length"), "rates": c.get("synthetic_acceptance_rates"),
               "independent": bool(c.get("synthetic_acceptance_independent", False))}
    simulated = (extra or {}).get("acceptance")
    if isinstance(simulated, str) and simulated.startswith("synthetic:"):
        out = {"simulated": simulated}
    if out is not None and own is not None:
        out["requests_with_their_own"] = own
    return out


def _num(value, fmt: str) -> str:
    """A number for a table cell; "-" for a metric a run does not have (no finished request)."""
    return "-" if value is None else format(value, fmt)
