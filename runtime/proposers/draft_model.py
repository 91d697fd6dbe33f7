"""Draft-model proposer: a small LLM with its own paged KV (same page pool, own table).

Invariant between steps: the draft's KV covers every emitted token, and `carried` holds its
logits after the last one, so the first draft token of a step is sampled without a draft
forward. Drafting runs D-1 single-token forwards in one launch; after verification the
fill runs over the tokens whose draft KV is missing or wrong (the bonus token, plus the
last draft when all D were accepted), restoring the invariant -- or, under the `eager_fill`
schedule, over the whole verify window one position ahead, launched behind the verify before
the host knows the accepted lengths (`FillMessage.window`, `base.window_reads`).
"""
from __future__ import annotations

import numpy as np
import torch

from specsched.runtime.dummy import load
from specsched.runtime.proposers.base import DraftCollector, Proposer, one_hot_or, one_token_forwards, window_reads
from specsched.runtime.sync_guard import to_device
from specsched.scheduler.messages import DraftMessage, FillMessage


class DraftModelProposer(Proposer):
    def __init__(self, worker, proposer_dir: str, num_pages: int):
        super().__init__(worker)
        self.model = load(proposer_dir, worker.load_format, worker.dtype, worker.device)
        if self.model.config.vocab_size != worker.target.config.vocab_size:
            raise ValueError(
                f"draft vocab {self.model.config.vocab_size} != target vocab "
                f"{worker.target.config.vocab_size}"
            )
        self.kv = self.model.make_kv_cache(num_pages, worker.page_size, backend=worker.backend)

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.model,)

    def draft(self, msg: DraftMessage) -> np.ndarray:
        w = self.worker
        slots = msg.slots.tolist()
        rows = [w.states[s] for s in slots]
        drafts = DraftCollector(w, slots, msg.start, rows, msg.draft_lens.tolist())
        drafts.first(torch.stack([st.carried for st in rows]))
        # forward j drafts token j + 1 over a KV of start + 2 + j tokens (the last emitted one at start)
        for j, active, step, pos in one_token_forwards(w, msg, drafts, msg.start + 2):
            drafts.extend(active, j + 1, self.model(drafts.last(active, j + 1), step, self.kv, pos).logits)
        return drafts.finish()

    def fill(self, msg: FillMessage) -> None:
        w = self.worker
        rows = [w.states[s] for s in msg.slots.tolist()]
        plan, step, positions = w.plan(msg.plan)
        if msg.window:  # the verify's emitted tokens at positions start.. (the draft reads token p at p)
            ids, carry = window_reads(w, msg, plan, 0)
        else:
            ids = w.tokens.ranges(msg.slots, msg.start, msg.end)
            carry = to_device(plan.qo_indptr[1:] - 1, w.device, torch.int64)
        out = self.model(ids, step, self.kv, positions, logits_indices=carry)
        for i, st in enumerate(rows):
            st.carried = out.logits[i]

    def draft_probs(self, rows, slots, starts, num: int) -> torch.Tensor | None:
        return one_hot_or(self.worker, rows, slots, starts, num, self.worker.target.config.vocab_size)

    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        if not output:
            return []
        seq = torch.tensor([prompt + output], dtype=torch.int64, device=self.worker.device)
        logits, _ = self.model.forward_full(seq)
        pred = logits[0, len(prompt) - 1 : len(prompt) - 1 + len(output)].argmax(-1).tolist()
        return [int(p == t) for p, t in zip(pred, output)]
