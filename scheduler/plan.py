"""Attention metadata for one step in FlashInfer's "NHD" paged-KV layout: built once per step (real host work) and
consumed as is by both attention backends (torch reference and FlashInfer) in every layer. Pure numpy, no wall clock.

Sequence i has qo_len[i] new (query) tokens and kv_len[i] KV tokens after appending them; its KV lives in pages
paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]], the last page holding paged_kv_last_page_len[i] entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specsched.scheduler.small_arrays import SMALL_BATCH


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    qo_indptr: np.ndarray  # [B+1] int32, prefix sums of new tokens per sequence
    paged_kv_indptr: np.ndarray  # [B+1] int32, prefix sums of pages per sequence
    paged_kv_indices: np.ndarray  # [num_pages_used] int32, page ids, sequence-major
    paged_kv_last_page_len: np.ndarray  # [B] int32, valid entries in each last page (1..page_size)
    kv_lens: np.ndarray  # [B] int32, KV tokens per sequence after this step's append
    positions: np.ndarray  # [N] int64, RoPE position of every new token
    slot_mapping: np.ndarray  # [N] int64, page * page_size + offset where each new token's KV goes
    page_size: int
    # Optional FlashInfer custom mask: flattened bool, concatenation over i of [qo_len_i, kv_len_i]
    # row-major (True = may attend). None means causal.
    custom_mask: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def qo_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr)

    def rows(self, lo: int, hi: int) -> "AttentionPlan":
        """The plan of sequences [lo, hi) alone (a micro-batch)."""
        q0, q1 = int(self.qo_indptr[lo]), int(self.qo_indptr[hi])
        k0, k1 = int(self.paged_kv_indptr[lo]), int(self.paged_kv_indptr[hi])
        mask = None
        if self.custom_mask is not None:
            sizes = np.diff(self.qo_indptr).astype(np.int64) * self.kv_lens.astype(np.int64)
            ends = np.cumsum(sizes)
            mask = self.custom_mask[int(ends[lo - 1]) if lo else 0 : int(ends[hi - 1]) if hi else 0]
        return AttentionPlan(
            qo_indptr=self.qo_indptr[lo : hi + 1] - q0, paged_kv_indptr=self.paged_kv_indptr[lo : hi + 1] - k0,
            paged_kv_indices=self.paged_kv_indices[k0:k1], paged_kv_last_page_len=self.paged_kv_last_page_len[lo:hi],
            kv_lens=self.kv_lens[lo:hi], positions=self.positions[q0:q1], slot_mapping=self.slot_mapping[q0:q1],
            page_size=self.page_size, custom_mask=mask)


    def select(self, rows: np.ndarray) -> "AttentionPlan":
        """The plan of the sequences `rows` alone (sorted indices; no custom mask), e.g. a mixed step's decode rows."""
        if self.custom_mask is not None:
            raise ValueError("select: a plan with a custom mask is split with rows(lo, hi)")
        rows = np.asarray(rows, dtype=np.int64)
        qo = np.diff(self.qo_indptr)[rows]
        pages = np.diff(self.paged_kv_indptr)[rows]
        tok = concat_ranges(self.qo_indptr[rows].astype(np.int64), qo.astype(np.int64))
        page_at = concat_ranges(self.paged_kv_indptr[rows].astype(np.int64), pages.astype(np.int64))
        return AttentionPlan(
            qo_indptr=np.concatenate([[0], np.cumsum(qo)]).astype(self.qo_indptr.dtype),
            paged_kv_indptr=np.concatenate([[0], np.cumsum(pages)]).astype(self.paged_kv_indptr.dtype),
            paged_kv_indices=self.paged_kv_indices[page_at], paged_kv_last_page_len=self.paged_kv_last_page_len[rows],
            kv_lens=self.kv_lens[rows], positions=self.positions[tok], slot_mapping=self.slot_mapping[tok],
            page_size=self.page_size)


def length_class(qo: int) -> int:
    """A row's class in `attention_groups`: 0 for one token, else k for 2^(k-1) <= qo < 2^k."""
    return int(qo).bit_length() if qo > 1 else 0


def attention_groups(qo_lens: np.ndarray) -> list[np.ndarray]:
    """The row groups the padding (torch) attention attends together: one-token rows, then longer ones by length class
    (2-3, 4-7, 8-15, ... queries), so no row is padded to over twice its queries. One group when that is all."""
    qo = np.asarray(qo_lens, dtype=np.int64)
    if qo.size <= SMALL_BATCH:  # a few rows: grouped in Python (numpy's unique costs more)
        by: dict[int, list[int]] = {}
        for i, q in enumerate(qo.tolist()):
            by.setdefault(length_class(q), []).append(i)
        return [np.array(by[c], dtype=np.int64) for c in sorted(by)] if len(by) > 1 else [np.arange(qo.size)]
    if qo.max() <= 1:
        return [np.arange(qo.size)]
    cls = _length_classes(qo)
    groups = [(cls == c).nonzero()[0] for c in np.unique(cls)]
    return groups if len(groups) > 1 else [np.arange(qo.size)]


