"""Continuous batching: which requests run this step, with how many tokens.

Policy (vLLM-like, FCFS): running requests first, then admit waiting ones within the
token budget (`max_num_batched_tokens`) and `max_num_seqs`. Prefill may be chunked.
Speculation happens only on decode-only batches (every running request decodes and no
waiting one can get a seat): a step that prefills anything samples normally for every
request in it. When pages run out the most recently admitted running request is preempted
(pages freed, recomputed later from prompt + outputs); a request is never dropped. A request
that could not fit in the pool even alone is rejected by `add`.

Every scheduled sequence computes tokens [num_computed_tokens, num_computed_tokens +
num_new_tokens) and samples iff that reaches its last token. A decode is the special case
num_new_tokens == 1; a speculative decode adds `num_draft` drafted tokens (at most D, and
fewer near max_tokens), but its verification always covers 1 + D positions
(D = `draft_len`), so budget and KV pages are reserved for 1 + D per row.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.request import Request, RequestState


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per step, verify width (1 + D) counted per spec row
    draft_len: int = 0  # D: verify candidates per speculative step (0 = no speculation)
    proposer_model: str | None = None  # second page table ("draft" / "mtp"), None if no KV

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.draft_len < 0:
            raise ValueError("need max_num_seqs >= 1, max_num_batched_tokens >= 1, draft_len >= 0")
        if self.max_num_batched_tokens < 1 + self.draft_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) cannot hold one "
                f"verification of 1 + draft_len ({1 + self.draft_len}) tokens"
            )


def max_pages_needed(config: SchedulerConfig, page_size: int, num_prompt_tokens: int,
                     max_tokens: int) -> int:
    """Upper bound on the KV pages one request holds at once, over every KV model: at its
    last verification the target's KV covers prompt + max_tokens + D slots, a proposer's one
    slot more (it also sees the sampled token). The engine checks requests and its pool
    against this number; the batch builder's admission uses it too."""
    last = num_prompt_tokens + max_tokens + config.draft_len
    pages = -(-last // page_size)
    if config.proposer_model is not None:
        pages += -(-(last + 1) // page_size)
    return pages


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # target tokens computed this step (prefill chunk or 1)
    num_draft: int = 0  # tokens to draft (decode-only batches; <= D, capped by max_tokens)
    samples: bool = field(init=False)  # this step produces an output token for the request
    prefill: bool = field(init=False)  # the request was in prefill when scheduled

    def __post_init__(self) -> None:
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens >= r.num_tokens
        self.prefill = r.in_prefill


@dataclass
class StepBatch:
    step: int
    seqs: list[ScheduledSeq]
    preempted: list[Request] = field(default_factory=list)

    # A batch's rows and draft counts are fixed once `schedule` returns it, so whether it
    # speculates and its kind are computed once, there (the pipeline asks several times per
    # step; a plain attribute, as functools.cached_property takes a lock on Python 3.11).
    is_spec: bool = field(init=False)
    kind: str = field(init=False)  # spec / decode / prefill / mixed, as scheduled

    def __post_init__(self) -> None:
        self.is_spec = any(s.num_draft > 0 for s in self.seqs)
        num_prefill = sum(1 for s in self.seqs if s.prefill)
        if self.is_spec:
            self.kind = "spec"
        elif not num_prefill:
            self.kind = "decode"
        else:
            self.kind = "prefill" if num_prefill == len(self.seqs) else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


class BatchBuilder:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._step = 0

    # -- queue management ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; InvalidRequestError if it could never fit in the KV pool alone."""
        rid = request.request_id
        if any(r.request_id == rid for r in self.running) or any(r.request_id == rid for r in self.waiting):
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        need = self.max_pages_needed(request)
        if need > self.blocks.num_pages:
            raise InvalidRequestError(
                f"request {rid}: prompt ({request.num_prompt_tokens}) + max_tokens "
                f"({request.params.max_tokens}) may need {need} KV pages, the pool has "
                f"{self.blocks.num_pages}"
            )
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def max_pages_needed(self, request: Request) -> int:
        """Upper bound on the pages the request can hold at once (its last verification)."""
        return max_pages_needed(self.config, self.blocks.page_size, request.num_prompt_tokens,
                                request.params.max_tokens)

    def remove(self, request: Request) -> None:
        """Take a finished/aborted request out of the queues and free its pages."""
        # membership first: a failed deque.remove formats the request's repr into its error
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- slots a sequence needs this step ------------------------------------------------
    def slots_needed(self, req: Request, num_new: int, num_draft: int) -> dict[str, int]:
        return self._slots(req.num_computed_tokens + num_new + num_draft)

    def _slots(self, target):
        """KV slots per model for `target` target slots (an int, or an array over rows): a
        proposer's KV is reserved one token ahead (a draft model also sees the sampled token)."""
        slots = {"target": target}
        if self.config.proposer_model is not None:
            slots[self.config.proposer_model] = target + 1
        return slots

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.blocks.free(victim.request_id)
        victim.state = RequestState.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_proposer_computed = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)

    # -- the schedule stage ---------------------------------------------------------------
    def schedule(self) -> StepBatch:
        batch = self._schedule_decode_only()
        return batch if batch is not None else self._schedule_general()

    def _schedule_decode_only(self) -> StepBatch | None:
        """The steady state in whole-array operations: every running request decodes (one
        token, plus drafts), none waits for a seat, and the pool holds the batch without
        preempting anyone. The batch `_schedule_general` would make (tested equal); None
        when any of that does not hold, and the general path decides."""
        cfg, running = self.config, self.running
        if not running or (self.waiting and len(running) < cfg.max_num_seqs):
            return None
        n = len(running)
        computed = np.fromiter((r.num_computed_tokens for r in running), dtype=np.int64, count=n)
        prompt = np.fromiter((r.num_prompt_tokens for r in running), dtype=np.int64, count=n)
        emitted = np.fromiter((len(r.output_token_ids) + r.num_pending_tokens for r in running),
                              dtype=np.int64, count=n)
        todo = prompt + emitted - computed
        if (todo > 1).any() or (computed < prompt).any():
            return None  # a prefill or recompute in the batch: no speculation, the general path
        draft = cfg.draft_len
        active = np.flatnonzero(todo == 1)
        # rows in order while the token budget holds their verification (1 + D each)
        take = active[: min(active.size, cfg.max_num_batched_tokens // (1 + draft))]
        if take.size == 0:
            return None
        reqs = [running[i] for i in take.tolist()]
        slots = self._slots(computed[take] + 1 + draft)
        need = self.blocks.pages_needed_many(self.blocks.rows([r.request_id for r in reqs]), slots)
        if int(need.sum()) > self.blocks.num_free_pages:
            return None  # someone is preempted: the general path chooses whom
        max_tokens = np.fromiter((r.params.max_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        remaining = max_tokens - emitted[take]  # `Request.remaining_tokens`
        num_draft = np.minimum(draft, np.maximum(0, remaining - 1)).tolist()
        batch = StepBatch(self._step, [ScheduledSeq(r, 1, d) for r, d in zip(reqs, num_draft)], [])
        self._step += 1
        return batch

    def _schedule_general(self) -> StepBatch:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        # Speculate only on a decode-only batch: every running request decodes and no waiting
        # one can be admitted (none waits, or every seat is taken).
        decode_only = (not self.waiting or len(self.running) >= cfg.max_num_seqs) and not any(
            r.in_prefill for r in self.running)
        draft = cfg.draft_len if decode_only else 0
        planned = 0  # pages already promised to earlier seqs this step

        def need(req: Request, n: int) -> int:
            # a verification computes (and writes KV for) all 1 + D positions of every row
            d = draft if n == 1 else 0
            return self.blocks.pages_needed(req.request_id, self.slots_needed(req, n, d))

        gone: set[int] = set()  # ids of requests preempted in this loop
        for req in list(self.running):
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
            d = min(draft, max(0, req.remaining_tokens - 1)) if n == 1 else 0
            seqs.append(ScheduledSeq(req, n, d))
            budget -= n + (draft if n == 1 else 0)
            if budget <= 0:
                break

        # Admit waiting requests (prefill) while budget, seats and pages allow.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
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
            planned += pages
            seqs.append(ScheduledSeq(req, n, 0))
            budget -= n

        if draft and any(s.prefill for s in seqs):
            for s in seqs:
                s.num_draft = 0
        batch = StepBatch(self._step, seqs, preempted)
        self._step += 1
        return batch

    # -- the kv_alloc stage ---------------------------------------------------------------
    def allocate(self, batch: StepBatch) -> None:
        """Grow page tables for the batch; a speculative batch reserves all 1 + D verify
        slots of every row (rejected ones are trimmed after acceptance)."""
        if not batch.seqs:
            return
        spec, draft_len = batch.is_spec, self.config.draft_len
        target = np.fromiter(
            (s.request.num_computed_tokens + s.num_new_tokens
             + (draft_len if spec and s.num_new_tokens == 1 else s.num_draft) for s in batch.seqs),
            dtype=np.int64, count=len(batch.seqs))
        self.blocks.allocate_many(self.blocks.rows([s.request.request_id for s in batch.seqs]),
                                  self._slots(target))
