"""Speculation on structured output: requests that must produce JSON following a schema, per proposer.

The bundled workload's prompts, each asked for a JSON object of a fixed schema (greedy). Every proposer drafts by the
request's grammar (forced tokens -- the keys, the punctuation -- are drafted and accepted) and its tokens must be
plain decoding's. Interleaved rounds whose order turns every round; per proposer the median output tokens/s, the mean
acceptance length, the median of the per-round ratios to plain decoding (range in brackets) and whether its tokens
were plain's.

    python benchmarks/structured_spec.py [--rounds 3] [--concurrency 1] [--draft-len 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bundled_items  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["function", "class", "module"]},
    "public": {"type": "boolean"}, "arguments": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                 "maxItems": 3}},
    "required": ["name", "kind", "public", "arguments"]}
PROPOSERS = {"plain": {"proposer": "none"}, "draft": {"proposer": "draft", "schedule": "overlap"},
             "mtp": {"proposer": "mtp", "schedule": "eager_fill"}, "eagle": {"proposer": "eagle", "schedule": "eager_fill"}}


def _run(items, concurrency: int, engine_kw: dict):
    import anyio

    from specsched.runtime.bench import run_workload
    from specsched.runtime.engine_config import EngineConfig

    m, _, outs = anyio.run(lambda: run_workload(EngineConfig.make(**engine_kw), items, concurrency=concurrency,
                                                warmup=1, agreement=False))
    return m, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=[p for p in PROPOSERS if p != "plain"], default=None)
    args = ap.parse_args()
    if min(args.rounds, args.concurrency, args.max_tokens, args.draft_len) < 1:
        ap.error("--rounds, --concurrency, --max-tokens and --draft-len must be >= 1")
    from specsched.scheduler.sampling_params import SamplingParams

    names = ["plain", *(args.only or [p for p in PROPOSERS if p != "plain"])]
    items = [replace(it, params=SamplingParams(max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA}))
             for it in bundled_items(args.num_requests, args.max_tokens)]
    tps: dict[str, list[float]] = {}
    al: dict[str, list[float]] = {}
    tokens: dict[tuple[str, int], list] = {}
    for r in range(args.rounds):
        for name in names[:: 1 if r % 2 == 0 else -1]:
            kw = PROPOSERS[name] | ({} if name == "plain" else {"draft_len": args.draft_len})
            m, tokens[(name, r)] = _run(items, args.concurrency, kw)
            tps.setdefault(name, []).append(m["output_tokens_per_s"])
            al.setdefault(name, []).append(m.get("mean_accept_len") or 1.0)
    print(f"{args.num_requests} bundled prompts, each a JSON object of a 4-field schema (<= {args.max_tokens} tokens), "
          f"greedy, {args.concurrency} concurrent, D={args.draft_len}, {args.rounds} interleaved rounds")
    print(f"{'proposer':>8} {'tok/s':>8} {'AL':>5} {'vs plain':>9} {'range':>10} {'same tokens':>12}")
    for name in names:
        ratios = [a / b for a, b in zip(tps[name], tps["plain"])]
        same = all(tokens[(name, r)] == tokens[("plain", r)] for r in range(args.rounds))
        print(f"{name:>8} {statistics.median(tps[name]):>8.1f} {statistics.mean(al[name]):>5.2f} "
              f"{statistics.median(ratios):>8.2f}x {min(ratios):>4.2f}-{max(ratios):.2f} {'yes' if same else 'NO':>12}")


if __name__ == "__main__":
    main()
