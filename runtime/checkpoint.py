"""Load (and write) a Llama checkpoint in Hugging Face layout (config.json + safetensors).

Why: models must load offline, fast and safely: safetensors only (never pickle), every tensor
checked against the config -- and for NaN/inf, which would otherwise load silently and
generate token 0 forever -- before any is used, and each failure names the file and tensor
so a broken checkpoint is fixed in one look. Sharded checkpoints
(`model.safetensors.index.json`) are read shard by shard.

Tensor parallel loading (`tp`): each rank reads only its slices of the sharded tensors
(`safe_open(...).get_slice(name)[rows]`), so no rank ever holds a full copy of a sharded
weight. Every tensor's full shape is checked from the file's header before any slice is read;
the NaN/inf check covers what a rank reads, and a rank's failure fails the load on all ranks
(a rank left behind would otherwise hang in the first forward's collective).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specsched.runtime.config import ConfigError, ModelConfig
from specsched.runtime.model import LlamaModel
from specsched.runtime.parallel import TPGroup, check_tp_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # stale buffers some older checkpoints carry


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def read_config_json(folder: Path, what: str = "") -> tuple[Path, dict]:
    """(path, settings) of `folder/config.json`; CheckpointError naming the file if it is
    missing, unreadable or not a JSON object. `what` names the folder in the message (e.g.
    "MTP head directory")."""
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"missing {CONFIG_FILE} in {what + ' ' if what else ''}{folder}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {cfg_path}: {exc}") from None
    if not isinstance(raw, dict):
        kind = "null" if raw is None else type(raw).__name__
        raise CheckpointError(f"{cfg_path}: expected a JSON object of model settings, got {kind}")
    return cfg_path, raw


def check_finite(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """CheckpointError naming `file` and the first tensor holding NaN or +-inf.

    A tensor's sum is NaN or inf whenever one of its elements is (and, rarely, when finite
    values overflow), so one sum per tensor screens it -- ~3 ms for the bundled target, a
    fifth of an `isfinite` pass -- and only a tensor it flags is counted element by element.
    """
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t.sum())):
            bad = t.numel() - int(torch.isfinite(t).sum())
            if bad:
                raise CheckpointError(f"{file}: tensor {name} has {bad} non-finite values "
                                      "(NaN or inf)")


def load_config(path: str | Path) -> ModelConfig:
    path = _model_dir(path)
    cfg_path, raw = read_config_json(path)
    try:
        return ModelConfig.from_hf(raw)
    except ConfigError as exc:
        raise CheckpointError(f"unsupported config in {cfg_path}: {exc}") from None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", tp: TPGroup | None = None) -> LlamaModel:
    """Read config and weights from a model directory; returns a frozen, eval-mode model.
    With `tp`, this rank's shard of it (every rank of the group must call this)."""
    path = _model_dir(path)
    config = load_config(path)
    if tp is None:
        tensors = _read_tensors(path, config)
    else:
        try:
            check_tp_config(config, tp.size)
        except ValueError as exc:
            raise CheckpointError(f"{path / CONFIG_FILE}: {exc}") from None
        shards = LlamaModel.hf_shards(config, tp)
        tensors = _agree(tp, device, path, lambda: _read_tensors(path, config, shards))
    model = LlamaModel(config, device=device, dtype=dtype, tp=tp)
    model.load_hf(tensors)
    return model.requires_grad_(False).eval()


def _agree(tp: TPGroup, device, path: Path, read):
    """read() on every rank; if it failed on any rank, fail on all of them."""
    try:
        result, error = read(), None
    except CheckpointError as exc:
        result, error = None, exc
    failed = tp.all_reduce(torch.tensor([error is not None], dtype=torch.int64, device=device))
    if error is not None:
        raise error
    if int(failed.item()):
        raise CheckpointError(f"cannot load {path}: it failed on another tensor-parallel rank "
                              "(that rank's error names the problem)")
    return result


def _model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model directory not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"model path is not a directory: {path}")
    return path


