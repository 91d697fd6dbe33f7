"""Per-request scheduler state as numpy arrays indexed by slot.

Why: the scheduler's steady state touches every running request every step (which rows
decode, how many tokens each computes and drafts, the pages they need, the accepted
lengths). Held as attributes of one Python object per request, that is a Python loop over
the batch in every stage; held as arrays indexed by the request's slot, a decode-only step
is a few whole-array operations whatever the batch size.

A `Request` is the public handle (id, params, output ids); its counters
(`num_computed_tokens`, `num_pending_tokens`, ...) read and write its row of a `SlotTable`.
A request without a slot (not yet added to a scheduler, or finished) keeps them in a dict
of its own (`own_counters`); `attach` moves them into the scheduler's table under a free
slot, `detach` moves them back out (the handle stays readable after its slot is reused). The slot is also the request's row in the block
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


def own_counters(prompt_len: int, max_tokens: int) -> dict:
    """A request's counters while it holds no slot: `COUNTERS` as ints, and the per-position
    draft / acceptance counts as lists."""
    own = dict.fromkeys(COUNTERS, 0)
    own["prompt_len"], own["max_tokens"] = prompt_len, max_tokens
    own["drafted_per_pos"], own["accepted_per_pos"] = [], []
    return own


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
        own = req._own
        width = len(own["drafted_per_pos"])
        if width > self._width:
            self._grow(width=width)
        for name in COUNTERS:
            getattr(self, name)[slot] = own[name]
        self.drafted_per_pos[slot, :width] = own["drafted_per_pos"]
        self.accepted_per_pos[slot, :width] = own["accepted_per_pos"]
        self.gen[slot] += 1
        req._table, req._row, req._own, req.slot = self, slot, None, slot
        return slot

    def detach(self, req) -> None:
        """Move `req`'s counters back to the handle and free its slot."""
        slot = req._row
        own = {name: int(getattr(self, name)[slot]) for name in COUNTERS}
        width = own["spec_width"]
        own["drafted_per_pos"] = self.drafted_per_pos[slot, :width].tolist()
        own["accepted_per_pos"] = self.accepted_per_pos[slot, :width].tolist()
        for name in COUNTERS:
            getattr(self, name)[slot] = 0
        self.drafted_per_pos[slot] = 0
        self.accepted_per_pos[slot] = 0
        self.gen[slot] += 1
        req._table, req._row, req._own = None, -1, own
        self._free.append(slot)

    # -- whole-array updates ----------------------------------------------------------------
    def record_spec(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """A verification's outcome for distinct `slots`: `drafted[i]` tokens drafted,
        `accepted[i]` of them accepted (rows that drafted nothing are not counted)."""
        drafted = np.asarray(drafted, dtype=np.int64)
        accepted = np.asarray(accepted, dtype=np.int64)
        if not drafted.size:
            return
        if int(drafted.min()) <= 0:
            keep = drafted > 0
            slots, drafted, accepted = slots[keep], drafted[keep], accepted[keep]
            if not slots.size:
                return
        widest = int(drafted.max())
        if widest > self._width:
            self._grow(width=widest)
        self.num_drafts[slots] += 1
        self.drafted_tokens[slots] += drafted
        self.accepted_tokens[slots] += accepted
        self.spec_width[slots] = np.maximum(self.spec_width[slots], drafted)  # slots are distinct
        pos = self._pos
        self.drafted_per_pos[slots] += pos < drafted[:, None]
        self.accepted_per_pos[slots] += pos < np.minimum(accepted, drafted)[:, None]

    # -- internals --------------------------------------------------------------------------
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
