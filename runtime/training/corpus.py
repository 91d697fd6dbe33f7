"""The offline training corpus: the running interpreter's standard-library `.py` sources.

Why: every machine that runs specsched already has these files, so the bundled models can be
retrained anywhere with no download. Test folders are left out (large, repetitive fixtures),
and a held-out split is taken by file, so evaluation text never shares a file with training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIR_NAMES = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
)
HELDOUT_MODULUS = 20  # one file in 20, chosen by path hash, is held out


@dataclass(frozen=True)
class SourceFile:
    rel_path: str  # posix path relative to the stdlib root
    text: str  # decoded source (utf-8, undecodable bytes replaced)


@dataclass(frozen=True)
class Corpus:
    root: str  # stdlib root the files came from
    train: tuple[SourceFile, ...]  # sorted by rel_path
    heldout: tuple[SourceFile, ...]  # sorted by rel_path

    def num_bytes(self, split: str) -> int:
        return sum(len(f.text.encode()) for f in self._split(split))

    def _split(self, split: str) -> tuple[SourceFile, ...]:
        if split not in ("train", "heldout"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'heldout'")
        return self.train if split == "train" else self.heldout


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(rel_path: str) -> bool:
    parts = rel_path.split("/")
    if any(p in EXCLUDED_DIR_NAMES for p in parts[:-1]):
        return True
    return parts[-1].startswith("test_")


def is_heldout(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def list_sources(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the corpus files under `root` (default: the stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    return sorted(r for r in rels if not is_excluded(r))


def load_corpus(root: Path | None = None) -> Corpus:
    root = Path(root) if root is not None else stdlib_root()
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    for rel in list_sources(root):
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        (heldout if is_heldout(rel) else train).append(SourceFile(rel, text))
    if not train or not heldout:
        raise ValueError(f"corpus under {root} too small: {len(train)} train, {len(heldout)} held-out files")
    return Corpus(str(root), tuple(train), tuple(heldout))


def function_prompts(
    files: tuple[SourceFile, ...],
    count_tokens,  # Callable[[str], int]
    num_prompts: int,
    seed: int,
    min_tokens: int = 32,
    max_tokens: int = 120,
) -> list[str]:
    """Code prefixes that open at a `def` line and run whole lines to a seeded length.

    A prefix never leaves the block the `def` sits in (it stops at a less-indented line).

    Each candidate gets a target length in [min_tokens, max_tokens]; lines are added until the
    prefix reaches it (the last line is dropped if that overshoots max_tokens). `num_prompts`
    candidates are sampled with `seed` and returned in corpus order.
    """
    import random
    import textwrap

    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    rng = random.Random(seed)
    candidates: list[str] = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("def "):
                continue
            want = rng.randint(min_tokens, max_tokens)
            indent = len(line) - len(line.lstrip())
            prompt, j = "", i
            while j < len(lines):
                if j > i and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) < indent:
                    break
                longer = textwrap.dedent(prompt + lines[j]) if prompt else lines[j].lstrip()
                n = count_tokens(longer)
                if n > max_tokens:
                    break
                prompt, j = (prompt + lines[j]), j + 1
                if n >= want:
                    break
            prompt = textwrap.dedent(prompt).rstrip() + "\n"
            if prompt and min_tokens <= count_tokens(prompt) <= max_tokens:
                candidates.append(prompt)
    if len(candidates) < num_prompts:
        raise ValueError(f"only {len(candidates)} function prompts found, {num_prompts} wanted")
    picked = sorted(rng.sample(range(len(candidates)), num_prompts))
    return [candidates[k] for k in picked]
