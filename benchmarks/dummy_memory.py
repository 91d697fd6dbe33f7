"""Dummy weights at a published shape: the worker's peak memory against the weights it holds.

Starts an engine with `load_format="dummy"` on a shipped shape (default the Llama-3.2-1B-shaped
target in bfloat16; `runtime/shapes`), generates `--max-tokens` tokens for one prompt of token
ids (greedy, EOS ignored: a dummy model's tokens mean nothing), and closes it. The engine's
worker is a child process of its own (`runtime/devices/process.py`), so its peak resident set
is the kernel's figure for the children this process waited for (`RUSAGE_CHILDREN`): start-up
(Python and torch), the weights made in place, the KV pool and the forwards. The weights' size
is the model's parameters built on torch's meta device (no memory). The KV pool is kept small
(`--num-pages`, printed): it is sized by the user, not by the loader. Each configuration runs in
a fresh process of this script (`--one`), so one's peak is not another's.

    python benchmarks/dummy_memory.py [--shapes llama-3.2-1b] [--dtype bfloat16] [--max-tokens 8]
        [--num-pages 64]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

GIB = 1024**3


def weights_bytes(shape: str, dtype: str) -> int:
    """Bytes of the shape's parameters in `dtype` (built on the meta device: nothing allocated)."""
    import torch

    from specsched.runtime.checkpoint import load_config
    from specsched.runtime.model import LlamaModel
    from specsched.runtime.shapes import shape_dir

    model = LlamaModel(load_config(shape_dir(shape)), device="meta", dtype=getattr(torch, dtype))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def one(shape: str, dtype: str, max_tokens: int, num_pages: int) -> dict:
    """One engine: start, generate, close; the worker's peak RSS and the timings."""
    import anyio

    from specsched.runtime.engine import AsyncEngine
    from specsched.runtime.engine_config import EngineConfig
    from specsched.scheduler.sampling_params import SamplingParams

    config = EngineConfig.make(model=shape, load_format="dummy", dtype=dtype, num_pages=num_pages, skip_warmup=True)

    async def main() -> dict:
        t0 = time.perf_counter()
        async with AsyncEngine(config) as engine:
            t1 = time.perf_counter()
            out = await engine.generate_all(list(range(1, 17)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            t2 = time.perf_counter()
        return {"start_s": t1 - t0, "generate_s": t2 - t1, "tokens": len(out.token_ids)}

    got = anyio.run(main)
    got["worker_peak_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b"], help="shipped shapes (runtime/shapes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=64, help="the KV pool (pages of 16 tokens)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one shape in this process, JSON on the last line
    args = ap.parse_args()
    if args.max_tokens < 1 or args.num_pages < 2:
        ap.error("--max-tokens must be >= 1 and --num-pages >= 2")
    if args.one:
        print(json.dumps(one(args.one, args.dtype, args.max_tokens, args.num_pages)))
        return
    from specsched.runtime.shapes import SHAPES

    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; shipped: {', '.join(sorted(SHAPES))}")
    print(f"dummy weights in {args.dtype}, KV pool {args.num_pages} pages of 16 tokens; "
          f"{args.max_tokens} tokens at batch 1; the worker's peak resident set")
    print(f"{'shape':>18} {'weights GiB':>11} {'peak GiB':>9} {'peak/weights':>12} {'start s':>8} {'tok/s':>7}")
    for shape in args.shapes:
        res = subprocess.run([sys.executable, __file__, "--one", shape, "--dtype", args.dtype, "--max-tokens",
                              str(args.max_tokens), "--num-pages", str(args.num_pages)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"{shape}: the engine failed:\n{res.stderr[-3000:]}")
        got = json.loads(res.stdout.splitlines()[-1])
        if got["tokens"] != args.max_tokens:
            sys.exit(f"{shape}: generated {got['tokens']} tokens, asked for {args.max_tokens}")
        w = weights_bytes(shape, args.dtype)
        print(f"{shape:>18} {w / GIB:>11.2f} {got['worker_peak_bytes'] / GIB:>9.2f} "
              f"{got['worker_peak_bytes'] / w:>11.2f}x {got['start_s']:>8.1f} {got['tokens'] / got['generate_s']:>7.1f}")


if __name__ == "__main__":
    main()
