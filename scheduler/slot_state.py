"""Per-request scheduler state as numpy arrays indexed by slot, so that a decode-only step is a few whole-array
operations whatever the batch size, not a Python loop over request objects in every stage.

A `Request` is the public handle; its counters (`num_computed_tokens`, ...) read and write its row of a `SlotTable`.
Without a slot (not yet added, or finished) it keeps them in a dict of its own (`own_counters`): `attach` moves them
into a free slot, `detach` back out, so the handle stays readable after its slot is reused. The slot is also the
request's row in the block manager's page tables and its index into the device's per-request state.
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.small_arrays import largest, smallest

# per-slot int64 counters, in the order `attach` / `detach` copy them
COUNTERS = (
    "prompt_len",  # prompt tokens (fixed)
    "max_tokens",  # the request's max_tokens (fixed)
    "num_output",  # len(output_token_ids): tokens the host has seen
    "computed",  # tokens with KV in the target cache
    "pending",  # sampled on the device, not yet seen by the host
    "proposer_computed",  # tokens with KV in the proposer's cache (draft model / head)
)
# The speculation totals (drafts, drafted and accepted tokens) are not counters of their own:
# they are sums over the histograms (`spec_totals`), so a verification updates two arrays.


def own_counters(prompt_len: int, max_tokens: int) -> dict:
    """A request's counters while it holds no slot: `COUNTERS` as ints, and its draft-length
    and accepted-count histograms (None until it was drafted for)."""
    own = dict.fromkeys(COUNTERS, 0)
    own["prompt_len"], own["max_tokens"] = prompt_len, max_tokens
    own["drafted_hist"] = own["accepted_hist"] = None  # [D+1] as in `SlotTable`, once drafted for
    return own


class SlotTable:
    """Counters of up to `capacity` requests (grows on demand), plus per slot how many
    drafts had d tokens and how many verifications accepted a of them (`[slots, max_draft_len + 1]`
    histograms: one element each per verification, whatever the draft length)."""

    def __init__(self, capacity: int = 8, max_draft_len: int = 4):
        self._capacity = max(1, capacity)
        self._max_draft_len = max(1, max_draft_len)
        self._counters = np.zeros((self._capacity, len(COUNTERS)), dtype=np.int64)
        self._views()
        # bumped whenever a slot changes hands: rows of a batch whose request finished while
        # it was in flight are told apart from a new request in the same slot
        self.gen = np.zeros(self._capacity, dtype=np.int64)
        # [slots, max_draft_len + 1]: verifications that drafted exactly d tokens / accepted exactly a
        self.drafted_hist = np.zeros((self._capacity, self._max_draft_len + 1), dtype=np.int64)
        self.accepted_hist = np.zeros((self._capacity, self._max_draft_len + 1), dtype=np.int64)
        self._free: list[int] = []  # freed slots, reused last-freed first
        self._next = 0  # slots ever handed out

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
        self._counters[slot] = [own[name] for name in COUNTERS]
        if own["drafted_hist"] is not None:
            max_draft_len = own["drafted_hist"].shape[0] - 1
            if max_draft_len > self._max_draft_len:
                self._grow(max_draft_len=max_draft_len)
            self.drafted_hist[slot, : max_draft_len + 1] = own["drafted_hist"]
            self.accepted_hist[slot, : max_draft_len + 1] = own["accepted_hist"]
        self.gen[slot] += 1
        req._table, req._row, req._own, req.slot = self, slot, None, slot
        return slot

    def detach(self, reqs) -> None:
        """Move each request's counters back to its handle and free its slot (distinct slots, in order)."""
        slots = np.fromiter((r._row for r in reqs), dtype=np.int64, count=len(reqs))
        rows = self._counters[slots]
        drafted, accepted = self.drafted_hist[slots], self.accepted_hist[slots]  # copies
        has = drafted.any(axis=1).tolist()
        for i, (req, row) in enumerate(zip(reqs, rows.tolist())):
            own = dict(zip(COUNTERS, row))
            if has[i]:
                own["drafted_hist"], own["accepted_hist"] = drafted[i], accepted[i]
            else:
                own["drafted_hist"] = own["accepted_hist"] = None
            req._table, req._row, req._own = None, -1, own
        self._counters[slots] = 0
        self.drafted_hist[slots] = 0
        self.accepted_hist[slots] = 0
        self.gen[slots] += 1
        self._free.extend(slots.tolist())

    # -- whole-array updates ----------------------------------------------------------------
    def record_spec(self, slots: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """A verification's outcome for distinct `slots`: `drafted[i]` tokens drafted,
        `accepted[i]` of them accepted (rows that drafted nothing are not counted)."""
        drafted = np.asarray(drafted, dtype=np.int64)
        accepted = np.asarray(accepted, dtype=np.int64)
        if not drafted.size:
            return
        if smallest(drafted) <= 0:
            keep = drafted > 0
            slots, drafted, accepted = slots[keep], drafted[keep], accepted[keep]
            if not slots.size:
                return
        widest = largest(drafted)
        if widest > self._max_draft_len:
            self._grow(max_draft_len=widest)
        self.drafted_hist[slots, drafted] += 1  # slots are distinct
        self.accepted_hist[slots, np.minimum(accepted, drafted)] += 1  # <= drafted, as verify guarantees

    def num_tokens(self, slots: np.ndarray) -> np.ndarray:
        """[B] tokens of each slot's sequence: prompt, output seen, and sampled on the device
        but not yet seen (`Request.num_tokens`)."""
        return self.prompt_len[slots] + self.num_output[slots] + self.pending[slots]

    # -- internals --------------------------------------------------------------------------
    def _views(self) -> None:
        """Each counter is a column of one [slots, counters] array: a whole-array update
        reads and writes its column, and attaching or detaching a request moves its row in
        one operation."""
        for j, name in enumerate(COUNTERS):
            setattr(self, name, self._counters[:, j])

    def _grow(self, rows: int | None = None, max_draft_len: int | None = None) -> None:
        rows = max(rows or 0, self._capacity)
        max_draft_len = max(max_draft_len or 0, self._max_draft_len)
        if rows > self._counters.shape[0]:
            counters = np.zeros((rows, len(COUNTERS)), dtype=np.int64)
            counters[: self._counters.shape[0]] = self._counters
            self._counters = counters
            self._views()
            gen = np.zeros(rows, dtype=np.int64)
            gen[: self.gen.shape[0]] = self.gen
            self.gen = gen
        for name in ("drafted_hist", "accepted_hist"):
            old = getattr(self, name)
            new = np.zeros((rows, max_draft_len + 1), dtype=np.int64)
            new[: old.shape[0], : old.shape[1]] = old
            setattr(self, name, new)
        self._capacity, self._max_draft_len = rows, max_draft_len



def spec_totals(drafted_hist: np.ndarray | None, accepted_hist: np.ndarray | None) -> tuple[int, int, int]:
    """Histograms of exact draft lengths and accepted counts -> (drafts, drafted tokens,
    accepted tokens)."""
    if drafted_hist is None:
        return 0, 0, 0
    d, a = drafted_hist.tolist(), accepted_hist.tolist()
    return sum(d), sum(k * n for k, n in enumerate(d)), sum(k * n for k, n in enumerate(a))


def per_pos(drafted_hist: np.ndarray | None, accepted_hist: np.ndarray | None) -> tuple[list[int], list[int]]:
    """Histograms of exact draft lengths and accepted counts -> ([D] drafts with >= k+1
    tokens, [D] drafts accepted at >= k+1), D the longest draft counted."""
    if drafted_hist is None:
        return [], []
    used = np.flatnonzero(drafted_hist)
    if not used.size:
        return [], []
    max_draft_len = int(used[-1])

    def at_least(h: np.ndarray) -> list[int]:
        return np.cumsum(h[::-1])[::-1][1 : max_draft_len + 1].tolist()

    return at_least(drafted_hist), at_least(accepted_hist)
