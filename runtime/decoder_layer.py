"""The Llama-family decoder layer (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache: Llama,
Mistral, Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) as fields of one config
(`specsched.runtime.config`), not copies of the layer. The target and draft models
(runtime/model.py) stack it; an MTP or EAGLE head (runtime/mtp_head.py, runtime/eagle3.py) is one.

Why: the bundled models are tiny, so a forward is bound by per-op dispatch, not FLOPs. The
layer is written for few ops: q/k/v are one Linear and gate/up one Linear (fused at load
time), RoPE's cos/sin come from the caller, computed once per forward and shared by all
layers, RoPE is applied to q and k together (`x*cos + roll(x)*sin_signed`), and the
attention backend's per-step state (`StepAttention`) is built once, not per layer.

Weights load from Hugging Face names through `DecoderLayer.load_hf` and go back out through
`hf_state_dict`, so every model made of these layers reads its own checkpoint's names.

Tensor parallelism (`tp`, a `specsched.runtime.parallel.TPGroup` of N ranks; None: no
sharding and not one extra op): the layer is split Megatron style, so it costs two
all-reduces and no other communication. Rank r holds query heads [r*Hq/N, (r+1)*Hq/N) and KV
heads [r*Hkv/N, (r+1)*Hkv/N) -- query head groups map onto consecutive KV heads, so GQA stays
rank-local -- as the rows of a column-parallel qkv_proj (its q, then k, then v rows) and the
columns of a row-parallel o_proj, whose partial sums are all-reduced; the MLP likewise
(gate_up: the rank's gate rows then its up rows; down_proj: its columns, all-reduced). The KV
cache is sharded by KV heads, so page ids and plans are the same on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from specsched.runtime.attention import StepAttention
from specsched.runtime.config import ModelConfig
from specsched.runtime.layers import TORCH_OPS, RMSNorm, column_major_linear, rms_norm
from specsched.runtime.parallel import TPGroup, shard_range


class DecoderLayer(nn.Module):
    """Pre-norm Llama block: x + attn(norm(x)), then + mlp(norm(x)).

    forward(x [N, H] (or [B, T, H] with CausalAttention), cos, sin_signed (from
    RotaryEmbedding for x's positions), step (a StepAttention), kv_layer (this layer's
    cache, in the backend's page layout; None with CausalAttention), layer_idx (index passed to
    `step.attend`)) -> x after the block, same shape.

    Weights start uninitialised: fill them with `load_hf` or `init_weights`. With `tp` the
    layer holds this rank's shard (module docstring) and num_heads, num_kv_heads and
    intermediate_size are the rank's counts.
    """

    def __init__(self, config: ModelConfig, device=None, dtype=None, tp: TPGroup | None = None,
                 attn_in: int | None = None) -> None:
        """`attn_in`: the width the q/k/v projection reads (default the hidden size; an EAGLE-3
        head's layer reads [embedding ; hidden], twice that, through `attend`)."""
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.config = config
        self.attn_in = attn_in or h
        n = 1 if tp is None else tp.size
        if tp is not None:  # what `load_hf` slices full tensors by (and names a field that does not split)
            self._full_shapes, self._shards = self.hf_shapes(config, attn_in), self.hf_shards(config, tp)
        self.tp = tp
        self.num_heads = config.num_attention_heads // n
        self.num_kv_heads = config.num_key_value_heads // n
        self.head_dim = d
        self.intermediate_size = config.intermediate_size // n
        self.eps = config.rms_norm_eps
        self.ops = TORCH_OPS  # its small ops; `layers.use_cpu_kernels` swaps in the C ones
        self.fused = None  # and where it can, the whole layer as one C call (cpu_kernels.FusedLayer)
        dd = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, **dd)
        self.qkv_proj = column_major_linear(self.attn_in, (self.num_heads + 2 * self.num_kv_heads) * d, **dd)
        self.o_proj = column_major_linear(self.num_heads * d, h, **dd)
        # the family's extras (None where the config has none): q/k/v and output biases, and
        # Qwen3's RMSNorm over each query and key head
        self.qkv_bias = nn.Parameter(torch.zeros((self.num_heads + 2 * self.num_kv_heads) * d, **dd)) \
            if config.qkv_bias else None
        self.o_bias = nn.Parameter(torch.zeros(h, **dd)) if config.o_bias else None
        self.q_norm = RMSNorm(d, config.rms_norm_eps, **dd) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, **dd) if config.qk_norm else None
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, **dd)
        self.gate_up_proj = column_major_linear(h, 2 * self.intermediate_size, **dd)
        self.down_proj = column_major_linear(self.intermediate_size, h, **dd)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """N(0, std) projections, unit norm weights."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: StepAttention, kv_layer: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
        if self.fused is not None and hasattr(step, "decoder_layer"):
            out = step.decoder_layer(self.fused, x, cos, sin, kv_layer)
            if out is not None:
                return out
        a = self.attend(self.ops.rms_norm(x, self.input_layernorm.weight, self.eps), cos, sin, step, kv_layer,
                        layer_idx)
        x, h = self.ops.rms_norm(a, self.post_attention_layernorm.weight, self.eps, residual=x)
        return x + self.mlp_normed(h)

    def attend(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepAttention,
               kv_layer: torch.Tensor | None, layer_idx: int) -> torch.Tensor:
        """The attention block on its (normalised) input h [..., attn_in]: the output
        projection's [..., H], all-reduced under tensor parallelism, before the residual."""
        lead = h.shape[:-1]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(h, self.qkv_bias).view(*lead, hq + 2 * hkv, d)
        qk = qkv[..., : hq + hkv, :]
        if self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[..., :hq, :], self.q_norm.weight, self.eps),
                            rms_norm(qk[..., hq:, :], self.k_norm.weight, self.eps)), -2)
        qk = self.ops.rope(qk, cos, sin)
        attn = step.attend(layer_idx, qk[..., :hq, :], qk[..., hq:, :], qkv[..., hq + hkv :, :],
                           kv_layer)
        o = self.o_proj(attn.reshape(*lead, hq * d))
        if self.tp is not None:
            self.tp.all_reduce(o)
        if self.o_bias is not None:  # after the all-reduce: added once, not once per rank
            o = o + self.o_bias
        return o

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP block on the residual stream x (it applies post_attention_layernorm), before
        the residual."""
        return self.mlp_normed(self.ops.rms_norm(x, self.post_attention_layernorm.weight, self.eps))

    def mlp_normed(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP block on the normalised residual stream h (all-reduced under tensor parallelism)."""
        o = self.down_proj(self.ops.silu_mul(self.gate_up_proj(h)))
        if self.tp is not None:
            self.tp.all_reduce(o)
        return o

    @staticmethod
    def hf_shapes(config: ModelConfig, attn_in: int | None = None) -> dict[str, tuple[int, ...]]:
        """Expected Hugging Face tensor shapes of one layer (names relative to the layer), the
        family's biases and q/k norms included where its config has them; `attn_in`: the
        width q/k/v read (default the hidden size)."""
        h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
        hq, hkv = config.num_attention_heads, config.num_key_value_heads
        a = attn_in or h
        shapes = {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (hq * d, a), "self_attn.k_proj.weight": (hkv * d, a),
            "self_attn.v_proj.weight": (hkv * d, a), "self_attn.o_proj.weight": (h, hq * d),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        if config.qkv_bias:
            shapes.update({"self_attn.q_proj.bias": (hq * d,), "self_attn.k_proj.bias": (hkv * d,),
                           "self_attn.v_proj.bias": (hkv * d,)})
        if config.o_bias:
            shapes["self_attn.o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        return shapes

    @staticmethod
    def hf_shards(config: ModelConfig, tp: TPGroup) -> dict[str, tuple[int, slice]]:
        """Rank `tp.rank`'s part of each sharded Hugging Face tensor of a layer (names relative
        to the layer) as (dim, slice): rows of q/k/v/gate/up, columns of o/down. The norms are
        replicated, so absent. ValueError naming the field if the config does not split."""
        d = config.head_dim
        q, kv, i = (shard_range(getattr(config, f), tp.rank, tp.size, f) for f in
                    ("num_attention_heads", "num_key_value_heads", "intermediate_size"))
        q, kv = slice(q.start * d, q.stop * d), slice(kv.start * d, kv.stop * d)
        shards = {
            "self_attn.q_proj.weight": (0, q), "self_attn.k_proj.weight": (0, kv),
            "self_attn.v_proj.weight": (0, kv), "self_attn.o_proj.weight": (1, q),
            "mlp.gate_proj.weight": (0, i), "mlp.up_proj.weight": (0, i),
            "mlp.down_proj.weight": (1, i),
        }
        if config.qkv_bias:
            shards.update({"self_attn.q_proj.bias": (0, q), "self_attn.k_proj.bias": (0, kv),
                           "self_attn.v_proj.bias": (0, kv)})
        return shards

    def _local(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `w`: sliced if `w` is the full tensor, as given otherwise."""
        spec = self._shards.get(name)
        if spec is None or tuple(w.shape) != self._full_shapes[name]:
            return w
        dim, s = spec
        return w[s] if dim == 0 else w[:, s]

    @torch.no_grad()
    def load_hf(self, tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
        """Copy weights given under Hugging Face names (`prefix + 'self_attn.q_proj.weight'`...),
        fusing q/k/v and gate/up. A sharded layer takes full tensors (and slices its shard) or
        this rank's shards as `hf_shards` cuts them (what a sharded `load_model` reads)."""
        t = {n: tensors[prefix + n] for n in self.hf_shapes(self.config, self.attn_in)}
        if self.tp is not None:
            t = {n: self._local(n, w) for n, w in t.items()}
        self.input_layernorm.weight.copy_(t["input_layernorm.weight"])
        self.post_attention_layernorm.weight.copy_(t["post_attention_layernorm.weight"])
        self.qkv_proj.weight.copy_(torch.cat(
            [t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"], t["self_attn.v_proj.weight"]]
        ))
        self.o_proj.weight.copy_(t["self_attn.o_proj.weight"])
        if self.qkv_bias is not None:
            self.qkv_bias.copy_(torch.cat([t[f"self_attn.{x}_proj.bias"] for x in "qkv"]))
        if self.o_bias is not None:
            self.o_bias.copy_(t["self_attn.o_proj.bias"])
        if self.q_norm is not None:
            self.q_norm.weight.copy_(t["self_attn.q_norm.weight"])
            self.k_norm.weight.copy_(t["self_attn.k_norm.weight"])
        self.gate_up_proj.weight.copy_(torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]]))
        self.down_proj.weight.copy_(t["mlp.down_proj.weight"])

    def hf_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """This layer's weights under Hugging Face names (unfused), for saving. A sharded layer
        gathers the full tensors from all ranks: a collective, every rank must call it."""
        hq, hkv, d, i = self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        q, k, v = self.qkv_proj.weight.detach().split([hq * d, hkv * d, hkv * d])
        gate, up = self.gate_up_proj.weight.detach().split([i, i])
        out = {
            "input_layernorm.weight": self.input_layernorm.weight.detach(),
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight.detach(),
            "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k,
            "self_attn.v_proj.weight": v, "self_attn.o_proj.weight": self.o_proj.weight.detach(),
            "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": self.down_proj.weight.detach(),
        }
        if self.qkv_bias is not None:
            for x, b in zip("qkv", self.qkv_bias.detach().split([hq * d, hkv * d, hkv * d])):
                out[f"self_attn.{x}_proj.bias"] = b
        if self.o_bias is not None:
            out["self_attn.o_proj.bias"] = self.o_bias.detach()
        if self.q_norm is not None:
            out["self_attn.q_norm.weight"] = self.q_norm.weight.detach()
            out["self_attn.k_norm.weight"] = self.k_norm.weight.detach()
        if self.tp is not None:
            out = {n: self.tp.all_gather(w, self._shards[n][0]) if n in self._shards else w
                   for n, w in out.items()}
        return {prefix + n: w.contiguous() for n, w in out.items()}
