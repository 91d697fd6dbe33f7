"""Continuous batching: which requests run this step, with how many tokens.

Policy (vLLM-like, FCFS): running requests first, then admit waiting ones within the
token budget (`max_num_batched_tokens`) and `max_num_seqs`. Prefill may be chunked.
Speculation happens only on decode-only batches (every running request decodes and no
waiting one can get a seat): a step that prefills anything samples normally for every
request in it. When pages run out the most recently admitted running request is preempted
(pages freed, recomputed later from prompt + outputs); a request is never dropped. A request
that could not fit in the pool even alone is rejected by `add`.

The steady state (every running request decodes) is scheduled here with whole-array operations
on the per-slot arrays (scheduler/slot_state.py); any other step takes the general path
(scheduler/general_schedule.py), where admission, chunking and preemption walk the few
requests they touch. Every scheduled row computes tokens [num_computed_tokens,
num_computed_tokens + num_new) and samples iff that reaches its last token. A decode is the special case
num_new == 1; a speculative decode adds `num_draft` drafted tokens (at most D, and
fewer near max_tokens); its verification covers the row's 1 + num_draft positions (an
n-gram row under `sync`: what it did draft), but budget and KV pages are reserved for
1 + D per row (D = `draft_len`), what the step may take before its drafts are known.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.draft_policy import DraftPolicy, FixedPolicy, StepView
from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.request import Request, RequestState
from specsched.scheduler.general_schedule import GeneralSchedule
from specsched.scheduler.row_bookkeeping import RowBookkeeping
from specsched.scheduler.slot_state import SlotTable
from specsched.scheduler.small_arrays import some, total
from specsched.scheduler.step_batch import StepBatch


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per step, verify width (1 + D) counted per spec row
    draft_len: int = 0  # D: verify candidates per speculative step (0 = no speculation)
    proposer_model: str | None = None  # second page table ("draft" / "mtp"), None if no KV
    kv_ahead: int = 0  # tokens the proposer's KV runs ahead of the target's (`ProposerSpec.kv_ahead`)
    # the proposer's fills may wait while a policy that pauses has speculation off, and catch up
    # when it drafts again (`ProposerRules.lazy_fill`)
    lazy_fill: bool = False

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


class BatchBuilder(RowBookkeeping, GeneralSchedule):
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, policy: DraftPolicy | None = None):
        self.config = config
        self.blocks = blocks
        # per-request counters by slot; a slot is also the request's page-table row
        self.table = SlotTable(max(8, config.max_num_seqs), max(1, config.draft_len))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._running_slots: np.ndarray | None = None  # slots of `running`, in order
        self._ids: set[str] = set()  # ids queued or running
        self._step = 0
        # chooses each decode-only step's D (scheduler/draft_policy.py); a fixed D by default
        self.policy: DraftPolicy = policy if policy is not None else FixedPolicy(config.draft_len)
        # each row's lag (tokens its proposer has not read) goes with the view the policy decides on
        self._lags = config.lazy_fill and self.policy.pauses

    # -- queue management ---------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (it gets its slot); InvalidRequestError if it could never fit in
        the KV pool alone, or its id is queued or running."""
        rid = request.request_id
        if rid in self._ids:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        need = self.max_pages_needed(request)
        if need > self.blocks.num_pages:
            raise InvalidRequestError(
                f"request {rid}: prompt ({request.num_prompt_tokens}) + max_tokens "
                f"({request.params.max_tokens}) may need {need} KV pages, the pool has "
                f"{self.blocks.num_pages}"
            )
        slot = self.table.attach(request)
        self.blocks.bind(rid, slot)
        self.policy.start(slot)
        self._ids.add(rid)
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def max_pages_needed(self, request: Request) -> int:
        """Upper bound on the pages the request can hold at once (its last verification)."""
        return max_pages_needed(self.config, self.blocks.page_size, request.num_prompt_tokens,
                                request.params.max_tokens)

    def remove(self, request: Request) -> None:
        """Take a finished/aborted request out of the queues, free its pages and its slot."""
        if request.request_id not in self._ids:
            return
        # membership first: a failed deque.remove formats the request's repr into its error
        if request in self.running:
            self.running.remove(request)
            self._running_slots = None
        if request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        self.table.detach(request)
        self._ids.discard(request.request_id)

    def remove_many(self, requests: list[Request]) -> None:
        """`remove` for many requests at once: each queue filtered once, pages and slots
        freed whole-array (the same pages and slots, in the same order, as one by one)."""
        ids = self._ids
        reqs = [r for r in requests if r.request_id in ids]
        if not reqs:
            return
        gone = set(reqs)
        running = [r for r in self.running if r not in gone]
        found = len(self.running) - len(running)
        if found:
            self.running[:] = running
            self._running_slots = None
        if found < len(reqs) and self.waiting:
            left = [r for r in self.waiting if r not in gone]
            if len(left) != len(self.waiting):
                self.waiting.clear()
                self.waiting.extend(left)
        self.blocks.free_many([r.request_id for r in reqs])
        self.table.detach_many(reqs)
        ids.difference_update(r.request_id for r in reqs)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_slots(self) -> np.ndarray:
        """[R] slots of the running requests, in their order."""
        if self._running_slots is None:
            self._running_slots = np.fromiter((r.slot for r in self.running), dtype=np.int64,
                                              count=len(self.running))
        return self._running_slots

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
        self._running_slots = None
        self.blocks.release_pages(victim.request_id)
        victim.state = RequestState.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_proposer_computed = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _batch(self, reqs: list[Request], slots: np.ndarray, start: np.ndarray, num_new: np.ndarray,
               num_draft: np.ndarray, prefill: np.ndarray, preempted: list[Request], draft: int = 0,
               decision: object = None, samples: np.ndarray | None = None) -> StepBatch:
        """The step's batch; `samples` (rows that reach their last token) unless given."""
        t = self.table
        if samples is None:
            samples = start + num_new >= t.num_tokens(slots)
        batch = StepBatch(self._step, reqs, slots, start, num_new, num_draft, samples,
                          prefill, t.gen[slots], preempted, 1 + draft, decision)
        self._step += 1
        return batch

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
        t = self.table
        slots = self.running_slots()
        computed = t.computed[slots]
        prompt = t.prompt_len[slots]
        emitted = t.num_output[slots] + t.pending[slots]
        todo = prompt + emitted - computed
        if some(todo > 1) or some(computed < prompt):
            return None  # a prefill or recompute in the batch: no speculation, the general path
        active = (todo == 1).nonzero()[0]
        # D for this step, how many rows its budget then holds (in order) and what each drafts
        a_slots = slots[active] if active.size < slots.size else slots
        a_computed = computed[active] if active.size < slots.size else computed
        lag = np.maximum(a_computed + cfg.kv_ahead - t.proposer_computed[a_slots], 0) if self._lags else None
        remaining = t.max_tokens[a_slots] - (emitted[active] if active.size < slots.size else emitted)
        decision = self.policy.choose(StepView(a_slots, remaining, a_computed, cfg.max_num_batched_tokens, lag))
        draft = decision.draft_len
        take = active[: min(active.size, decision.rows)]
        n = take.size
        if n == 0:
            return None
        if n == len(running):
            reqs, rows = list(running), slots
        else:
            reqs, rows, computed, emitted = [running[i] for i in take.tolist()], slots[take], computed[take], emitted[take]
        blocks = self.blocks
        cols = blocks.shortfall(rows, self._slots(computed + 1 + draft))
        if sum(total(c) for c in cols.values()) > blocks.num_free_pages:
            return None  # someone is preempted: the general path chooses whom
        num_draft = decision.num_draft
        one = np.ones(n, dtype=np.int64)
        # every row computes its one last token: every row samples
        batch = self._batch(reqs, rows, computed, one, num_draft, np.zeros(n, dtype=bool), [], draft, decision,
                            samples=np.ones(n, dtype=bool))
        batch.shortfall = (blocks.version, cols)  # what `allocate` reserves: 1 + D slots per row
        return batch

    # -- the kv_alloc stage ---------------------------------------------------------------
    def allocate(self, batch: StepBatch) -> None:
        """Grow page tables for the batch; a speculative batch reserves all 1 + D verify
        slots of every row (rejected ones are trimmed after acceptance)."""
        if not len(batch):
            return
        if batch.shortfall is not None and batch.shortfall[0] == self.blocks.version:
            self.blocks.allocate_many(batch.slots, shortfall=batch.shortfall[1])
            return
        extra = np.where(batch.num_new == 1, batch.width - 1, batch.num_draft) if batch.is_spec \
            else batch.num_draft
        self.blocks.allocate_many(batch.slots, self._slots(batch.start + batch.num_new + extra))
