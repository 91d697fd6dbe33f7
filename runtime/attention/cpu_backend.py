"""Paged attention on a CPU by a C kernel that reads the KV pages in place.

Why: the torch backend gathers every sequence's pages into a contiguous copy and then runs SDPA
over it -- two passes over all the K/V of the step, plus a dispatch of several ops per layer.
The kernel (`specsched_paged_attention` in runtime/cpu_attention.c) appends the step's K/V and
attends in one call per layer, reading each page once. Where the kernels cannot be built,
`kernel_status()` says why and the worker keeps the torch backend.

Pages are the torch backend's "HND" layout, so a step the kernel does not take -- queries
longer than `MAX_QUERY_LEN` a sequence (long prefills, where SDPA's blocked kernel wins), or a
dtype other than float32 -- is handed to the torch backend over the same cache.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from specsched.runtime.attention.torch_backend import TorchBackend
from specsched.runtime.cpu_kernels import KernelUnavailable, StepPlan, library, status
from specsched.scheduler.plan import AttentionPlan

HEAD_DIMS = (32, 64, 128)  # the head sizes cpu_attention.c is compiled for
# longer queries a sequence go to SDPA: the kernel's scores are quadratic per row (measured on the
# bundled target's heads: 1.5x faster than the torch backend at a 256-token prefill, even at 1024)
MAX_QUERY_LEN = 1024


def kernel_status(head_dim: int) -> str | None:
    """None when the kernel builds (or was built) and loads here and takes heads of `head_dim`
    values, else why not."""
    if head_dim not in HEAD_DIMS:
        return f"head size {head_dim}: the C kernel takes {', '.join(map(str, HEAD_DIMS))}"
    return status()


class CpuBackend:
    """The C kernel for steps of float32 queries up to `MAX_QUERY_LEN` a sequence, the torch
    backend for the rest. Raises KernelUnavailable at construction where the kernel is not
    (`kernel_status` says beforehand)."""

    name = "cpu"
    kv_layout = TorchBackend.kv_layout

    def __init__(self, num_qo_heads: int | None = None, num_kv_heads: int | None = None,
                 head_dim: int | None = None, dtype: torch.dtype | None = None, **_unused) -> None:
        if head_dim is not None and (why := kernel_status(head_dim)):
            raise KernelUnavailable(why)
        self._attention = library().specsched_paged_attention
        self.dtype = dtype
        self.torch = TorchBackend(num_kv_heads=num_kv_heads, dtype=dtype)

    @staticmethod
    def kv_head_dim(head_dim: int) -> int:
        return head_dim

    def _takes(self, plan: AttentionPlan, device: torch.device | str) -> bool:
        return (torch.device(device).type == "cpu" and self.dtype in (None, torch.float32)
                and int(np.diff(plan.qo_indptr).max(initial=0)) <= MAX_QUERY_LEN)

    def prepare(self, plan: AttentionPlan, device: torch.device | str = "cpu"):
        if not self._takes(plan, device):
            return self.torch.prepare(plan, device)
        return CpuStepAttention(self._attention, plan)

    def prepare_steps(self, last: AttentionPlan, num_steps: int, device: torch.device | str):
        """`num_steps` one-token steps over the same rows, the last planned by `last` (see
        TorchBackend.prepare_steps)."""
        if not self._takes(last, device):
            return self.torch.prepare_steps(last, num_steps, device)
        return CpuOneTokenSteps(self._attention, last, num_steps)


def _int32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


class CpuStepAttention:
    """One step's plan, marshalled once for the kernel; `attend` is one kernel call a layer."""

    def __init__(self, attention, plan: AttentionPlan) -> None:
        qo = np.diff(plan.qo_indptr)
        num_tokens = int(plan.qo_indptr[-1])
        if plan.num_seqs == 0 or num_tokens == 0:
            raise ValueError("attention plan has no tokens")
        if plan.slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"plan has {plan.slot_mapping.shape[0]} slots for {num_tokens} tokens")
        if (plan.kv_lens < qo).any():
            raise ValueError("attention plan has a sequence with fewer KV tokens than new ones")
        pages = np.diff(plan.paged_kv_indptr)
        if (pages * plan.page_size < plan.kv_lens).any():
            raise ValueError("attention plan has a sequence with too few pages for its KV tokens")
        self.plan, self._attention = plan, attention
        self.num_tokens = num_tokens
        # StepPlan's arrays in its order (mask and offsets None: causal), kept referenced: the
        # kernel reads them through pointers
        self._arrays = [_int32(plan.qo_indptr), _int32(plan.kv_lens), _int32(plan.paged_kv_indptr),
                        _int32(plan.paged_kv_indices), np.ascontiguousarray(plan.slot_mapping, dtype=np.int64),
                        None, None]
        if plan.custom_mask is not None:
            sizes = qo.astype(np.int64) * plan.kv_lens.astype(np.int64)
            mask = np.ascontiguousarray(plan.custom_mask, dtype=np.uint8)
            if mask.shape[0] != int(sizes.sum()):
                raise ValueError(f"custom_mask has {mask.shape[0]} entries, plan needs {int(sizes.sum())}")
            self._arrays[5:] = [mask, np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)]
        self._max_kv = int(plan.kv_lens.max())
        self._c = None  # the StepPlan, filled at the first layer (head counts come with q/k)
        self._scratch: torch.Tensor | None = None  # whole-layer calls' working rows, shared by the layers

    def _plan(self, num_heads: int, num_kv_heads: int, head_dim: int) -> StepPlan:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
        ptr = [None if a is None else a.ctypes.data for a in self._arrays]
        return StepPlan(self.plan.num_seqs, num_heads, num_kv_heads, head_dim, self.plan.page_size, *ptr,
                        self._max_kv, head_dim ** -0.5)

    def _first_layer(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self._c = self._plan(num_heads, num_kv_heads, head_dim)
        self._out = torch.empty((self.num_tokens, num_heads, head_dim), dtype=torch.float32)
        self._layout = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor) -> torch.Tensor:
        """Every layer of a forward reads the output before the next layer attends: one output
        buffer serves them all."""
        if self._c is None:
            self._first_layer(q.shape[-2], k.shape[-2], q.shape[-1])
        layout = (q.stride(), k.stride(), v.stride())
        if layout != self._layout:  # checked once a step where, as usual, every layer's are alike
            if kv_layer.dtype != torch.float32 or not kv_layer.is_contiguous():
                raise ValueError("the CPU attention kernel needs a contiguous float32 KV cache")
            # heads and values contiguous in a row, as views of a qkv projection are
            if any(x.stride(-1) != 1 or x.stride(-2) != x.shape[-1] or x.dtype != torch.float32 for x in (q, k, v)):
                q, k, v = (x.float().contiguous() for x in (q, k, v))
                layout = (q.stride(), k.stride(), v.stride())
            else:
                self._layout = layout
        out = self._out
        rc = self._attention(ctypes.byref(self._c), self.num_tokens, q.data_ptr(), layout[0][0], k.data_ptr(),
                             layout[1][0], v.data_ptr(), layout[2][0], out.data_ptr(), out.stride(0),
                             kv_layer.data_ptr())
        self._check(rc)
        return out

    def decoder_layer(self, fused, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                      kv_layer: torch.Tensor) -> torch.Tensor | None:
        """A whole decoder layer's output [N, H] for its input x [N, H] in one C call
        (`cpu_kernels.FusedLayer`: its attention this step's), or None where the call does not
        take these tensors (the layer then runs op by op)."""
        if not (x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1 and x.shape[0] == self.num_tokens
                and cos.is_contiguous() and sin_signed.is_contiguous() and kv_layer.dtype == torch.float32
                and kv_layer.is_contiguous() and not torch.is_grad_enabled()):
            return None
        if self._c is None:
            w = fused.weights
            self._first_layer(w.num_heads, w.num_kv_heads, w.head_dim)
        need = self.num_tokens * fused.scratch_per_row
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        out = torch.empty(x.shape, dtype=torch.float32)
        self._check(fused.run(
            ctypes.byref(fused.weights), ctypes.byref(self._c), self.num_tokens, x.data_ptr(), x.stride(0),
            cos.data_ptr(), sin_signed.data_ptr(), kv_layer.data_ptr(), self._scratch.data_ptr(), out.data_ptr()))
        return out

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise (MemoryError("the CPU attention kernel could not allocate its scratch memory") if rc == -1 else
                   ValueError(f"the CPU attention kernel has no build for head size {self._c.head_dim}"))


