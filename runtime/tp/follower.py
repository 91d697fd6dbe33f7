"""A follower rank (1..N-1): its shards of the target and head, replaying the leader's calls.

Why so little here: a follower holds no request state. Each message names a sharded module
and a method with the call's plan and flags; the tensors follow as broadcasts; the follower
plans the attention step on its own KV shard and runs the call, meeting the leader at every
all-reduce. Its outputs are dropped (it asked for no logits). See runtime/tp/ranks.py.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from specsched.runtime.attention import resolve_backend
from specsched.runtime.tp.channel import Stamps
from specsched.runtime.tp.ranks import RankConfig, attach_shm, form_group, make_channel, stamps_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _die_with_leader(leader_pid: int) -> None:
    """PR_SET_PDEATHSIG: the kernel kills this process when the leader dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != leader_pid:  # the leader died before the prctl took effect
        os._exit(1)


def entry() -> None:
    """`python -c "...; entry()" CONFIG_JSON` (started by `ranks.Leader`)."""
    cfg = RankConfig(**json.loads(sys.argv[1]))
    _die_with_leader(cfg.leader_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader decides when ranks stop
    try:
        serve(cfg)
    except Exception:  # noqa: BLE001 - reported on stderr; the leader's watchdog sees the exit
        sys.stderr.write(f"specsched: tensor-parallel rank {cfg.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)


def serve(cfg: RankConfig) -> None:
    from specsched.runtime.dummy import load, load_head_for
    from specsched.runtime.layers import pack_linears, use_cpu_kernels

    torch.set_num_threads(cfg.num_threads)
    torch.set_grad_enabled(False)
    shm = attach_shm(cfg)
    stamps = Stamps(stamps_path(cfg, cfg.rank))
    tp = form_group(cfg, shm)
    channel = make_channel(tp.group, shm)
    device = torch.device(cfg.device)
    # the same loads in the same order as the leader's worker (loading is collective)
    target = load(cfg.model_dir, cfg.load_format, _DTYPES[cfg.dtype], device, tp)
    # resolved as the leader's worker does, on the same machine: the same backend
    backend = target.attention_backend(resolve_backend(cfg.attention, device, _DTYPES[cfg.dtype],
                                                       target.config.head_dim)[0])
    modules: dict[str, tuple[Any, Any]] = {
        "target": (target, target.make_kv_cache(cfg.num_pages, cfg.page_size, backend=backend))}
    if cfg.head_dir is not None:
        head = load_head_for(cfg.head_dir, target, cfg.load_format)
        modules["head"] = (head, head.make_kv_cache(cfg.num_pages, cfg.page_size, backend=backend))
    if cfg.linear == "auto":
        pack_linears(*(module for module, _ in modules.values()))
    if cfg.ops == "auto":
        use_cpu_kernels(*(module for module, _ in modules.values()))
    for name, (_, kv) in list(modules.items()):  # a cache's own calls (EAGLE's slot copies)
        modules[f"{name}.kv"] = (kv, kv)
    no_logits = torch.zeros(0, dtype=torch.int64, device=device)
    with torch.inference_mode():
        while True:
            msg = channel.recv()
            if msg[0] == "stop":
                break
            _, call, name, method, args, kwargs = msg
            t0 = time.monotonic_ns()
            module, kv = modules[name]

            def unpack(p: tuple) -> Any:
                kind = p[0]
                if kind == "tensor":
                    return _receive(p[1], p[2], tp.group, device)
                if kind == "array":
                    return torch.from_numpy(p[1]).to(device)
                if kind == "kv":
                    return kv
                if kind == "step":
                    return backend.prepare(p[1], device)
                if kind == "no_logits":
                    return no_logits
                return p[1]

            call_args = [unpack(a) for a in args]  # tensors arrive in the leader's packing order
            call_kwargs = {k: unpack(v) for k, v in kwargs.items()}
            getattr(module, method)(*call_args, **call_kwargs)
            stamps.add(call, t0, time.monotonic_ns())  # the host's clock base, as the leader's stamps
    channel.close()
    dist.destroy_process_group()


def _receive(shape: tuple, dtype: str, group: Any, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
    dist.broadcast(t, 0, group=group)
    return t
