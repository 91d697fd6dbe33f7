"""The worker's native libraries and kernels side by side: engine tokens/s with each
allocator / OpenMP runtime / linear-layer path / attention backend.

Runs the bundled model on the bundled workload (closed loop at each concurrency) with the worker
started as `--variants` name them (`EngineConfig.worker_malloc` / `worker_openmp`: "system", "auto"
or a library's path; `worker_linear`: "auto", the weights packed for the C linear kernel, or
"torch"; `ops`: the layer's small ops, "auto" (in C) or "torch"; `attention`: "auto", the C kernel
where it builds, "cpu" or "torch"), in interleaved rounds whose order turns every round, and prints each
variant's median output tokens/s and its ratio to the first variant (median of the per-round
ratios, range in brackets). The worker's start-up report says what each variant ran with.

    python benchmarks/worker_libs.py [--rounds 5] [--concurrency 1 8] [--configs none/sync draft/overlap]
    python benchmarks/worker_libs.py --variants malloc=system malloc=auto openmp=auto
    python benchmarks/worker_libs.py --variants malloc=auto,linear=torch malloc=auto,linear=auto
    python benchmarks/worker_libs.py --variants malloc=auto,attention=torch,ops=torch malloc=auto,ops=torch malloc=auto

A variant that resolves to the same libraries as the first (e.g. "auto" where nothing is
installed) is reported as such and not run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bundled_items, run  # noqa: E402
from engine_ab import CONFIGS  # noqa: E402


FIELDS = {"malloc": "worker_malloc", "openmp": "worker_openmp", "linear": "worker_linear", "ops": "worker_ops",
          "attention": "attention"}


def parse_variant(text: str) -> dict[str, str]:
    """'malloc=auto,openmp=system' -> EngineConfig fields (unnamed libraries 'system', an
    unnamed linear, ops or attention 'auto')."""
    fields = {"worker_malloc": "system", "worker_openmp": "system", "worker_linear": "auto", "worker_ops": "auto",
              "attention": "auto"}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in FIELDS or not value:
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected {'=..., '.join(FIELDS)}=... (any of them)")
        fields[FIELDS[key]] = value
    return fields


def resolved(fields: dict[str, str]) -> tuple:
    from specsched.runtime.devices.native import MALLOC_NAMES, OPENMP_NAMES, resolve

    return (resolve(fields["worker_malloc"], MALLOC_NAMES, "malloc"),
            resolve(fields["worker_openmp"], OPENMP_NAMES, "openmp"), fields["worker_linear"], fields["worker_ops"],
            fields["attention"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["malloc=system", "malloc=auto"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["none/sync"])
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    try:
        variants = {v: parse_variant(v) for v in args.variants}
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    base_name = args.variants[0]
    base_libs = resolved(variants[base_name])
    for name in args.variants[1:]:
        if resolved(variants[name]) == base_libs:
            print(f"{name}: the same libraries as {base_name} on this machine ({base_libs}); not run")
            del variants[name]
    if len(variants) < 2:
        print("nothing to compare: install tcmalloc (e.g. libtcmalloc-minimal4) or name a library's path")
        return
    print(f"{args.num_requests} bundled requests x {args.max_tokens} tokens, {args.rounds} interleaved rounds; "
          f"preloads: " + "; ".join(f"{n} -> {', '.join(p for p in resolved(f)[:2] if p) or 'none'}, "
                                      f"linear {f['worker_linear']}, ops {f['worker_ops']}, attention {f['attention']}"
                                      for n, f in variants.items()))
    tps: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        order = list(variants.items())[:: 1 if r % 2 == 0 else -1]
        for c in args.concurrency:
            items = bundled_items(max(args.num_requests, c), args.max_tokens)
            for config in args.configs:
                for name, fields in order:
                    m, _ = run(items, concurrency=c, warmup=1, trace=False, **CONFIGS[config], **fields)
                    tps.setdefault((config, c, name), []).append(m["output_tokens_per_s"])
    w = max(7, *map(len, variants))
    print(f"{'config':>16} {'batch':>5} {'variant':>{w}} {'tok/s':>8} {'ratio':>7} {'range':>12}")
    for config in args.configs:
        for c in args.concurrency:
            base = tps[(config, c, base_name)]
            for name in variants:
                vals = tps[(config, c, name)]
                ratios = [v / b for v, b in zip(vals, base)]
                print(f"{config:>16} {c:>5} {name:>{w}} {statistics.median(vals):>8.1f} "
                      f"{statistics.median(ratios):>6.2f}x {min(ratios):>5.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
