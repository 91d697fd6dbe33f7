"""The host device's worker polling for its next launch, against blocking on the pipe at once.

Between two ops the CPU worker process waits for the host's next launch; under `sync` that is
every op (the host plans the next one only after the result), under the overlapped schedules
rarely. A core left idle runs the next op slower, so the worker polls for `worker_spin_ms`
before it blocks (runtime/devices/worker_main.py). This runs the engine on the bundled models
with the poll (`--spin-ms`, default the engine's) and without it (0: the worker blocks at once,
as before the poll existed), alternating within each round, and prints per configuration the
tokens/s of each, their ratio (median of the per-round ratios) and the median device time of the
target's step op (decode, or verify for a speculative run) under each.

    python benchmarks/worker_spin.py [--rounds 3] [--concurrency 1 8] [--configs none/sync ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import med, median_span_ms, parse_workload, run  # noqa: E402

from specsched.runtime.engine_config import EngineConfig  # noqa: E402

CONFIGS = ["none/sync", "none/plain_overlap", "mtp/sync", "mtp/eager_fill", "draft/eager_fill", "eagle/sync", "eagle/eager_fill"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--configs", nargs="+", default=CONFIGS, help="proposer/schedule pairs")
    ap.add_argument("--spin-ms", type=float, default=EngineConfig.model_fields["worker_spin_ms"].default)
    args, items = parse_workload(ap, 6, 48)
    spins = (0.0, args.spin_ms)
    print(f"{len(items)} requests, median of {args.rounds} round(s); worker poll {args.spin_ms:g} ms vs 0 "
          f"(blocking at once); op: the target's step op (decode / verify), median device ms")
    print(f"{'config':<20} {'conc':>4} {'tok/s, 0':>9} {'tok/s, poll':>11} {'ratio':>6} {'op ms, 0':>9} "
          f"{'op ms, poll':>11}")
    for conc in args.concurrency:
        for config in args.configs:
            proposer, schedule = config.split("/")
            res: dict[float, list] = {s: [] for s in spins}
            for r in range(args.rounds):
                for s in spins if r % 2 == 0 else spins[::-1]:
                    res[s].append(run(items, concurrency=conc, proposer=proposer, schedule=schedule,
                                      worker_spin_ms=s))
            tps = {s: [m["output_tokens_per_s"] for m, _ in res[s]] for s in spins}
            op = "decode" if proposer == "none" else "verify"
            op_ms = {s: med(median_span_ms(tr, op) for _, tr in res[s]) for s in spins}
            ratio = med(b / a for a, b in zip(tps[spins[0]], tps[spins[1]]))
            print(f"{config:<20} {conc:>4} {med(tps[spins[0]]):>9.1f} {med(tps[spins[1]]):>11.1f} {ratio:>5.2f}x "
                  f"{op_ms[spins[0]]:>9.2f} {op_ms[spins[1]]:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
