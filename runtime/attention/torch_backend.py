"""Paged attention in plain torch: the reference backend, on any device (a float32 CPU worker runs the C
kernel of cpu_backend.py where it builds).

Why: the bundled models are tiny, so a forward is dominated by per-op dispatch, not FLOPs.
Everything that depends only on the plan (write rows, gather rows, padded mask) is built once
per step in numpy and moved to the device once; each layer then costs one write per K/V, one
gather, and one `scaled_dot_product_attention` (GQA handled by `enable_gqa`, no head repeat).

Gather layout: a layer's cache is stored in HND pages, [P, 2, Hkv, ps, D], viewed as blocks of
ps x D values (a page's keys or values of one head, contiguous); the gather index
[B, 2, Hkv, NP] picks, for sequence b, K (c=0) or V (c=1), head h and the sequence's j-th
page, so the result reshapes for free into SDPA's [B, Hkv, NP * ps, D] K and V. Copying whole
blocks, not rows of D values, took a layer's gather in a decode step of the bundled target at
batch 8 over 150 cached tokens from ~216 to ~176 us. Positions past a sequence's length (the rest of its last page; pages
repeated to pad a shorter sequence) are masked out, or cut off where no mask is needed.
New K/V are written head by head into the same view as rows of D values.

A step whose rows' query lengths differ -- prefill chunks among one-token decode rows, prompts
of different lengths -- is attended in parts (`SplitStepAttention`, rows grouped by
`scheduler.plan.attention_groups`: the one-token rows, then longer ones by length class):
padded together, every decode row would pay for the longest chunk's queries -- B x Qmax x Lmax
scores where the work is ~Qmax x Lmax -- which made mixed steps ~10x a decode step of the same
rows and most of a loaded run's time.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from specsched.runtime.sync_guard import to_device
from specsched.scheduler.plan import AttentionPlan, attention_groups, concat_ranges


def write_rows(slots: np.ndarray, num_kv_heads: int, page_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a layer's [P * 2 * Hkv * ps, D] view (HND pages) where the keys and the values of
    the tokens at cache `slots` [..., N] go, head by head: [..., N * Hkv] each, on `device`."""
    base = (slots // page_size) * (2 * num_kv_heads * page_size) + slots % page_size
    k = (base[..., None] + np.arange(num_kv_heads) * page_size).reshape(*slots.shape[:-1], -1)
    return to_device(k, device), to_device(k + num_kv_heads * page_size, device)


class TorchBackend:
    """`num_kv_heads`/`dtype`, when given, let `prepare` build the gather index and mask
    eagerly; otherwise they are built at the first layer's `attend` and reused."""

    name = "torch"
    kv_layout = "HND"  # the page layout of the KV caches it reads (runtime/kv_cache.py)

    def __init__(self, num_kv_heads: int | None = None, dtype: torch.dtype | None = None,
                 **_unused) -> None:
        self.num_kv_heads = num_kv_heads
        self.dtype = dtype

    @staticmethod
    def kv_head_dim(head_dim: int) -> int:
        """The head size a KV cache for this backend stores: the model's."""
        return head_dim

    def prepare(self, plan: AttentionPlan, device: torch.device | str = "cpu"
                ) -> "TorchStepAttention | SplitStepAttention":
        groups = attention_groups(np.diff(plan.qo_indptr)) if plan.custom_mask is None else []
        if len(groups) > 1:
            return SplitStepAttention(plan, [(rows, self._step(plan.select(rows), device)) for rows in groups],
                                      torch.device(device))
        return self._step(plan, device)

    def prepare_steps(self, last: AttentionPlan, num_steps: int, device: torch.device | str
                      ) -> "OneTokenSteps":
        """Attention for `num_steps` consecutive forwards of one new token per row over the
        same rows, each row's KV one token longer at every step; `last` is the plan of the
        final step. Planned once: every step writes its token's K/V to its own slots and
        reads through the last step's gather, masked (or, for one row, cut) to its length."""
        return OneTokenSteps(self._step(last, device), num_steps)

    def _step(self, plan: AttentionPlan, device: torch.device | str) -> "TorchStepAttention":
        step = TorchStepAttention(plan, torch.device(device))
        if self.num_kv_heads is not None:
            step._gather_index(self.num_kv_heads)
            step._write_rows(self.num_kv_heads)
        if self.dtype is not None:
            step._mask(self.dtype)
        return step


class SplitStepAttention:
    """A step whose sequences are attended in parts (sequence indices, the part's step): each
    part writes its own new K/V and attends over its own rows; outputs go back to the tokens'
    places in the step."""

    def __init__(self, plan: AttentionPlan, parts: list[tuple[np.ndarray, "TorchStepAttention"]],
                 device: torch.device) -> None:
        self.plan = plan
        self.parts = []
        for rows, step in parts:
            tokens = concat_ranges(plan.qo_indptr[rows].astype(np.int64), np.diff(plan.qo_indptr)[rows].astype(np.int64))
            self.parts.append((to_device(tokens, device), step))

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape)
        for tokens, step in self.parts:
            out.index_copy_(0, tokens, step.attend(layer_idx, q.index_select(0, tokens), k.index_select(0, tokens),
                                                   v.index_select(0, tokens), kv_layer))
        return out


