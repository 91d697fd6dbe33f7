"""Per proposer at batch 1 on the bundled workload: mean acceptance length, acceptance per
draft position, tokens/s and speedup over plain decoding measured in the same run, next to the
analytic bound AL / (c_verify(D) + D * c_draft) from the costs measured in the same traces
(c_verify(D) = verify time / plain decode time; c_draft = proposer device time per drafted
token / plain decode time).

    python benchmarks/proposers.py [--num-requests 6] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_span_ms, parse_workload, run  # noqa: E402

PROPOSERS = [("draft", "overlap", 3), ("draft", "overlap", 4), ("mtp", "mtp", 1), ("mtp", "sync", 2),
             ("eagle", "sync", 3), ("ngram", "sync", 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="proposer names to run")
    args, items = parse_workload(ap, 6, 64)
    plain, ptrace = run(items, proposer="none", schedule="sync")
    t_decode = median_span_ms(ptrace, "decode")
    print(f"plain: {plain['output_tokens_per_s']:.1f} tok/s, target decode {t_decode:.2f} ms")
    print(f"{'proposer':<22} {'AL':>5} {'per-position acceptance':<28} {'tok/s':>7} {'speedup':>8} {'bound':>7}")
    for proposer, schedule, d in PROPOSERS:
        if args.only and proposer not in args.only:
            continue
        m, tr = run(items, proposer=proposer, schedule=schedule, draft_len=d)
        t_verify = median_span_ms(tr, "verify") or 0.0
        t_prop = sum(v for v in (median_span_ms(tr, "draft"), median_span_ms(tr, "draft_fill")) if v)
        c_verify = t_verify / t_decode
        c_draft = t_prop / max(d, 1) / t_decode
        al = m["mean_accept_len"] or 1.0
        bound = al / (c_verify + d * c_draft)
        per_pos = ", ".join(f"{x:.2f}" for x in m["accept_rate_per_pos"][:6])
        print(f"{proposer + '/' + schedule + ' D=' + str(d):<22} {al:>5.2f} {per_pos:<28} "
              f"{m['output_tokens_per_s']:>7.1f} {m['output_tokens_per_s'] / plain['output_tokens_per_s']:>7.2f}x "
              f"{bound:>6.2f}x")


if __name__ == "__main__":
    main()
