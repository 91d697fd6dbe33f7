"""The Llama-family model: embedding, a stack of decoder layers (runtime/decoder_layer.py), final
norm and LM head over a paged KV cache; the target and the draft model are one.

Weights load from Hugging Face names through `LlamaModel.load_hf` and go back out through
`hf_state_dict`. Under tensor parallelism (`tp`) the decoder layers hold this rank's shards
(runtime/decoder_layer.py); embedding, final norm and lm_head are replicated: the vocabulary is
small and every rank (the leader above all, which samples and accepts) gets full logits with no
gather.
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
from specsched.runtime.decoder_layer import DecoderLayer
from specsched.runtime.kv_cache import PagedKVCache
from specsched.runtime.layers import RMSNorm, RotaryEmbedding, column_major_linear, column_major_weight, rms_norm
from specsched.runtime.parallel import TPGroup


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [M, V] float32, rows `logits_indices` (all N if None)
    hidden: torch.Tensor | None  # [N, H] last layer output BEFORE the final norm, or None


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
            input_ids, n = pad_inputs(input_ids, positions)  # a padded step's pad rows (runtime/padding.py)
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