class TorchStepAttention:
    def __init__(self, plan: AttentionPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        ps = plan.page_size
        qo = np.diff(plan.qo_indptr).astype(np.int64)
        kv = plan.kv_lens.astype(np.int64)
        self.num_seqs = b = int(kv.shape[0])
        self.num_tokens = n = int(plan.qo_indptr[-1])
        if b == 0 or n == 0:
            raise ValueError("attention plan has no tokens")
        if plan.slot_mapping.shape[0] != n:
            raise ValueError(f"plan has {plan.slot_mapping.shape[0]} slots for {n} tokens")
        self.max_q = int(qo.max())
        self.max_kv = lmax = int(kv.max())
        self._new_slots = plan.slot_mapping.astype(np.int64)  # where this step's K/V go

        # each sequence's first NP pages (NP: the longest's), a shorter one's padded by its last
        num_pages = -(-lmax // ps)
        self.kv_width = num_pages * ps  # keys per sequence in the gather, positions past kv masked
        have = np.diff(plan.paged_kv_indptr).astype(np.int64)
        page_ptr = plan.paged_kv_indptr[:-1].astype(np.int64)[:, None] + np.minimum(np.arange(num_pages)[None, :],
                                                                                    have[:, None] - 1)
        self.pages = plan.paged_kv_indices.astype(np.int64)[page_ptr]  # [B, NP]
        valid = np.arange(self.kv_width)[None, :] < kv[:, None]  # [B, W]

        self.is_decode = self.max_q == 1  # one new token per sequence: no q padding
        if b > 1 and not self.is_decode:
            t = np.arange(self.max_q)
            q_valid = t[None, :] < qo[:, None]  # [B, Qmax]
            q_start = plan.qo_indptr[:-1].astype(np.int64)
            self.q_index = to_device(np.where(q_valid, q_start[:, None] + t[None, :], 0).reshape(-1), device)
            self.out_index = to_device(np.flatnonzero(q_valid.reshape(-1)), device)
        self._allowed = self._allowed_mask(qo, kv, valid)  # [B, Qmax, Lmax] bool or None
        self.is_causal = (
            self._allowed is None and b == 1 and n > 1 and n == lmax
        )
        self._index_cache: dict[int, torch.Tensor] = {}
        self._rows_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask_cache: dict[torch.dtype, torch.Tensor | None] = {}

    def _allowed_mask(self, qo: np.ndarray, kv: np.ndarray, valid: np.ndarray) -> np.ndarray | None:
        """[B, Qmax, W] which keys each query sees; None where none is masked among the first
        max_kv (the gather is then cut to them)."""
        plan, b, qmax, lmax = self.plan, self.num_seqs, self.max_q, self.max_kv
        if plan.custom_mask is None:
            if b == 1 and (qmax == 1 or qmax == lmax):
                return None  # whole row visible, or plain causal (SDPA's is_causal)
            if self.is_decode and (kv == lmax).all():
                return None
        t = np.arange(qmax)
        pos = np.arange(self.kv_width)
        allowed = pos[None, None, :] <= (kv - qo)[:, None, None] + t[None, :, None]
        allowed &= valid[:, None, :]
        if plan.custom_mask is not None:
            flat = np.asarray(plan.custom_mask, dtype=bool)
            expected = int((qo * kv).sum())
            if flat.shape[0] != expected:
                raise ValueError(f"custom_mask has {flat.shape[0]} entries, plan needs {expected}")
            offset = 0
            for i in range(b):
                q_i, k_i = int(qo[i]), int(kv[i])
                allowed[i, :q_i, :k_i] = flat[offset : offset + q_i * k_i].reshape(q_i, k_i)
                allowed[i, :q_i, k_i:] = False
                offset += q_i * k_i
        padded_q = t[None, :] >= qo[:, None]  # [B, Qmax]
        allowed[padded_q, 0] = True  # padded query rows attend to one key: no NaN
        return allowed

    def _gather_index(self, num_kv_heads: int) -> torch.Tensor:
        """[B * 2 * Hkv * NP] blocks of the [P * 2 * Hkv, ps * D] view: each sequence's K then V,
        head by head, page by page."""
        idx = self._index_cache.get(num_kv_heads)
        if idx is None:
            blocks = (self.pages[:, None, None, :] * 2 + np.arange(2)[None, :, None, None]) * num_kv_heads
            idx = to_device((blocks + np.arange(num_kv_heads)[None, None, :, None]).reshape(-1), self.device)
            self._index_cache[num_kv_heads] = idx
        return idx

    def _write_rows(self, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the [P * 2 * Hkv * ps, D] view the step's new K and V go to, [N * Hkv] each."""
        rows = self._rows_cache.get(num_kv_heads)
        if rows is None:
            rows = self._rows_cache[num_kv_heads] = write_rows(self._new_slots, num_kv_heads, self.plan.page_size,
                                                               self.device)
        return rows

    def _mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        if dtype not in self._mask_cache:
            mask = None
            if self._allowed is not None:
                allowed = to_device(self._allowed, self.device)
                mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
                mask.masked_fill_(~allowed, float("-inf"))
                mask = mask.unsqueeze(1)  # [B, 1, Qmax, Lmax], broadcast over heads
            self._mask_cache[dtype] = mask
        return self._mask_cache[dtype]

    def write_and_gather(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                         v_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V [N, Hkv, D] at rows `k_rows`/`v_rows` [N * Hkv] of the layer's
        cache, then gather every sequence's keys and values [B, Hkv, W, D] through this step's
        gather index."""
        num_kv_heads, head_dim = k.shape[-2], k.shape[-1]
        rows = kv_layer.view(-1, head_dim)
        rows.index_copy_(0, k_rows, k.reshape(-1, head_dim))
        rows.index_copy_(0, v_rows, v.reshape(-1, head_dim))
        gathered = kv_layer.view(-1, self.plan.page_size * head_dim).index_select(0, self._gather_index(num_kv_heads))
        gathered = gathered.view(self.num_seqs, 2, num_kv_heads, self.kv_width, head_dim)
        return gathered[:, 0], gathered[:, 1]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor) -> torch.Tensor:
        head_dim = k.shape[-1]
        keys, values = self.write_and_gather(kv_layer, k, v, *self._write_rows(k.shape[-2]))
        mask = self._mask(q.dtype)
        if mask is None:  # every key among the first max_kv is seen: the rest are cut off
            keys, values = keys[:, :, : self.max_kv], values[:, :, : self.max_kv]
        b = self.num_seqs
        if b == 1:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                is_causal=self.is_causal, enable_gqa=True,
            )
            return out[0].transpose(0, 1)
        if self.is_decode:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True
            )
            return out.squeeze(2)
        num_heads = q.shape[1]
        qp = q.index_select(0, self.q_index).view(b, self.max_q, num_heads, head_dim)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(b * self.max_q, num_heads, head_dim)
        return out.index_select(0, self.out_index)


class OneTokenSteps:
    """`TorchBackend.prepare_steps`: `step(j)` is the attention of the j-th of `num_steps`
    one-token steps (0-based) whose last is `last`'s plan; `positions` [num_steps, B] their
    RoPE positions. Why: a draft launch runs D - 1 such forwards, and planning each one
    (page lookups, gather index, mask, host-to-device copies) cost as much host time as a
    tenth of the forward itself on the bundled models."""

    def __init__(self, last: "TorchStepAttention", num_steps: int) -> None:
        plan = last.plan
        if not last.is_decode or plan.custom_mask is not None:
            raise ValueError("prepare_steps needs a plan of one new token per row and no custom mask")
        kv_last = plan.kv_lens.astype(np.int64)
        if num_steps < 1 or int(kv_last.min()) < num_steps:
            raise ValueError(f"{num_steps} steps do not fit rows of {int(kv_last.min())} KV tokens")
        self.last, self.num_steps = last, num_steps
        b, ps = last.num_seqs, plan.page_size
        kv = kv_last[None, :] - np.arange(num_steps - 1, -1, -1)[:, None]  # [S, B] KV length at step j
        # each step's new token: its slot in the row's pages
        self._slots = last.pages[np.arange(b)[None, :], (kv - 1) // ps] * ps + (kv - 1) % ps  # [S, B]
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.positions = to_device(kv - 1, last.device)
        self.kv_lens = kv[:, 0].tolist() if b == 1 else None
        # several rows: step j's keys are the gather's first kv[j, b] of each row's W
        self._allowed = (np.arange(last.kv_width)[None, None, :] < kv[:, :, None]) if b > 1 else None
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def write_rows(self, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, B * Hkv] rows each step's new K and V go to (TorchStepAttention._write_rows)."""
        rows = self._rows.get(num_kv_heads)
        if rows is None:
            rows = self._rows[num_kv_heads] = write_rows(self._slots, num_kv_heads, self.last.plan.page_size,
                                                         self.last.device)
        return rows

    def mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[S, B, 1, 1, Lmax] additive masks (None for one row)."""
        if self._allowed is None:
            return None
        m = self._masks.get(dtype)
        if m is None:
            allowed = to_device(self._allowed, self.last.device)
            m = torch.zeros(allowed.shape, dtype=dtype, device=self.last.device)
            m.masked_fill_(~allowed, float("-inf"))
            m = self._masks[dtype] = m[:, :, None, None, :]
        return m

    def step(self, j: int) -> "OneTokenStep":
        return OneTokenStep(self, j)


class OneTokenStep:
    """Step j of a `OneTokenSteps` run (the StepAttention interface)."""

    def __init__(self, run: OneTokenSteps, j: int) -> None:
        self.run, self.j = run, j
        self.plan = run.last.plan  # the run's last step: page tables cover every step

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor) -> torch.Tensor:
        run, j = self.run, self.j
        k_rows, v_rows = run.write_rows(k.shape[-2])
        keys, values = run.last.write_and_gather(kv_layer, k, v, k_rows[j], v_rows[j])
        if run.kv_lens is not None:  # one row: its keys so far, no mask
            n = run.kv_lens[j]
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys[:, :, :n],
                                                 values[:, :, :n], enable_gqa=True)
            return out[0].transpose(0, 1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=run.mask(q.dtype)[j],
                                             enable_gqa=True)
        return out.squeeze(2)


class CausalAttention:
    """Dense causal attention without a KV cache, for `LlamaModel.forward_full`:
    q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]; `kv_layer` is ignored."""

    plan = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor | None = None) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True,
        )
        return out.transpose(1, 2)
