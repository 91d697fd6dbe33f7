"""Speculation on structured output: requests that must produce JSON following a schema, per proposer.

The bundled workload's prompts, each asked for a JSON object of a fixed schema (greedy). Every proposer drafts by the
request's grammar (forced tokens -- the keys, the punctuation -- are drafted and accepted) and its tokens must be
plain decoding's. Interleaved rounds whose order turns every round; per proposer the median output tokens/s, the mean
acceptance length, the median of the per-round ratios to plain decoding (range in brackets) and whether its tokens
were plain's. With `--baseline CHECKOUT`, the same in alternating processes of this checkout and that one, each
proposer's ratio to plain decoding in its own process.

    python benchmarks/structured_spec.py [--rounds 3] [--concurrency 1] [--draft-len 3] [--baseline ../before]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_side_by_side_options, bundled_items, side_by_side  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["function", "class", "module"]},
    "public": {"type": "boolean"}, "arguments": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                 "maxItems": 3}},
    "required": ["name", "kind", "public", "arguments"]}
PROPOSERS = {"plain": {"proposer": "none"}, "draft": {"proposer": "draft", "schedule": "overlap"},
             "mtp": {"proposer": "mtp", "schedule": "eager_fill"}, "eagle": {"proposer": "eagle", "schedule": "eager_fill"},
             "ngram": {"proposer": "ngram", "schedule": "sync"}}


def _run(items, concurrency: int, engine_kw: dict):
    import anyio

    from specsched.runtime.bench import run_workload
    from specsched.runtime.engine_config import EngineConfig

    m, _, outs = anyio.run(lambda: run_workload(EngineConfig.make(**engine_kw), items, concurrency=concurrency,
                                                warmup=1, agreement=False))
    return m, [o.token_ids for o in outs]


def measure(names: list[str], args) -> dict[str, list]:
    """One round, in this process, in the order given: per proposer [tok/s, acceptance length, output token ids]."""
    from specsched.scheduler.sampling_params import SamplingParams

    items = [replace(it, params=SamplingParams(max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA}))
             for it in bundled_items(args.num_requests, args.max_tokens)]
    out = {}
    for name in names:
        kw = PROPOSERS[name] | ({} if name == "plain" else {"draft_len": args.draft_len})
        m, tokens = _run(items, args.concurrency, kw)
        out[name] = [m["output_tokens_per_s"], m.get("mean_accept_len") or 1.0, tokens]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=[p for p in PROPOSERS if p != "plain"], default=None)
    add_side_by_side_options(ap)
    args = ap.parse_args()
    if min(args.rounds, args.concurrency, args.max_tokens, args.draft_len) < 1:
        ap.error("--rounds, --concurrency, --max-tokens and --draft-len must be >= 1")
    names = ["plain", *(args.only or [p for p in PROPOSERS if p != "plain"])]
    if args.json:
        print(json.dumps(measure(names, args)))
        return
    if args.baseline is not None:
        cmd = [sys.executable, __file__, "--json", "--concurrency", str(args.concurrency), "--num-requests",
               str(args.num_requests), "--max-tokens", str(args.max_tokens), "--draft-len", str(args.draft_len),
               "--only", *names[1:]]
        runs = side_by_side(cmd, args.baseline, args.rounds)
    else:
        runs = {"this": [measure(names[:: 1 if r % 2 == 0 else -1], args) for r in range(args.rounds)]}
    print(f"{args.num_requests} bundled prompts, each a JSON object of a 4-field schema (<= {args.max_tokens} tokens), "
          f"greedy, {args.concurrency} concurrent, D={args.draft_len}, {args.rounds} interleaved rounds")
    print(f"{'proposer':>8} {'tok/s':>8} {'AL':>5} {'vs plain':>9} {'range':>10} {'same tokens':>12}"
          + (f" {'baseline AL':>12} {'vs plain':>9}" if args.baseline is not None else ""))
    for name in names:
        line = ""
        for who in runs:
            rounds = runs[who]
            ratios = [r[name][0] / r["plain"][0] for r in rounds]
            al = statistics.mean(r[name][1] for r in rounds)
            if who == "this":
                same = all(r[name][2] == r["plain"][2] for r in rounds)
                line = (f"{name:>8} {statistics.median(r[name][0] for r in rounds):>8.1f} {al:>5.2f} "
                        f"{statistics.median(ratios):>8.2f}x {min(ratios):>4.2f}-{max(ratios):.2f} "
                        f"{'yes' if same else 'NO':>12}")
            else:
                line += f" {al:>12.2f} {statistics.median(ratios):>8.2f}x"
        print(line)


if __name__ == "__main__":
    main()
