"""Scheduler host cost per step (schedule + kv_alloc + plan + accept) at 64, 256 and 1024 running requests.

Runs the real scheduler code (Scheduler, BlockManager, message packing with the
FlashInfer-layout plan, the bookkeeping of the device's result: counters, accepted lengths,
speculation statistics, output counts and trimming of rejected slots) on N decoding requests, for plain
decode steps and speculative (verify, D=4) steps, and prints the median milliseconds per
stage. No model is involved:
this is the CPU work that must hide behind the device.

    python benchmarks/host_overhead.py [--requests 64 256 1024] [--steps 200]
    python benchmarks/host_overhead.py --baseline ../before   # side by side with another checkout
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_side_by_side_options, side_by_side  # noqa: E402

from specsched.scheduler import messages  # noqa: E402

try:  # noqa: E402
    from specsched.scheduler import packing
    from specsched.scheduler.scheduler import Scheduler, SchedulerConfig
except ImportError:  # the previous release's batch builder, which packed in messages.py (--baseline)
    from specsched.scheduler.batch_builder import BatchBuilder as Scheduler, SchedulerConfig
    packing = messages
from specsched.scheduler.block_manager import BlockManager  # noqa: E402
from specsched.scheduler.proposer import ProposerSpec  # noqa: E402
from specsched.scheduler.request import Request  # noqa: E402
from specsched.scheduler.sampling_params import SamplingParams  # noqa: E402


def measure(num_requests: int, steps: int, draft_len: int, prompt_len: int = 512) -> dict[str, float]:
    spec = ProposerSpec("draft", draft_len) if draft_len else ProposerSpec()
    blocks = BlockManager(2 * num_requests * ((prompt_len + steps * (draft_len + 1) + 8) // 16 + 2) + 64, 16,
                          ("target", "draft") if draft_len else ("target",))
    config = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=1 << 20,
                             draft_len=draft_len, proposer_model="draft" if draft_len else None)
    builder = Scheduler(config, blocks)  # token ids kept, as the engine keeps them
    params = SamplingParams(max_tokens=steps * (draft_len + 1) + 8, ignore_eos=True)
    for i in range(num_requests):
        builder.add(Request(f"r{i}", list(range(prompt_len)), params, arrival_ns=0))
    batch = builder.schedule()  # the prefill step
    builder.allocate(batch)
    book = _bookkeeping(builder, spec)
    book(batch)
    times: dict[str, list[float]] = {"schedule": [], "kv_alloc": [], "plan": [], "accept": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = builder.schedule()
        t1 = time.perf_counter()
        builder.allocate(batch)
        t2 = time.perf_counter()
        if batch.is_spec:
            packing.verify_message(batch, blocks, spec)
            packing.draft_message(batch, blocks, spec)
        else:
            packing.forward_message(batch, blocks)
        t3 = time.perf_counter()
        book(batch)  # every draft accepted: sequences grow by D + 1
        times["schedule"].append(t1 - t0)
        times["kv_alloc"].append(t2 - t1)
        times["plan"].append(t3 - t2)
        times["accept"].append(book.seconds)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["total"] = sum(out.values())
    return out


def _bookkeeping(builder, spec):
    """The bookkeeping of a step's launch and device result (every draft accepted): the
    counters, speculation statistics, output counts and trimming of rejected slots (one
    `Scheduler.update`; the previous release's batch builder runs what it had instead)."""
    kv_ahead = spec.kv_ahead if spec.kv_model is not None else None

    def update(batch):
        n = len(batch)
        if batch.is_spec:
            d = batch.draft_lens
            result = messages.VerifyResult(accepted=d, tokens=np.ones((n, 1 + int(d.max())), dtype=np.int64),
                                           draft_lens=d)
            t0 = time.perf_counter()
        else:
            result = messages.ForwardResult(tokens=np.ones(n, dtype=np.int64))
            t0 = time.perf_counter()
            builder.launched(batch, fills=True)
        builder.update(batch, result, 0)
        run.seconds = time.perf_counter() - t0

    def arrays(batch):
        # the previous release: the batch builder's bookkeeping and the pipeline's output stage
        t0 = time.perf_counter()
        if batch.is_spec:
            accepted = batch.num_draft
            before = builder.advance_verify(batch, accepted)
            builder.record_verify(batch, before, accepted, batch.num_draft, spec.kv_ahead)
            n = len(batch)
            output._output(batch, np.arange(n), np.ones((n, 1 + int(accepted.max())), dtype=np.int64), accepted + 1)
            builder.trim_rejected(batch)
        else:
            builder.advance_forward(batch, kv_ahead)
            builder.complete_forward(batch)
            rows = batch.samples.nonzero()[0]
            output._output(batch, rows, np.ones((len(rows), 1), dtype=np.int64))
        run.seconds = time.perf_counter() - t0

    if not hasattr(builder, "update"):
        from specsched.scheduler.output_stage import OutputStage

        class Output(OutputStage):  # the pipeline's state the output stage reads
            table, keep_ids, eos, _aborts, _now = builder.table, True, set(), set(), staticmethod(lambda: 0)
            sink = type("Sink", (), {"on_tokens": staticmethod(lambda r, t: None)})()

            def _finish_many(self, reqs, reason):
                builder.remove_many(reqs)

        output = Output()

    run = update if hasattr(builder, "update") else arrays
    run.seconds = 0.0
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    add_side_by_side_options(ap)
    args = ap.parse_args()
    cases = [(n, d, kind) for n in args.requests for d, kind in ((0, "decode"), (4, "verify D=4"))]
    if args.json:
        print(json.dumps([measure(n, args.steps, d) for n, d, _ in cases]))
        return
    if args.baseline is None:
        print(f"{'running':>8} {'step':>10} {'schedule':>9} {'kv_alloc':>9} {'plan':>9} {'accept':>9} {'total ms':>9}")
        for n, d, kind in cases:
            m = measure(n, args.steps, d)
            print(f"{n:>8} {kind:>10} {m['schedule']:>9.3f} {m['kv_alloc']:>9.3f} {m['plan']:>9.3f} "
                  f"{m['accept']:>9.3f} {m['total']:>9.3f}")
        return
    cmd = [sys.executable, __file__, "--json", "--steps", str(args.steps), "--requests",
               *map(str, args.requests)]
    runs = side_by_side(cmd, args.baseline, args.rounds)
    print(f"median of {args.rounds} alternating rounds, ms per step (schedule + kv_alloc + plan + accept)")
    print(f"{'running':>8} {'step':>10} {'stage':>9} {'baseline':>9} {'this':>9} {'ratio':>7}")
    for i, (n, _, kind) in enumerate(cases):
        for stage in ("schedule", "kv_alloc", "plan", "accept", "total"):
            a = statistics.median(run[i][stage] for run in runs["baseline"])
            b = statistics.median(run[i][stage] for run in runs["this"])
            print(f"{n:>8} {kind:>10} {stage:>9} {a:>9.3f} {b:>9.3f} {b / a:>6.2f}x")


if __name__ == "__main__":
    main()
