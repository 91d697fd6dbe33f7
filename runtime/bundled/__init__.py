"""Where the bundled tiny model family lives, so the default runs anywhere with no download.

The files (HF layout: config.json, model.safetensors, tokenizer.json, model card README.md)
are produced by `specsched train-models` (the tokenizer, target and draft by
runtime/training/bundled.py, the MTP head in `mtp/` by runtime/training/mtp.py on top of the
target); each card gives the exact command of the shipped run.
"""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent
MAX_BUNDLE_BYTES = 40 * 1024 * 1024  # all bundled files together stay under this


def target_dir() -> Path:
    """12-layer target model directory."""
    return BUNDLED_DIR / "target"


def draft_dir() -> Path:
    """1-layer draft distilled from the target."""
    return BUNDLED_DIR / "draft"


def mtp_dir() -> Path:
    """MTP head trained on the target (may be absent until it is trained)."""
    return BUNDLED_DIR / "mtp"


def workload_path() -> Path:
    """Default workload: one {"prompt": str, "max_tokens": int} JSON object per line."""
    return BUNDLED_DIR / "workload.jsonl"


def transition_workload_path() -> Path:
    """The bundled workload's 64 requests in four phases of 16 whose synthetic acceptance
    alternates low, high, low, high (`synthetic_acceptance_rates` on each line: [0.5], an
    acceptance length of 1.5, and [1, 1, 0.5], 3.5 at any draft length >= 3; rates rather than
    lengths, so that every draft length can run it): what an adaptive draft length must follow,
    under an engine with synthetic acceptance. Made from workload.jsonl by adding that key to
    line i: the low rates if (i // 16) is even, else the high ones."""
    return BUNDLED_DIR / "transition.jsonl"


def tokenizer_path(model_dir: Path | None = None) -> Path:
    """tokenizer.json of a bundled model directory (default: the target's)."""
    return (model_dir or target_dir()) / "tokenizer.json"


def bundle_bytes() -> int:
    """Total size of the bundled data files (Python sources excluded)."""
    return sum(p.stat().st_size for p in BUNDLED_DIR.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc"))
