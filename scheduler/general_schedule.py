"""The batch builder's general path: any step -- prefill admission, chunking, preemption.

Why a module of its own: scheduler/batch_builder.py schedules the steady state (every running
request decodes) in whole-array operations and falls back to this path for everything else:
running requests first (whole-array unless someone must be preempted, then one by one, most
recently admitted preempted first), then the waiting requests admitted first come first served
while the token budget, the seats and the pool hold them. It works on the builder's state
(`running`, `waiting`, `table`, `blocks`, `config`, `policy`) and helpers (`_slots`,
`slots_needed`, `_preempt`, `_batch`, `running_slots`).
"""
from __future__ import annotations

import itertools

import numpy as np

from specsched.scheduler.request import Request, RequestState
from specsched.scheduler.step_batch import StepBatch, empty_batch


class GeneralSchedule:
    def _running_rows(self, budget: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The running requests' rows of a step that drafts nothing, in whole-array
        operations: (indices into `running`, tokens each computes, pages they need), each
        taking what is left of the token budget in order -- or None when the pool cannot
        hold them all and someone must be preempted (the loop in `_schedule_general`)."""
        t = self.table
        slots = self.running_slots()
        computed = t.computed[slots]
        todo = t.num_tokens(slots) - computed
        before = np.cumsum(todo) - todo  # budget the rows ahead of each take
        n = np.clip(budget - before, 0, todo)
        rows = (n > 0).nonzero()[0]
        n = n[rows]
        need = self.blocks.pages_needed_many(slots[rows], self._slots(computed[rows] + n))
        pages = int(need.sum())
        if pages > self.blocks.num_free_pages:
            return None
        return rows, n, pages

    def _schedule_general(self, vectorized: bool = True) -> StepBatch:
        """Any step: running requests first (whole-array unless someone must be preempted),
        then admission of waiting ones (whole-array, `_admissions`); with `vectorized=False`
        both one request at a time (the reference the whole-array paths are tested against)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        reqs: list[Request] = []
        new_l: list[int] = []
        draft_l: list[int] = []
        prefill_l: list[bool] = []
        preempted: list[Request] = []
        t = self.table
        slots = self.running_slots()
        computed = t.computed[slots]
        prompt = t.prompt_len[slots]
        total = t.num_tokens(slots)
        in_prefill = (computed < prompt) | (computed < total - 1)  # `Request.in_prefill`
        # Speculate only on a decode-only batch: every running request decodes and no waiting
        # one can be admitted (none waits, or every seat is taken).
        decode_only = (not self.waiting or len(self.running) >= cfg.max_num_seqs) and not in_prefill.any()
        last = self.policy.last
        draft = (cfg.draft_len if last is None else last.draft_len) if decode_only else 0
        planned = 0  # pages already promised to earlier seqs this step
        fast = self._running_rows(budget) if (vectorized and not draft and self.running) else None

        def need(req: Request, n: int) -> int:
            # a row's verification computes (and writes KV for) up to 1 + D positions
            d = draft if n == 1 else 0
            return self.blocks.pages_needed(req.request_id, self.slots_needed(req, n, d))

        def take(req: Request, n: int, d: int) -> None:
            reqs.append(req)
            new_l.append(n)
            draft_l.append(d)
            prefill_l.append(req.in_prefill)

        gone: set[int] = set()  # ids of requests preempted in this loop
        if fast is not None:
            rows, n, planned = fast
            running = self.running
            reqs = [running[i] for i in rows.tolist()]
            new_l = n.tolist()
            draft_l = [0] * len(reqs)
            prefill_l = in_prefill[rows].tolist()
            budget -= int(n.sum())
        for req in (list(self.running) if fast is None else ()):
            if id(req) in gone:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            if n == 1 and draft and budget < 1 + draft:
                break
            pages = need(req, n)
            while pages + planned > self.blocks.num_free_pages and self.running[-1] is not req:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                gone.add(id(victim))
            if pages + planned > self.blocks.num_free_pages:
                if len(self.running) == 1:
                    raise RuntimeError(
                        f"request {req.request_id} does not fit in the KV pool even alone "
                        f"({pages} pages needed, {self.blocks.num_free_pages} free)"
                    )
                self._preempt(req)
                preempted.append(req)
                gone.add(id(req))
                continue
            planned += pages
            take(req, n, min(draft, max(0, req.remaining_tokens - 1)) if n == 1 else 0)
            budget -= n + (draft if n == 1 else 0)
            if budget <= 0:
                break

        # Admit waiting requests (prefill) while budget, seats and pages allow.
        if vectorized and self.waiting and not preempted:
            adm, n, pre, budget, planned = self._admissions(budget, planned, draft)
            reqs.extend(adm)
            new_l.extend(n)
            draft_l.extend([0] * len(adm))
            prefill_l.extend(pre)
        while not vectorized and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs \
                and not preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            pages = need(req, n)
            if pages + planned > self.blocks.num_free_pages:
                if not self.running:
                    raise RuntimeError(
                        f"request {req.request_id} does not fit in the KV pool even alone "
                        f"({pages} pages needed, {self.blocks.num_free_pages} free)"
                    )
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            self.running.append(req)
            self._running_slots = None
            planned += pages
            take(req, n, 0)
            budget -= n

        if not reqs:
            batch = empty_batch(self._step, preempted)
            self._step += 1
            return batch
        prefill = np.array(prefill_l, dtype=bool)
        num_draft = np.array(draft_l, dtype=np.int64)
        if draft and prefill.any():
            num_draft[:] = 0
        slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=len(reqs))
        return self._batch(reqs, slots, self.table.computed[slots], np.array(new_l, dtype=np.int64),
                           num_draft, prefill, preempted, draft)

    def _admissions(self, budget: int, planned: int, draft: int
                    ) -> tuple[list[Request], list[int], list[bool], int, int]:
        """Admission of waiting requests, whole-array: first come first served while the
        token budget, the seats and the pool (beyond the `planned` pages) hold them -- the
        requests the one-by-one loop of `_schedule_general` admits, moved to `running`.
        Returns (requests, tokens each computes, whether each is in prefill, budget left,
        pages planned)."""
        waiting = self.waiting
        m = min(len(waiting), self.config.max_num_seqs - len(self.running))
        if m <= 0 or budget <= 0:
            return [], [], [], budget, planned
        cand = list(itertools.islice(waiting, m))
        t = self.table
        slots = np.fromiter((r.slot for r in cand), dtype=np.int64, count=m)
        computed = t.computed[slots]
        prompt = t.prompt_len[slots]
        total = t.num_tokens(slots)
        todo = total - computed
        before = np.cumsum(todo) - todo  # the budget the requests ahead of each take
        k = int(np.count_nonzero(before < budget))  # a prefix: the budget left is > 0 for them
        n = np.minimum(todo[:k], budget - before[:k])
        # a verification reserves 1 + D slots per decoding row (`need` in `_schedule_general`)
        pages = self.blocks.pages_needed_many(slots[:k], self._slots(computed[:k] + n + np.where(n == 1, draft, 0)))
        fits = planned + np.cumsum(pages) <= self.blocks.num_free_pages
        a = k if fits.all() else int(np.argmin(fits))  # up to the first that does not fit
        if a == 0:
            if k and not self.running:
                raise RuntimeError(
                    f"request {cand[0].request_id} does not fit in the KV pool even alone "
                    f"({int(pages[0])} pages needed, {self.blocks.num_free_pages} free)"
                )
            return [], [], [], budget, planned
        admitted = cand[:a]
        for r in admitted:
            waiting.popleft()
            r.state = RequestState.RUNNING
        self.running.extend(admitted)
        self._running_slots = None
        in_prefill = (computed[:a] < prompt[:a]) | (computed[:a] < total[:a] - 1)  # `Request.in_prefill`
        return (admitted, n[:a].tolist(), in_prefill.tolist(), budget - int(n[:a].sum()),
                planned + int(pages[:a].sum()))
