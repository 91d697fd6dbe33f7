"""The device-side proposer interface and what every proposer shares (the factory that
picks one is runtime/proposers/factory.py, so this module imports no proposer).

A proposer lives inside the worker next to the target. It answers four calls:
  draft(msg)            make up to D tokens per row into SeqState.drafts (one launch)
  fill(msg)             extend its own KV over tokens it has not seen; carry logits
  draft_probs(rows, D)  [B, D, V] distributions the drafts were sampled from, or None (one-hot)
  agreement(p, o)       teacher-forced greedy agreement with an output (for trace replay)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specsched.runtime.sampling import logits_to_probs, sample

if TYPE_CHECKING:
    from specsched.runtime.worker import ModelWorker, SeqState
    from specsched.scheduler.messages import DraftMessage, FillMessage


class NoProposer:
    needs_hidden = False

    def __init__(self, worker: "ModelWorker"):
        self.worker = worker

    def draft(self, msg: "DraftMessage") -> np.ndarray:
        raise RuntimeError("no proposer configured: this engine does not speculate")

    def fill(self, msg: "FillMessage") -> None:
        raise RuntimeError("no proposer configured: nothing to fill")

    def draft_probs(self, rows: list["SeqState"], num: int) -> torch.Tensor | None:
        return None

    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        return []


class NgramDrafter(NoProposer):
    """Prompt lookup: drafts copied from the request's own history; q is one-hot."""

    def __init__(self, worker: "ModelWorker", min_n: int, max_n: int, num_tokens: int):
        super().__init__(worker)
        from specsched.runtime.proposers.ngram import NgramProposer

        self.lookup = NgramProposer(min_n, max_n, num_tokens)

    def draft(self, msg: "DraftMessage") -> np.ndarray:
        counts = []
        for slot, d in zip(msg.slots.tolist(), msg.num_draft.tolist()):
            st = self.worker.states[slot]
            st.drafts = self.lookup.propose(st.tokens, int(d)) if d > 0 else []
            counts.append(len(st.drafts))
        return np.asarray(counts, dtype=np.int64)

    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        seq = list(prompt)
        agree = []
        for t in output:
            guess = self.lookup.propose(seq, 1)
            agree.append(int(bool(guess) and guess[0] == t))
            seq.append(t)
        return agree


def sample_next(worker: "ModelWorker", rows: list["SeqState"], logits: torch.Tensor
                ) -> tuple[list[int], torch.Tensor | None]:
    """Draft tokens from logits [B, V]; probs [B, V] when any row samples."""
    st = worker.sampling_tensors(rows)
    if st.all_greedy:
        return logits.argmax(-1).tolist(), None
    probs = logits_to_probs(logits, st)
    return sample(probs, st.generators).tolist(), probs


class DraftCollector:
    """One draft launch's tokens, sampled step by step into `SeqState.drafts`, and the
    distributions q they were drawn from, stacked into `SeqState.draft_q` by `finish`."""

    def __init__(self, worker: "ModelWorker", rows: list["SeqState"], num_draft: list[int]):
        self.worker = worker
        self.rows = rows
        self.num_draft = num_draft
        self.qs: list[list[torch.Tensor]] = [[] for _ in rows]

    def first(self, logits: torch.Tensor) -> None:
        """The first draft token of every row (rows drafting none get no draft) from [B, V]."""
        toks, probs = sample_next(self.worker, self.rows, logits)
        for i, st in enumerate(self.rows):
            st.drafts = [toks[i]] if self.num_draft[i] > 0 else []
            if probs is not None:
                self.qs[i].append(probs[i])

    def extend(self, active: list[int], logits: torch.Tensor) -> None:
        """One more draft token for rows `active` (indices into rows) from logits [len(active), V]."""
        toks, probs = sample_next(self.worker, [self.rows[i] for i in active], logits)
        for j, i in enumerate(active):
            self.rows[i].drafts.append(toks[j])
            if probs is not None:
                self.qs[i].append(probs[j])

    def finish(self) -> np.ndarray:
        """Store sampled rows' draft_q [n, V] (None for greedy rows); returns the draft counts."""
        for i, st in enumerate(self.rows):
            st.draft_q = torch.stack(self.qs[i]) if (self.qs[i] and not st.greedy) else None
        return np.asarray([len(st.drafts) for st in self.rows], dtype=np.int64)


def one_hot_or(rows: list["SeqState"], num: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """Stack rows' draft distributions [B, num, V]; rows drafted greedily get one-hot rows."""
    if all(st.draft_q is None for st in rows):
        return None
    out = torch.zeros(len(rows), num, vocab, device=device)
    for i, st in enumerate(rows):
        if st.draft_q is not None:
            n = min(num, st.draft_q.shape[0])
            out[i, :n] = st.draft_q[:n]
        else:
            for j, t in enumerate(st.drafts[:num]):
                out[i, j, t] = 1.0
    return out
