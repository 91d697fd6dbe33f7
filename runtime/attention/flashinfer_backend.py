"""Paged attention with FlashInfer kernels (CUDA only).

Why: on a GPU the `plan` stage is FlashInfer's `wrapper.plan()` — host work every step that
the schedules try to hide. `prepare` does exactly that once per step: pure-decode steps
(one new token per sequence, no tree mask) use BatchDecodeWithPagedKVCacheWrapper, all
others BatchPrefillWithPagedKVCacheWrapper (causal, or the plan's custom mask for trees).
Each layer then appends K/V with `flashinfer.page.append_paged_kv_cache` and runs the
planned wrapper. The KV layout is the runtime's NHD cache, unchanged.

A wrapper holds one plan at a time, so the backend keeps `num_slots` wrapper sets (each with
its own workspace) and rotates through them: the overlap schedule plans step t+1 while step t
runs, and a draft launch plans one forward per draft token. A plan overwrites its wrapper's
pinned host buffer at once and copies it to the device behind the stream's queued work, so a
slot is taken again only after the kernels of its previous plan ran: each step records an
event after its attention, and reusing a slot whose event has not completed waits for it (a
host wait that enough slots make rare).
FlashInfer's kernels cover head sizes 64, 128 and 256 (`SUPPORTED_HEAD_DIMS`). A model with a
smaller head (the bundled models have 32) runs zero-padded to the next one: its KV caches
are allocated `kv_head_dim(head_dim)` wide, q/k/v are padded before the kernels and the output
is cut back. Zeros add nothing to q·k, and the softmax scale stays 1/sqrt(model head size).
`import flashinfer` happens only when this backend is constructed.
"""

from __future__ import annotations

import numpy as np
import torch

from specsched.runtime.sync_guard import to_device
from specsched.scheduler.plan import AttentionPlan

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def padded_head_dim(head_dim: int) -> int:
    """The smallest head size FlashInfer's kernels cover that holds `head_dim`."""
    for d in SUPPORTED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"the flashinfer backend supports head sizes up to {SUPPORTED_HEAD_DIMS[-1]}, "
                     f"got {head_dim}")


