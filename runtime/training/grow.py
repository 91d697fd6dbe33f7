"""Growing a trained target deeper: `deepen` (the same function at step 0; bundled.train_target
trains it on), bf16 storage (`round_to_bf16`) and what `train-models --grow-from` starts from
(`grow_plan`).

Why: on a CPU the target's depth sets what a one-layer proposer costs against it, and a deeper
target grown from a trained one reaches the shallower one's loss at once, where one trained from
scratch needs hours on two cores (bundled.py trains the family; this module is the growth).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

GROW_LR = 1e-3  # peak learning rate when continuing a grown target (3e-3 trains one from scratch)


def deepen(source, config):
    """A deeper copy of a trained target that computes exactly the same function: with m =
    config's layers / the source's, source layer k becomes layers m*k .. m*k+m-1, the first a
    copy of it and the others copies whose residual outputs (attention o_proj, MLP down_proj)
    are zero, so they add nothing until trained (function-preserving growth, as Net2Net's
    identity layers). The residual stream after layer m*k+m-1 is the source's after layer k,
    so heads that read a source layer's output read that layer of the grown target."""
    from transformers import LlamaForCausalLM

    src = source.config
    layers = config.num_hidden_layers
    if config.hidden_size != src.hidden_size or layers % src.num_hidden_layers:
        raise ValueError(f"cannot grow a {src.num_hidden_layers}x{src.hidden_size} target to "
                         f"{layers}x{config.hidden_size}: the width must match and the depth be a multiple")
    m = layers // src.num_hidden_layers
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
        model.model.norm.weight.copy_(source.model.norm.weight)
        for i, layer in enumerate(model.model.layers):
            layer.load_state_dict(source.model.layers[i // m].state_dict())
            if i % m:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return model


def checkpoint_layers(path: str | Path) -> int:
    """The decoder layers of the checkpoint in `path` (its config.json), without loading it."""
    return json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]


@dataclass(frozen=True)
class GrowPlan:
    """What `train-models --grow-from FAMILY` starts from: the family's target (deepened), its
    draft and MTP head (continued), and the grown target's layers that hold the features the
    head read (the last of each source layer's copies, see `deepen`)."""

    target: Path
    draft: Path
    head: Path
    aux_layers: tuple[int, ...]


def grow_plan(family: str | Path, layers: int, draft_layers: int | None = None) -> GrowPlan:
    """Check that `family` (target/, draft/, mtp/) can grow to `layers` layers (and its draft to
    `draft_layers`); ValueError naming what is missing or does not fit."""
    family = Path(family)
    dirs = {name: family / name for name in ("target", "draft", "mtp")}
    for name, d in dirs.items():
        if not (d / "config.json").is_file():
            raise ValueError(f"--grow-from {family}: no {name} model ({d / 'config.json'} is missing)")
    src = checkpoint_layers(dirs["target"])
    if layers % src:
        raise ValueError(f"--grow-from {family}: its target has {src} layers, and {layers} is not a multiple of it")
    m = layers // src
    src_draft = checkpoint_layers(dirs["draft"])
    if draft_layers is not None and draft_layers % src_draft:
        raise ValueError(f"--grow-from {family}: its draft has {src_draft} layer(s), and {draft_layers} is not a "
                         "multiple of it")
    aux = json.loads((dirs["mtp"] / "config.json").read_text()).get("aux_layers") or []
    return GrowPlan(dirs["target"], dirs["draft"], dirs["mtp"], tuple(a * m + m - 1 for a in aux))


def round_to_bf16(model) -> None:
    """Round the weights to bf16 values in place (kept in fp32): what `save_model(bf16=True)`
    writes, so the models trained against this one see exactly the shipped weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
