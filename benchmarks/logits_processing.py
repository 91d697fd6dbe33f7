"""What a request's logits processing costs: penalties and a grammar that change no token, against none.

Three variants of the bundled workload, each request's parameters changed so its tokens stay the same: `plain`
(none), `penalties` (frequency and presence penalties of 1e-6: every step counts each row's tokens, drafts included,
on the device) and `grammar` (structured output with a regex every text matches: every step walks each row's
grammar on the host and masks its columns). Interleaved rounds whose order turns every round; per concurrency the
median output tokens/s of each and the median of its per-round ratios to `plain` (range in brackets), and whether
its tokens were plain's.

    python benchmarks/logits_processing.py [--rounds 3] [--concurrency 1 8] [--spec draft --draft-len 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bundled_items  # noqa: E402

VARIANTS = {
    "plain": {},
    "penalties": {"frequency_penalty": 1e-6, "presence_penalty": 1e-6},
    "grammar": {"structured_outputs": {"regex": r"[\s\S]*"}},
}


def _run(items, concurrency: int, engine_kw: dict):
    import anyio

    from specsched.runtime.bench import run_workload
    from specsched.runtime.engine_config import EngineConfig

    m, _, outs = anyio.run(lambda: run_workload(EngineConfig.make(**engine_kw), items, concurrency=concurrency,
                                                warmup=1, agreement=False))
    return m["output_tokens_per_s"], [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-requests", type=int, default=16, help="at least the largest concurrency")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--spec", default="none", help="the proposer")
    ap.add_argument("--draft-len", type=int, default=None)
    args = ap.parse_args()
    if args.rounds < 1 or min(args.concurrency) < 1 or args.max_tokens < 1:
        ap.error("--rounds, --concurrency and --max-tokens must be >= 1")
    from specsched.scheduler.sampling_params import SamplingParams

    engine_kw = {"proposer": args.spec, **({"draft_len": args.draft_len} if args.draft_len is not None else {})}
    base = bundled_items(args.num_requests, args.max_tokens)
    # the workload's requests, EOS ignored: a grammar's EOS is its own, and the lengths stay the same
    items = {name: [replace(it, params=SamplingParams(**(it.params.model_dump() | {"ignore_eos": True} | kw)))
                    for it in base] for name, kw in VARIANTS.items()}
    tps: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int, int], list] = {}
    for r in range(args.rounds):
        for c in args.concurrency:
            for name in list(VARIANTS)[:: 1 if r % 2 == 0 else -1]:
                t, tokens[(name, c, r)] = _run(items[name], c, engine_kw)
                tps.setdefault((name, c), []).append(t)
    print(f"{args.num_requests} bundled requests x {args.max_tokens} tokens, proposer {args.spec}"
          f"{'' if args.draft_len is None else f' D={args.draft_len}'}, {args.rounds} interleaved rounds")
    print(f"{'batch':>5} {'variant':>10} {'tok/s':>8} {'vs plain':>9} {'range':>10} {'same tokens':>12}")
    for c in args.concurrency:
        plain = tps[("plain", c)]
        for name in VARIANTS:
            ratios = [a / b for a, b in zip(tps[(name, c)], plain)]
            same = all(tokens[(name, c, r)] == tokens[("plain", c, r)] for r in range(args.rounds))
            print(f"{c:>5} {name:>10} {statistics.median(tps[(name, c)]):>8.1f} {statistics.median(ratios):>8.2f}x "
                  f"{min(ratios):>4.2f}-{max(ratios):.2f} {'yes' if same else 'NO':>12}")


if __name__ == "__main__":
    main()
