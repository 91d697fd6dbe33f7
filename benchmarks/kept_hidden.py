"""What an MTP head costs while speculation is off: plain decoding against the head's adaptive
draft length held at D = 0, in one process, in alternating rounds.

At D = 0 the head's fills wait and the worker keeps the target's hidden states of every
forward for the catch-up (`ForwardMessage.keep_hidden`, runtime/proposers/hidden_log.py), and
every forward returns them. This runs the same requests through a Pipeline on an in-process
device (`run_requests`: no worker process, so no round trip's noise) as plain decoding under
`plain_overlap` and as the MTP head under `eager_fill` with a policy that pauses as the adaptive
one does and chooses D = 0 every step (the adaptive policy's own host time is priced by
`benchmarks/policy_overhead.py`), and prints each round's wall time and the ratio of medians.

    python benchmarks/kept_hidden.py [--num-requests 16] [--max-tokens 48] [--rounds 6]
"""
from __future__ import annotations

import argparse
import statistics
import time



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=16, help="requests, all in flight at once")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6, help="rounds; each runs both, in alternating order")
    args = ap.parse_args()
    import torch

    from specsched.runtime import bundled
    from specsched.runtime.tokenizer import Tokenizer
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.runtime.workload import load_workload
    from specsched.scheduler.draft_policy import FixedPolicy
    from specsched.scheduler.sampling_params import SamplingParams

    torch.set_num_threads(1)
    tok = Tokenizer(bundled.target_dir())
    prompts = [tok.encode(it.prompt) for it in load_workload(bundled.workload_path(), limit=args.num_requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    n = len(prompts)

    class AlwaysPlain(FixedPolicy):
        """D = 0 on every decode step, pausing as the adaptive policy does: the head's fills wait."""

        pauses = True
    pages = 64 * n
    target = str(bundled.target_dir())
    workers = {"plain (plain_overlap)": ModelWorker(target, {"kind": "none", "draft_len": 0}, num_pages=pages),
               "mtp auto at D = 0 (eager_fill)": ModelWorker(target, {"kind": "mtp", "draft_len": 3},
                                                      proposer_dir=str(bundled.mtp_dir()), num_pages=pages)}
    walls: dict[str, list[float]] = {k: [] for k in workers}
    names = list(workers)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            head = name.startswith("mtp")
            t0 = time.perf_counter()
            out = run_requests(workers[name], prompts, params, schedule="eager_fill" if head else "plain_overlap",
                               num_pages=pages, max_num_seqs=n, policy=AlwaysPlain(0) if head else None)
            walls[name].append(time.perf_counter() - t0)
            assert all(o.num_drafts == 0 and o.error is None for o in out)
    print(f"{n} requests x {args.max_tokens} tokens, {args.rounds} alternating rounds (wall s)")
    for name, v in walls.items():
        print(f"  {name:<24} " + " ".join(f"{x:.3f}" for x in v) + f"   median {statistics.median(v):.3f}")
    a, b = (statistics.median(walls[k]) for k in names)
    print(f"mtp auto at D = 0 / plain: {b / a:.3f}x wall time")


if __name__ == "__main__":
    main()
