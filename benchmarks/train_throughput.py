"""Training throughput of the bundled target on this CPU: threads x precision x batch.

Each configuration runs in its own process (thread count and oneDNN state are per process):
a few warm-up steps, then timed AdamW steps (forward, backward, clip, step) of the bundled
target's architecture on random token windows of the training length. Rounds are
interleaved and the median per configuration is printed with its ratio to the first
configuration (by default 1 thread, fp32, batch 8).

    python benchmarks/train_throughput.py --steps 8 --rounds 2

Needs the `dev` extra (transformers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CONFIGS = (  # (threads, precision, batch)
    (1, "fp32", 8), (2, "fp32", 8), (1, "bf16", 8), (2, "bf16", 8), (2, "bf16", 16), (2, "bf16", 32),
)


def _measure(threads: int, precision: str, batch: int, steps: int) -> float:
    """Tokens per second of `steps` timed training steps (after 2 warm-up steps)."""
    import time

    import torch
    import torch.nn.functional as F

    from specsched.runtime.training.bundled import SEQ_LEN, llama_config
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
    ap.add_argument("--configs", nargs="*", default=None, metavar="THREADS:PRECISION:BATCH",
                    help="configurations to measure (default: all six, e.g. 2:bf16:16)")
    ap.add_argument("--child", nargs=3, metavar=("THREADS", "PRECISION", "BATCH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_measure(int(a.child[0]), a.child[1], int(a.child[2]), a.steps)))
        return
    configs = CONFIGS if a.configs is None else [(int(t), p, int(b)) for t, p, b in
                                                 (c.split(":") for c in a.configs)]
    runs: dict[tuple, list[float]] = {c: [] for c in configs}
    for _ in range(a.rounds):
        for c in configs:
            out = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--child", *map(str, c)],
                                 check=True, capture_output=True, text=True).stdout
            runs[c].append(json.loads(out.strip().splitlines()[-1]))
    base = statistics.median(runs[configs[0]])
    print(f"| threads | precision | batch | tokens/s (median) | vs {configs[0][0]} thread(s) {configs[0][1]} batch"
          f" {configs[0][2]} |")
    print("|---|---|---|---|---|")
    for c, v in runs.items():
        m = statistics.median(v)
        print(f"| {c[0]} | {c[1]} | {c[2]} | {m:,.0f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
