"""EAGLE-3 heads in their published layout (`LlamaForCausalLMEagle3`), as vLLM and SGLang load them.

Why: the EAGLE-3 heads users download (SpecForge's, the EAGLE authors', for Llama 3.x, Qwen3 ...)
are one decoder layer over the target's features, in a layout of their own. This module reads
that layout and runs it as the `eagle` (tree) or `mtp` (chain) proposer's head, with the
interface of `MTPHead` (runtime/mtp_head.py).

The head at position i reads the token t_{i+1} and the target's features at i:
- target features: the residual stream entering target layers `eagle_aux_hidden_state_layer_ids`
  (default 2, N/2, N-3 of N; as vLLM captures them, the outputs of the layers before), their
  concatenation [3 * target_hidden] mapped to the head's width by `fc`; the head's own output
  hidden state (width H) is fed back as is for deeper drafts;
- `midlayer`: residual = that hidden state (or its `hidden_norm`, with `norm_before_residual`),
  attention over [input_layernorm(embed(t)) ; hidden_norm(hidden)] (q/k/v read 2H), then the
  usual post-attention norm and MLP (`DecoderLayer.attend` / `DecoderLayer.mlp`);
- `norm` and `lm_head` over the draft vocabulary; a draft id j is target id j + d2t[j], and the
  head's logits come out over the target's vocabulary, -inf off the draft vocabulary, so
  drafting and (lossless) verification see target ids only. `t2d` is ignored.

Embeddings are the target's (an `embed_tokens.weight` in the checkpoint is used instead when
present, as vLLM does). Weights: safetensors (`model.safetensors` or a sharded index), read and
checked as a model checkpoint's are (`checkpoint.read_checked`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specsched.runtime.checkpoint import CheckpointError, read_checked, read_config_json
from specsched.runtime.config import ConfigError, ModelConfig
from specsched.runtime.cuda_graphs import pad_inputs, real_rows, run_body
from specsched.runtime.kv_cache import PagedKVCache
from specsched.runtime.layers import RMSNorm, RotaryEmbedding, column_major_weight, rms_norm
from specsched.runtime.decoder_layer import DecoderLayer
from specsched.runtime.model import LlamaModel
from specsched.runtime.mtp_head import HeadOutput, layer_kv_cache

ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_eagle3(path: str | Path) -> bool:
    """Whether the folder's config.json names the EAGLE-3 architecture."""
    cfg = Path(path) / "config.json"
    try:
        return ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return False


