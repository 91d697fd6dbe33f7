"""Typed device messages for one request in slot 0, for tests that drive a worker's ops
directly (the pipeline packs them from a scheduled step; see scheduler/messages.py)."""
from __future__ import annotations

import numpy as np

from specsched.scheduler.messages import DraftMessage, FillMessage, ForwardMessage, LaunchShape, Registration
from specsched.scheduler.plan import AttentionPlan

SLOT0 = np.array([0], dtype=np.int64)


def _one(v: int) -> np.ndarray:
    return np.array([v], dtype=np.int64)


def prefill_forward(prompt: list[int], plan: AttentionPlan, step: int = 0) -> ForwardMessage:
    """Register slot 0 with `prompt` (greedy) and compute it, sampling the next token."""
    n = len(prompt)
    return ForwardMessage(step=step, slots=SLOT0, shape=LaunchShape(1, n, n, kind="prefill"), start=_one(0),
                          num_new=_one(n), samples=np.array([True]),
                          register=(Registration(0, list(prompt), 0.0, 0, 1.0, None),), plan=plan)


def fill(plan: AttentionPlan, start: int, end: int, after: str, step: int = 0) -> FillMessage:
    return FillMessage(step=step, slots=SLOT0, shape=LaunchShape(1, end - start, end, after=after), after=after,
                       start=_one(start), end=_one(end), plan=plan)


def draft(draft_lens: int, table: list[int], page_size: int, num_tokens: int, step: int = 1) -> DraftMessage:
    """Draft for slot 0, whose sequence has `num_tokens` tokens."""
    return DraftMessage(step=step, slots=SLOT0, shape=LaunchShape(1, 1, 0, draft_len=draft_lens),
                        start=_one(num_tokens - 1), draft_lens=_one(draft_lens), page_size=page_size,
                        page_tables=np.array([table], dtype=np.int32), table_lens=_one(len(table)))
