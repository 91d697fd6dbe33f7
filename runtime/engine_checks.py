"""The engine's start-up checks: a configuration no request could be served under is the user's
input error, named before anything loads or starts.

Why a module of its own: these rules (checkpoint folders, device, tokenizers, tensor-parallel
shapes, the smallest request's positions and pages, the adaptive policy's cost profile) are read
once per engine and each names its own problem; the engine only needs their results.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import orjson

from specsched.runtime.engine_config import EngineConfig
from specsched.runtime.tokenizer import Tokenizer
from specsched.scheduler.scheduler import SchedulerConfig, max_pages_needed
from specsched.scheduler.errors import ConfigurationError
from specsched.scheduler.proposer import RULES


class EngineSetup(NamedTuple):
    tokenizer: Tokenizer  # the target's
    max_model_len: int  # EngineConfig.max_model_len, or the target's max_position_embeddings
    seed_costs: dict | None  # the adaptive draft length's cost profile (`draft_profile`), checked
    vocab_size: int  # the target's: the token ids a prompt may hold


def check_engine(c: EngineConfig, model_dir: str, proposer_dir: str | None,
                 scheduler: SchedulerConfig) -> EngineSetup:
    """Every start-up check, in the order a user would fix them; returns what they read."""
    from specsched.runtime.checkpoint import load_config

    check_inputs(c, model_dir, proposer_dir)
    tok = tokenizer(c, model_dir)
    if c.load_format != "dummy":
        check_tokenizers(c, model_dir, proposer_dir, tok)
    config = load_config(model_dir)
    max_len = config.max_position_embeddings
    if c.max_model_len is not None:
        if c.max_model_len > max_len:
            raise ConfigurationError(f"max_model_len {c.max_model_len} exceeds the model's max_position_embeddings "
                                     f"{max_len} ({model_dir})")
        max_len = c.max_model_len
    check_attention_window(c, config, max_len, model_dir, proposer_dir)
    check_smallest_request_fits(c, model_dir, max_len, scheduler)
    check_tensor_parallel(c, model_dir)
    return EngineSetup(tok, max_len, draft_profile(c), config.vocab_size)


def check_attention_window(c: EngineConfig, target, max_len: int, model_dir: str, proposer_dir: str | None) -> None:
    """A model with a sliding window shorter than the context served (`max_len` positions): the attention attends to
    every position, so it would compute other logits than the model's past the window."""
    from specsched.runtime.checkpoint import load_config
    from specsched.runtime.config import ConfigError

    configs = [("model", model_dir, target)]
    if proposer_dir is not None and RULES[c.proposer].checkpoint == "draft":
        configs.append(("draft", proposer_dir, load_config(proposer_dir)))
    for option, path, config in configs:
        try:
            config.check_servable(max_len)
        except ConfigError as e:
            raise ConfigurationError(f"{option} {path}: {e}") from None


def tokenizer(c: EngineConfig, model_dir: str) -> Tokenizer:
    """The target's tokenizer; with dummy weights and none beside the config, the bundled one
    (its text is meaningless anyway: token ids it does not know decode to nothing)."""
    if c.load_format == "dummy" and not (Path(model_dir) / "tokenizer.json").is_file():
        from specsched.runtime import bundled

        return Tokenizer(str(bundled.target_dir()))
    return Tokenizer(model_dir)


def check_inputs(c: EngineConfig, model_dir: str, proposer_dir: str | None) -> None:
    """Checkpoint folders that are not there and a device this machine lacks."""
    for option, path in (("model", model_dir), (RULES[c.proposer].checkpoint, proposer_dir)):
        if path is not None and not Path(path).is_dir():
            what = "not a folder" if Path(path).exists() else "folder not found"
            raise ConfigurationError(f"{option} {path}: {what} (expected a checkpoint folder "
                                     "with config.json and model.safetensors)")
    if c.device == "cuda":
        from specsched.runtime.devices import cuda_available

        if not cuda_available():
            raise ConfigurationError("device 'cuda': this machine has no usable CUDA device "
                                     "(torch.cuda.is_available() is False); use device 'host'")


def check_tokenizers(c: EngineConfig, model_dir: str, proposer_dir: str | None, tok: Tokenizer) -> None:
    if RULES[c.proposer].checkpoint != "draft":
        return  # only a draft model has a vocabulary of its own
    if Tokenizer(proposer_dir).fingerprint() != tok.fingerprint():
        raise ConfigurationError(
            f"draft {proposer_dir} and target {model_dir} use different tokenizers; speculative "
            "decoding needs the same vocabulary"
        )


def draft_profile(c: EngineConfig) -> dict | None:
    """The adaptive draft length's seed: a cost profile's JSON."""
    path = c.draft_profile
    if path is None:
        return None
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise ConfigurationError(f"draft_profile {path}: not a readable cost profile: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("device"), dict):
        raise ConfigurationError(f"draft_profile {path}: not a cost profile (no 'device' models)")
    return data


def check_tensor_parallel(c: EngineConfig, model_dir: str) -> None:
    """A target (or head) whose heads or MLP do not split over the ranks, before any rank starts."""
    if c.tensor_parallel_size == 1:
        return
    from specsched.runtime.checkpoint import load_config
    from specsched.runtime.parallel import check_tp_config

    try:
        check_tp_config(load_config(model_dir), c.tensor_parallel_size)
    except ValueError as e:
        raise ConfigurationError(f"model {model_dir}: {e}") from None


def check_smallest_request_fits(c: EngineConfig, model_dir: str, max_len: int, scheduler: SchedulerConfig) -> None:
    """Reject a config under which no request at all could be served (e.g. a draft length
    near the model's context), instead of rejecting every request with a request error.
    The smallest request has one prompt and one output token; `AsyncEngine.validate` sizes it."""
    spec = c.proposer_spec()
    n = spec.num_candidates
    what = f"the {c.proposer} tree's {n} nodes" if spec.is_tree else f"draft_len {c.longest_draft_len}"
    need = 1 + 1 + n + 1
    if need > max_len:
        raise ConfigurationError(
            f"{what} is too long for the model: even a 1-token prompt with max_tokens 1 needs "
            f"{need} positions, and {model_dir} has max_position_embeddings {max_len}"
        )
    pages = max_pages_needed(scheduler, c.page_size, 1, 1)
    if pages > c.num_pages:
        raise ConfigurationError(
            f"num_pages ({c.num_pages}) cannot hold even the smallest request, which needs "
            f"{pages} pages of {c.page_size} tokens with {what}"
        )
