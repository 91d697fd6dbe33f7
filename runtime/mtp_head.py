"""The MTP head (DeepSeek-V3's multi-token-prediction module) and its checkpoint io.

Why: a one-layer head on the target's own hidden states drafts nearly for free, because the
expensive parts -- embedding and lm_head -- are the target's, shared and frozen. At head
position i the input is concat(enorm(embed(t_{i+1})), hnorm(H_i)), H_i the target's last
hidden state at i before its final norm; eh_proj maps 2H -> H, one Llama decoder layer
(`specsched.runtime.decoder_layer.DecoderLayer`) with its own paged KV runs, and a final norm + the target's
lm_head give logits for t_{i+2}. The layer's output before that norm is the head's "hidden"
(trained to match H_{i+1}), which multi-token drafting feeds back in place of H.
`norms=False` drops enorm/hnorm (EAGLE's layout), kept for the ablation in the model card.

`aux_layers` (EAGLE-3's multi-layer features): the outputs of these earlier target layers
join H_i, and a bias-free `fc` maps the concatenation [(A + 1) * H] to H before hnorm. Only
the target's features go through it: a draft step fed the head's own hidden (width H) skips
it. A fresh `fc` is the identity on H_i and zero on the rest, so training starts from the
plain head.

A checkpoint is a directory: config.json (`architectures: ["SpecschedMTPHead"]`, the layer's
shape, `norms`, `aux_layers`, `target_fingerprint`) and model.safetensors with the head's own weights
only. Loading checks every field and tensor and names the file and the problem.

On a tensor-parallel target (`target.tp`) the head follows it: its decoder layer is sharded
like the target's (and so is its KV cache), while enorm/hnorm, eh_proj and the final norm stay
replicated (and so is `fc`) -- they are small, and every rank needs the full [N, H] input to the layer. The
head's file is read whole and each rank keeps its slices (one layer: no memory worth saving).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from specsched.runtime.attention import StepAttention, kv_layout
from specsched.runtime.attention.torch_backend import CausalAttention
from specsched.runtime.checkpoint import CheckpointError, check_finite, read_config_json
from specsched.runtime.config import ModelConfig
from specsched.runtime.cuda_graphs import pad_inputs, real_rows, run_body
from specsched.runtime.kv_cache import PagedKVCache
from specsched.runtime.layers import RMSNorm, RotaryEmbedding
from specsched.runtime.decoder_layer import DecoderLayer
from specsched.runtime.model import LlamaModel
from specsched.runtime.parallel import TPGroup

ARCHITECTURE = "SpecschedMTPHead"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_SHARED_FIELDS = ("vocab_size", "hidden_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")


@dataclass
class HeadOutput:
    logits: torch.Tensor  # [M, V] float32 (rows `logits_indices`), or [B, T, V] dense
    hidden: torch.Tensor  # [N, H] (or [B, T, H]) layer output before the final norm


class MTPHead(nn.Module):
    """The head's own weights; `bind(target)` attaches the shared embedding and lm_head
    (kept outside the module's parameters, so they are never trained or saved). With `tp`
    the decoder layer holds this rank's shard (module docstring)."""

    def __init__(self, config: ModelConfig, norms: bool = True, tp: TPGroup | None = None,
                 aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"an MTP head has one decoder layer, config says {config.num_hidden_layers}")
        h = config.hidden_size
        self.config = config
        self.norms = norms
        self.aux_layers = check_aux_layers(aux_layers)
        self.fc = nn.Linear((len(self.aux_layers) + 1) * h, h, bias=False) if self.aux_layers else None
        self.enorm = RMSNorm(h, config.rms_norm_eps) if norms else None
        self.hnorm = RMSNorm(h, config.rms_norm_eps) if norms else None
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.tp = tp
        self.layer = DecoderLayer(config, tp=tp)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None  # (embed, lm_head)

    @classmethod
    def for_target(cls, target: LlamaModel, norms: bool = True, seed: int = 0,
                   std: float = 0.02, aux_layers: tuple[int, ...] = ()) -> "MTPHead":
        """A randomly initialised, frozen head shaped like one of the target's layers, bound
        to it (`requires_grad_(True).train()` it to train); `fc` (with `aux_layers`) starts as
        the identity on the last layer's hidden state."""
        config = target.config.model_copy(update={"num_hidden_layers": 1})
        check_aux_layers(aux_layers, target.config.num_hidden_layers)
        head = cls(config, norms, aux_layers=aux_layers)
        gen = torch.Generator().manual_seed(seed)
        h = config.hidden_size
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name == "fc.weight":
                    p.zero_()
                    p[:, -h:].copy_(torch.eye(h))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        if target.tp is not None:  # this rank's shard of the head an unsharded target gets
            full, head = head, cls(config, norms, tp=target.tp, aux_layers=aux_layers)
            head.load_tensors(full.state_for_save())
        head = head.to(device=target.device, dtype=target.dtype).requires_grad_(False).eval()
        return head.bind(target)

    def bind(self, target: LlamaModel) -> "MTPHead":
        if target.config.hidden_size != self.config.hidden_size or target.config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"head (hidden {self.config.hidden_size}, vocab {self.config.vocab_size}) does not fit "
                f"target (hidden {target.config.hidden_size}, vocab {target.config.vocab_size})"
            )
        self._shared = (target.embed_tokens.weight, target.lm_head.weight)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.eh_proj.weight.dtype

    def make_kv_cache(self, num_pages: int, page_size: int, device: torch.device | str | None = None,
                      backend=None) -> PagedKVCache:
        return layer_kv_cache(self.layer, num_pages, page_size, device or self.eh_proj.weight.device, backend)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self._weights()[0])

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._shared is None:
            raise RuntimeError("MTPHead is not bound to a target: call head.bind(target) first")
        return self._shared

    def _inputs(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.fc is not None and hidden.shape[-1] != self.config.hidden_size:  # the target's features
            hidden = F.linear(hidden, self.fc.weight)
        e = self.embed(token_ids).to(hidden.dtype)
        if self.norms:
            e, hidden = self.enorm(e), self.hnorm(hidden)
        return F.linear(torch.cat([e, hidden], dim=-1), self.eh_proj.weight)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] head hidden (before the final norm) -> [..., V] float32 logits."""
        return F.linear(self.norm(x), self._weights()[1]).float()

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, step: StepAttention,
                kv: PagedKVCache, positions: torch.Tensor, *,
                logits_indices: torch.Tensor | None = None) -> HeadOutput:
        """Paged step over N packed rows: token_ids [N] (t_{i+1}), hidden [N, H] (H_i or the
        head's own hidden; [N, (A + 1) * H] target features with A `aux_layers`), positions [N]
        (i); logits for rows `logits_indices` (None: all)."""
        (token_ids, n), (hidden, _) = pad_inputs(token_ids, positions), pad_inputs(hidden, positions)
        x = real_rows(run_body(self, step, kv, (token_ids, hidden, positions))[0], n)  # a padded step's pad rows cut
        rows = x if logits_indices is None else x.index_select(0, logits_indices)
        return HeadOutput(self.compute_logits(rows), x)

    def body(self, step: StepAttention, kv: PagedKVCache, token_ids: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor]:
        """The head's layer over a step's rows (what a CUDA graph captures): (its output [N, H],)."""
        x = self._inputs(token_ids, hidden)
        cos, sin = self.rotary(positions, x.dtype)
        return (self.layer(x, cos, sin, step, kv.layers[0], 0),)

    def forward_full(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> HeadOutput:
        """Dense causal pass without a KV cache: token_ids [B, T] (t_1..t_T), hidden [B, T, H]
        (H_0..H_{T-1}) -> logits [B, T, V] for t_2..t_{T+1}, hidden [B, T, H]."""
        positions = torch.arange(token_ids.shape[-1], device=token_ids.device)
        return self.forward_dense(token_ids, hidden, positions, CausalAttention())

    def forward_dense(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      attention) -> HeadOutput:
        """Dense pass with any cache-free attention (`attend(layer_idx, q, k, v, None)` on
        [B, T, heads, D]); token_ids [B, T], hidden [B, T, H], positions [T]."""
        x = self._inputs(token_ids, hidden)
        cos, sin = self.rotary(positions, x.dtype)
        x = self.layer(x, cos, sin, attention, None, 0)
        return HeadOutput(self.compute_logits(x), x)

    # --- weights under checkpoint names ----------------------------------------------------

    def state_for_save(self) -> dict[str, torch.Tensor]:
        """The head's weights under checkpoint names, full size (sharded: a collective)."""
        out = {"eh_proj.weight": self.eh_proj.weight.detach(), "norm.weight": self.norm.weight.detach()}
        if self.fc is not None:
            out["fc.weight"] = self.fc.weight.detach()
        if self.norms:
            out["enorm.weight"] = self.enorm.weight.detach()
            out["hnorm.weight"] = self.hnorm.weight.detach()
        out.update(self.layer.hf_state_dict("layer."))
        return {k: v.contiguous() for k, v in out.items()}

    @staticmethod
    def expected_shapes(config: ModelConfig, norms: bool, aux_layers: tuple[int, ...] = ()) -> dict[str, tuple[int, ...]]:
        h = config.hidden_size
        shapes = {"eh_proj.weight": (h, 2 * h), "norm.weight": (h,)}
        if aux_layers:
            shapes["fc.weight"] = (h, (len(aux_layers) + 1) * h)
        if norms:
            shapes["enorm.weight"] = (h,)
            shapes["hnorm.weight"] = (h,)
        shapes.update({f"layer.{n}": s for n, s in DecoderLayer.hf_shapes(config).items()})
        return shapes

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.eh_proj.weight.copy_(tensors["eh_proj.weight"])
        self.norm.weight.copy_(tensors["norm.weight"])
        if self.fc is not None:
            self.fc.weight.copy_(tensors["fc.weight"])
        if self.norms:
            self.enorm.weight.copy_(tensors["enorm.weight"])
            self.hnorm.weight.copy_(tensors["hnorm.weight"])
        self.layer.load_hf(tensors, "layer.")


def layer_kv_cache(layer: DecoderLayer, num_pages: int, page_size: int, device, backend=None) -> PagedKVCache:
    """A head's one-layer KV cache (its decoder layer's KV heads, this rank's under tensor
    parallelism), in the layer's dtype, as wide per head as `backend` stores (see the target's)."""
    head_dim = layer.head_dim if backend is None else backend.kv_head_dim(layer.head_dim)
    return PagedKVCache(1, num_pages, page_size, layer.num_kv_heads, head_dim, layer.qkv_proj.weight.dtype, device,
                        kv_layout(backend))


def target_fingerprint(target: LlamaModel) -> str:
    """A cheap identity of a target's weights: shapes plus a strided sample of every tensor,
    rounded to bf16 so a float32 and a bfloat16 load of one checkpoint agree. A sharded target
    gives its full model's fingerprint (its layers' shards are gathered: a collective)."""
    h = hashlib.sha256()
    c = target.config
    h.update(json.dumps([c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size,
                         c.num_attention_heads, c.num_key_value_heads, c.head_dim]).encode())
    for name, p in sorted(_full_parameters(target).items()):
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024]
        h.update(name.encode())
        h.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:16]