def _weight_files(path: Path) -> dict[Path, list[str] | None]:
    """Shard file -> tensor names it should hold (None: whatever the single file holds)."""
    single, index = path / WEIGHTS_FILE, path / INDEX_FILE
    if single.is_file():
        return {single: None}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read weight_map from {index}: {exc!r}") from None
        shards: dict[Path, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(path / shard, []).append(name)
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"missing shard file {shard.name} listed in {index}")
        return shards
    pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    hint = f" (found {', '.join(pickled)}: only safetensors are loaded)" if pickled else ""
    raise CheckpointError(f"missing weights: neither {WEIGHTS_FILE} nor {INDEX_FILE} in {path}{hint}")


def _read_tensors(path: Path, config: ModelConfig,
                  shards: dict[str, tuple[int, slice]] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a model checkpoint (`read_checked` against `LlamaModel.hf_shapes`); with
    `shards` (name -> (dim, slice), see `LlamaModel.hf_shards`) only those slices of the named
    tensors are read."""
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return read_checked(path, LlamaModel.hf_shapes(config), optional, shards)


def read_checked(path: Path, expected: dict[str, tuple[int, ...]], optional: set[str] = frozenset(),
                 shards: dict[str, tuple[int, slice]] | None = None, what: str = "a Llama model"
                 ) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint in `path` (one file or a sharded index), each
    checked by name and shape against `expected` (from the file header, before it is read) and
    for NaN/inf; a tensor of `expected` not in `optional` must be there. `what` names the
    checkpoint's kind in the error for an unexpected tensor."""
    tensors: dict[str, torch.Tensor] = {}
    for file, names in _weight_files(path).items():
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                if names is not None:
                    absent = [n for n in names if n not in keys]
                    if absent:
                        raise CheckpointError(
                            f"missing tensor {absent[0]!r} in shard {file.name} (listed in {INDEX_FILE})"
                        )
                    keys = names
                shard = {}
                for name in keys:
                    part = f.get_slice(name)
                    _check_shape(name, tuple(part.get_shape()), expected, path, what)
                    spec = shards.get(name) if shards else None
                    if spec is None:
                        shard[name] = f.get_tensor(name)
                    else:
                        shard[name] = part[spec[1]] if spec[0] == 0 else part[:, spec[1]]
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from None
        check_finite(shard, file)
        tensors.update(shard)
    for name, shape in expected.items():
        if name not in tensors and name not in optional:
            raise CheckpointError(f"missing tensor {name!r} in {path} (expected shape {shape})")
    return tensors


def _check_shape(name: str, got: tuple[int, ...], expected: dict[str, tuple[int, ...]], path: Path,
                 what: str) -> None:
    if name not in expected:
        if name.endswith(IGNORED_SUFFIXES):
            return
        raise CheckpointError(f"unexpected tensor {name!r} in {path} (not part of {what})")
    if got != expected[name]:
        raise CheckpointError(
            f"shape mismatch for tensor {name!r} in {path}: checkpoint has {got}, "
            f"config.json implies {expected[name]}"
        )


def save_llama(model, out_dir) -> None:
    """Write a LlamaModel as a Hugging Face checkpoint (config.json + model.safetensors) of its
    family (Llama, Mistral, Qwen2, Qwen3), the layout `load_model` and transformers read."""
    from safetensors.torch import save_file

    from specsched.runtime.config import ARCHITECTURES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = model.config
    arch = next(a for a, t in ARCHITECTURES.items() if t == c.model_type)
    cfg = {"architectures": [arch], "hidden_act": "silu", "attention_bias": c.o_bias,
           **c.model_dump(exclude={"rope_scaling", "torch_dtype", "qkv_bias", "o_bias", "qk_norm"}),
           "torch_dtype": "float32"}
    if c.rope_scaling is not None:
        cfg["rope_scaling"] = c.rope_scaling.model_dump()
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.float().contiguous() for k, v in model.hf_state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