def default_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature layers of an N-layer target: 2, N // 2, N - 3."""
    n = num_target_layers
    return (2, n // 2, n - 3)


class Eagle3Head(nn.Module):
    """The head's own weights; `bind(target)` attaches the target's embedding (unless the
    checkpoint has one). `layer_ids`: EAGLE-3's feature layer ids (the residual stream entering
    each), `aux_layers` the same as target layer outputs (id - 1), what the worker asks the
    target for."""

    norms = True

    def __init__(self, config: ModelConfig, *, target_hidden: int, draft_vocab: int, layer_ids: tuple[int, ...],
                 norm_before_residual: bool = False, own_embedding: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.layer_ids = tuple(layer_ids)
        self.aux_layers = tuple(i - 1 for i in layer_ids)
        self.target_hidden = target_hidden
        self.norm_before_residual = norm_before_residual
        self.fc = nn.Linear(len(layer_ids) * target_hidden, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layer = DecoderLayer(config, attn_in=2 * h)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.lm_head.weight = column_major_weight(draft_vocab, h)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        self.rotary = RotaryEmbedding(config)
        self._target_embed: torch.Tensor | None = None
        self._target_ids: torch.Tensor | None = None

    @classmethod
    def for_target(cls, target: LlamaModel, aux_layers: tuple[int, ...], seed: int = 0,
                   std: float = 0.02) -> "Eagle3Head":
        """A randomly initialised head of the target's width and family reading the outputs of
        target layers `aux_layers` (EAGLE-3's ids: one more each), its draft vocabulary the
        target's, bound to it: what `train-mtp --layout eagle3` starts from."""
        c = target.config
        config = c.model_copy(update={"num_hidden_layers": 1})
        head = cls(config, target_hidden=c.hidden_size, draft_vocab=c.vocab_size,
                   layer_ids=tuple(i + 1 for i in aux_layers))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                p.copy_(torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * std)
        return head.to(device=target.device, dtype=target.dtype).requires_grad_(False).eval().bind(target)

    def bind(self, target: LlamaModel) -> "Eagle3Head":
        c = target.config
        if c.vocab_size != self.config.vocab_size or c.hidden_size != self.target_hidden:
            raise ValueError(f"EAGLE-3 head (vocab {self.config.vocab_size}, target_hidden_size {self.target_hidden}) "
                             f"does not fit target (vocab {c.vocab_size}, hidden {c.hidden_size})")
        self._target_embed = target.embed_tokens.weight
        self._target_ids = torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def make_kv_cache(self, num_pages: int, page_size: int, device: torch.device | str | None = None,
                      backend=None) -> PagedKVCache:
        return layer_kv_cache(self.layer, num_pages, page_size, device or self.fc.weight.device, backend)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.embed_tokens is not None else self._target_embed
        if weight is None:
            raise RuntimeError("Eagle3Head is not bound to a target: call head.bind(target) first")
        return F.embedding(token_ids, weight)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] head hidden (before the final norm) -> [..., V] float32 logits over the
        target's vocabulary (-inf off the draft vocabulary)."""
        draft = F.linear(self.norm(x), self.lm_head.weight).float()
        out = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self._target_ids] = draft
        return out

    def _run(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attention,
             kv_layer) -> torch.Tensor:
        if hidden.shape[-1] != self.config.hidden_size:  # the target's features: the aux layers, then its last
            hidden = F.linear(hidden[..., : len(self.layer_ids) * self.target_hidden], self.fc.weight)
        eps = self.config.rms_norm_eps
        normed = rms_norm(hidden, self.hidden_norm.weight, eps)
        residual = normed if self.norm_before_residual else hidden
        e = rms_norm(self.embed(token_ids).to(hidden.dtype), self.layer.input_layernorm.weight, eps)
        cos, sin = self.rotary(positions, hidden.dtype)
        x = residual + self.layer.attend(torch.cat([e, normed], -1), cos, sin, attention, kv_layer, 0)
        return x + self.layer.mlp(x)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, step, kv: PagedKVCache, positions: torch.Tensor,
                *, logits_indices: torch.Tensor | None = None) -> HeadOutput:
        """As `MTPHead.forward`: token_ids [N] (t_{i+1}), hidden [N, H] (the head's own) or the
        target's features [N, (A + 1) * target_hidden], positions [N] (i)."""
        (token_ids, n), (hidden, _) = pad_inputs(token_ids, positions), pad_inputs(hidden, positions)
        x = real_rows(run_body(self, step, kv, (token_ids, hidden, positions))[0], n)  # a padded step's pad rows cut
        rows = x if logits_indices is None else x.index_select(0, logits_indices)
        return HeadOutput(self.compute_logits(rows), x)

    def body(self, step, kv: PagedKVCache, token_ids: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor]:
        """The head's layer over a step's rows (what a CUDA graph captures): (its output [N, H],)."""
        return (self._run(token_ids, hidden, positions, step, kv.layers[0]),)

    def forward_full(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> HeadOutput:
        """Dense causal pass, as `MTPHead.forward_full`."""
        from specsched.runtime.attention.torch_backend import CausalAttention

        positions = torch.arange(token_ids.shape[-1], device=token_ids.device)
        return self.forward_dense(token_ids, hidden, positions, CausalAttention())

    def forward_dense(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      attention) -> HeadOutput:
        """Dense pass with any cache-free attention, as `MTPHead.forward_dense` (training)."""
        x = self._run(token_ids, hidden, positions, attention, None)
        return HeadOutput(self.compute_logits(x), x)

    # -- the published layout --------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.config.hidden_size
        shapes = {"fc.weight": (h, len(self.layer_ids) * self.target_hidden), "norm.weight": (h,),
                  "lm_head.weight": tuple(self.lm_head.weight.shape), "d2t": tuple(self.d2t.shape),
                  "midlayer.hidden_norm.weight": (h,)}
        shapes.update({f"midlayer.{n}": s for n, s in DecoderLayer.hf_shapes(self.config, 2 * h).items()})
        if self.embed_tokens is not None:
            shapes["embed_tokens.weight"] = (self.config.vocab_size, h)
        return shapes

    def state_for_save(self) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight,
               "d2t": self.d2t, "midlayer.hidden_norm.weight": self.hidden_norm.weight}
        out.update({f"midlayer.{n}": w for n, w in self.layer.hf_state_dict().items()})
        if self.embed_tokens is not None:
            out["embed_tokens.weight"] = self.embed_tokens.weight
        return {k: v.detach().contiguous() for k, v in out.items()}

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.fc.weight.copy_(tensors["fc.weight"])
        self.norm.weight.copy_(tensors["norm.weight"])
        self.lm_head.weight.copy_(tensors["lm_head.weight"])
        self.d2t.copy_(tensors["d2t"])
        self.hidden_norm.weight.copy_(tensors["midlayer.hidden_norm.weight"])
        self.layer.load_hf(tensors, "midlayer.")
        if self.embed_tokens is not None:
            self.embed_tokens.weight.copy_(tensors["embed_tokens.weight"])