def _full_parameters(target: LlamaModel) -> dict[str, torch.Tensor]:
    """`target.named_parameters()`, with a sharded target's layer weights gathered and fused."""
    params = dict(target.named_parameters())
    if target.tp is None:
        return params
    for i, layer in enumerate(target.layers):
        t = layer.hf_state_dict()
        a, m = "self_attn.", "mlp."
        params.update({
            f"layers.{i}.qkv_proj.weight": torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"],
                                                      t[a + "v_proj.weight"]]),
            f"layers.{i}.o_proj.weight": t[a + "o_proj.weight"],
            f"layers.{i}.gate_up_proj.weight": torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]]),
            f"layers.{i}.down_proj.weight": t[m + "down_proj.weight"],
        })
    return params


def save_head(head: MTPHead, out_dir: str | Path, target: LlamaModel, **card_fields) -> Path:
    """Write config.json + model.safetensors (float32) for `head`, trained against `target`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = head.config
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "specsched_mtp",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling.model_dump() if c.rope_scaling is not None else None,
        "max_position_embeddings": c.max_position_embeddings,
        # its decoder layer follows the target's family
        "layer_model_type": c.model_type, "qkv_bias": c.qkv_bias, "o_bias": c.o_bias, "qk_norm": c.qk_norm,
        "norms": head.norms, "aux_layers": list(head.aux_layers), "target_fingerprint": target_fingerprint(target),
        "torch_dtype": "float32", **card_fields,
    }
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.float().cpu() for k, v in head.state_for_save().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def load_head_config(path: str | Path) -> tuple[ModelConfig, bool, dict]:
    """(layer config, norms, raw config.json) of a head directory, validated."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"MTP head directory not found: {path}")
    cfg_path, raw = read_config_json(path, "MTP head directory")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: config must be a JSON object")
    archs = raw.get("architectures")
    if archs != [ARCHITECTURE]:
        hint = " (that is a full model; pass it as the target or the draft)" if archs == ["LlamaForCausalLM"] else ""
        raise CheckpointError(f"{cfg_path}: architectures must be [{ARCHITECTURE!r}], got {archs!r}{hint}")
    norms = raw.get("norms")
    if not isinstance(norms, bool):
        raise CheckpointError(f"{cfg_path}: field 'norms' must be true or false, got {norms!r}")
    fields = {k: v for k, v in raw.items() if k in ModelConfig.model_fields and v is not None
              and k not in ("model_type", "sliding_window")}
    fields["model_type"] = raw.get("layer_model_type", "llama")  # the head's own model_type names the head
    if "head_dim" not in fields and "hidden_size" in fields and "num_attention_heads" in fields:
        fields["head_dim"] = int(fields["hidden_size"]) // int(fields["num_attention_heads"])
    fields.setdefault("num_key_value_heads", fields.get("num_attention_heads"))
    fields["num_hidden_layers"] = 1
    try:
        config = ModelConfig.model_validate(fields)
    except Exception as exc:  # pydantic ValidationError: name the fields
        errors = getattr(exc, "errors", lambda: [])()
        msg = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in errors) or str(exc)
        raise CheckpointError(f"{cfg_path}: invalid MTP head config: {msg}") from None
    try:
        check_aux_layers(raw.get("aux_layers", []))
    except ValueError as exc:
        raise CheckpointError(f"{cfg_path}: field {exc}") from None
    return config, norms, raw


