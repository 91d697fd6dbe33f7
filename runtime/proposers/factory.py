"""The factory the worker uses: a ProposerSpec to the device-side proposer that serves it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specsched.runtime.proposers.base import NgramDrafter, NoProposer
from specsched.traces.names import ProposerKind

if TYPE_CHECKING:
    from specsched.runtime.worker import ModelWorker
    from specsched.scheduler.proposer import ProposerSpec


def make_proposer(worker: "ModelWorker", spec: "ProposerSpec", proposer_dir: str | None,
                  num_pages: int, ngram: tuple[int, int]) -> Any:
    if spec.kind == ProposerKind.NONE:
        return NoProposer(worker)
    if spec.kind == ProposerKind.NGRAM:
        return NgramDrafter(worker, ngram[0], ngram[1], spec.draft_len)
    if spec.kind == ProposerKind.DRAFT:
        from specsched.runtime.proposers.draft_model import DraftModelProposer  # loads torch models: lazily

        return DraftModelProposer(worker, proposer_dir, num_pages)
    if spec.kind in (ProposerKind.MTP, ProposerKind.EAGLE):
        from specsched.runtime.proposers.mtp import make_head_proposer

        return make_head_proposer(worker, spec, proposer_dir, num_pages)
    raise ValueError(f"unknown proposer {spec.kind!r}")
