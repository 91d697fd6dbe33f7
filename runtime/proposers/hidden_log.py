"""The target's hidden states a head has not read yet, kept on the device by forward launch.

Why: with an adaptive draft length at D = 0 (speculation off) a head's fills wait, so that a
load at which speculation does not pay costs what plain decoding does. When drafting resumes
the head catches up in one fill over the positions it missed, and a head reads, at each
position, the target's hidden state there -- which only the target's forwards of those
positions computed. The forwards whose fills wait (`ForwardMessage.keep_hidden`) leave their
hidden states here; the catch-up fill gathers them.

Kept per launch, not per request: a chunk holds one forward's rows (slots, first positions,
row offsets, hidden [tokens, H]), and gathering or dropping works on whole arrays (host index
math, one device gather per chunk): no Python loop over rows, and no device value is read.
A chunk is dropped once every row in it has been read or released; a later chunk of the same
slot and position (a preempted request recomputed) wins over an earlier one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specsched.runtime.sync_guard import to_device
from specsched.scheduler.plan import concat_ranges


@dataclass
class _Chunk:
    slots: np.ndarray  # [n] slot of each row
    starts: np.ndarray  # [n] first position of each row
    offsets: np.ndarray  # [n + 1] row i's hidden states are hidden[offsets[i]:offsets[i + 1]]
    hidden: torch.Tensor  # [tokens, H] on the device
    live: np.ndarray  # [n] bool: not read yet, nor released

    @property
    def ends(self) -> np.ndarray:
        return self.starts + np.diff(self.offsets)


class HiddenLog:
    def __init__(self) -> None:
        self.chunks: list[_Chunk] = []

    def keep(self, slots: np.ndarray, starts: np.ndarray, offsets: np.ndarray, hidden: torch.Tensor) -> None:
        """One forward's hidden states: row i (slot slots[i]) holds positions starts[i].. at
        hidden[offsets[i]:offsets[i + 1]]."""
        n = len(slots)
        self.chunks.append(_Chunk(np.asarray(slots, dtype=np.int64).copy(), np.asarray(starts, dtype=np.int64).copy(),
                                  np.asarray(offsets, dtype=np.int64).copy(), hidden, np.ones(n, dtype=bool)))

    def release(self, slot: int) -> None:
        """The request in `slot` is gone: its rows are never read."""
        for c in self.chunks:
            c.live &= c.slots != slot
        self._prune()

    def gather(self, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> torch.Tensor:
        """[sum(ends - starts), H]: positions [starts[i], ends[i]) of each row, rows in order;
        the rows' chunks up to those ends are read and then dropped. RuntimeError if a position
        was never kept."""
        slots, starts, ends = (np.asarray(x, dtype=np.int64) for x in (slots, starts, ends))
        lens = ends - starts
        total = int(lens.sum())
        first = np.cumsum(lens) - lens  # each requested row's offset in the output
        src_chunk = np.full(total, -1, dtype=np.int64)
        src_index = np.zeros(total, dtype=np.int64)
        by_slot = np.argsort(slots)  # a slot appears once among the requested rows
        sorted_slots, sorted_ends = slots[by_slot], ends[by_slot]
        matches = []
        for c in self.chunks:  # the requested row of each chunk row's slot, if any
            k = np.searchsorted(sorted_slots, c.slots).clip(max=max(len(slots) - 1, 0))
            matches.append((k, (sorted_slots[k] == c.slots) if len(slots) else np.zeros(len(c.slots), dtype=bool)))
        for ci, c in enumerate(self.chunks):
            # pairs (requested row i, chunk row j) of the same slot, and the positions they share
            k, same = matches[ci]
            j = np.flatnonzero(same & c.live)
            if not j.size:
                continue
            i = by_slot[k[j]]
            lo = np.maximum(starts[i], c.starts[j])
            hi = np.minimum(ends[i], c.ends[j])
            n = np.maximum(hi - lo, 0)
            if not n.any():
                continue
            pos = concat_ranges(lo, n)
            dst = np.repeat(first[i] - starts[i], n) + pos
            src_chunk[dst] = ci  # later chunks overwrite earlier ones: a recompute wins
            src_index[dst] = np.repeat(c.offsets[j] - c.starts[j], n) + pos
        if (src_chunk < 0).any():
            row = int(np.searchsorted(first, int(np.flatnonzero(src_chunk < 0)[0]), side="right") - 1)
            raise RuntimeError(f"head catch-up of slot {int(slots[row])} positions [{int(starts[row])}, "
                               f"{int(ends[row])}): target hidden states of some were never kept")
        parts, order = [], []
        for ci in np.unique(src_chunk).tolist():
            at = np.flatnonzero(src_chunk == ci)
            c = self.chunks[ci]
            parts.append(c.hidden.index_select(0, to_device(src_index[at], c.hidden.device)))
            order.append(at)
        if len(parts) == 1:
            out = parts[0]
        else:
            out = torch.cat(parts)
            inverse = np.empty(total, dtype=np.int64)
            inverse[np.concatenate(order)] = np.arange(total)
            out = out.index_select(0, to_device(inverse, out.device))
        for c, (k, same) in zip(self.chunks, matches):  # what the fill read is not needed again
            c.live &= ~(same & (c.ends <= sorted_ends[k]))
        self._prune()
        return out

    def _prune(self) -> None:
        self.chunks = [c for c in self.chunks if c.live.any()]

    def __len__(self) -> int:
        return len(self.chunks)