def check_aux_layers(aux_layers, num_target_layers: int | None = None) -> tuple[int, ...]:
    """`aux_layers` as a tuple; ValueError unless it is a list of increasing layer indices
    >= 0 and, given the target's layer count, each a layer before its last (whose output is
    always read)."""
    ok = isinstance(aux_layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                       for i in aux_layers)
    if not ok or list(aux_layers) != sorted(set(aux_layers)) or any(i < 0 for i in aux_layers):
        raise ValueError(f"'aux_layers' must be a list of increasing layer indices >= 0, got {aux_layers!r}")
    bad = [] if num_target_layers is None else [i for i in aux_layers if i >= num_target_layers - 1]
    if bad:
        raise ValueError(f"aux_layers {bad} are not layers before the target's last "
                         f"(it has {num_target_layers}: 0..{num_target_layers - 2} qualify)")
    return tuple(aux_layers)


def load_head(path: str | Path, target: LlamaModel, *, check_target: bool = True) -> MTPHead:
    """Load a head directory and bind it to `target` (in the target's dtype and device).
    With `check_target`, a head trained for another target (fingerprint) is refused."""
    path = Path(path)
    config, norms, raw = load_head_config(path)
    cfg_path = path / CONFIG_FILE
    for name in _SHARED_FIELDS:
        mine, theirs = getattr(config, name), getattr(target.config, name)
        if mine != theirs:
            raise CheckpointError(f"{cfg_path}: {name} {mine} does not match the target's {theirs}")
    if check_target and raw.get("target_fingerprint") is not None:
        want, have = raw["target_fingerprint"], target_fingerprint(target)
        if want != have:
            raise CheckpointError(
                f"{cfg_path}: head was trained for target {want}, this target is {have}; "
                "train a head for it (specsched train-mtp) or load with check_target=False"
            )
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"missing weights {WEIGHTS_FILE} in MTP head directory {path}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {weights}: {exc}") from None
    check_finite(tensors, weights)
    try:
        aux_layers = check_aux_layers(raw.get("aux_layers", []), target.config.num_hidden_layers)
    except ValueError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None
    expected = MTPHead.expected_shapes(config, norms, aux_layers)
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"missing tensor {name!r} in {weights} (expected shape {shape})")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"shape mismatch for tensor {name!r} in {weights}: checkpoint has "
                                  f"{tuple(tensors[name].shape)}, config.json implies {shape}")
    for name in tensors:
        if name not in expected:
            why = " (norms is false in config.json)" if name in ("enorm.weight", "hnorm.weight") else \
                " (config.json has no aux_layers)" if name == "fc.weight" else ""
            raise CheckpointError(f"unexpected tensor {name!r} in {weights}{why}")
    head = MTPHead(config, norms, tp=target.tp, aux_layers=aux_layers)
    head.load_tensors(tensors)
    head = head.to(device=target.device, dtype=target.dtype).requires_grad_(False).eval()
    return head.bind(target)
