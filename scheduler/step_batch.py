"""One scheduled step as arrays over its rows: what the scheduler hands the pipeline. Rows whose request finished while
the step was in flight (its slot given back, maybe to a new request) are told apart by the slot's generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specsched.scheduler.request import Request
from specsched.scheduler.slot_state import SlotTable
from specsched.scheduler.small_arrays import every, some, total


@dataclass(eq=False)
class StepBatch:
    """One step's rows as arrays over the B scheduled requests (in `requests` order). Every row computes target tokens
    [start, start + num_new) and samples iff that reaches its last token; a speculative row also drafts `draft_lens`
    tokens, verified over 1 + that many positions (budget and pages are reserved for 1 + `draft_len`)."""

    step: int
    requests: list[Request]
    slots: np.ndarray  # [B] int64: each request's slot (page-table row, device state)
    start: np.ndarray  # [B] int64: num_computed_tokens when scheduled
    num_new: np.ndarray  # [B] int64: target tokens computed this step (prefill chunk or 1)
    draft_lens: np.ndarray  # [B] int64: tokens to draft (decode-only batches; <= D)
    samples: np.ndarray  # [B] bool: this step produces an output token for the row
    prefill: np.ndarray  # [B] bool: the request was in prefill when scheduled
    gen: np.ndarray  # [B] int64: the slots' generations when scheduled (see `live`)
    preempted: list[Request] = field(default_factory=list)
    draft_len: int = 0  # the step's D: a speculative step reserves 1 + D tokens per row (budget, pages)
    decision: object = None  # the adaptive draft length's `Decision` for this step, if one chose D

    # fixed once `schedule` returns the batch, so computed once (asked several times a step; plain attributes, as
    # functools.cached_property takes a lock on Python 3.11)
    is_spec: bool = field(init=False)
    kind: str = field(init=False)  # spec / decode / prefill / mixed, as scheduled
    shape_cache: dict = field(init=False, default_factory=dict)  # `packing.batch_shape`'s sums
    # the pages each row is short of, as scheduling found them (per model), and the block
    # manager's version then: `allocate` reuses them while no pages changed hands
    shortfall: tuple[int, dict[str, np.ndarray]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.is_spec = some(self.draft_lens)
        num_prefill = total(self.prefill)
        if self.is_spec:
            self.kind = "spec"
        elif not num_prefill:
            self.kind = "decode"
        else:
            self.kind = "prefill" if num_prefill == len(self.requests) else "mixed"

    @property
    def num_tokens(self) -> int:
        return total(self.num_new) + total(self.draft_lens)

    def __len__(self) -> int:
        return len(self.requests)


def empty_batch(step: int, preempted: list[Request]) -> StepBatch:
    z = np.zeros(0, dtype=np.int64)
    return StepBatch(step, [], z, z, z, z, z.astype(bool), z.astype(bool), z, preempted)


def live_rows(batch: StepBatch, table: SlotTable) -> np.ndarray:
    """[B] rows whose request still holds its slot (one that finished in flight gave it back, maybe to a new one)."""
    return table.gen[batch.slots] == batch.gen


def without_finished(batch: StepBatch, table: SlotTable) -> StepBatch:
    """The batch, before allocation, without rows whose request finished since it was scheduled (itself if none)."""
    live = live_rows(batch, table)
    if every(live):
        return batch
    keep = live.nonzero()[0]
    return StepBatch(batch.step, [batch.requests[i] for i in keep.tolist()], batch.slots[keep],
                     batch.start[keep], batch.num_new[keep], batch.draft_lens[keep], batch.samples[keep],
                     batch.prefill[keep], batch.gen[keep], batch.preempted, batch.draft_len, batch.decision)


def computed_now(batch: StepBatch, table: SlotTable) -> np.ndarray:
    """[B] num_computed_tokens of the batch's rows now (a finished row's from its handle, its slot gone back)."""
    computed = table.computed[batch.slots]
    gone = table.gen[batch.slots] != batch.gen
    if some(gone):
        for i in gone.nonzero()[0].tolist():
            computed[i] = batch.requests[i].num_computed_tokens
    return computed
