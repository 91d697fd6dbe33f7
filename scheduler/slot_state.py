"""Per-request scheduler state as numpy arrays indexed by slot.

Why: the scheduler's steady state touches every running request every step (which rows
decode, how many tokens each computes and drafts, the pages they need, the accepted
lengths). Held as attributes of one Python object per request, that is a Python loop over
the batch in every stage; held as arrays indexed by the request's slot, a decode-only step
is a few whole-array operations whatever the batch size.

A `Request` is the public handle (id, params, output ids); its counters
(`num_computed_tokens`, `num_pending_tokens`, ...) read and write its row of a `SlotTable`.
A request not yet added to a scheduler has a one-row table of its own; `attach` moves its
row into the scheduler's table under a free slot, `detach` moves it back out (the handle
stays readable after its slot is reused). The slot is also the request's row in the block
manager's page tables and its index into the device's per-request state.
"""
from __future__ import annotations

import numpy as np

# per-slot int64 counters, in the order `attach` / `detach` copy them
COUNTERS = (
    "prompt_len",  # prompt tokens (fixed)
    "max_tokens",  # the request's max_tokens (fixed)
    "num_output",  # len(output_token_ids): tokens the host has seen
    "computed",  # tokens with KV in the target cache
    "pending",  # sampled on the device, not yet seen by the host
    "proposer_computed",  # tokens with KV in the proposer's cache (draft model / head)
    "num_drafts",  # speculative steps this request was drafted for
    "drafted_tokens",
    "accepted_tokens",
    "spec_width",  # longest draft seen: the used width of the per-position counts
)


class SlotTable:
    """Counters of up to `capacity` requests (grows on demand), plus per-position draft /
    acceptance counts `[slots, width]`."""

    def __init__(self, capacity: int = 8, width: int = 4):
        self._capacity = max(1, capacity)
        self._width = max(1, width)
        for name in COUNTERS:
            setattr(self, name, np.zeros(self._capacity, dtype=np.int64))
        # [slots, width]: drafts with >= k+1 tokens, and of those accepted at >= k+1
        # bumped whenever a slot changes hands: rows of a batch whose request finished while
        # it was in flight are told apart from a new request in the same slot
        self.gen = np.zeros(self._capacity, dtype=np.int64)
        self.drafted_per_pos = np.zeros((self._capacity, self._width), dtype=np.int64)
        self.accepted_per_pos = np.zeros((self._capacity, self._width), dtype=np.int64)
        self._free: list[int] = []  # freed slots, reused last-freed first
        self._next = 0  # slots ever handed out
        self._pos = np.arange(self._width)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_used(self) -> int:
        return self._next - len(self._free)

    # -- slots ----------------------------------------------------------------------------
    def attach(self, req) -> int:
        """Give `req` a slot and move its counters there; returns the slot."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._next
            self._next += 1
            if slot >= self._capacity:
                self._grow(rows=2 * self._capacity)
        src, i = req._table, req._row
        if src.drafted_per_pos.shape[1] > self._width:
            self._grow(width=src.drafted_per_pos.shape[1])
        self._copy_row(src, i, self, slot)
        self.gen[slot] += 1
        req._table, req._row, req.slot = self, slot, slot
        return slot

    def detach(self, req) -> None:
        """Move `req`'s counters to a one-row table of its own and free its slot."""
        slot = req._row
        own = SlotTable(1, self._width)
        self._copy_row(self, slot, own, 0)
        for name in COUNTERS:
            getattr(self, name)[slot] = 0
        self.drafted_per_pos[slot] = 0
        self.accepted_per_pos[slot] = 0
        self.gen[slot] += 1
        req._table, req._row = own, 0
        self._free.append(slot)

    # -- whole-array updates ----------------------------------------------------------------
    def record_spec(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """A verification's outcome for distinct `slots`: `drafted[i]` tokens drafted,
        `accepted[i]` of them accepted (rows that drafted nothing are not counted)."""
        drafted = np.asarray(drafted, dtype=np.int64)
        accepted = np.asarray(accepted, dtype=np.int64)
        keep = drafted > 0
        if not keep.all():
            slots, drafted, accepted = slots[keep], drafted[keep], accepted[keep]
        if not slots.size:
            return
        widest = int(drafted.max())
        if widest > self._width:
            self._grow(width=widest)
        self.num_drafts[slots] += 1
        self.drafted_tokens[slots] += drafted
        self.accepted_tokens[slots] += accepted
        np.maximum.at(self.spec_width, slots, drafted)
        pos = self._pos
        self.drafted_per_pos[slots] += pos < drafted[:, None]
        self.accepted_per_pos[slots] += pos < np.minimum(accepted, drafted)[:, None]

    # -- internals --------------------------------------------------------------------------
    @staticmethod
    def _copy_row(src: "SlotTable", i: int, dst: "SlotTable", j: int) -> None:
        for name in COUNTERS:
            getattr(dst, name)[j] = getattr(src, name)[i]
        w = src.drafted_per_pos.shape[1]
        dst.drafted_per_pos[j, :w] = src.drafted_per_pos[i]
        dst.accepted_per_pos[j, :w] = src.accepted_per_pos[i]

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        rows = max(rows or 0, self._capacity)
        width = max(width or 0, self._width)
        for name in (*COUNTERS, "gen"):
            old = getattr(self, name)
            new = np.zeros(rows, dtype=np.int64)
            new[: old.shape[0]] = old
            setattr(self, name, new)
        for name in ("drafted_per_pos", "accepted_per_pos"):
            old = getattr(self, name)
            new = np.zeros((rows, width), dtype=np.int64)
            new[: old.shape[0], : old.shape[1]] = old
            setattr(self, name, new)
        self._capacity, self._width = rows, width
        self._pos = np.arange(width)
