"""Leader -> follower broadcast of one message per call: shared memory or torch.distributed.

Why two: a launch's metadata (attention plan, shapes, flags) has to reach every rank before
its forward. `DistChannel` sends it as a `torch.distributed.broadcast` of the pickled bytes
(two collectives: length, then payload); `ShmChannel` writes it once into a shared-memory
ring that every follower reads, the layout vLLM uses for the same job (its shared-memory
message queue), with one writer, N readers and no collective at all. Messages larger than a
ring slot go over the `DistChannel` instead (a marker in the ring says so), so there is no
size limit. `benchmarks/tensor_parallel.py` measures both.

Ordering: the ring's counters are written after the payload they publish. On x86 (TSO)
stores become visible in program order, which is all the protocol needs; readers poll the
counters, yielding the CPU between polls (a follower waits there between launches, and on a
small machine a spinning reader would steal the leader's core).
"""
from __future__ import annotations

import mmap
import os
import pickle
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_COUNTER_STRIDE = 8  # int64s between counters: one 64-byte cache line each


def _map_file(path: str, size: int, create: bool) -> mmap.mmap:
    """`size` bytes of the file at `path`, mapped shared: created (it must not exist yet) by the
    leader, opened by the followers."""
    if create:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
    else:
        fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _wait_until(ready, yields: int = 64, nap_s: float = 50e-6) -> None:
    """Poll `ready()`, yielding the CPU between polls, then napping `nap_s` between them (a
    spinning reader would take the core the rank it waits for needs)."""
    polls = 0
    while not ready():
        polls += 1
        time.sleep(0 if polls < yields else nap_s)


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # a view is still alive; the mapping goes with the process


class DistChannel:
    """Pickled messages over `torch.distributed.broadcast` from rank `src` of `group`."""

    def __init__(self, group: Any = None, src: int = 0):
        self.group, self.src = group, src
        self._len = torch.zeros(1, dtype=torch.int64)

    def send(self, obj: Any) -> int:
        return self.send_bytes(pickle.dumps(obj, _PROTOCOL))

    def send_bytes(self, payload: bytes) -> int:
        self._len[0] = len(payload)
        dist.broadcast(self._len, self.src, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.src, group=self.group)
        return len(payload)

    def recv(self) -> Any:
        dist.broadcast(self._len, self.src, group=self.group)
        buf = torch.empty(int(self._len[0]), dtype=torch.uint8)
        dist.broadcast(buf, self.src, group=self.group)
        return pickle.loads(buf.numpy().tobytes())

    def close(self) -> None:
        pass


class ShmChannel:
    """A ring of `slots` message slots of `slot_bytes` in a shared-memory file, written by
    the leader and read by `num_readers` followers (reader index = rank - 1).

    Layout: counters (the writer's next sequence number, then each reader's), a cache line
    each; then the slots, each an int64 length (-1: the message went over `fallback`) and
    the payload. The writer reuses a slot only once every reader has read it."""

    def __init__(self, path: str, num_readers: int, *, reader: int | None = None, create: bool = False,
                 slots: int = 4, slot_bytes: int = 4 << 20, fallback: DistChannel | None = None):
        self.path, self.num_readers, self.reader = path, num_readers, reader
        self.slots, self.slot_bytes = slots, slot_bytes
        self.fallback = fallback
        self._head = (1 + num_readers) * _COUNTER_STRIDE * 8
        size = self._head + slots * (8 + slot_bytes)
        self._map = _map_file(path, size, create)
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=(1 + num_readers) * _COUNTER_STRIDE)
        self._seq = 0

    def _slot(self, seq: int) -> int:
        return self._head + (seq % self.slots) * (8 + self.slot_bytes)

    def send(self, obj: Any) -> int:
        payload = pickle.dumps(obj, _PROTOCOL)
        seq, c = self._seq, self._counters
        readers = c[_COUNTER_STRIDE::_COUNTER_STRIDE]
        _wait_until(lambda: int(readers.min()) > seq - self.slots)  # the slot's last message was read
        at = self._slot(seq)
        n = len(payload)
        big = n > self.slot_bytes
        if not big:
            self._map[at + 8 : at + 8 + n] = payload
        self._map[at : at + 8] = (-1 if big else n).to_bytes(8, "little", signed=True)
        c[0] = seq + 1  # publish
        self._seq = seq + 1
        if big:
            if self.fallback is None:
                raise ValueError(f"message of {n} bytes exceeds the shared-memory slot ({self.slot_bytes})")
            self.fallback.send_bytes(payload)
        return n

    def recv(self) -> Any:
        seq, c = self._seq, self._counters
        _wait_until(lambda: int(c[0]) > seq)
        at = self._slot(seq)
        n = int.from_bytes(self._map[at : at + 8], "little", signed=True)
        obj = None if n < 0 else pickle.loads(self._map[at + 8 : at + 8 + n])
        self._seq = seq + 1
        c[(1 + self.reader) * _COUNTER_STRIDE] = seq + 1  # the slot is free again
        return self.fallback.recv() if n < 0 else obj

    def close(self) -> None:
        self._counters = None
        _unmap(self._map)


