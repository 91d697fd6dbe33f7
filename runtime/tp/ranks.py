"""Tensor-parallel ranks: the leader starts ranks 1..N-1 and replays its forwards on them.

Why this split: the leader (rank 0) is the `ModelWorker` the device already talks to. It
keeps everything that is per request or sequential -- the token buffer, sampling, the draft
model and the n-gram index, acceptance -- and only the sharded modules (the target and an
MTP / EAGLE head) run on every rank. Each call of a sharded module on the leader is first
broadcast to the followers as one message (the call's attention plan, flags and tensor
shapes, over a `channel`), its tensor inputs follow as `torch.distributed.broadcast`s, and
then all ranks run the module in lockstep, meeting at the layers' all-reduces. A follower
skips the LM head (it asks for no logits): only the leader reads them. The pipeline, the
messages and the schedules do not know the TP size.

Lifetimes: followers are children of the leader's process, started with
`python -c` (not multiprocessing: see devices/process.py) and tied to it by
PR_SET_PDEATHSIG, so a killed leader takes them along. A follower that dies makes the leader
exit at once (a watchdog thread), which the host device reports as `DeviceCrashed` for every
pending and later launch. `close` stops, joins and if need be kills every follower.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specsched.runtime.kv_cache import PagedKVCache
from specsched.runtime.parallel import TPGroup
from specsched.runtime.sync_guard import host_side
from specsched.runtime.tp.channel import DistChannel, ShmAllReduce, ShmChannel, Stamps

_ENTRY = "from specsched.runtime.tp.follower import entry; entry()"
CHANNELS = ("shm", "dist")
# collectives wait as long as the engine idles; a dead rank is noticed by the watchdog, not a timeout
_IDLE_TIMEOUT = timedelta(days=30)
_START_GRACE_S = 3.0


@dataclass(frozen=True)
class RankConfig:
    """What a follower needs to build its shards (JSON on its command line)."""

    rank: int
    size: int
    init_method: str
    channel: str
    shm_path: str
    model_dir: str
    head_dir: str | None
    dtype: str
    device: str
    attention: str
    num_pages: int
    page_size: int
    num_threads: int
    leader_pid: int
    start_timeout_s: float
    load_format: str = "auto"  # "dummy": each rank makes its shard from config.json (runtime/dummy.py)
    linear: str = "auto"  # WorkerConfig.linear: each rank packs its shard's linears as the leader does
    ops: str = "auto"  # WorkerConfig.ops: each rank's layers run their small ops as the leader's do


@dataclass
class CommStats:
    """Host time the leader spent broadcasting launches and in all-reduces (on a CPU group
    the collectives are synchronous, so this is their cost)."""

    broadcasts: int = 0
    broadcast_bytes: int = 0
    broadcast_ns: int = 0
    all_reduces: int = 0
    all_reduce_ns: int = 0


@dataclass(frozen=True)
class MeteredGroup(TPGroup):
    """A TPGroup that counts its all-reduces' time into `stats`."""

    stats: CommStats = field(default_factory=CommStats, compare=False)
    shm: ShmAllReduce | None = field(default=None, compare=False)  # the "shm" channel's all-reduce

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        if self.shm is None or not self.shm.all_reduce(t):
            dist.all_reduce(t, group=self.group)
        self.stats.all_reduce_ns += time.perf_counter_ns() - t0
        self.stats.all_reduces += 1
        return t


def form_group(cfg: RankConfig, shm: tuple | None = None) -> MeteredGroup:
    """Join the ranks' gloo group (every rank calls this). The rendezvous is bounded by the
    start timeout; the group the model uses waits as long as the engine idles. `shm`: what
    `attach_shm` mapped (its all-reduce replaces gloo's for tensors that fit)."""
    dist.init_process_group("gloo", init_method=cfg.init_method, rank=cfg.rank, world_size=cfg.size,
                            timeout=timedelta(seconds=cfg.start_timeout_s))
    group = dist.new_group(list(range(cfg.size)), timeout=_IDLE_TIMEOUT)
    return MeteredGroup(cfg.rank, cfg.size, group, shm=shm[1] if shm is not None else None)