def _length_classes(qo: np.ndarray) -> np.ndarray:
    """`length_class` of every row of an int64 array (frexp's exponent is a positive int's bit_length)."""
    cls = np.frexp(qo)[1]
    cls[qo <= 1] = 0
    return cls


def padded_attention(qo_lens: np.ndarray, kv_lens: np.ndarray) -> int:
    """The padding backend's attention work: sum over `attention_groups` of rows x longest query x longest KV. Many
    rows go whole-array, without numpy's `unique` or per-group gathers (several times dearer at a few hundred rows)."""
    qo = np.asarray(qo_lens, dtype=np.int64)
    if qo.size <= SMALL_BATCH:  # a few rows: a numpy call costs more than the loop
        by: dict[int, list[int]] = {}  # class -> [rows, longest query, longest KV]
        for q, kv in zip(qo.tolist(), np.asarray(kv_lens).tolist()):
            g = by.setdefault(length_class(q), [0, 0, 0])
            g[0], g[1], g[2] = g[0] + 1, max(g[1], q), max(g[2], kv)
        return sum(r * q * kv for r, q, kv in by.values())
    cls = _length_classes(qo)
    rows = np.bincount(cls)
    longest_q = np.zeros(rows.size, dtype=np.int64)
    np.maximum.at(longest_q, cls, qo)
    longest_kv = np.zeros(rows.size, dtype=np.int64)
    np.maximum.at(longest_kv, cls, kv_lens)
    return int((rows * longest_q * longest_kv).sum())


def concat_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + lens[i]) (int64), without a Python loop."""
    return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(lens) - lens), lens)


def build_plan(
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]] | np.ndarray,
    page_size: int,
    *,
    table_lens: np.ndarray | None = None,
    table_rows: np.ndarray | None = None,
    positions: Sequence[np.ndarray | None] | None = None,
    custom_masks: Sequence[np.ndarray | None] | None = None,
    tree: tuple[np.ndarray, np.ndarray] | None = None,
) -> AttentionPlan:
    """The step's attention plan. qo_lens[i]: new tokens of sequence i, in KV slots [kv_len - qo_len, kv_len);
    kv_lens[i]: its KV length including them; page_tables[i]: its page ids (at least ceil(kv_len / page_size), extras
    ignored) -- a list per sequence, or one [B, max_pages] array with page counts in `table_lens` (whole-array
    operations); with `table_rows`, sequence i's pages are row table_rows[i] of that whole table (no copy).
    positions[i] overrides its RoPE positions; custom_masks[i] is a bool [qo_len, kv_len] mask (None: causal).
    `tree` = (offsets [W], mask [W, W]): every sequence computes the same W-node tree, node j at RoPE position
    (kv_len - W) + offsets[j], attending to the whole prefix and to the nodes mask[j] marks.
    """
    qo, kv = _checked(qo_lens, kv_lens, page_tables, page_size, table_rows, positions, custom_masks)
    num_seqs = qo.shape[0]
    num_pages = (kv + page_size - 1) // page_size
    indices, kv_indptr = _page_indices(page_tables, table_lens, table_rows, num_pages, kv)
    qo_indptr = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(qo, out=qo_indptr[1:])
    last_page_len = kv - (num_pages - 1) * page_size

    pos, slot_mapping = _slot_mapping(qo, kv, qo_indptr, indices, kv_indptr, page_size)
    mask = None
    if tree is not None:
        pos, mask = _tree(tree, qo, kv)
    if positions is not None:
        for i, p in enumerate(positions):
            if p is not None:
                if len(p) != qo[i]:
                    raise ValueError(f"sequence {i}: {len(p)} positions for {qo[i]} tokens")
                pos[qo_indptr[i] : qo_indptr[i + 1]] = p
    if custom_masks is not None and any(m is not None for m in custom_masks):
        mask = _custom_masks(custom_masks, qo, kv)

    return AttentionPlan(
        qo_indptr=qo_indptr.astype(np.int32),
        paged_kv_indptr=kv_indptr.astype(np.int32),
        paged_kv_indices=np.asarray(indices, dtype=np.int32),
        paged_kv_last_page_len=last_page_len.astype(np.int32),
        kv_lens=kv.astype(np.int32),
        positions=pos,
        slot_mapping=slot_mapping,
        page_size=page_size,
        custom_mask=mask,
    )


def _slot_mapping(qo, kv, qo_indptr, indices, kv_indptr, page_size) -> tuple[np.ndarray, np.ndarray]:
    """(logical KV index, physical KV slot) of each new token, fresh arrays (tree positions may overwrite the first)."""
    seq_of_tok = np.repeat(np.arange(qo.shape[0]), qo)
    offset_in_seq = np.arange(int(qo_indptr[-1])) - qo_indptr[:-1][seq_of_tok]
    logical = (kv - qo)[seq_of_tok] + offset_in_seq
    page_of_tok = indices[kv_indptr[:-1][seq_of_tok] + logical // page_size].astype(np.int64)
    return logical, page_of_tok * page_size + logical % page_size


def _checked(qo_lens, kv_lens, page_tables, page_size, table_rows, positions, custom_masks
             ) -> tuple[np.ndarray, np.ndarray]:
    """[B] query and KV lengths as int64; ValueError naming the first argument that does not fit."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    qo = np.asarray(qo_lens, dtype=np.int64).reshape(-1)
    kv = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    num_seqs = qo.shape[0]
    num_tables = len(table_rows) if table_rows is not None else len(page_tables)
    if kv.shape[0] != num_seqs or num_tables != num_seqs:
        raise ValueError(
            f"qo_lens ({num_seqs}), kv_lens ({kv.shape[0]}) and page_tables ({num_tables}) "
            "must have one entry per sequence"
        )
    for name, per_seq in (("positions", positions), ("custom_masks", custom_masks)):
        if per_seq is not None and len(per_seq) != num_seqs:
            raise ValueError(f"{name} has {len(per_seq)} entries for {num_seqs} sequences")
    bad = np.flatnonzero((qo < 1) | (kv < qo))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"sequence {i}: qo_len {qo[i]}, kv_len {kv[i]}; need qo_len >= 1 and kv_len >= qo_len"
        )
    return qo, kv


