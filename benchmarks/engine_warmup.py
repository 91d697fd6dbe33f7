"""The engine's start-up warm-up: the first requests' latency with it and without it.

For each configuration (plain decoding, the draft model under `overlap`, the MTP head under
`mtp`, the bundled models), an engine is started with its warm-up request (the default) and
with `skip_warmup=True`, in alternating rounds; each engine then serves the first bundled
prompts one after another (greedy, `--max-tokens` each). Printed per configuration, medians
over the rounds: the start (`async with` entered), the first request's time to first token
and its whole latency, and the second request's latency -- which neither engine's cold
launches touch any more.

    python benchmarks/engine_warmup.py [--rounds 3] [--max-tokens 16] [--configs none/sync draft/overlap mtp/eager_fill]
        [--device cuda --attention flashinfer --dtype bfloat16] [--processes [--cold-kernels]]

`--processes` starts every engine in a fresh Python process: on CUDA the first engine of a
process also pays what any later one finds done (the CUDA context, library handles, kernel
modules), so only a fresh process shows what a real start-up costs. `--cold-kernels` gives each
of those processes an empty kernel cache (`SPECSCHED_CACHE`): a CPU worker then builds its C
kernels (runtime/cpu_kernels.c) as on a machine's first start; without it the cache is the
user's, built once.
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_device_options, bundled_items, device_fields  # noqa: E402

CONFIGS = {  # name -> EngineConfig fields
    "none/sync": {"proposer": "none", "schedule": "sync"},
    "draft/overlap": {"proposer": "draft", "draft_len": 4, "schedule": "overlap"},
    "mtp/eager_fill": {"proposer": "mtp", "draft_len": 1, "schedule": "eager_fill"},
}


async def one_engine(config: dict, prompts: list[str], max_tokens: int) -> dict[str, float]:
    """Seconds: the start, and per request (served one after another) its first token and end."""
    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    async with AsyncEngine(EngineConfig.make(**config)) as eng:
        out = {"start": time.perf_counter() - t0}
        for i, prompt in enumerate(prompts):
            t1, first = time.perf_counter(), None
            async for piece in eng.generate(prompt, params):
                if first is None and piece.token_ids:
                    first = time.perf_counter() - t1
            out[f"ttft{i}"], out[f"latency{i}"] = first, time.perf_counter() - t1
    return out


def in_fresh_process(cfg: dict, prompts: list[str], max_tokens: int, cold_kernels: bool = False) -> dict[str, float]:
    """One engine in a fresh Python process (its figures come back as JSON on stdout); with
    `cold_kernels`, an empty kernel cache of its own."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SPECSCHED_CACHE": cache} if cold_kernels else None
        res = subprocess.run([sys.executable, __file__, "--one", json.dumps([cfg, prompts, max_tokens])],
                             capture_output=True, text=True, check=False, env=env)
    if res.returncode != 0:
        raise SystemExit(f"engine process failed ({cfg}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        cfg, prompts, max_tokens = json.loads(sys.argv[2])
        print(json.dumps(anyio.run(one_engine, cfg, prompts, max_tokens)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    add_device_options(ap)
    ap.add_argument("--processes", action="store_true", help="every engine in a fresh Python process")
    ap.add_argument("--cold-kernels", action="store_true", help="with --processes: each with an empty kernel cache")
    args = ap.parse_args()
    where = device_fields(args)
    if args.rounds < 1 or args.max_tokens < 1:
        ap.error("--rounds and --max-tokens must be >= 1")
    if args.cold_kernels and not args.processes:
        ap.error("--cold-kernels needs --processes (a process builds its kernels once)")
    prompts = [item.prompt for item in bundled_items(2, args.max_tokens)]
    runs: dict[tuple[str, bool], list[dict]] = {}
    for r in range(args.rounds):
        for name in args.configs:
            for skip in ((False, True) if r % 2 == 0 else (True, False)):
                cfg = CONFIGS[name] | where | {"skip_warmup": skip}
                run = (in_fresh_process(cfg, prompts, args.max_tokens, args.cold_kernels) if args.processes
                       else anyio.run(one_engine, cfg, prompts, args.max_tokens))
                runs.setdefault((name, skip), []).append(run)
    print(f"median of {args.rounds} rounds (alternating), ms; two requests of {args.max_tokens} tokens, one after another; "
          f"{args.device}, {args.attention} attention, {args.dtype}" + (", a process per engine" if args.processes else "")
          + (", each building its kernels" if args.cold_kernels else ""))
    print(f"{'config':>14} {'warm-up':>8} {'start':>8} {'1st TTFT':>9} {'1st latency':>12} {'2nd latency':>12}")
    for name in args.configs:
        for skip in (False, True):
            med = {k: statistics.median(run[k] for run in runs[(name, skip)]) * 1e3
                   for k in ("start", "ttft0", "latency0", "latency1")}
            print(f"{name:>14} {'no' if skip else 'yes':>8} {med['start']:>8.0f} {med['ttft0']:>9.1f} "
                  f"{med['latency0']:>12.1f} {med['latency1']:>12.1f}")


if __name__ == "__main__":
    main()
