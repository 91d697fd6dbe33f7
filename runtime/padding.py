"""Padded step shapes: the fixed (rows, tokens per row) shapes CUDA graphs are captured for (the sizes:
`EngineConfig.graph_sizes`). Pure numpy.

A step whose rows all compute the same q tokens (decodes, verifies, draft steps, verify-window fills; q at most
`max_tokens_per_row` and one page) runs with its rows padded up to the next capture size, the pad rows' outputs
dropped; prefill chunks, mixed steps, rows of different lengths and batches above the largest size run at their own.

A pad row never touches a request's state: it reads and writes only the *scratch page*, a page past the block
manager's pool that every KV cache holds (`PagedKVCache.scratch_page`): its KV is its own q tokens at positions
0..q-1, its tokens are id 0, and a tree's pad rows are causal. The models pad their inputs to the padded plan's
positions and cut their outputs back to the real tokens (`pad_inputs`, `real_rows`). On a CPU worker the padded
shapes run eagerly, which the tests use to show that padding leaves every real row's outputs and pages as they were.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np

from specsched.scheduler.plan import AttentionPlan

@dataclass(frozen=True)
class Padding:
    sizes: tuple[int, ...]  # capture sizes, increasing
    scratch_page: int  # the page pad rows read and write (past the pool's pages)
    page_size: int
    max_tokens_per_row: int  # q above this runs at its own shape (1 + the longest verify)

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"capture sizes must be given increasing (EngineConfig.graph_sizes), got {self.sizes}")

    def shape(self, plan: AttentionPlan) -> tuple[int, int] | None:
        """(padded rows, tokens per row) of the step, or None where it runs at its own shape."""
        qo = np.diff(plan.qo_indptr)
        b = len(qo)
        if b == 0 or b > self.sizes[-1]:
            return None
        q = int(qo[0])
        if q > min(self.max_tokens_per_row, self.page_size) or (qo != q).any():
            return None
        return self.sizes[bisect.bisect_left(self.sizes, b)], q

    def pad(self, plan: AttentionPlan) -> AttentionPlan | None:
        """The plan padded to its capture size (`plan` itself when it fills one); None where it runs at its own."""
        shape = self.shape(plan)
        if shape is None:
            return None
        rows, q = shape
        return plan if rows == plan.num_seqs else self._with_pad_rows(plan, rows - plan.num_seqs, q)

    def scratch_plan(self, rows: int, q: int, tree: bool = False) -> AttentionPlan:
        """`rows` pad rows alone, q tokens each (causal, or a tree's mask): what a shape's CUDA graph captures."""
        empty = AttentionPlan(np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(0, np.int32),
                              np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64),
                              np.zeros(0, np.int64), self.page_size, np.zeros(0, bool) if tree else None)
        return self._with_pad_rows(empty, rows, q)

    def _with_pad_rows(self, plan: AttentionPlan, n: int, q: int) -> AttentionPlan:
        i32 = np.int32
        t = plan.qo_indptr[-1] + q * np.arange(1, n + 1, dtype=i32)
        own = np.arange(q, dtype=np.int64)
        mask = plan.custom_mask
        if mask is not None:  # each pad row attends causally over its own q tokens
            mask = np.concatenate([mask, np.tile(np.tril(np.ones((q, q), dtype=bool)).reshape(-1), n)])
        return replace(
            plan,
            qo_indptr=np.concatenate([plan.qo_indptr, t.astype(i32)]),
            paged_kv_indptr=np.concatenate([plan.paged_kv_indptr,
                                            (plan.paged_kv_indptr[-1] + np.arange(1, n + 1)).astype(i32)]),
            paged_kv_indices=np.concatenate([plan.paged_kv_indices, np.full(n, self.scratch_page, dtype=i32)]),
            paged_kv_last_page_len=np.concatenate([plan.paged_kv_last_page_len, np.full(n, q, dtype=i32)]),
            kv_lens=np.concatenate([plan.kv_lens, np.full(n, q, dtype=i32)]),
            positions=np.concatenate([plan.positions, np.tile(own, n)]),
            slot_mapping=np.concatenate([plan.slot_mapping, np.tile(self.scratch_page * self.page_size + own, n)]),
            custom_mask=mask,
        )
