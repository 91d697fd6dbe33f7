"""Draft-model proposer: a small LLM with its own paged KV (same page pool, own table).

Invariant between steps: the draft's KV covers every emitted token, and `carried` holds its
logits after the last one, so the first draft token of a step is sampled without a draft
forward. Drafting runs D-1 single-token forwards in one launch; after verification the
fill runs over the tokens whose draft KV is missing or wrong (the bonus token, plus the
last draft when all D were accepted), restoring the invariant.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime.checkpoint import load_model
from runtime.proposers.base import NoProposer, one_hot_or
from runtime.sampling import logits_to_probs, sample
from scheduler.plan import build_plan


class DraftModelProposer(NoProposer):
    def __init__(self, worker, proposer_dir: str, num_pages: int):
        super().__init__(worker)
        self.model = load_model(proposer_dir, dtype=worker.dtype, device=worker.device)
        if self.model.config.vocab_size != worker.target.config.vocab_size:
            raise ValueError(
                f"draft vocab {self.model.config.vocab_size} != target vocab "
                f"{worker.target.config.vocab_size}"
            )
        self.kv = self.model.make_kv_cache(num_pages, worker.page_size)

    def _next(self, rows, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """Draft tokens from logits [B, V]; probs [B, V] when any row samples."""
        w = self.worker
        st = w.sampling_tensors(rows)
        if st.all_greedy:
            return logits.argmax(-1).tolist(), None
        probs = logits_to_probs(logits, st)
        return sample(probs, st.generators).tolist(), probs

    def draft(self, msg: dict) -> np.ndarray:
        w = self.worker
        slots = [int(s) for s in msg["slots"]]
        rows = [w.states[s] for s in slots]
        num_draft = [int(d) for d in msg["num_draft"]]
        tables = msg["page_tables"]
        L = [len(st.tokens) for st in rows]
        carried = torch.stack([st.carried for st in rows])
        toks, probs = self._next(rows, carried)
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        for i, st in enumerate(rows):
            st.drafts = [toks[i]] if num_draft[i] > 0 else []
            if probs is not None:
                qs[i].append(probs[i])
        for k in range(1, max(num_draft, default=0)):
            active = [i for i in range(len(rows)) if num_draft[i] > k]
            plan = build_plan([1] * len(active), [L[i] + k for i in active],
                              [tables[i] for i in active], w.page_size)
            step = w.backend.prepare(plan, w.device)
            ids = torch.tensor([rows[i].drafts[-1] for i in active], dtype=torch.int64, device=w.device)
            pos = torch.as_tensor(plan.positions, device=w.device)
            out = self.model(ids, step, self.kv, pos)
            arows = [rows[i] for i in active]
            toks, probs = self._next(arows, out.logits)
            for j, i in enumerate(active):
                rows[i].drafts.append(toks[j])
                if probs is not None:
                    qs[i].append(probs[j])
        for i, st in enumerate(rows):
            st.draft_q = torch.stack(qs[i]) if (qs[i] and not st.greedy) else None
        return np.asarray([len(st.drafts) for st in rows], dtype=np.int64)

    def fill(self, msg: dict) -> None:
        w = self.worker
        slots = [int(s) for s in msg["slots"]]
        rows = [w.states[s] for s in slots]
        plan, step, positions = w.plan(msg["plan"])
        ids = []
        for st, a, n in zip(rows, msg["start"], plan.qo_lens):
            ids.extend(st.tokens[int(a) : int(a) + int(n)])
        last = torch.as_tensor(plan.qo_indptr[1:] - 1, dtype=torch.int64, device=w.device)
        out = self.model(torch.tensor(ids, dtype=torch.int64, device=w.device), step, self.kv,
                         positions, logits_indices=last)
        for i, st in enumerate(rows):
            st.carried = out.logits[i]

    def draft_probs(self, rows, num: int) -> torch.Tensor | None:
        return one_hot_or(rows, num, self.worker.target.config.vocab_size, self.worker.device)

    def agreement(self, prompt: list[int], output: list[int]) -> list[int]:
        if not output:
            return []
        seq = torch.tensor([prompt + output], dtype=torch.int64, device=self.worker.device)
        logits, _ = self.model.forward_full(seq)
        pred = logits[0, len(prompt) - 1 : len(prompt) - 1 + len(output)].argmax(-1).tolist()
        return [int(p == t) for p, t in zip(pred, output)]