class CpuOneTokenSteps:
    """`CpuBackend.prepare_steps`: step j (0-based) of `num_steps` one-token steps over the rows
    of `last`, each row's KV one token shorter per step back from the last."""

    def __init__(self, attention, last: AttentionPlan, num_steps: int) -> None:
        if int(np.diff(last.qo_indptr).max()) != 1 or last.custom_mask is not None:
            raise ValueError("prepare_steps needs a plan of one new token per row and no custom mask")
        kv_last = last.kv_lens.astype(np.int64)
        if num_steps < 1 or int(kv_last.min()) < num_steps:
            raise ValueError(f"{num_steps} steps do not fit rows of {int(kv_last.min())} KV tokens")
        ps = last.page_size
        kv = kv_last[None, :] - np.arange(num_steps - 1, -1, -1)[:, None]  # [S, B]
        first_page = last.paged_kv_indptr[:-1].astype(np.int64)
        slots = last.paged_kv_indices[first_page[None, :] + (kv - 1) // ps].astype(np.int64) * ps + (kv - 1) % ps
        self.positions = torch.from_numpy(np.ascontiguousarray(kv - 1))
        self.num_steps = num_steps
        # the page tables every step shares, in the kernel's dtype once (not once a step)
        qo_indptr, kv_indptr, kv_indices = (_int32(a) for a in (last.qo_indptr, last.paged_kv_indptr,
                                                                 last.paged_kv_indices))
        self._steps = [CpuStepAttention(attention, AttentionPlan(
            qo_indptr=qo_indptr, paged_kv_indptr=kv_indptr, paged_kv_indices=kv_indices,
            paged_kv_last_page_len=(kv[j] - 1) % ps + 1, kv_lens=kv[j], positions=kv[j] - 1, slot_mapping=slots[j],
            page_size=ps)) for j in range(num_steps)]

    def step(self, j: int) -> CpuStepAttention:
        return self._steps[j]
