"""Does an op run slower after the device sat idle? Op duration against the idle gap before it.

On a CPU "device" (the worker process) an idle gap lets caches go cold and the core drop its
clock (on a VM, the host may run other work there), so the op after it runs slower; under a
no-sync schedule ops run back to back and stay warm. This measures it: the same op (a torch
matmul in the worker) launched back to back, right after a host round trip, and after
sleeping 0.5-5 ms, in shuffled order, with the median duration per gap and its ratio to the
back-to-back one.

    python benchmarks/device_idle.py [--n 384] [--repeat 4] [--rounds 100]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specsched.runtime.devices.host import HostDevice
from specsched.runtime.devices.spec import WorkerSpec

GAPS_MS = (None, 0.0, 0.5, 1.0, 2.0, 5.0)  # None: queued right behind the previous op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=384, help="matrix size of the op (n x n matmuls)")
    ap.add_argument("--repeat", type=int, default=4, help="matmuls per op")
    ap.add_argument("--rounds", type=int, default=100)
    args = ap.parse_args()
    batch = {"n": args.n, "repeat": args.repeat}
    durations: dict[float | None, list[float]] = {g: [] for g in GAPS_MS}
    rng = np.random.default_rng(0)
    with HostDevice(WorkerSpec("specsched.runtime.devices.testing_worker:TestingWorker"), name="idle-bench") as dev:
        stream = dev.stream("main")
        stream.launch("matmul", batch).synchronize(60)  # warm-up (imports torch there)
        for _ in range(args.rounds):
            for i in rng.permutation(len(GAPS_MS)):
                gap = GAPS_MS[i]
                first = stream.launch("matmul", batch)
                if gap is not None:
                    first.synchronize(60)
                    if gap:
                        time.sleep(gap / 1e3)
                ev = stream.launch("matmul", batch)
                ev.synchronize(60)
                durations[gap].append((ev.end_ns - ev.start_ns) / 1e3)
    base = statistics.median(durations[None])
    print(f"op: {args.repeat} matmuls of {args.n} x {args.n}, {args.rounds} rounds, shuffled")
    print(f"{'idle before the op':<34} {'median us':>10} {'vs back to back':>16}")
    for gap in GAPS_MS:
        med = statistics.median(durations[gap])
        label = "none (queued behind the previous)" if gap is None else (
            "host round trip" if gap == 0 else f"round trip + {gap:g} ms")
        print(f"{label:<34} {med:>10.0f} {med / base:>15.3f}x")


if __name__ == "__main__":
    main()
