"""Draft-model proposer: a small LLM with its own paged KV (same page pool, own table).

Invariant between steps: the draft's KV covers every emitted token, and `carried` holds its
logits after the last one, so the first draft token of a step is sampled without a draft
forward. Drafting runs D-1 single-token forwards in one launch; after verification the
fill runs over the tokens whose draft KV is missing or wrong (the bonus token, plus the
last draft when all D were accepted), restoring the invariant -- or, under the `mtp`
schedule, over the whole verify window one position ahead, launched behind the verify before
the host knows the accepted lengths (`FillMessage.window`, `_window`).
"""
from __future__ import annotations

import numpy as np
import torch

from specsched.runtime.checkpoint import load_model
from specsched.runtime.proposers.base import DraftCollector, NoProposer, one_hot_or
from specsched.runtime.sync_guard import to_device
from specsched.scheduler.messages import DraftMessage, FillMessage
from specsched.scheduler.plan import build_plan


class DraftModelProposer(NoProposer):
    def __init__(self, worker, proposer_dir: str, num_pages: int):
        super().__init__(worker)
        self.model = load_model(proposer_dir, dtype=worker.dtype, device=worker.device)
        if self.model.config.vocab_size != worker.target.config.vocab_size:
            raise ValueError(
                f"draft vocab {self.model.config.vocab_size} != target vocab "
                f"{worker.target.config.vocab_size}"
            )
        self.kv = self.model.make_kv_cache(num_pages, worker.page_size, backend=worker.backend)

    def draft(self, msg: DraftMessage) -> np.ndarray:
        w = self.worker
        slots = msg.slots.tolist()
        rows = [w.states[s] for s in slots]
        num_draft = msg.num_draft.tolist()
        tables, table_lens = msg.page_tables, msg.table_lens
        L = (msg.start + 1).tolist()  # tokens per row (the last emitted one at start)
        drafts = DraftCollector(w, slots, msg.start, rows, num_draft)
        drafts.first(torch.stack([st.carried for st in rows]))
        for k in range(1, max(num_draft, default=0)):
            active = [i for i in range(len(rows)) if num_draft[i] > k]
            plan = build_plan([1] * len(active), [L[i] + k for i in active], tables[active],
                              w.page_size, table_lens=table_lens[active])
            step = w.backend.prepare(plan, w.device)
            pos = to_device(plan.positions, w.device)
            drafts.extend(active, k, self.model(drafts.last(active, k), step, self.kv, pos).logits)
        return drafts.finish()

    def fill(self, msg: FillMessage) -> None:
        w = self.worker
        rows = [w.states[s] for s in msg.slots.tolist()]
        plan, step, positions = w.plan(msg.plan)
        if msg.window:
            ids, carry = self._window(msg, plan.qo_lens, plan.qo_indptr)
        else:
            ids = w.tokens.ranges(msg.slots, msg.start, msg.end)
            carry = to_device(plan.qo_indptr[1:] - 1, w.device, torch.int64)
        out = self.model(ids, step, self.kv, positions, logits_indices=carry)
        for i, st in enumerate(rows):
            st.carried = out.logits[i]

    def _window(self, msg: FillMessage, qo: np.ndarray, qo_indptr: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """A fill over the verify window, launched before the host knows the accepted lengths:
        (token ids, index of each row's carried logits), both following the accepted counts on
        the device. A row fills positions start .. start + its drafts, whose tokens the verify emitted
        (accepted drafts, then the bonus or recovered token at start + accepted); past that
        last token it reads it again (KV the next draft overwrites), and it carries the logits
        after it."""
        w = self.worker
        got = w.last_verify
        if got is None or got[0] != msg.step or not np.array_equal(got[1], msg.slots):
            raise RuntimeError(f"draft fill over the verify window of step {msg.step} needs that verify's "
                               f"accepted lengths; the latest verify is step {None if got is None else got[0]}")
        acc = got[2]
        total = int(qo_indptr[-1])
        pos = np.repeat(msg.start - qo_indptr[:-1], qo) + np.arange(total)
        last = to_device(msg.start, w.device, torch.int64) + acc
        limit = torch.repeat_interleave(last, to_device(qo, w.device, torch.int64), output_size=total)
        ids = w.tokens.at(np.repeat(msg.slots, qo), torch.minimum(to_device(pos, w.device, torch.int64), limit))
        return ids, to_device(qo_indptr[:-1], w.device, torch.int64) + acc

    def draft_probs(self, rows, slots, starts, num: int) -> torch.Tensor | None:
        return one_hot_or(self.worker, rows, slots, starts, num, self.worker.target.config.vocab_size)

    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        if not output:
            return []
        seq = torch.tensor([prompt + output], dtype=torch.int64, device=self.worker.device)
        logits, _ = self.model.forward_full(seq)
        pred = logits[0, len(prompt) - 1 : len(prompt) - 1 + len(output)].argmax(-1).tolist()
        return [int(p == t) for p, t in zip(pred, output)]
