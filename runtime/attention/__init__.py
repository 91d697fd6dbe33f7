"""Attention backends behind one interface.

Why: the model code must not care whether attention runs as plain torch (CPU, tests, any GPU)
or as FlashInfer kernels (CUDA). A step is planned once (`backend.prepare(plan, device)`:
index tensors, masks, FlashInfer's `plan()`), then every layer calls `attend`, which appends
this step's K/V into that layer's paged cache and attends over it.

Masking rule shared by all backends: sequence i's new tokens occupy the last qo_len[i] of its
kv_len[i] KV slots; without a custom mask token t (0-based among the new ones) sees KV
[0, kv_len - qo_len + t]; with `plan.custom_mask` it sees exactly the True entries (trees).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specsched.scheduler.plan import AttentionPlan

BACKENDS = ("torch", "cpu", "flashinfer")


@runtime_checkable
class StepAttention(Protocol):
    """Per-step attention state, shared by all layers of one forward. A step may also offer
    `decoder_layer(fused, x, cos, sin_signed, kv_layer)`, a whole decoder layer in one call (the
    CPU backend's, runtime/attention/cpu_backend.py); DecoderLayer uses it where it is there."""

    plan: AttentionPlan

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [N, Hq, D], RoPE applied
        k: torch.Tensor,  # [N, Hkv, D], RoPE applied
        v: torch.Tensor,  # [N, Hkv, D]
        kv_layer: torch.Tensor,  # one layer's pages in the backend's `kv_layout`, written in place
    ) -> torch.Tensor:  # [N, Hq, D]
        ...


@runtime_checkable
class AttentionBackend(Protocol):
    name: str
    kv_layout: str  # the page layout of the KV caches it reads: "NHD" or "HND" (runtime/kv_cache.py)

    def prepare(self, plan: AttentionPlan, device: torch.device | str) -> StepAttention:
        ...


def get_backend(name: str = "torch", **options) -> AttentionBackend:
    """An attention backend by name.

    Options (FlashInfer needs them, torch ignores them): num_qo_heads, num_kv_heads,
    head_dim, dtype, workspace_bytes.
    """
    if name == "torch":
        from specsched.runtime.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "cpu":
        from specsched.runtime.attention.cpu_backend import CpuBackend

        return CpuBackend(**options)
    if name == "flashinfer":
        from specsched.runtime.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(**options)
    raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """The backend a configured `attention` names, and a note on it for the worker's start-up
    line: "auto" is the C kernel (`cpu`) for a float32 model on a CPU where the kernel builds and
    takes the head size, else torch. "cpu" where the kernel cannot serve is a RuntimeError
    saying why."""
    from specsched.runtime.attention.cpu_backend import kernel_status

    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r} (choose from auto, {', '.join(BACKENDS)})")
    if name == "cpu" or (name == "auto" and device.type == "cpu" and dtype == torch.float32):
        why = kernel_status(head_dim)
        if why is None:
            return "cpu", "C kernel on the pages"
        if name == "cpu":
            raise RuntimeError(f"attention 'cpu': {why}")
        return "torch", f"torch gather + SDPA ({why})"
    name = "torch" if name == "auto" else name
    return name, {"torch": "torch gather + SDPA", "flashinfer": "FlashInfer"}[name]


def kv_layout(backend: AttentionBackend | None) -> str:
    """The page layout a KV cache read by `backend` (None: the torch backend) is stored in."""
    if backend is None:
        from specsched.runtime.attention.torch_backend import TorchBackend

        return TorchBackend.kv_layout
    return backend.kv_layout


__all__ = ["AttentionBackend", "StepAttention", "get_backend", "kv_layout", "resolve_backend", "BACKENDS"]
