"""vLLM's `speculative_config` read onto `EngineConfig` fields (`EngineConfig(speculative_config=...)`,
CLI `--speculative-config JSON`): a configuration written for vLLM runs here unchanged."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specsched.traces.names import ProposerKind

# vLLM's `speculative_config`: its method names, and its keys onto these fields
VLLM_METHODS = {"draft_model": ProposerKind.DRAFT.value, "mtp": ProposerKind.MTP.value,
                "eagle": ProposerKind.EAGLE.value, "eagle3": ProposerKind.EAGLE.value,
                "ngram": ProposerKind.NGRAM.value}
VLLM_KEYS = {"num_speculative_tokens": "draft_len", "prompt_lookup_min": "ngram_min",
             "prompt_lookup_max": "ngram_max", "synthetic_acceptance_length": "synthetic_acceptance_length",
             "synthetic_acceptance_rates": "synthetic_acceptance_rates"}


def speculative_fields(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The `EngineConfig` fields vLLM's `speculative_config` dict means; ValueError naming a key
    or value it does not support."""
    known = set(VLLM_KEYS) | {"method", "model", "rejection_sample_method"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"speculative_config: unsupported key {unknown[0]!r} (supported: {', '.join(sorted(known))})")
    method = spec.get("method")
    if method is None and spec.get("model") is not None:
        method = "draft_model"  # vLLM's reading of a model without a method
    if isinstance(method, str) and method.endswith("_mtp"):
        method = "mtp"  # vLLM reads its model-specific MTP names (deepseek_mtp, qwen3_next_mtp, ...) as mtp
    if method is not None and method not in VLLM_METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not one of {', '.join(VLLM_METHODS)}")
    # without a method (and model) the configuration's own proposer speculates (e.g. only synthetic acceptance set)
    out: dict[str, Any] = {} if method is None else {"proposer": VLLM_METHODS[method]}
    out.update({VLLM_KEYS[k]: v for k, v in spec.items() if k in VLLM_KEYS})
    if spec.get("model") is not None:
        out["draft" if method == "draft_model" else "mtp_head"] = spec["model"]
    sampler = spec.get("rejection_sample_method")
    if sampler is not None:
        if sampler not in ("standard", "synthetic"):
            raise ValueError(f"speculative_config: rejection_sample_method {sampler!r} is not 'standard' or 'synthetic'")
        out["acceptance"] = "lossless" if sampler == "standard" else "synthetic"
    return out
