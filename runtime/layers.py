"""The Llama decoder's building blocks: RMSNorm, RoPE tables, column-major and packed linear layers.

Why a module of its own: the target (runtime/model.py) and the MTP head (runtime/mtp_head.py)
share them, and each is written for few ops on tiny models, where a forward is bound by per-op
dispatch (see each function's docstring for the trick it plays).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specsched.runtime import cpu_kernels
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


def packed_kernel() -> str:
    """Which kernel `Linear.pack` packs for here: "C" (runtime/cpu_kernels.c's `specsched_linear`)
    where the C kernels build and torch runs one thread (the C kernel runs on one), else "oneDNN"."""
    return "C" if cpu_kernels.status() is None and torch.get_num_threads() == 1 else "oneDNN"


class Linear(nn.Linear):
    """A bias-free linear layer whose weight is laid out by column_major_weight; `forward(x,
    bias=None)` takes an optional bias (a family's q/k/v bias lives beside the layer).

    `pack()` (a CPU worker, once its weights are final) keeps a copy of the float32 weight laid
    out for a faster kernel (`packed_kernel()`), which then multiplies every input: blocks of
    outputs for specsched's C kernel, which streams each block once for up to six rows held in
    registers, the copy in bfloat16 where every weight is a bfloat16 value (the same products
    from half the memory; benchmarks/linear_kernels.py); else oneDNN's blocked layout, the one its
    inner-product kernel reads, as vLLM's CPU backend and inductor's freezing pass do (MKL
    repacks the weight at every call). The copy is not a parameter: state dicts, training and
    tensor-parallel slicing see the plain weight alone.
    """

    packed: torch.Tensor | None = None
    blocked = False  # whether `packed` is laid out for the C kernel (cpu_kernels.blocked_weight)

    def pack(self) -> None:
        if self.packed is None:
            if packed_kernel() == "C":
                self.packed, self.blocked = cpu_kernels.blocked_weight(self.weight), True
            else:
                # the batch-size hint picks the blocking; 8 rows measured best from 1 to 584 rows
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            if not self.blocked:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
            if x.dtype == torch.float32:
                return cpu_kernels.linear(x, self.packed, self.out_features, bias)
        return F.linear(x, self.weight, bias)


def column_major_linear(in_features: int, out_features: int, device=None, dtype=None) -> Linear:
    """Bias-free Linear with an uninitialised weight laid out by column_major_weight."""
    lin = Linear(in_features, out_features, bias=False, device="meta")
    lin.weight = column_major_weight(out_features, in_features, device, dtype)
    return lin


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `Linear.pack` applies to weights of this device and dtype: float32 on a CPU
    whose torch has oneDNN."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(*modules: nn.Module) -> int:
    """`pack` every `Linear` in `modules` whose weight `can_pack`; returns how many were packed."""
    layers = {id(m): m for module in modules for m in module.modules()
              if isinstance(m, Linear) and can_pack(m.weight.device, m.weight.dtype)}
    for layer in layers.values():
        layer.pack()
    return len(layers)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated (Hugging Face half-split convention)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


class TorchLayerOps:
    """The decoder layer's small ops in PyTorch: every device and dtype, autograd. The C
    versions (`runtime/cpu_kernels.LayerOps`, same signatures) replace them where
    `use_cpu_kernels` installs them."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of x; with `residual`, (x + residual, its RMSNorm)."""
        if residual is None:
            return rms_norm(x, weight, eps)
        total = x + residual
        return total, rms_norm(total, weight, eps)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin_signed)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [..., 2I] = [gate | up]."""
        i = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :i]) * gate_up[..., i:]


TORCH_OPS = TorchLayerOps()


def use_cpu_kernels(*modules: nn.Module) -> int:
    """Give every decoder layer in `modules` (anything with an `ops` attribute) whose weights are
    float32 on a CPU the C versions of its small ops (runtime/cpu_kernels.py; they still leave
    autograd and other shapes to PyTorch's) and, where its linears are packed for the C kernel
    (`pack_linears` first), the whole layer as one C call (`cpu_kernels.FusedLayer`); returns how
    many layers (0 where the kernels cannot be built: `cpu_kernels.status()` says why)."""
    if cpu_kernels.status() is not None:
        return 0
    ops = cpu_kernels.LayerOps(TORCH_OPS)
    layers = {id(m): m for module in modules for m in module.modules() if getattr(m, "ops", None) is TORCH_OPS
              and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in m.parameters())}
    for layer in layers.values():
        layer.ops = ops
        layer.fused = cpu_kernels.FusedLayer.of(layer)
    return len(layers)


def kernel_notes(packed_linears: int, cpu_layers: int, *modules: nn.Module) -> tuple[str, str]:
    """What a worker's linears and its decoder layers' small ops run on, given how many
    `pack_linears` packed and `use_cpu_kernels` gave C ops, and the `modules` they were given
    (words for its start-up line)."""
    why = cpu_kernels.status()
    linears = ("torch" if not packed_linears else "C on blocked weights" if packed_kernel() == "C"
               else "oneDNN pre-packed" + (f" ({why})" if why else " (C kernel: one thread only)"))
    whole = len({id(m) for module in modules for m in module.modules() if getattr(m, "fused", None) is not None})
    calls = "" if not whole else "; a layer a call" if whole == cpu_layers else f"; {whole} layers a call"
    return linears, f"C (RMSNorm, RoPE, SiLU-and-multiply{calls})" if cpu_layers else "torch" + (f" ({why})" if why else "")
