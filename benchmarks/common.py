"""Helpers shared by the benchmark scripts: run one engine configuration on the bundled
workload and return its metrics and trace; put another checkout's code on the path of a
subprocess, for side-by-side runs."""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio


def parse_workload(ap, num_requests: int, max_tokens: int):
    """Add the workload options every engine benchmark takes (bundled prompts), parse the
    command line, and load the items: returns (args, items)."""
    ap.add_argument("--num-requests", type=int, default=num_requests, help="prompts from the bundled workload")
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="output tokens per request")
    args = ap.parse_args()
    return args, bundled_items(args.num_requests, args.max_tokens)


DEVICE_FIELDS = ("device", "attention", "dtype")  # EngineConfig fields the device options set


def add_device_options(ap) -> None:
    """--device, --attention and --dtype, with EngineConfig's defaults and choices."""
    from typing import get_args

    from specsched.runtime.engine_config import EngineConfig

    for name in DEVICE_FIELDS:
        field = EngineConfig.model_fields[name]
        ap.add_argument(f"--{name}", default=field.default, choices=get_args(field.annotation))


def device_fields(args) -> dict:
    """The EngineConfig fields `add_device_options` parsed."""
    return {name: getattr(args, name) for name in DEVICE_FIELDS}


def bundled_items(num_requests: int, max_tokens: int, temperature: float | None = None):
    """The bundled workload's first `num_requests` prompts, `max_tokens` each; `temperature`:
    every request sampled at it (None: the workload's own, greedy)."""
    from specsched.runtime import bundled
    from specsched.runtime.workload import load_workload

    return load_workload(bundled.workload_path(), limit=num_requests, max_tokens=max_tokens, temperature=temperature)


def run(items, *, concurrency: int = 1, warmup: int = 1, trace: bool = True, engine_factory=None, **engine_kw):
    """(metrics, trace) of one engine run; engine_kw go to EngineConfig, `engine_factory`
    (default AsyncEngine) builds the engine from it."""
    from specsched.runtime.bench import run_workload
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig

    cfg = EngineConfig.make(**engine_kw)
    metrics, tr, _ = anyio.run(lambda: run_workload(cfg, items, concurrency=concurrency, warmup=warmup,
                                                    agreement=trace, record=trace,
                                                    engine_factory=engine_factory or AsyncEngine))
    return metrics, tr


def family_kw(family: Path | None, proposer: str) -> dict:
    """EngineConfig checkpoint options for a model family folder laid out like runtime/bundled
    (target/, draft/, mtp/); None: the bundled family."""
    if family is None:
        return {}
    kw = {"model": str(family / "target")}
    if proposer == "draft":
        kw["draft"] = str(family / "draft")
    if proposer in ("mtp", "eagle"):
        kw["mtp_head"] = str(family / "mtp")
    return kw


def med(values) -> float:
    """The median of an iterable (rounds of a benchmark)."""
    return statistics.median(list(values))


def median_span_ms(trace, name: str, track_prefix: str = "device:") -> float | None:
    vals = [(s.end_ns - s.start_ns) / 1e6 for s in trace.spans if s.name == name and s.track.startswith(track_prefix)]
    return statistics.median(vals) if vals else None


def specsched_path(checkout: Path, workdir: Path) -> str:
    """A folder in which `specsched` is `checkout`'s code, to put first on PYTHONPATH."""
    pkg = workdir / "specsched"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in ("scheduler", "runtime", "traces", "simulator", "cli"):
        if not (pkg / name).exists():
            (pkg / name).symlink_to(checkout.resolve() / name)
    return str(workdir)


def best_of(call, repeats: int, min_seconds: float = 0.0) -> tuple[float, float, int, Any]:
    """`call()` at least `repeats` times, and on until the calls have taken `min_seconds` of
    CPU, each after a garbage collection: (least CPU seconds, least wall seconds, calls, the
    last call's result)."""
    cpu = wall = float("inf")
    done, spent, out = 0, 0.0, None
    while done < repeats or spent < min_seconds:
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        out = call()
        w1, c1 = time.perf_counter(), time.process_time()
        cpu, wall = min(cpu, c1 - c0), min(wall, w1 - w0)
        done, spent = done + 1, spent + (c1 - c0)
    return cpu, wall, done, out


def add_side_by_side_options(ap) -> None:
    """`--baseline CHECKOUT` and `--rounds N` for `side_by_side`, and the hidden `--json` mode
    each of its processes runs in (one process's raw figures on its last line)."""
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. a git worktree of an earlier "
                    "commit) measured side by side, in alternating processes")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline: alternating rounds (medians)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)


def side_by_side(cmd: list[str], baseline: Path, rounds: int) -> dict[str, list]:
    """Run `cmd` (a script's `--json` mode, printing one JSON value on its last line) in
    alternating processes -- this checkout, then `baseline`'s code, then the other way round --
    for `rounds` rounds: {"this": [value per round], "baseline": [...]}. A failing run exits
    with its error output."""
    runs: dict[str, list] = {"this": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {"this": dict(os.environ), "baseline": baseline_env(baseline, Path(tmp))}
        for r in range(rounds):
            for name in (("this", "baseline") if r % 2 == 0 else ("baseline", "this")):
                runs[name].append(run_json(cmd, envs[name], name))
    return runs


def baseline_env(checkout: Path, workdir: Path) -> dict:
    """This process's environment with `checkout`'s code first on PYTHONPATH (see `specsched_path`)."""
    return {**os.environ, "PYTHONPATH": specsched_path(checkout, workdir)}


def run_json(cmd: list[str], env: dict, name: str):
    """Run `cmd` in `env`; the JSON value on its last line. A failing run exits with its error
    output (`name` says which run it was)."""
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"the {name} run failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
