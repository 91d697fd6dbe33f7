"""Dummy weights (vLLM's and SGLang's `--load-format dummy`): a model of any published shape
from its config.json alone, random and seeded, created on the device in the configured dtype.

Why: to measure speed at a production shape without its checkpoint -- the tokens it generates
mean nothing (benchmarks run with `ignore_eos`). Each parameter is filled in place on the device
(`normal_` with a generator seeded from the seed and the parameter's name: the same values on
every tensor-parallel rank where a tensor is replicated), so the model never exists on the host
and the peak memory is the weights'. Norm weights are 1, everything else N(0, 0.02).
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch
from torch import nn

from specsched.runtime.checkpoint import CheckpointError, load_config, load_model
from specsched.runtime.model import LlamaModel
from specsched.runtime.mtp_head import MTPHead, check_aux_layers, load_head, load_head_config
from specsched.runtime.parallel import TPGroup, check_tp_config

STD = 0.02


@torch.no_grad()
def fill_random_(module: nn.Module, seed: int = 0, std: float = STD) -> nn.Module:
    """Every parameter of `module` random in place, on its own device and in its dtype."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        gen = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
        p.normal_(0.0, std, generator=gen)
    return module


def dummy_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                tp: TPGroup | None = None, seed: int = 0) -> LlamaModel:
    """A frozen, eval-mode model of the shape `path/config.json` gives, with dummy weights."""
    config = load_config(path)
    if tp is not None:
        try:
            check_tp_config(config, tp.size)
        except ValueError as exc:
            raise CheckpointError(f"{Path(path) / 'config.json'}: {exc}") from None
    model = LlamaModel(config, device=device, dtype=dtype, tp=tp)
    return fill_random_(model, seed).requires_grad_(False).eval()


def dummy_head(path: str | Path, target: LlamaModel, seed: int = 0) -> MTPHead:
    """An MTP (or EAGLE) head of the shape `path/config.json` gives, with dummy weights, bound
    to `target` (whose width it must have)."""
    config, norms, raw = load_head_config(path)
    if config.hidden_size != target.config.hidden_size or config.vocab_size != target.config.vocab_size:
        raise CheckpointError(f"{Path(path) / 'config.json'}: hidden_size {config.hidden_size} / vocab_size "
                              f"{config.vocab_size} do not match the target's {target.config.hidden_size} / "
                              f"{target.config.vocab_size}")
    try:
        aux = check_aux_layers(raw.get("aux_layers", []), target.config.num_hidden_layers)
    except ValueError as exc:
        raise CheckpointError(f"{Path(path) / 'config.json'}: {exc}") from None
    with torch.device(target.device):
        head = MTPHead(config, norms, tp=target.tp, aux_layers=aux)
    head = fill_random_(head.to(dtype=target.dtype), seed)
    return head.requires_grad_(False).eval().bind(target)


def load(path: str | Path, load_format: str, dtype: torch.dtype, device: torch.device | str,
         tp: TPGroup | None = None) -> LlamaModel:
    """A target or draft model: the checkpoint's weights, or with `load_format="dummy"` its shape alone."""
    if load_format == "dummy":
        return dummy_model(path, dtype=dtype, device=device, tp=tp)
    return load_model(path, dtype=dtype, device=device, tp=tp)


def load_head_for(path: str | Path, target: LlamaModel, load_format: str):
    """An MTP (or EAGLE) head bound to `target`: the checkpoint's, or with `load_format="dummy"` its
    shape alone; an EAGLE-3 head in its published layout (runtime/eagle3.py) where config.json
    names `LlamaForCausalLMEagle3`."""
    from specsched.runtime.eagle3 import is_eagle3, load_eagle3_head

    if is_eagle3(path):
        return load_eagle3_head(path, target, dummy=load_format == "dummy")
    return dummy_head(path, target) if load_format == "dummy" else load_head(path, target)
