"""WorkerConfig: what a `ModelWorker` is built with, typed and frozen.

Why: the worker is built on the far side of a process boundary (the host device's worker
process; its tensor-parallel ranks get theirs from it), so what it needs travels pickled in
its `WorkerSpec`. One frozen dataclass, built in one place from the engine's `EngineConfig`
(`WorkerConfig.from_engine`), names every setting the worker reads. It imports no torch: the
engine's process builds it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specsched.scheduler.proposer import ProposerSpec
from specsched.scheduler.synthetic import SyntheticAcceptance

if TYPE_CHECKING:
    from specsched.runtime.engine_config import EngineConfig


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str  # the target checkpoint (HF layout)
    proposer: ProposerSpec
    proposer_dir: str | None = None  # the draft model's or the MTP / EAGLE head's checkpoint
    num_pages: int = 1024
    page_size: int = 16
    dtype: str = "float32"
    load_format: str = "auto"  # "dummy": random weights from config.json (runtime/dummy.py)
    attention: str = "auto"  # runtime/attention resolve_backend
    device: str = "cpu"  # the torch device: "cpu" or "cuda"
    acceptance: str = "lossless"  # or "threshold", "synthetic"
    threshold: float = 0.3
    synthetic: SyntheticAcceptance | None = None  # with acceptance "synthetic": what it forces
    seed: int = 0  # the engine's seed: its synthetic draws
    ngram: tuple[int, int] = (1, 3)  # n-gram lookup lengths (min, max)
    max_model_len: int | None = None  # the longest sequence served (None: the target's positions)
    num_threads: int | None = None  # torch's intra-op threads (None: torch's default)
    sync_guard: bool = False
    verify_micro_batches: int = 1
    tensor_parallel_size: int = 1
    tp_channel: str = "shm"
    # steps of uniform rows run at these padded row counts (runtime/padding.py): CUDA graphs'
    # capture sizes; () runs every step at its own shape
    cuda_graph_sizes: tuple[int, ...] = ()
    # "auto": float32 CPU linear layers also keep their weights packed for a faster kernel
    # (runtime/layers.py `Linear.pack`); "torch": F.linear on the plain weights alone
    linear: str = "auto"
    # "auto": float32 CPU decoder layers run RMSNorm, RoPE and SiLU-and-multiply in C where
    # runtime/cpu_kernels.c builds (`layers.use_cpu_kernels`); "torch": PyTorch's ops
    ops: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.proposer, ProposerSpec):
            raise TypeError(f"WorkerConfig.proposer must be a ProposerSpec, got {type(self.proposer).__name__}")

    @classmethod
    def of(cls, model_dir: str | os.PathLike, proposer: ProposerSpec | dict, **settings: Any) -> WorkerConfig:
        """A worker's configuration from a target dir, its proposer (a ProposerSpec, or a dict
        of its `kind`, `draft_len` and, for a tree, `tree_parents`) and the other fields."""
        if isinstance(proposer, dict):
            proposer = ProposerSpec(proposer["kind"], proposer["draft_len"], tuple(proposer.get("tree_parents", ())))
        if settings.get("proposer_dir") is not None:
            settings["proposer_dir"] = os.fspath(settings["proposer_dir"])
        for key in ("ngram", "cuda_graph_sizes"):
            if key in settings:
                settings[key] = tuple(settings[key])
        return cls(os.fspath(model_dir), proposer, **settings)

    @classmethod
    def from_engine(cls, config: EngineConfig, model_dir: str, proposer_dir: str | None) -> WorkerConfig:
        """The worker an engine of `config` runs (its target and proposer checkpoints resolved)."""
        c = config
        return cls(
            model_dir=model_dir,
            proposer=c.proposer_spec(),
            proposer_dir=proposer_dir,
            num_pages=c.num_pages,
            page_size=c.page_size,
            dtype=c.dtype,
            load_format=c.load_format,
            attention=c.attention,
            device="cuda" if c.device == "cuda" else "cpu",
            acceptance=c.acceptance,
            threshold=c.threshold,
            synthetic=c.synthetic(),
            seed=c.seed,
            ngram=(c.ngram_min, c.ngram_max),
            max_model_len=c.max_model_len,
            num_threads=c.worker_threads,
            sync_guard=c.sync_guard,
            verify_micro_batches=c.verify_micro_batches,
            tensor_parallel_size=c.tensor_parallel_size,
            tp_channel=c.tp_channel,
            cuda_graph_sizes=c.graph_sizes(),
            linear=c.worker_linear,
            ops=c.worker_ops,
        )
