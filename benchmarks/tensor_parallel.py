"""Tensor parallelism on the bundled model: TP=1 against TP=2, and the launch broadcast's cost.

1. Engine output tokens/s at TP=1 and TP=2 (gloo ranks on this machine's CPUs), alternating
   rounds in one run, medians; per proposer (none, mtp) at the given concurrencies.
2. Where TP=2's time goes, from the leader's counters (`ModelWorker.op_tp_stats`) over one
   served workload: per sharded call the broadcast (message + its tensors), per all-reduce
   (two per layer per call) its time -- mostly waiting for the other rank to reach it -- and
   both as a share of the run's wall time.
3. One message from rank 0 to rank 1 by size, over the shared-memory ring and over
   `torch.distributed.broadcast`: median microseconds from the send call to the message
   unpickled on the reader.

On a machine with few cores TP=2 is not expected to be faster: both ranks and the host
process share them, and the bundled model is dispatch-bound. What the numbers show is the
price of the group: broadcast and all-reduce per step.

    python benchmarks/tensor_parallel.py [--rounds 3] [--concurrency 1 8] [--sizes 1024 65536 1048576]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bundled_items, run  # noqa: E402

CONFIGS = {"none": {"proposer": "none", "schedule": "sync"}, "mtp": {"proposer": "mtp", "draft_len": 1}}


def engine_tokens_per_s(items_by_c, configs, rounds: int) -> None:
    print("1. engine output tokens/s, TP=1 vs TP=2 (median of alternating rounds)")
    print(f"{'proposer':<9} {'batch':>5} {'TP=1':>8} {'TP=2':>8} {'ratio':>6}")
    for name in configs:
        for c, items in items_by_c.items():
            got: dict[int, list[float]] = {1: [], 2: []}
            for r in range(rounds):
                for tp in ((1, 2) if r % 2 == 0 else (2, 1)):
                    m, _ = run(items, concurrency=c, warmup=1, trace=False, tensor_parallel_size=tp, **CONFIGS[name])
                    got[tp].append(m["output_tokens_per_s"])
            a, b = statistics.median(got[1]), statistics.median(got[2])
            print(f"{name:<9} {c:>5} {a:>8.1f} {b:>8.1f} {b / a:>5.2f}x")


def where_time_goes(items, configs, channel: str) -> None:
    import torch

    from specsched.runtime import bundled
    from specsched.runtime.training.mtp_eval import run_requests
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.sampling_params import SamplingParams

    torch.set_num_threads(1)
    print(f"\n2. TP=2 communication on the leader ({channel} channel), {len(items)} requests at once")
    print(f"{'proposer':<9} {'calls':>6} {'bcast us':>9} {'KiB/call':>9} {'all-reduces':>11} {'us each':>8} "
          f"{'bcast %':>8} {'allred %':>9}   (%: of the run's wall time)")
    tok = None
    prompts = []
    for it in items:
        if not isinstance(it.prompt, list) and tok is None:
            from specsched.runtime.tokenizer import Tokenizer

            tok = Tokenizer(str(bundled.target_dir()))
        prompts.append(list(it.prompt) if isinstance(it.prompt, list) else tok.encode(it.prompt))
    params = SamplingParams(max_tokens=items[0].params.max_tokens, ignore_eos=True)
    for name in configs:
        kw = CONFIGS[name]
        head = str(bundled.mtp_dir()) if kw["proposer"] == "mtp" else None
        w = ModelWorker(str(bundled.target_dir()), {"kind": kw["proposer"], "draft_len": kw.get("draft_len", 0)},
                        proposer_dir=head, num_pages=1024, num_threads=1, tensor_parallel_size=2, tp_channel=channel)
        try:
            run_requests(w, prompts[:1], params)  # warm-up
            before = w.op_tp_stats(None)
            t0 = time.perf_counter()
            run_requests(w, prompts, params)
            wall_ns = (time.perf_counter() - t0) * 1e9
            s = {k: v - before[k] for k, v in w.op_tp_stats(None).items() if k != "size"}
        finally:
            w.close()
        print(f"{name:<9} {s['broadcasts']:>6} {s['broadcast_ns'] / s['broadcasts'] / 1e3:>9.1f} "
              f"{s['broadcast_bytes'] / s['broadcasts'] / 1024:>9.1f} {s['all_reduces']:>11} "
              f"{s['all_reduce_ns'] / s['all_reduces'] / 1e3:>8.1f} {100 * s['broadcast_ns'] / wall_ns:>7.1f}% "
              f"{100 * s['all_reduce_ns'] / wall_ns:>8.1f}%")


def _rank(rank: int, port: int, shm_path: str, sizes: list[int], repeats: int, out_path: str) -> None:
    """Rank 0 sends `repeats` messages of each size over each channel, each stamped with the
    send time; rank 1 notes receive time - send time after unpickling (`perf_counter` is the
    system-wide monotonic clock on Linux). An untimed all-reduce separates the messages."""
    import pickle

    import torch
    import torch.distributed as dist

    from specsched.runtime.tp.channel import DistChannel, ShmChannel

    torch.set_num_threads(1)
    shm = ShmChannel(shm_path, 1, reader=None if rank == 0 else 0, slot_bytes=max(sizes) + 4096)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm.fallback = DistChannel()
    ack = torch.zeros(1)
    results = {}
    for name, ch in {"shm": shm, "dist": DistChannel()}.items():
        for size in sizes:
            payload = b"x" * size
            times = []
            for i in range(repeats + 3):
                if rank == 0:
                    ch.send((time.perf_counter_ns(), payload))
                else:
                    sent, _ = ch.recv()
                    if i >= 3:  # warm-up messages
                        times.append(time.perf_counter_ns() - sent)
                dist.all_reduce(ack)
            if rank == 1:
                results[(name, size)] = statistics.median(times)
    if rank == 1:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)
    shm.close()
    dist.destroy_process_group()


def broadcast_by_size(sizes: list[int], repeats: int) -> None:
    import pickle

    import torch.multiprocessing as mp

    from specsched.runtime.tp.channel import ShmChannel

    with tempfile.TemporaryDirectory() as tmp:
        shm_path, out = os.path.join(tmp, "ring"), os.path.join(tmp, "out.pkl")
        ShmChannel(shm_path, 1, create=True, slot_bytes=max(sizes) + 4096).close()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(port, shm_path, sizes, repeats, out), nprocs=2, join=True)
        with open(out, "rb") as f:
            res = pickle.load(f)
    print(f"\n3. one message rank 0 -> rank 1: median us from send to unpickled on the reader "
          f"({repeats} messages per cell)")
    print(f"{'bytes':>10} {'shm':>9} {'dist':>9} {'dist/shm':>9}")
    for size in sizes:
        a, b = res[("shm", size)], res[("dist", size)]
        print(f"{size:>10} {a / 1e3:>9.1f} {b / 1e3:>9.1f} {b / a:>8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--channel", choices=["shm", "dist"], default="shm", help="for part 2")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 262144, 1048576])
    ap.add_argument("--repeats", type=int, default=200, help="messages per size in part 3")
    ap.add_argument("--sections", default="123")
    args = ap.parse_args()
    if min(args.concurrency) < 1 or args.rounds < 1 or min(args.sizes) < 1 or args.repeats < 1:
        ap.error("--concurrency, --rounds, --sizes and --repeats must be >= 1")
    if "1" in args.sections:
        items_by_c = {c: bundled_items(max(args.num_requests, c), args.max_tokens) for c in args.concurrency}
        engine_tokens_per_s(items_by_c, args.configs, args.rounds)
    if "2" in args.sections:
        where_time_goes(bundled_items(args.num_requests, args.max_tokens), args.configs, args.channel)
    if "3" in args.sections:
        broadcast_by_size(args.sizes, args.repeats)


if __name__ == "__main__":
    main()
