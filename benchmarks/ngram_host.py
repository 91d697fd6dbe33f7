"""Host cost of the n-gram lookup per speculative step at 64 and 256 running requests.

Under `sync` the n-gram proposer drafts on the host (`NgramHostDrafter`, the pipeline's
`HostDrafter`): before each verify it looks up every row's drafts in the row's own tokens.
This times that call alone on N decoding requests whose contexts repeat themselves (code-like:
a prompt built from a small pool of token runs, outputs copying earlier runs), each step
appending what a verify would have emitted (the accepted drafts and one token), and prints the
median milliseconds per step. No model is involved.

    python benchmarks/ngram_host.py [--requests 64 256] [--context 512 2048] [--steps 100]
    python benchmarks/ngram_host.py --baseline ../before   # side by side with another checkout
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_side_by_side_options, side_by_side  # noqa: E402

from specsched.runtime.proposers.ngram import NgramHostDrafter  # noqa: E402
from specsched.scheduler.request import Request  # noqa: E402
from specsched.scheduler.sampling_params import SamplingParams  # noqa: E402

DRAFT_LEN = 4


def _repetitive(rng: np.random.Generator, length: int) -> list[int]:
    """`length` tokens made of runs of 4-16 tokens drawn from a pool of 64 runs (vocab 4096)."""
    pool = [rng.integers(2, 4096, int(rng.integers(4, 17))) for _ in range(64)]
    out: list[int] = []
    while len(out) < length:
        out.extend(pool[int(rng.integers(len(pool)))].tolist())
    return out[:length]


def measure(num_requests: int, context: int, steps: int, seed: int = 0) -> float:
    """Median ms per step of `draft(batch)` over `steps` steps, every request decoding."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=steps * (DRAFT_LEN + 1) + 8, ignore_eos=True)
    reqs = []
    for i in range(num_requests):
        r = Request(f"r{i}", _repetitive(rng, context), params, arrival_ns=0)
        r.slot = i
        reqs.append(r)
    drafter = NgramHostDrafter(1, 4, DRAFT_LEN)
    batch = SimpleNamespace(requests=reqs, draft_lens=np.full(num_requests, DRAFT_LEN, dtype=np.int64))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens, counts = drafter.draft(batch)
        times.append(time.perf_counter() - t0)
        counts = np.asarray(counts).tolist()
        for i, r in enumerate(reqs):  # what a verify emits: the drafts it accepted and one token
            accepted = int(rng.integers(0, counts[i] + 1))
            r.extend_output([int(t) for t in np.asarray(tokens)[i, :accepted]] + [int(rng.integers(2, 4096))])
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048], help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=100)
    add_side_by_side_options(ap)
    args = ap.parse_args()
    cases = [(n, c) for n in args.requests for c in args.context]
    if args.json:
        print(json.dumps([measure(n, c, args.steps) for n, c in cases]))
        return
    if args.baseline is None:
        print(f"{'running':>8} {'context':>8} {'ms/step':>9} {'us/row':>8}")
        for n, c in cases:
            ms = measure(n, c, args.steps)
            print(f"{n:>8} {c:>8} {ms:>9.3f} {ms * 1e3 / n:>8.1f}")
        return
    cmd = [sys.executable, __file__, "--json", "--steps", str(args.steps), "--requests", *map(str, args.requests),
           "--context", *map(str, args.context)]
    runs = side_by_side(cmd, args.baseline, args.rounds)
    print(f"median of {args.rounds} alternating rounds, ms per step of the n-gram host lookup (D={DRAFT_LEN})")
    print(f"{'running':>8} {'context':>8} {'baseline':>9} {'this':>9} {'ratio':>7}")
    for i, (n, c) in enumerate(cases):
        a = statistics.median(run[i] for run in runs["baseline"])
        b = statistics.median(run[i] for run in runs["this"])
        print(f"{n:>8} {c:>8} {a:>9.3f} {b:>9.3f} {b / a:>6.2f}x")


if __name__ == "__main__":
    main()
