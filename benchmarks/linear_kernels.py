"""The linear layers' kernels side by side: specsched's C kernel, oneDNN, MKL, by input rows.

Why: a CPU worker's forward is mostly its linears, over few rows when decoding (1 a request, D + 1
in a verify) and many in a prefill. `Linear.pack` picks the kernel (runtime/layers.py
`packed_kernel`); this script times one pass over every linear of the target -- the C kernel on
its blocked copy (in bfloat16 where the weights are bfloat16 values, as a checkpoint saved in
bfloat16 has them) and on one kept in float32, oneDNN's inner product on its packed copy,
`F.linear` (MKL) on the plain weight -- at each row count, interleaved repeats in one process, one torch thread, and prints the
medians and each kernel's speed relative to oneDNN (> 1: faster).

    python benchmarks/linear_kernels.py                    # bundled target
    python benchmarks/linear_kernels.py --rows 1 4 8 --repeats 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specsched.runtime import cpu_kernels
from specsched.runtime.checkpoint import load_model
from specsched.runtime.layers import Linear, can_pack

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=REPO / "runtime" / "bundled" / "target")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if min(args.rows) < 1:
        ap.error("--rows must be >= 1")
    why = cpu_kernels.status()
    if why is not None or not can_pack("cpu", torch.float32):
        print(f"skipped: needs the C kernels and oneDNN ({why or 'this torch has no oneDNN'})")
        return
    torch.set_num_threads(1)
    model = load_model(args.target)
    layers = {id(m): m for m in model.modules() if isinstance(m, Linear)}.values()
    # per linear: its weight, the copies each kernel reads (the C kernel's as packed -- bfloat16 where
    # every weight is a bfloat16 value -- and one kept in float32), oneDNN's
    weights = [dict(plain=m.weight.detach(), blocked=cpu_kernels.blocked_weight(m.weight),
                    blocked32=cpu_kernels.blocked_weight(m.weight, compact=False),
                    packed=torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 8)) for m in layers]
    compact = sum(w["blocked"].dtype == torch.bfloat16 for w in weights)
    megabytes = sum(w["plain"].numel() for w in weights) * 4 / 1e6

    kernels = {"C": lambda x, w: cpu_kernels.linear(x, w["blocked"], w["plain"].shape[0]),
               "C fp32": lambda x, w: cpu_kernels.linear(x, w["blocked32"], w["plain"].shape[0]),
               "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w["packed"], None, "none", [], ""),
               "MKL": lambda x, w: F.linear(x, w["plain"])}
    print(f"{len(weights)} linears of {args.target.name} ({megabytes:.1f} MB float32; {compact} packed for C in "
          f"bfloat16, their values exactly), one thread; median ms a pass over {args.repeats} interleaved repeats")
    print(f"{'rows':>5} {'C':>8} {'C fp32':>8} {'oneDNN':>8} {'MKL':>8} {'C/oneDNN':>9} {'C fp32/oneDNN':>14} "
          f"{'MKL/oneDNN':>11}")
    with torch.inference_mode():
        for n in args.rows:
            inputs = [torch.randn(n, w["plain"].shape[1]) for w in weights]
            for name, kernel in kernels.items():  # each agrees with F.linear
                for x, w in zip(inputs[:3], weights):
                    torch.testing.assert_close(kernel(x, w), F.linear(x, w["plain"]), rtol=1e-4, atol=1e-4)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.repeats):
                for name, kernel in kernels.items():
                    t0 = time.perf_counter()
                    for x, w in zip(inputs, weights):
                        kernel(x, w)
                    times[name].append(time.perf_counter() - t0)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"{n:>5} {ms['C']:>8.3f} {ms['C fp32']:>8.3f} {ms['oneDNN']:>8.3f} {ms['MKL']:>8.3f} "
                  f"{ms['oneDNN'] / ms['C']:>8.2f}x {ms['oneDNN'] / ms['C fp32']:>13.2f}x "
                  f"{ms['oneDNN'] / ms['MKL']:>10.2f}x")

if __name__ == "__main__":
    main()
