"""Continuous batching: which requests run this step, with how many tokens.

Policy (vLLM-like, FCFS): running requests first, then admit waiting ones within the
token budget (`max_num_batched_tokens`) and `max_num_seqs`. Prefill may be chunked.
Speculation happens only on decode-only batches: a step that prefills anything samples
normally for every request in it. When pages run out the most recently admitted running
request is preempted (pages freed, recomputed later); a request is never dropped.

Every scheduled sequence computes tokens [num_computed_tokens, num_computed_tokens +
num_new_tokens) and samples iff that reaches its last token. A decode is the special case
num_new_tokens == 1; a speculative decode adds `num_draft` extra scheduled tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestState


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    draft_len: int = 0  # D: draft tokens per speculative step (0 = no speculation)
    proposer_model: str | None = None  # second page table ("draft" / "mtp"), None if no KV


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int  # target tokens computed this step (prefill chunk or 1)
    num_draft: int = 0  # extra speculative tokens (decode-only batches)
    samples: bool = field(init=False)  # this step produces an output token for the request

    def __post_init__(self) -> None:
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens >= r.num_tokens


@dataclass
class StepBatch:
    step: int
    seqs: list[ScheduledSeq]
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_spec(self) -> bool:
        return any(s.num_draft > 0 for s in self.seqs)

    @property
    def kind(self) -> str:
        prefill = [s for s in self.seqs if s.request.in_prefill]
        if self.is_spec:
            return "spec"
        if not prefill:
            return "decode"
        return "prefill" if len(prefill) == len(self.seqs) else "mixed"

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
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished/aborted request out of the queues and free its pages."""
        if request in self.running:
            self.running.remove(request)
        try:
            self.waiting.remove(request)
        except ValueError:
            pass
        self.blocks.free(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- slots a sequence needs this step ------------------------------------------------
    def slots_needed(self, req: Request, num_new: int, num_draft: int) -> dict[str, int]:
        target = req.num_computed_tokens + num_new + num_draft
        slots = {"target": target}
        if self.config.proposer_model is not None:
            # draft KV runs one token ahead of the target's (it also sees the sampled token)
            slots[self.config.proposer_model] = target + 1
        return slots

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.blocks.free(victim.request_id)
        victim.state = RequestState.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)

    # -- the schedule stage ---------------------------------------------------------------
    def schedule(self) -> StepBatch:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        # Decide speculation up front: only when nothing waits to prefill (decode-only batch).
        decode_only = not self.waiting and all(not r.in_prefill for r in self.running)
        draft = cfg.draft_len if decode_only else 0
        planned: dict[str, int] = {}  # pages already promised to earlier seqs this step

        def fits(req: Request, n: int, d: int) -> bool:
            need = self.blocks.pages_needed(req.request_id, self.slots_needed(req, n, d))
            return need + sum(planned.values()) <= self.blocks.num_free_pages

        queue = list(self.running)
        i = 0
        while i < len(queue):
            req = queue[i]
            if req not in self.running:  # preempted below
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            d = min(draft, max(0, req.remaining_tokens - 1)) if n == 1 else 0
            while not fits(req, n, d):
                victim = self.running[-1]
                if victim is req:
                    break
                self._preempt(victim)
                preempted.append(victim)
            if not fits(req, n, d):
                if len(self.running) == 1:
                    raise RuntimeError(
                        f"request {req.request_id} does not fit in the KV pool even alone"
                    )
                self._preempt(req)
                preempted.append(req)
                i += 1
                continue
            planned[req.request_id] = self.blocks.pages_needed(
                req.request_id, self.slots_needed(req, n, d)
            )
            seqs.append(ScheduledSeq(req, n, d))
            budget -= n + d
            i += 1
            if budget <= 0:
                break

        # Admit waiting requests (prefill) while budget, seats and pages allow.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not fits(req, n, 0):
                break
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            self.running.append(req)
            planned[req.request_id] = self.blocks.pages_needed(
                req.request_id, self.slots_needed(req, n, 0)
            )
            seqs.append(ScheduledSeq(req, n, 0))
            budget -= n

        if draft and any(s.request.in_prefill for s in seqs):
            for s in seqs:
                s.num_draft = 0
        batch = StepBatch(self._step, seqs, preempted)
        self._step += 1
        return batch

    # -- the kv_alloc stage ---------------------------------------------------------------
    def allocate(self, batch: StepBatch) -> None:
        for s in batch.seqs:
            self.blocks.allocate(s.request.request_id, self.slots_needed(s.request, s.num_new_tokens, s.num_draft))
