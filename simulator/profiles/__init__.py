"""Cost profiles shipped with specsched, by name: fitted from traces of production-shaped models
on GPUs (`benchmarks/gpu_shapes.py --out DIR` writes them as `<gpu>-<shape>.json`, e.g.
`h100-llama-3.1-8b.json`), so that `specsched replay/ab/tune --profile h100-llama-3.1-8b` prices
a workload at that deployment's costs on a machine without a GPU. A profile file elsewhere is
named by its path."""
from __future__ import annotations

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent


def shipped() -> tuple[str, ...]:
    """The names of the shipped profiles."""
    return tuple(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))


def profile_path(name_or_path: str | Path) -> Path:
    """A profile's file: `name_or_path` where it is a file, else the shipped profile of that name;
    ValueError naming both and the shipped profiles otherwise."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if str(name_or_path) in shipped():
        return PROFILES_DIR / f"{name_or_path}.json"
    names = ", ".join(shipped()) or "none yet"
    raise ValueError(f"{name_or_path}: no such cost profile file, nor a shipped profile of that name "
                     f"(shipped: {names})")