def pack_mask(mask: np.ndarray, qo_lens: np.ndarray, kv_lens: np.ndarray) -> np.ndarray:
    """A step's custom mask (each sequence's [qo_len, kv_len] block, flattened and concatenated)
    bit-packed on the host as `plan(packed_custom_mask=...)` reads it.

    Why on the host: `plan(custom_mask=...)` packs on the GPU with an indptr it leaves on the
    host (FlashInfer 0.6.0 fails there: "input_indptr must be a CUDA tensor"). Why this layout:
    with a packed mask, `plan` takes each sequence's offset into it from the unpacked sizes
    (the sum of qo_len * kv_len before it), and the kernel reads that offset in bytes; so
    sequence i's bits (little bit order, as `segment_packbits` writes them) start at byte
    sum_{j<i} qo_j * kv_j, the bytes between them unused."""
    sizes = qo_lens.astype(np.int64) * kv_lens.astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    bits = np.flatnonzero(np.asarray(mask, dtype=bool))  # set bits, global index
    seq = np.searchsorted(starts, bits, side="right") - 1
    local = bits - starts[seq]
    out = np.zeros(int(starts[-1]) + 1, dtype=np.uint8)
    np.add.at(out, starts[seq] + local // 8, (1 << (local % 8)).astype(np.uint8))  # distinct bits: add = or
    return out


class FlashInferBackend:
    name = "flashinfer"
    kv_layout = "NHD"  # the page layout of the KV caches it reads (runtime/kv_cache.py)

    def __init__(self, num_qo_heads: int | None = None, num_kv_heads: int | None = None,
                 head_dim: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 workspace_bytes: int = 64 << 20, num_slots: int = 8, prefill_backend: str = "auto",
                 **_unused) -> None:
        """`prefill_backend`: FlashInfer's prefill implementation ("auto" picks FA3 on Hopper,
        "fa2" the portable one)."""
        if None in (num_qo_heads, num_kv_heads, head_dim):
            raise ValueError(
                "the flashinfer backend needs num_qo_heads, num_kv_heads and head_dim "
                "(use model.attention_backend('flashinfer'))"
            )
        try:
            import flashinfer
        except ImportError as exc:
            raise RuntimeError(
                "the flashinfer backend needs the 'cuda' extra (pip install flashinfer-python)"
            ) from exc
        self._fi = flashinfer
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.padded_dim = padded_head_dim(head_dim)
        self.sm_scale = head_dim ** -0.5
        self.dtype = dtype
        self.workspace_bytes = workspace_bytes
        self.num_slots = num_slots
        self.prefill_backend = prefill_backend
        self._slots: list[dict] = []
        self._next = 0

    @staticmethod
    def kv_head_dim(head_dim: int) -> int:
        """The head size a KV cache for this backend stores (padded to a supported one)."""
        return padded_head_dim(head_dim)

    def _slot(self, device: torch.device) -> dict:
        if len(self._slots) < self.num_slots:
            ws = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
            self._slots.append({
                "prefill": self._fi.BatchPrefillWithPagedKVCacheWrapper(ws, self.kv_layout, backend=self.prefill_backend),
                "decode": self._fi.BatchDecodeWithPagedKVCacheWrapper(ws, self.kv_layout),
            })
        slot = self._slots[self._next % self.num_slots]
        self._next += 1
        used = slot.get("used")
        if used is not None and not used.query():
            used.synchronize()  # its previous plan's kernels have not run yet
        slot["used"] = torch.cuda.Event()
        return slot

    def prepare(self, plan: AttentionPlan, device: torch.device | str) -> "FlashInferStepAttention":
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the flashinfer backend runs on CUDA devices only, got {device}")
        is_decode = plan.custom_mask is None and bool((np.diff(plan.qo_indptr) == 1).all())
        kv_indices = to_device(host_int32(plan.paged_kv_indices), device)
        slot = self._slot(device)
        wrapper = slot["decode" if is_decode else "prefill"]
        self.plan_wrapper(wrapper, is_decode, plan, kv_indices, device)
        seq_of_tok, pos_in_seq = append_indices(plan)
        return FlashInferStepAttention(
            plan=plan, wrapper=wrapper, append=self._fi.page.append_paged_kv_cache, used=slot["used"],
            batch_indices=to_device(host_int32(seq_of_tok), device),
            positions=to_device(host_int32(pos_in_seq), device),
            kv_indices=kv_indices,
            kv_indptr=to_device(host_int32(plan.paged_kv_indptr), device),
            last_page_len=to_device(host_int32(plan.paged_kv_last_page_len), device),
            head_pad=self.padded_dim - self.head_dim,
        )

    def plan_wrapper(self, wrapper, decode: bool, plan: AttentionPlan, kv_indices: torch.Tensor,
                     device: torch.device) -> None:
        """FlashInfer's `plan()` of a decode (`decode`) or prefill wrapper for `plan`, its page
        indices already on the device (`kv_indices`); a tree's mask packed on the host."""
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.sm_scale)
        indptr, last = host_int32(plan.paged_kv_indptr), host_int32(plan.paged_kv_last_page_len)
        if decode:
            wrapper.plan(indptr, kv_indices, last, self.num_qo_heads, self.num_kv_heads, self.padded_dim,
                         plan.page_size, **common)
            return
        packed = None
        if plan.custom_mask is not None:
            packed = to_device(pack_mask(plan.custom_mask, np.diff(plan.qo_indptr), plan.kv_lens), device)
        wrapper.plan(host_int32(plan.qo_indptr), indptr, kv_indices, last, self.num_qo_heads, self.num_kv_heads,
                     self.padded_dim, plan.page_size, packed_custom_mask=packed, causal=packed is None, **common)


def host_int32(a) -> torch.Tensor:
    """An index array as a host int32 tensor (what `plan()` and the KV append take)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def append_indices(plan: AttentionPlan) -> tuple[np.ndarray, np.ndarray]:
    """(each new token's sequence, its position in that sequence's KV): what the KV append reads."""
    qo = np.diff(plan.qo_indptr)
    seq_of_tok = np.repeat(np.arange(qo.shape[0]), qo)
    pos_in_seq = (plan.kv_lens.astype(np.int64) - qo)[seq_of_tok] + np.arange(seq_of_tok.shape[0]) \
        - plan.qo_indptr[:-1][seq_of_tok]
    return seq_of_tok, pos_in_seq


class FlashInferStepAttention:
    def __init__(self, *, plan: AttentionPlan, wrapper, append, batch_indices: torch.Tensor,
                 positions: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                 last_page_len: torch.Tensor, used: torch.cuda.Event | None, head_pad: int = 0) -> None:
        self.plan = plan
        # recorded after each layer's kernels: the slot may be reused once it completed (None: the
        # caller tracks reuse, as CUDA graphs do per replay)
        self._used = used
        self._wrapper, self._append = wrapper, append
        self._batch_indices, self._positions = batch_indices, positions  # [N] int32 each
        self._kv_indices, self._kv_indptr, self._last = kv_indices, kv_indptr, last_page_len
        self._pad = head_pad  # zeros appended to each head (a model head size FlashInfer lacks)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor) -> torch.Tensor:
        if self._pad:
            q, k, v = (torch.nn.functional.pad(t, (0, self._pad)) for t in (q, k, v))
        self._append(k.contiguous(), v.contiguous(), self._batch_indices, self._positions,
                     kv_layer, self._kv_indices, self._kv_indptr, self._last, kv_layout=FlashInferBackend.kv_layout)
        out = self._wrapper.run(q.contiguous(), kv_layer)
        if self._used is not None:
            self._used.record()
        return out[..., : out.shape[-1] - self._pad] if self._pad else out
