"""Training throughput of the bundled target on this CPU: threads x precision x batch.

Each configuration runs in its own process (thread count and oneDNN state are per process):
a few warm-up steps, then timed AdamW steps (forward, backward, clip, step) of the bundled
target's architecture on random token windows of the training length. Rounds are
interleaved and the median per configuration is printed with its ratio to the first
configuration (by default 1 thread, fp32, batch 8).

    python benchmarks/train_throughput.py --steps 8 --rounds 2
    python benchmarks/train_throughput.py --busy     # the same with another process spinning on one core

`--busy` is the shared machine: OpenMP threads spin-wait at every barrier (OMP_WAIT_POLICY
active, the default), so two threads collapse when one core is taken; `passive` yields instead.

Needs the `dev` extra (transformers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = (  # (threads, precision, batch, OpenMP wait policy)
    (1, "fp32", 8, "active"), (2, "fp32", 8, "active"), (1, "bf16", 8, "active"), (2, "bf16", 8, "active"),
    (2, "bf16", 16, "active"), (2, "bf16", 32, "active"), (1, "bf16", 16, "active"), (2, "bf16", 16, "passive"),
)


def _measure(threads: int, precision: str, batch: int, steps: int) -> float:
    """Tokens per second of `steps` timed training steps (after 2 warm-up steps)."""
    import time

    import torch
    import torch.nn.functional as F

    from specsched.runtime.training.bundled import llama_config
    from specsched.runtime.training.loop import SEQ_LEN
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(4096, 0, 1, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 4096, (batch, SEQ_LEN + 1))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(input_ids=ids[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(2):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch * SEQ_LEN / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", nargs="*", default=None, metavar="THREADS:PRECISION:BATCH[:passive]",
                    help="configurations to measure (default: all of CONFIGS, e.g. 2:bf16:16:passive)")
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning process meanwhile")
    ap.add_argument("--child", nargs=3, metavar=("THREADS", "PRECISION", "BATCH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_measure(int(a.child[0]), a.child[1], int(a.child[2]), a.steps)))
        return
    configs = CONFIGS if a.configs is None else [_parse(c) for c in a.configs]
    runs: dict[tuple, list[float]] = {c: [] for c in configs}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if a.busy else None
    try:
        for _ in range(a.rounds):
            for c in configs:
                env = {**os.environ, "OMP_WAIT_POLICY": c[3].upper()}
                out = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--child", *map(str, c[:3])],
                                     check=True, capture_output=True, text=True, env=env).stdout
                runs[c].append(json.loads(out.strip().splitlines()[-1]))
    finally:
        if spinner is not None:
            spinner.kill()
    base = statistics.median(runs[configs[0]])
    if a.busy:
        print("(another process spinning on one core throughout)")
    print("| threads | precision | batch | OpenMP wait | tokens/s (median) | vs the first row |")
    print("|---|---|---|---|---|---|")
    for c, v in runs.items():
        m = statistics.median(v)
        print(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {m:,.0f} | {m / base:.2f}x |")


def _parse(spec: str) -> tuple:
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[1] not in ("fp32", "bf16") or (len(parts) == 4 and parts[3] not in
                                                                       ("active", "passive")):
        raise SystemExit(f"--configs {spec!r}: expected THREADS:fp32|bf16:BATCH[:active|passive]")
    return int(parts[0]), parts[1], int(parts[2]), parts[3] if len(parts) == 4 else "active"


if __name__ == "__main__":
    main()
