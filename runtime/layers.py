"""The Llama decoder's building blocks: RMSNorm, RoPE tables, column-major linear weights.

Why a module of its own: the target (runtime/model.py) and the MTP head (runtime/mtp_head.py)
share them, and each is written for few ops on tiny models, where a forward is bound by per-op
dispatch (see each function's docstring for the trick it plays).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specsched.runtime.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim.

    Computed as LayerNorm of [x, -x]: that vector has mean 0 and variance mean(x^2), so its
    first half normalises to exactly RMSNorm(x). LayerNorm is one fused CPU kernel, while
    `F.rms_norm` runs as several small ops, which the decode forward pays for in dispatch.
    Returns a view (row stride 2H) of the first half.
    """
    h = x.shape[-1]
    both = torch.cat((x, x.neg()), -1)
    return F.layer_norm(both, (2 * h,), torch.cat((weight, weight)), None, eps)[..., :h]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE tables for given positions; `forward(positions) -> (cos, sin_signed)`, each
    [*positions.shape, 1, D], broadcast over heads. `sin_signed` carries rotate_half's sign
    (first half negated), so `apply_rope(x, cos, sin_signed)` needs only a roll. The tables
    stay float32 whatever dtype the model is cast to."""

    def __init__(self, config: ModelConfig, device=None) -> None:
        super().__init__()
        self.config = config
        self._build(torch.device(device or "cpu"))

    def _build(self, device: torch.device) -> None:
        c, d = self.config, self.config.head_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if c.rope_scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, c)
        self.register_buffer("inv_freq", torch.cat([inv_freq, inv_freq]).to(device),
                             persistent=False)  # [D]
        sign = torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])
        self.register_buffer("sign", sign.to(device), persistent=False)  # [D]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._build(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        angles = positions.unsqueeze(-1).float() * self.inv_freq  # [..., D] fp32
        cos = angles.cos().unsqueeze(-2)
        sin = (angles.sin() * self.sign).unsqueeze(-2)
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def _llama3_inv_freq(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Llama 3 scaling: long wavelengths stretched by `factor`, short kept, smooth between."""
    s = config.rope_scaling
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def column_major_weight(rows: int, cols: int, device=None, dtype=None) -> nn.Parameter:
    """An uninitialised [rows, cols] parameter; float32 ones stored column-major (.t() contiguous).

    `F.linear` multiplies by weight.t(); in float32 with this layout MKL streams the weight
    row by row, which for the few-row inputs of decoding is faster (AVX2) than the default
    layout. bfloat16/float16 kernels prefer the default row-major layout (column-major is
    much slower there), so they keep it. Shapes, names and autograd are
    unchanged either way, and `copy_` into the parameter keeps its layout.
    """
    if (dtype or torch.get_default_dtype()) == torch.float32:
        return nn.Parameter(torch.empty(cols, rows, device=device, dtype=dtype).t())
    return nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype))


def column_major_linear(in_features: int, out_features: int, device=None, dtype=None) -> nn.Linear:
    """Bias-free nn.Linear with an uninitialised weight laid out by column_major_weight."""
    lin = nn.Linear(in_features, out_features, bias=False, device="meta")
    lin.weight = column_major_weight(out_features, in_features, device, dtype)
    return lin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated (Hugging Face half-split convention)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)
