"""What the HTTP server costs: `specsched serve` driven over streaming HTTP against the embedded engine.

One server process (`specsched serve` with the same engine configuration) and, in each round,
one embedded engine run of the same workload at each concurrency, in interleaved rounds whose
order turns every round. Prints per concurrency the median output tokens/s of each and the
median of the per-round ratios (server / embedded, range in brackets), and TTFT and TPOT p50 /
p99 of each (the server's measured at the client, from the moment each request is sent).

    python benchmarks/server_overhead.py [--rounds 3] [--concurrency 1 8 32] [--spec none] [--num-requests 32]
"""
from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bundled_items, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, default=32, help="at least the largest concurrency")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--spec", default="none", help="the proposer of both engines")
    ap.add_argument("--draft-len", type=int, default=None)
    args = ap.parse_args()
    if args.rounds < 1 or min(args.concurrency) < 1 or args.max_tokens < 1:
        ap.error("--rounds, --concurrency and --max-tokens must be >= 1")
    from specsched.runtime.server.client import launch_server, run_endpoint

    engine_kw = {"proposer": args.spec, **({"draft_len": args.draft_len} if args.draft_len is not None else {})}
    engine_args = ["--spec", args.spec, *(["--draft-len", str(args.draft_len)] if args.draft_len is not None else [])]
    proc, url = launch_server(engine_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got: dict[tuple[str, int], list[dict]] = {}
    try:
        for r in range(args.rounds):
            for c in args.concurrency:
                items = bundled_items(max(args.num_requests, c), args.max_tokens)
                order = ["server", "embedded"][:: 1 if r % 2 == 0 else -1]
                for who in order:
                    if who == "server":
                        m, _ = anyio.run(lambda: run_endpoint(url, items, concurrency=c, warmup=1))
                    else:
                        m, _ = run(items, concurrency=c, warmup=1, trace=True, **engine_kw)
                    got.setdefault((who, c), []).append(m)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print(f"{max(args.num_requests, 1)} bundled requests x {args.max_tokens} tokens, proposer {args.spec}, "
          f"{args.rounds} interleaved rounds; server over streaming HTTP / embedded engine")
    print(f"{'batch':>5} {'server tok/s':>12} {'embedded':>9} {'ratio':>6} {'range':>10}  "
          f"{'TTFT p50/p99 ms server':>22} {'embedded':>13}  {'TPOT p50/p99 ms server':>22} {'embedded':>13}")
    for c in args.concurrency:
        s, e = got[("server", c)], got[("embedded", c)]
        ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(s, e)]

        def med(runs, key, q):
            return statistics.median(m[key][q] for m in runs)

        print(f"{c:>5} {statistics.median(m['output_tokens_per_s'] for m in s):>12.1f} "
              f"{statistics.median(m['output_tokens_per_s'] for m in e):>9.1f} {statistics.median(ratios):>5.2f}x "
              f"{min(ratios):>4.2f}-{max(ratios):.2f}  "
              f"{med(s, 'ttft_ms', 'p50'):>11.1f} / {med(s, 'ttft_ms', 'p99'):>8.1f} "
              f"{med(e, 'ttft_ms', 'p50'):>6.1f} / {med(e, 'ttft_ms', 'p99'):>5.1f}  "
              f"{med(s, 'tpot_ms', 'p50'):>11.2f} / {med(s, 'tpot_ms', 'p99'):>8.2f} "
              f"{med(e, 'tpot_ms', 'p50'):>6.2f} / {med(e, 'tpot_ms', 'p99'):>5.2f}")


if __name__ == "__main__":
    main()