def _page_indices(page_tables, table_lens, table_rows, num_pages: np.ndarray, kv: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(every sequence's first num_pages page ids, concatenated; [B + 1] their offsets) from `build_plan`'s tables."""
    num_seqs = num_pages.shape[0]
    if isinstance(page_tables, np.ndarray):
        lens = np.asarray(table_lens, dtype=np.int64)
        short = np.flatnonzero(lens < num_pages)
        if short.size:
            i = int(short[0])
            raise ValueError(f"sequence {i}: {kv[i]} KV tokens need {num_pages[i]} pages, page table "
                             f"has {lens[i]}")
        width = page_tables.shape[1] if page_tables.ndim == 2 else 0
        kv_indptr = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_pages, out=kv_indptr[1:])
        # each row's first num_pages entries, row after row, as one gather from the flat table
        rows = np.arange(num_seqs) if table_rows is None else np.asarray(table_rows, dtype=np.int64)
        flat = np.arange(int(kv_indptr[-1])) + np.repeat(rows * width - kv_indptr[:-1], num_pages)
        indices = page_tables.reshape(-1)[flat] if flat.size else np.zeros(0, dtype=np.int32)
    else:
        flat: list[int] = []  # one Python list, one array: cheaper than an array per row
        for i, (table, n) in enumerate(zip(page_tables, num_pages.tolist())):
            if len(table) < n:
                raise ValueError(
                    f"sequence {i}: {kv[i]} KV tokens need {n} pages, page table has {len(table)}"
                )
            flat.extend(table[:n])
        indices = np.array(flat, dtype=np.int32)
        kv_indptr = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_pages, out=kv_indptr[1:])
    return indices, kv_indptr


def _tree(tree: tuple[np.ndarray, np.ndarray], qo: np.ndarray, kv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, mask) for `build_plan`'s `tree`, every sequence computing the same token tree."""
    num_seqs = qo.shape[0]
    offsets, tree_mask = np.asarray(tree[0], dtype=np.int64), np.asarray(tree[1], dtype=bool)
    width = offsets.shape[0]
    if tree_mask.shape != (width, width) or (qo != width).any():
        raise ValueError(f"a tree of {width} nodes needs a [{width}, {width}] mask and {width} new "
                         f"tokens per sequence (mask {tree_mask.shape}, qo_lens {sorted(set(qo.tolist()))})")
    prefix = kv - width
    pos = (prefix[:, None] + offsets[None, :]).reshape(-1)
    # row-major [W, kv_len] per sequence, concatenated: all True, then the tree block
    sizes = width * kv
    base = np.cumsum(sizes) - sizes
    mask = np.ones(int(sizes.sum()), dtype=bool)
    q = np.arange(width)
    at = base[:, None, None] + q[None, :, None] * kv[:, None, None] + prefix[:, None, None] + q[None, None, :]
    mask[at.reshape(-1)] = np.broadcast_to(tree_mask, (num_seqs, width, width)).reshape(-1)
    return pos, mask


def _custom_masks(custom_masks, qo: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """Every sequence's [qo_len, kv_len] mask (None: causal), row-major, concatenated."""
    parts = []
    for i, m in enumerate(custom_masks):
        q_i, k_i = int(qo[i]), int(kv[i])
        if m is None:
            m = np.arange(k_i)[None, :] <= (k_i - q_i + np.arange(q_i))[:, None]
        m = np.asarray(m, dtype=bool)
        if m.shape != (q_i, k_i):
            raise ValueError(f"sequence {i}: custom mask {m.shape}, expected {(q_i, k_i)}")
        parts.append(m.reshape(-1))
    return np.concatenate(parts)