def read_eagle3_config(path: str | Path, num_target_layers: int) -> tuple[ModelConfig, dict, dict]:
    """(layer config, the head's own fields, raw config.json) of an EAGLE-3 head folder; a field
    the runtime cannot serve is a CheckpointError naming it."""
    cfg_path, raw = read_config_json(Path(path), "EAGLE-3 head directory")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: config must be a JSON object")
    if raw.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{cfg_path}: num_hidden_layers {raw['num_hidden_layers']}: an EAGLE-3 head has one "
                              "decoder layer (midlayer)")
    try:
        config = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                      "num_hidden_layers": 1})
    except ConfigError as e:
        raise CheckpointError(f"{cfg_path}: unsupported config: {e}") from None
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    if eagle.get("use_aux_hidden_state") is False:
        raise CheckpointError(f"{cfg_path}: use_aux_hidden_state false (EAGLE-1/2 features) is not supported")
    ids = tuple(default_layer_ids(num_target_layers) if ids is None else ids)
    bad = not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or list(ids) != sorted(set(ids))
    if bad or len(ids) != 3 or ids[0] < 1 or ids[-1] > num_target_layers - 1:
        raise CheckpointError(f"{cfg_path}: eagle_aux_hidden_state_layer_ids {list(ids)}: expected 3 increasing "
                              f"target layer ids in 1..{num_target_layers - 1} (the target has {num_target_layers})")
    fields = {"target_hidden": int(raw.get("target_hidden_size") or config.hidden_size),
              "draft_vocab": int(raw.get("draft_vocab_size") or config.vocab_size), "layer_ids": ids,
              "norm_before_residual": bool(raw.get("norm_before_residual", False))}
    return config, fields, raw


def load_eagle3_head(path: str | Path, target: LlamaModel, *, dummy: bool = False) -> Eagle3Head:
    """An EAGLE-3 head folder bound to `target` (its dtype and device); `dummy`: the config's
    shape with random weights (`runtime/dummy.py`). Every tensor is checked by name and shape."""
    path = Path(path)
    if target.tp is not None:
        raise CheckpointError(f"{path}: EAGLE-3 heads are not supported on a tensor-parallel target yet")
    config, fields, raw = read_eagle3_config(path, target.config.num_hidden_layers)
    draft_vocab, vocab = fields["draft_vocab"], config.vocab_size
    weights = {}
    if not dummy:
        expected = Eagle3Head(config, **fields, own_embedding=True).expected_shapes() | {"t2d": (vocab,)}
        weights = read_checked(path, expected, {"embed_tokens.weight", "t2d", "d2t"}, what="an EAGLE-3 head")
        weights.pop("t2d", None)
        if "d2t" not in weights:
            if draft_vocab != vocab:
                raise CheckpointError(f"missing tensor 'd2t' in {path} (draft_vocab_size is smaller than vocab_size: "
                                      f"draft ids map to target ids through it) (expected shape {(draft_vocab,)})")
            weights["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)  # the draft vocabulary is the target's
    own = "embed_tokens.weight" in weights
    if not own and config.hidden_size != target.config.hidden_size:
        raise CheckpointError(f"{path}: hidden_size {config.hidden_size} differs from the target's "
                              f"{target.config.hidden_size}, so the head needs its own 'embed_tokens.weight'")
    head = Eagle3Head(config, **fields, own_embedding=own)
    if not dummy:
        ids = weights["d2t"].to(torch.int64) + torch.arange(draft_vocab)
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
            raise CheckpointError(f"tensor 'd2t' in {path} maps draft ids outside the target's vocabulary "
                                  f"(0..{config.vocab_size - 1})")
        head.load_tensors(weights)
    else:
        from specsched.runtime.dummy import fill_random_

        fill_random_(head)
    head = head.to(device=target.device, dtype=target.dtype).requires_grad_(False).eval()  # d2t stays int64
    try:
        return head.bind(target)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def save_eagle3_head(head: Eagle3Head, out_dir: str | Path) -> Path:
    """Write `head` in the published layout: config.json (`LlamaForCausalLMEagle3`) and model.safetensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = head.config
    cfg = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
           "draft_vocab_size": int(head.d2t.shape[0]), "target_hidden_size": head.target_hidden,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.layer_ids), "use_aux_hidden_state": True},
           "norm_before_residual": head.norm_before_residual, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: (v if k == "d2t" else v.float()).cpu() for k, v in head.state_for_save().items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
