"""Every proposer under every schedule it runs with, on the bundled models: the cases the
device-level tests sweep (sync-free ops, tensor parallelism), and a worker for one; and a tiny
random family (target, draft, head) of any config with a worker over it."""
from __future__ import annotations

from pathlib import Path

from specsched.runtime import bundled
from specsched.runtime.checkpoint import load_model, save_llama
from specsched.runtime.config import ModelConfig
from specsched.runtime.model import LlamaModel
from specsched.runtime.mtp_head import MTPHead, save_head
from specsched.runtime.worker import ModelWorker
from specsched.scheduler import wiring

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 40, 41, 40, 41], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
CASES = {  # proposer -> (draft length, checkpoint, schedules)
    "none": (0, None, ("sync", "plain_overlap")),
    "draft": (3, "draft", ("sync", "overlap", "eager_fill")),
    "mtp": (2, "mtp", ("sync", "eager_fill")),
    "ngram": (3, None, ("sync",)),
    "eagle": (3, "mtp", ("sync", "overlap", "eager_fill")),
}


def case_worker(kind: str, *, target: str | None = None, proposer_dir: str | None = None, **kw) -> ModelWorker:
    """A ModelWorker for `kind` at its case's draft length (the bundled target and checkpoint
    unless given); kw go to ModelWorker."""
    d, ckpt, _ = CASES[kind]
    spec = wiring.proposer_spec(kind, d)
    proposer_dir = proposer_dir or ({"draft": bundled.draft_dir, "mtp": bundled.mtp_dir}[ckpt]() if ckpt else None)
    return ModelWorker(target or str(bundled.target_dir()),
                       {"kind": kind, "draft_len": d, "tree_parents": list(spec.tree_parents)},
                       proposer_dir=str(proposer_dir) if proposer_dir else None, num_pages=256, page_size=16, **kw)


def save_tiny_family(root: Path, config: ModelConfig) -> None:
    """A random target of `config` (root/target), a one-layer draft of its family (root/draft) and
    an MTP head for it (root/head), written as checkpoints."""
    save_llama(LlamaModel.random(config, seed=1, std=0.3), root / "target")
    save_llama(LlamaModel.random(config.model_copy(update={"num_hidden_layers": 1}), seed=2, std=0.3), root / "draft")
    target = load_model(root / "target")
    save_head(MTPHead.for_target(target, seed=3, std=0.3), root / "head", target)


def family_worker(root: Path, kind: str, d: int, **kw) -> ModelWorker:
    """A ModelWorker for `kind` at D = `d` over a `save_tiny_family` folder; kw go to ModelWorker."""
    spec = wiring.proposer_spec(kind, d)
    proposer_dir = {"draft": root / "draft", "mtp": root / "head", "eagle": root / "head"}.get(kind)
    return ModelWorker(str(root / "target"), {"kind": kind, "draft_len": d, "tree_parents": list(spec.tree_parents)},
                       proposer_dir=str(proposer_dir) if proposer_dir else None, **kw)