class ShmAllReduce:
    """All-reduce (sum) of a tensor over `size` ranks on one machine through a shared-memory
    file: each rank copies its tensor into its own slot, marks it written, waits for every
    rank's mark, and sums the slots in rank order (so every rank gets bit-identical sums).

    Why: a gloo all-reduce of a [tokens, hidden] activation costs a couple of hundred
    microseconds over loopback TCP even for a few kilobytes, two of them per layer; the
    shared-memory path is a copy and a poll. Two generations of slots alternate, so a rank
    may write the next all-reduce while another still reads this one (it can only get two
    ahead once every rank has written the one in between, i.e. finished reading this one). A
    tensor larger than a slot returns False: the caller uses torch.distributed instead (every
    rank sees the same size, so all take the same path)."""

    def __init__(self, path: str, rank: int, size: int, *, create: bool = False, slot_bytes: int = 8 << 20):
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self._data_at = size * _COUNTER_STRIDE * 8
        total = self._data_at + 2 * size * slot_bytes
        self._map = _map_file(path, total, create)
        self._marks = np.frombuffer(self._map, dtype=np.int64, count=size * _COUNTER_STRIDE)[::_COUNTER_STRIDE]
        self._views: dict[torch.dtype, torch.Tensor] = {}
        self._seq = 0

    def _slot(self, dtype: torch.dtype, generation: int, rank: int, numel: int) -> torch.Tensor:
        whole = self._views.get(dtype)
        if whole is None:
            whole = self._views[dtype] = torch.frombuffer(self._map, dtype=dtype, offset=self._data_at)
        per = self.slot_bytes // whole.element_size()
        at = (generation * self.size + rank) * per
        return whole[at : at + numel]

    def all_reduce(self, t: torch.Tensor) -> bool:
        numel = t.numel()
        if numel * t.element_size() > self.slot_bytes or t.device.type != "cpu" or not t.is_contiguous():
            return False
        seq = self._seq
        gen = seq % 2
        flat = t.view(-1)
        self._slot(t.dtype, gen, self.rank, numel).copy_(flat)
        self._marks[self.rank] = seq + 1
        marks = self._marks
        # a layer's all-reduce waits for the other rank's matmul: poll longer before napping
        _wait_until(lambda: int(marks.min()) > seq, yields=256, nap_s=20e-6)
        flat.copy_(self._slot(t.dtype, gen, 0, numel))
        for r in range(1, self.size):
            flat.add_(self._slot(t.dtype, gen, r, numel))
        self._seq = seq + 1
        return True

    def close(self) -> None:
        self._views.clear()
        self._marks = None
        _unmap(self._map)


class Stamps:
    """A follower's (call, start_ns, end_ns) per sharded call, in a shared-memory ring of
    `capacity` entries that the leader reads (an entry is written before the count that
    publishes it). The leader reads often (after every op), so the ring never laps it."""

    def __init__(self, path: str, *, create: bool = False, capacity: int = 4096):
        self.capacity = capacity
        size = 8 * (_COUNTER_STRIDE + 3 * capacity)
        self._map = _map_file(path, size, create)
        self._a = np.frombuffer(self._map, dtype=np.int64)
        self._read = 0

    def add(self, call: int, start_ns: int, end_ns: int) -> None:
        n = int(self._a[0])
        at = _COUNTER_STRIDE + 3 * (n % self.capacity)
        self._a[at : at + 3] = (call, start_ns, end_ns)
        self._a[0] = n + 1

    def new(self) -> list[tuple[int, int, int]]:
        """Entries added since the last call (the newest `capacity` if more)."""
        n = int(self._a[0])
        first = max(self._read, n - self.capacity)
        out = []
        for i in range(first, n):
            at = _COUNTER_STRIDE + 3 * (i % self.capacity)
            out.append(tuple(int(v) for v in self._a[at : at + 3]))
        self._read = n
        return out

    def close(self) -> None:
        self._a = None
        _unmap(self._map)
