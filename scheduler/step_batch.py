"""One scheduled step as arrays over its rows: what the batch builder hands the pipeline.

Why a module of its own: the builder (scheduler/batch_builder.py) decides the rows; the
pipeline, the message packing, the output stage and the trace read them. Every reader needs
this type, none needs the builder.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specsched.scheduler.request import Request
from specsched.scheduler.small_arrays import some, total


@dataclass(eq=False)
class StepBatch:
    """One step's rows as arrays over the B scheduled requests (in `requests` order).

    Every row computes target tokens [start, start + num_new) and samples iff that reaches
    its last token; a speculative row also drafts `num_draft` tokens and its verification
    covers 1 + num_draft positions (budget and pages are reserved for `width`)."""

    step: int
    requests: list[Request]
    slots: np.ndarray  # [B] int64: each request's slot (page-table row, device state)
    start: np.ndarray  # [B] int64: num_computed_tokens when scheduled
    num_new: np.ndarray  # [B] int64: target tokens computed this step (prefill chunk or 1)
    num_draft: np.ndarray  # [B] int64: tokens to draft (decode-only batches; <= D)
    samples: np.ndarray  # [B] bool: this step produces an output token for the row
    prefill: np.ndarray  # [B] bool: the request was in prefill when scheduled
    gen: np.ndarray  # [B] int64: the slots' generations when scheduled (see `live`)
    preempted: list[Request] = field(default_factory=list)
    width: int = 1  # what a speculative step reserves per row (budget, pages): 1 + the step's D
    decision: object = None  # the adaptive draft length's `Decision` for this step, if one chose D

    # A batch's rows and draft counts are fixed once `schedule` returns it, so whether it
    # speculates and its kind are computed once, there (the pipeline asks several times per
    # step; a plain attribute, as functools.cached_property takes a lock on Python 3.11).
    is_spec: bool = field(init=False)
    kind: str = field(init=False)  # spec / decode / prefill / mixed, as scheduled
    shape_cache: dict = field(init=False, default_factory=dict)  # `messages.batch_shape`'s sums
    # the pages each row is short of, as scheduling found them (per model), and the block
    # manager's version then: `allocate` reuses them while no pages changed hands
    shortfall: tuple[int, dict[str, np.ndarray]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.is_spec = some(self.num_draft)
        num_prefill = total(self.prefill)
        if self.is_spec:
            self.kind = "spec"
        elif not num_prefill:
            self.kind = "decode"
        else:
            self.kind = "prefill" if num_prefill == len(self.requests) else "mixed"

    @property
    def num_tokens(self) -> int:
        return total(self.num_new) + total(self.num_draft)

    def __len__(self) -> int:
        return len(self.requests)


def empty_batch(step: int, preempted: list[Request]) -> StepBatch:
    z = np.zeros(0, dtype=np.int64)
    return StepBatch(step, [], z, z, z, z, z.astype(bool), z.astype(bool), z, preempted)
