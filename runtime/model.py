"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache: Llama, Mistral,
Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) as fields of one config
(`specsched.runtime.config`), not copies of the layer.

Why: the bundled models are tiny, so a forward is bound by per-op dispatch, not FLOPs. The
layer is written for few ops: q/k/v are one Linear and gate/up one Linear (fused at load
time), RoPE's cos/sin are computed once per forward for the step's positions and shared by
all layers, RoPE is applied to q and k together (`x*cos + roll(x)*sin_signed`), and the
attention backend's per-step state (`StepAttention`) is built once, not per layer.

Weights load from Hugging Face names through `DecoderLayer.load_hf` / `LlamaModel.load_hf`
and go back out through `hf_state_dict`, so other modules (an MTP head is one DecoderLayer)
can reuse these classes with their own checkpoints.

Tensor parallelism (`tp`, a `specsched.runtime.parallel.TPGroup` of N ranks; None: no
sharding and not one extra op): each layer is split Megatron style, so a layer costs two
all-reduces and no other communication. Rank r holds query heads [r*Hq/N, (r+1)*Hq/N) and KV
heads [r*Hkv/N, (r+1)*Hkv/N) -- query head groups map onto consecutive KV heads, so GQA stays
rank-local -- as the rows of a column-parallel qkv_proj (its q, then k, then v rows) and the
columns of a row-parallel o_proj, whose partial sums are all-reduced; the MLP likewise
(gate_up: the rank's gate rows then its up rows; down_proj: its columns, all-reduced). The KV
cache is sharded by KV heads, so page ids and plans are the same on every rank. Embedding,
final norm and lm_head are replicated: the vocabulary is small and every rank (the leader
above all, which samples and accepts) gets full logits with no gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specsched.runtime.attention import StepAttention, get_backend, kv_layout
from specsched.runtime.attention.torch_backend import CausalAttention
from specsched.runtime.config import ModelConfig
from specsched.runtime.cuda_graphs import pad_inputs, real_rows, run_body
from specsched.runtime.kv_cache import PagedKVCache
from specsched.runtime.layers import (RMSNorm, RotaryEmbedding, apply_rope, column_major_linear, column_major_weight,
                                      rms_norm)
from specsched.runtime.parallel import TPGroup, shard_range


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [M, V] float32, rows `logits_indices` (all N if None)
    hidden: torch.Tensor | None  # [N, H] last layer output BEFORE the final norm, or None


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
        x = x + self.attend(rms_norm(x, self.input_layernorm.weight, self.eps), cos, sin, step, kv_layer, layer_idx)
        return x + self.mlp(x)

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
        qk = apply_rope(qk, cos, sin)
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
        h = rms_norm(x, self.post_attention_layernorm.weight, self.eps)
        gate_up = self.gate_up_proj(h)
        i = self.intermediate_size
        o = self.down_proj(F.silu(gate_up[..., :i]) * gate_up[..., i:])
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


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding if the
    config says so). `LlamaModel(config)` allocates uninitialised weights; use
    `specsched.runtime.checkpoint.load_model` to load a checkpoint or `LlamaModel.random` for a
    randomly initialised one. With `tp` the decoder layers hold this rank's shards and the
    rest is replicated (module docstring); every rank then runs every forward, with the same
    inputs, and gets the same full logits."""

    def __init__(self, config: ModelConfig, device=None, dtype=None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        dd = dict(device=device, dtype=dtype)
        # column-major like the Linear layers, since it may serve as the (tied) LM head
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=column_major_weight(config.vocab_size, config.hidden_size, **dd).data,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, tp=tp, **dd) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **dd)
        self.lm_head = column_major_linear(config.hidden_size, config.vocab_size, **dd)
        self.rotary = RotaryEmbedding(config, device=device)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """N(0, std) embedding and projections, unit norm weights."""
        self.embed_tokens.weight.copy_(torch.randn(self.embed_tokens.weight.shape, generator=generator) * std)
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=generator) * std)
        self.norm.weight.fill_(1.0)
        for layer in self.layers:
            layer.init_weights(std, generator)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, std: float = 0.02,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               tp: TPGroup | None = None) -> "LlamaModel":
        """A randomly initialised, frozen model (N(0, std) weights, unit norms). With `tp`, this
        rank's shard of the very model `tp=None` gives (the full one is built, then sliced)."""
        model = cls(config, device=device, dtype=dtype)
        model.init_weights(std, torch.Generator().manual_seed(seed))
        if tp is not None:
            full, model = model, cls(config, device=device, dtype=dtype, tp=tp)
            model.load_hf(full.hf_state_dict())
        return model.requires_grad_(False).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def make_kv_cache(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None,
                      device: torch.device | str | None = None, backend=None) -> PagedKVCache:
        """This rank's KV cache: all layers, its KV heads only; as wide per head and in the page
        layout `backend` (the attention backend that reads it) stores, the torch backend's by
        default (the model's head size, HND pages)."""
        c = self.config
        head_dim = c.head_dim if backend is None else backend.kv_head_dim(c.head_dim)
        return PagedKVCache(c.num_hidden_layers, num_pages, page_size, self.num_kv_heads, head_dim,
                            dtype or self.dtype, device or self.device, kv_layout(backend))

    def attention_backend(self, name: str = "torch"):
        """A backend configured with this rank's head counts and the model's dtype."""
        return get_backend(name, num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.config.head_dim, dtype=self.dtype)

    @property
    def num_heads(self) -> int:
        """Query heads this rank computes (all of them without tp)."""
        return self.config.num_attention_heads // (1 if self.tp is None else self.tp.size)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them without tp)."""
        return self.config.num_key_value_heads // (1 if self.tp is None else self.tp.size)

    def compute_logits(self, hidden_normed: torch.Tensor) -> torch.Tensor:
        """[..., H] final-normed hidden states -> [..., V] float32 logits."""
        return self.lm_head(hidden_normed).float()

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm.weight, self.norm.eps)

    def forward(self, input_ids: torch.Tensor, step: StepAttention, kv: PagedKVCache,
                positions: torch.Tensor, *, logits_indices: torch.Tensor | None = None,
                return_hidden: bool = False, inputs_embeds: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = ()) -> ModelOutput:
        """One step over N packed new tokens (the layout of `step.plan`).

        input_ids [N] (ignored when inputs_embeds [N, H] is given), positions [N] RoPE
        positions, logits_indices [M] rows to compute logits for (None: all N; an empty
        tensor gives [0, V] logits). With `return_hidden`, `aux_layers` (increasing indices
        of earlier decoder layers) put those layers' outputs in front of the last layer's:
        hidden [N, (len(aux_layers) + 1) * H], the features an EAGLE-3 head reads.
        """
        if inputs_embeds is None:
            input_ids, n = pad_inputs(input_ids, positions)  # a padded step's pad rows (scheduler/padding.py)
            x, hidden = run_body(self, step, kv, (input_ids, positions), (return_hidden, tuple(aux_layers)))
        else:
            x, n = pad_inputs(inputs_embeds, positions)
            x, hidden = self._layers(x, step, kv, positions, return_hidden, aux_layers)
        x, hidden = real_rows(x, n), real_rows(hidden, n)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return ModelOutput(logits=self.compute_logits(self.final_norm(x)), hidden=hidden)

    def body(self, step: StepAttention, kv: PagedKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
             return_hidden: bool, aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers over a step's tokens -- what a CUDA graph captures (runtime/cuda_graphs.py):
        (the last layer's output [N, H], before the final norm; the hidden features or None)."""
        return self._layers(F.embedding(input_ids, self.embed_tokens.weight), step, kv, positions, return_hidden,
                            aux_layers)

    def _layers(self, x: torch.Tensor, step: StepAttention, kv: PagedKVCache, positions: torch.Tensor,
                return_hidden: bool, aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = self.rotary(positions, x.dtype)
        aux = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, step, kv.layers[i], i)
            if return_hidden and i in aux_layers:
                aux.append(x)
        return x, (_with_aux(aux, x) if return_hidden else None)

    def forward_full(self, input_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain causal forward without a KV cache: input_ids [B, T] ->
        (logits [B, T, V] float32, hidden [B, T, H] before the final norm; with `aux_layers`
        those layers' outputs in front, [B, T, (len(aux_layers) + 1) * H], as `forward`)."""
        x = F.embedding(input_ids, self.embed_tokens.weight)
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        cos, sin = self.rotary(positions, x.dtype)
        step = CausalAttention()
        aux = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, step, None, i)
            if i in aux_layers:
                aux.append(x)
        return self.compute_logits(self.final_norm(x)), _with_aux(aux, x)

    # --- Hugging Face weights -------------------------------------------------------------

    @staticmethod
    def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face checkpoint of this config holds, with its shape."""
        shapes = {
            "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
            "model.norm.weight": (config.hidden_size,),
            "lm_head.weight": (config.vocab_size, config.hidden_size),
        }
        for i in range(config.num_hidden_layers):
            for name, shape in DecoderLayer.hf_shapes(config).items():
                shapes[f"model.layers.{i}.{name}"] = shape
        return shapes

    @staticmethod
    def hf_shards(config: ModelConfig, tp: TPGroup) -> dict[str, tuple[int, slice]]:
        """Rank `tp.rank`'s (dim, slice) of every sharded checkpoint tensor (the tensors not
        named are replicated); see `DecoderLayer.hf_shards`."""
        layer = DecoderLayer.hf_shards(config, tp)
        return {f"model.layers.{i}.{name}": spec for i in range(config.num_hidden_layers)
                for name, spec in layer.items()}

    @torch.no_grad()
    def load_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy weights given under Hugging Face names; a sharded model takes full tensors or
        this rank's shards of the layer weights (see `DecoderLayer.load_hf`)."""
        self.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
        self.norm.weight.copy_(tensors["model.norm.weight"])
        if not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(tensors["lm_head.weight"])
        for i, layer in enumerate(self.layers):
            layer.load_hf(tensors, f"model.layers.{i}.")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight under Hugging Face names, full size: a sharded model gathers its layers'
        shards (a collective, every rank must call it; each rank then holds a full copy)."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight.detach().contiguous(),
               "model.norm.weight": self.norm.weight.detach().contiguous()}
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight.detach().contiguous()
        for i, layer in enumerate(self.layers):
            out.update(layer.hf_state_dict(f"model.layers.{i}."))
        return out


def _with_aux(aux: list[torch.Tensor], last: torch.Tensor) -> torch.Tensor:
    """The hidden states a forward returns: the last layer's, the aux layers' outputs in front."""
    return torch.cat([*aux, last], -1) if aux else last
