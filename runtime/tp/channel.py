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
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=(1 + num_readers) * _COUNTER_STRIDE)
        self._seq = 0

    def _slot(self, seq: int) -> int:
        return self._head + (seq % self.slots) * (8 + self.slot_bytes)

    def _wait(self, ready) -> None:
        polls = 0
        while not ready():
            polls += 1
            time.sleep(0 if polls < 64 else 50e-6)

    def send(self, obj: Any) -> int:
        payload = pickle.dumps(obj, _PROTOCOL)
        seq, c = self._seq, self._counters
        readers = c[_COUNTER_STRIDE::_COUNTER_STRIDE]
        self._wait(lambda: int(readers.min()) > seq - self.slots)  # the slot's last message was read
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
        self._wait(lambda: int(c[0]) > seq)
        at = self._slot(seq)
        n = int.from_bytes(self._map[at : at + 8], "little", signed=True)
        obj = None if n < 0 else pickle.loads(self._map[at + 8 : at + 8 + n])
        self._seq = seq + 1
        c[(1 + self.reader) * _COUNTER_STRIDE] = seq + 1  # the slot is free again
        return self.fallback.recv() if n < 0 else obj

    def close(self) -> None:
        self._counters = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with the process
