"""Published model shapes as config files alone (no weights), for dummy weights
(`EngineConfig(load_format="dummy")`, CLI `--load-format dummy`): targets shaped like
Llama-3.2-1B, Llama-3.1-8B, Qwen3-8B and Qwen2.5-7B, and a one-layer draft model and an MTP head
of each (`<shape>-draft`, `<shape>-mtp`, layers of the target's family). With dummy weights a model, draft or head named by one of
these folder names (e.g. `--model llama-3.2-1b`) reads its config.json here.
"""

from __future__ import annotations

from pathlib import Path

SHAPES_DIR = Path(__file__).resolve().parent
SHAPES = tuple(sorted(p.name for p in SHAPES_DIR.iterdir() if (p / "config.json").is_file()))


def shape_dir(name: str) -> Path | None:
    """The folder of shipped shape `name` (None if there is no such shape)."""
    return SHAPES_DIR / name if name in SHAPES else None