def attach_shm(cfg: RankConfig, create: bool = False) -> tuple[ShmChannel, ShmAllReduce] | None:
    """A "shm" group's launch ring and all-reduce buffers (None for "dist"); mapped before
    the group forms, so that the leader can unlink their files once it has."""
    if cfg.channel != "shm":
        return None
    reader = None if cfg.rank == 0 else cfg.rank - 1
    return (ShmChannel(cfg.shm_path, cfg.size - 1, reader=reader, create=create),
            ShmAllReduce(cfg.shm_path + ".reduce", cfg.rank, cfg.size, create=create))


def make_channel(group: Any, shm: tuple | None) -> ShmChannel | DistChannel:
    """The group's launch channel: the ring (oversized messages over `torch.distributed`),
    or `torch.distributed` alone."""
    dist_channel = DistChannel(group)
    if shm is None:
        return dist_channel
    shm[0].fallback = dist_channel
    return shm[0]


def stamps_path(cfg: RankConfig, rank: int) -> str:
    return f"{cfg.shm_path}.stamps{rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Leader:
    """Rank 0 of a group of `size`: starts the followers and forms the group (`tp`, for
    `load_model(tp=...)`); `wrap` makes a module's calls run on every rank."""

    def __init__(self, size: int, *, model_dir: str, head_dir: str | None, dtype: str, device: str,
                 attention: str, num_pages: int, page_size: int, num_threads: int, channel: str = "shm",
                 start_timeout_s: float = 120.0, load_format: str = "auto", linear: str = "auto",
                 ops: str = "auto"):
        if channel not in CHANNELS:
            raise ValueError(f"unknown tensor-parallel channel {channel!r} (choose from {', '.join(CHANNELS)})")
        if device != "cpu":
            raise ValueError("tensor parallelism runs on the host device's CPU ranks (gloo); "
                             f"device {device!r} is not supported with tensor_parallel_size > 1")
        self.size = size
        self.stats = CommStats()
        self.channel = None
        self._closing = False
        self._started = False
        self._stamps: list[Stamps] = []
        self._seq = 0  # sharded calls so far (the followers stamp each by this number)
        self._calls: dict[int, tuple[str, int | None]] = {}  # call -> (span name, step), until stamped
        self.current: tuple[str, int | None] = ("", None)  # the op being run: its span name and step
        shm_path = os.path.join(_shm_dir(), f"specsched-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        base = RankConfig(0, size, f"tcp://127.0.0.1:{_free_port()}", channel, shm_path, model_dir, head_dir,
                          dtype, device, attention, num_pages, page_size, num_threads, os.getpid(), start_timeout_s,
                          load_format, linear, ops)
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._shm_file = shm_path  # the ring's, the all-reduce's and the stamps' files start with it
        self.followers: list[subprocess.Popen] = []
        try:
            shm = attach_shm(base, create=True)  # before the followers, which map it at start
            self._stamps = [Stamps(stamps_path(base, r), create=True) for r in range(1, size)]
            for rank in range(1, size):
                cfg = json.dumps(asdict(base) | {"rank": rank})
                self.followers.append(subprocess.Popen([sys.executable, "-c", _ENTRY, cfg], env=env,
                                                       stdin=subprocess.DEVNULL))
            self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
            self._watchdog.start()
            self.tp = form_group(base, shm)
            self.stats = self.tp.stats
            self.channel = make_channel(self.tp.group, shm)
        except BaseException:
            self.close()
            raise
        if self._shm_file is not None:
            # every follower mapped them before the group could form; nothing else may open them
            self._unlink_shm()

    # -- launching work on every rank -----------------------------------------------------------
    def wrap(self, module: Any, name: str) -> "Replicated":
        return Replicated(module, name, self)

    def wrap_kv(self, kv: PagedKVCache, name: str) -> "ReplicatedKV":
        return ReplicatedKV(kv, name, self)

    def broadcast(self, command: tuple, tensors: list[torch.Tensor] = ()) -> None:
        """One message to every follower, then its tensors in order."""
        t0 = time.perf_counter_ns()
        n = self.channel.send(command)
        for t in tensors:
            dist.broadcast(t.contiguous(), 0, group=self.tp.group)
            n += t.numel() * t.element_size()
        s = self.stats
        s.broadcast_ns += time.perf_counter_ns() - t0
        s.broadcasts += 1
        s.broadcast_bytes += n

    def collect(self) -> tuple[tuple[int, str, int | None, int, int], ...]:
        """The followers' call intervals stamped since the last collect, as (rank, span name,
        step, start_ns, end_ns) (a call still running on a follower comes with a later one)."""
        out = []
        for rank, stamps in enumerate(self._stamps, start=1):
            for call, t0, t1 in stamps.new():
                name, step = self._calls.get(call, ("", None))
                out.append((rank, name, step, t0, t1))
        if out and len(self._calls) > 1024:  # stamped by every rank long ago
            for call in [c for c in self._calls if c < self._seq - 1024]:
                del self._calls[call]
        return tuple(out)

    def call(self, name: str, method: str, args: tuple, kwargs: dict) -> None:
        # over the ring, CPU tensors travel inside the message (a pickled array costs ~10 us,
        # a gloo broadcast a few hundred); over torch.distributed, as broadcasts of their own
        tensors: list[torch.Tensor] | None = None if isinstance(self.channel, ShmChannel) else []
        packed = ([_pack(a, None, tensors) for a in args], {k: _pack(v, k, tensors) for k, v in kwargs.items()})
        seq = self._seq
        self._seq += 1
        self._calls[seq] = self.current
        self.broadcast(("call", seq, name, method, *packed), tensors or ())

    # -- lifetime -------------------------------------------------------------------------------
    def started(self) -> None:
        """The worker is built: from now on a follower's death stops the leader at once."""
        self._started = True

    def _watch(self) -> None:
        while not self._closing:
            for rank, p in enumerate(self.followers, start=1):
                code = p.poll()
                if code is None or self._closing:
                    continue
                if not self._started:
                    # while starting, the leader's own load usually fails on the same cause
                    # (loading is collective) and reports it; give it the chance
                    time.sleep(_START_GRACE_S)
                    if self._closing:
                        return
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                sys.stderr.write(f"specsched: tensor-parallel rank {rank} (pid {p.pid}) {how}; "
                                 "the leader (rank 0) stops\n")
                sys.stderr.flush()
                os._exit(70)
            time.sleep(0.05)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every follower (a stop message, then terminate / kill) and leave the group."""
        if self._closing:
            return
        self._closing = True
        if self.channel is not None:
            try:
                self.broadcast(("stop",))
            except Exception:  # noqa: BLE001 - a follower already gone; killed below
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.followers:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.channel is not None:
            self.channel.close()
        for stamps in self._stamps:
            stamps.close()
        if self._shm_file is not None:
            self._unlink_shm()

    def _unlink_shm(self) -> None:
        for path in (self._shm_file, self._shm_file + ".reduce",
                     *(f"{self._shm_file}.stamps{r}" for r in range(1, self.size))):
            if os.path.exists(path):
                os.unlink(path)
        self._shm_file = None


def _pack(v: Any, key: str | None, tensors: list[torch.Tensor] | None) -> tuple:
    """A call argument as the followers rebuild it; tensors travel as broadcasts appended to
    `tensors`, or (None) in the message as arrays."""
    if key == "logits_indices":
        return ("no_logits",)  # followers skip the LM head
    if key == "return_hidden":
        return ("value", False)
    if isinstance(v, torch.Tensor):
        if tensors is None:  # CPU ranks: the values are in host memory already (no device to wait for)
            view = host_side(v.detach().view(v.shape))
            return ("array", view.numpy())
        tensors.append(v)
        return ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."))
    if isinstance(v, (PagedKVCache, ReplicatedKV)):
        return ("kv",)
    if hasattr(v, "plan") and hasattr(v, "attend"):  # a StepAttention: the followers plan it themselves
        return ("step", v.plan)
    return ("value", v)


class Replicated:
    """A sharded module whose calls (`module(...)`, `module.forward_full(...)`) the leader
    broadcasts before running its own shard; every other attribute is the module's."""

    def __init__(self, module: Any, name: str, leader: Leader):
        self.__dict__.update(_module=module, _name=name, _leader=leader)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._module, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._leader.call(self._name, "forward", args, kwargs)
        return self._module(*args, **kwargs)

    def forward_full(self, *args: Any) -> Any:
        self._leader.call(self._name, "forward_full", args, {})
        return self._module.forward_full(*args)


class ReplicatedKV:
    """A sharded module's KV cache: slot copies (EAGLE's path compaction) run on every rank."""

    def __init__(self, kv: PagedKVCache, name: str, leader: Leader):
        self.__dict__.update(_kv=kv, _name=name, _leader=leader)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._kv, attr)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._leader.call(f"{self._name}.kv", "copy_slots", (src, dst), {})
        self._kv.copy_slots(src, dst)
