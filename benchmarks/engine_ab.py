"""Engine tokens/s of this checkout against another, side by side, at batch 1 and 8.

Runs the bundled model on the bundled workload (closed loop at each concurrency) for plain
decoding and two speculative configurations, in alternating subprocesses -- this checkout,
then the other, then the other way round -- and prints the median output tokens/s of each
and their ratio. What a change to the host side costs or saves end to end.

    python benchmarks/engine_ab.py --baseline ../before [--rounds 3] [--concurrency 1 8] [--configs mtp/eager_fill]

With none/sync among the configurations it also prints each one's speedup over plain
decoding measured in the same process, per checkout (the n-gram ones are not in the default set).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bundled_items, run, side_by_side  # noqa: E402

CONFIGS = {  # name -> EngineConfig fields
    "none/sync": {"proposer": "none", "schedule": "sync"},
    "draft/overlap": {"proposer": "draft", "draft_len": 4, "schedule": "overlap"},
    "mtp/eager_fill": {"proposer": "mtp", "draft_len": 1, "schedule": "eager_fill"},
    "none/plain_overlap": {"proposer": "none", "schedule": "plain_overlap"},
    "mtp3/eager_fill": {"proposer": "mtp", "draft_len": 3, "schedule": "eager_fill"},
    "draft3/eager_fill": {"proposer": "draft", "draft_len": 3, "schedule": "eager_fill"},
    "eagle/eager_fill": {"proposer": "eagle", "schedule": "eager_fill"},
    "ngram/sync": {"proposer": "ngram", "draft_len": 4, "schedule": "sync"},
    "ngram-auto/sync": {"proposer": "ngram", "draft_len": "auto", "max_draft_len": 4, "schedule": "sync"},
}
DEFAULT_CONFIGS = ["none/sync", "draft/overlap", "mtp/eager_fill"]


def measure(concurrencies: list[int], num_requests: int, max_tokens: int, configs: list[str]) -> dict[str, float]:
    out = {}
    for c in concurrencies:
        items = bundled_items(max(num_requests, c), max_tokens)
        for name in configs:
            kw = CONFIGS[name]
            m, _ = run(items, concurrency=c, warmup=1, trace=False, **kw)
            out[f"{name}@{c}"] = m["output_tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, required=True, help="another checkout (e.g. a git worktree)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one process's raw figures
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.concurrency, args.num_requests, args.max_tokens, args.configs)))
        return
    cmd = [sys.executable, __file__, "--json", "--baseline", str(args.baseline), "--num-requests",
               str(args.num_requests), "--max-tokens", str(args.max_tokens), "--concurrency",
               *map(str, args.concurrency), "--configs", *args.configs]
    runs = side_by_side(cmd, args.baseline, args.rounds)
    print(f"median of {args.rounds} alternating rounds, output tokens/s ({args.num_requests} requests x "
          f"{args.max_tokens} tokens, bundled model)")
    print(f"{'config':>16} {'batch':>6} {'baseline':>9} {'this':>9} {'ratio':>7}")
    for key in runs["this"][0]:
        name, c = key.rsplit("@", 1)
        a = statistics.median(r[key] for r in runs["baseline"])
        b = statistics.median(r[key] for r in runs["this"])
        print(f"{name:>16} {c:>6} {a:>9.1f} {b:>9.1f} {b / a:>6.2f}x")
    if "none/sync" in args.configs and len(args.configs) > 1:
        # against plain decoding in the same process: the machine's swings between runs cancel
        print("speedup over none/sync in the same run (median of the rounds' ratios)")
        print(f"{'config':>16} {'batch':>6} {'baseline':>9} {'this':>9}")
        for key in runs["this"][0]:
            name, c = key.rsplit("@", 1)
            if name != "none/sync":
                a, b = (statistics.median(r[key] / r[f"none/sync@{c}"] for r in runs[k]) for k in ("baseline", "this"))
                print(f"{name:>16} {c:>6} {a:>8.2f}x {b:>8.2f}x")


if __name__ == "__main__":
    main()
