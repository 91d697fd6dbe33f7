"""Model configuration read from a Hugging Face `config.json`.

Why: the runtime implements one decoder (RMSNorm, RoPE, GQA, SwiGLU) and the small ways the
families people run differ from Llama: Qwen2 / Qwen2.5 add biases to the q/k/v projections,
Qwen3 normalises each query and key head (RMSNorm over `head_dim`, which need not be
width / heads) before RoPE, Mistral is Llama's layer with an optional sliding window. These
are fields of one `ModelConfig` (`qkv_bias`, `o_bias`, `qk_norm`, `sliding_window`), read from
each family's config.json, not copies of the model. Anything outside them fails at load time,
naming the field, instead of producing silently wrong logits. Both the classic layout
(`rope_theta`, `rope_scaling`, `torch_dtype`) and the transformers 5 layout (`rope_parameters`,
`dtype`) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

# architecture -> model_type
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES.values())


class ConfigError(ValueError):
    """A config.json the runtime cannot serve; the message names the field."""


class RopeScaling(BaseModel):
    """Llama 3 frequency-dependent RoPE scaling (the only scaling supported)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    rope_type: Literal["llama3"] = "llama3"
    factor: float  # wavelength stretch for low frequencies
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int  # context length the model was pre-trained on


class ModelConfig(BaseModel):
    """The fields of a `config.json` the runtime uses."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_type: Literal["llama", "mistral", "qwen2", "qwen3"] = "llama"
    qkv_bias: bool = False  # biases on q/k/v (Qwen2 always; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # a bias on the output projection (Llama/Qwen3 with attention_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head before RoPE (Qwen3)
    sliding_window: int | None = None  # attention window (Mistral; Qwen with use_sliding_window)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # per attention head; defaults to hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"  # dtype the checkpoint was saved in

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelConfig":
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        return self

    def check_servable(self, max_len: int) -> None:
        """ConfigError naming `sliding_window` if the model attends within a window shorter than
        the `max_len` positions it would be served at (the attention backends attend to every
        position)."""
        if self.sliding_window is not None and self.sliding_window < max_len:
            raise ConfigError(
                f"sliding_window {self.sliding_window} is shorter than the {max_len} positions the engine "
                "would serve, and the attention does not implement a sliding window (a checkpoint whose "
                "config sets sliding_window null, or at least max_position_embeddings, is served; or serve it with "
                "max_model_len at most the window)")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Validate a parsed HF config.json; raises ConfigError naming the offending field."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = _check_architecture(raw)
        if raw.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported (bias-free MLPs only)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")
        fields = dict(raw)
        fields.update(_family_fields(raw, model_type))
        rope_theta, scaling = _rope_fields(raw)
        fields["rope_theta"] = rope_theta
        fields["rope_scaling"] = scaling
        if fields.get("head_dim") is None and "hidden_size" in raw and "num_attention_heads" in raw:
            try:
                fields["head_dim"] = int(raw["hidden_size"]) // int(raw["num_attention_heads"])
            except (TypeError, ValueError, ZeroDivisionError):
                pass
        if fields.get("num_key_value_heads") is None:
            fields["num_key_value_heads"] = raw.get("num_attention_heads")
        fields["torch_dtype"] = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        fields = {k: v for k, v in fields.items() if v is not None or k in ("rope_scaling",)}
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None


def _check_architecture(raw: dict[str, Any]) -> str:
    """The config's model_type (one of SUPPORTED_MODEL_TYPES), or ConfigError naming the field."""
    archs = raw.get("architectures")
    model_type = raw.get("model_type")
    if archs:
        bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if bad:
            raise ConfigError(
                f"unsupported architecture {bad[0]!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return ARCHITECTURES[archs[0]]
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r} and no architectures field "
            f"(supported: model_type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))})"
        )
    return model_type


def _family_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """What a family's config.json says in its own words, as ModelConfig's fields."""
    bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window they do not use unless asked to
    if model_type == "qwen2":  # Qwen2 / Qwen2.5: q/k/v biases, none on the output projection
        return {"model_type": model_type, "qkv_bias": True, "o_bias": False, "sliding_window": window}
    return {"model_type": model_type, "qkv_bias": bias, "o_bias": bias, "qk_norm": model_type == "qwen3",
            "sliding_window": window if model_type != "llama" else None}


def _rope_fields(raw: dict[str, Any]) -> tuple[Any, RopeScaling | None]:
    """(rope_theta, scaling) from either `rope_parameters` or `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (only 'llama3' or none)")
    try:
        return theta, RopeScaling.model_validate({**scaling, "rope_type": "llama3"})
    except ValidationError as exc:
        raise ConfigError("rope_scaling: " + _describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        parts.append(f"{loc}: {err['msg']}")
    return "invalid config field " + "; ".join(parts)
