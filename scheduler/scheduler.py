"""The scheduler: a pure state machine over requests, slots and KV pages (no torch, no clock, no device).

    add(request)                 queue it (it gets a slot); InvalidRequestError if it never fits
    abort(id) / stop(id, n)      end it at the next step boundary (`finish_marked`)
    schedule() -> StepBatch      which requests run this step, with how many tokens
    allocate(batch)              grow their page tables (the kv_alloc stage)
    launched(batch, fills)       a forward step's launch: positions computed, tokens pending
    update(batch, result, now)   a step's result: accepted lengths, emitted tokens (cut at
                                 max_tokens, EOS, aborts and stops), finishes, freed pages
                                 -> StepOutput

It owns the per-slot arrays, the queues and the block manager; the pipeline reads them and calls the methods above.
Continuous batching as vLLM does it (FCFS, chunked prefill, speculation on decode-only batches, preemption by
recompute) is batching.py; what a step's tokens do to their requests, outputs.py.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from specsched.scheduler import batching
from specsched.scheduler.batching import SchedulerConfig, max_pages_needed
from specsched.scheduler.block_manager import BlockManager, KVPoolStats
from specsched.scheduler.draft_policy import DraftPolicy, FixedPolicy
from specsched.scheduler.errors import InvalidRequestError
from specsched.scheduler.outputs import StepOutput, emit, marked_reason
from specsched.scheduler.request import Request, RequestState
from specsched.scheduler.slot_state import SlotTable
from specsched.scheduler.small_arrays import every
from specsched.scheduler.step_batch import StepBatch, empty_batch, live_rows


_NOTHING = StepOutput()  # what a boundary with no abort or stop asked for ends (never changed)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, policy: DraftPolicy | None = None, *,
                 eos_token_ids: tuple[int, ...] = (), keep_ids: bool = True):
        self.config = config
        self.blocks = blocks
        # per-request counters by slot; a slot is also the request's page-table row
        self.table = SlotTable(max(8, config.max_num_seqs), max(1, config.draft_len))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # queued or running, by id
        self._running_slots: np.ndarray | None = None  # slots of `running`, in order
        self._marked: dict[str, None] = {}  # ids to abort or stop at the next step boundary, in order asked
        self._step = 0
        self.eos = frozenset(eos_token_ids)
        self.keep_ids = keep_ids  # False: a request's output is its count only (the simulator's)
        # chooses each decode-only step's D (scheduler/draft_policy.py); a fixed D by default
        self.policy: DraftPolicy = policy if policy is not None else FixedPolicy(config.draft_len)
        # each row's lag (tokens its proposer has not read) goes with the view the policy decides on
        self._lags = config.lazy_fill and self.policy.pauses

    # -- requests --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (it gets its slot); InvalidRequestError if it could never fit in
        the KV pool alone, or its id is queued or running."""
        rid = request.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        need = self.max_pages_needed(request)
        if need > self.blocks.num_pages:
            raise InvalidRequestError(
                f"request {rid}: prompt ({request.num_prompt_tokens}) + max_tokens "
                f"({request.params.max_tokens}) may need {need} KV pages, the pool has "
                f"{self.blocks.num_pages}"
            )
        slot = self.table.attach(request)
        self.policy.start(slot)
        self.requests[rid] = request
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def max_pages_needed(self, request: Request) -> int:
        """Upper bound on the pages the request can hold at once (its last verification)."""
        return max_pages_needed(self.config, self.blocks.page_size, request.num_prompt_tokens,
                                request.params.max_tokens)

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary. False if unknown or finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.abort_requested = True
        self._marked[request_id] = None
        return True

    def stop(self, request_id: str, num_output_tokens: int) -> bool:
        """A stop string the request's consumer found: finish it with reason "stop" at the next
        step boundary, its output cut to its first `num_output_tokens` tokens (tokens produced
        meanwhile are dropped). False if unknown or finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.stop_at is None or num_output_tokens < req.stop_at:
            req.stop_at = num_output_tokens
        self._marked[request_id] = None
        return True

    def finish_marked(self, in_flight: StepBatch | None, now: int) -> StepOutput:
        """Aborts and stops asked for, of requests not in the step in flight."""
        if not self._marked:
            return _NOTHING
        out = StepOutput()
        for rid in list(self._marked):
            req = self.requests.get(rid)
            if req is None:
                self._marked.pop(rid, None)
            elif in_flight is None or not any(r is req for r in in_flight.requests):
                self._finish([req], marked_reason(req), now, out.finished)
        return out

    def fail(self, batch: StepBatch, error: str, now: int) -> StepOutput:
        """A device error failed the batch: its requests finish with reason "error"."""
        out = StepOutput()
        for r in batch.requests:
            if not r.is_finished:
                r.num_pending_tokens = 0
        self._finish(list(batch.requests), "error", now, out.finished, error)
        return out

    def finish_all(self, now: int) -> StepOutput:
        """Every request left finishes as aborted (the run loop was cancelled)."""
        out = StepOutput()
        self._finish(list(self.requests.values()), "abort", now, out.finished)
        return out

    def kv_stats(self) -> KVPoolStats:
        return self.blocks.stats({rid: r.slot for rid, r in self.requests.items()})

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the schedule and kv_alloc stages ---------------------------------------------------
    def schedule(self) -> StepBatch:
        """Which requests run this step, with how many tokens (scheduler/batching.py)."""
        return batching.schedule(self)

    def allocate(self, batch: StepBatch) -> None:
        """Grow page tables for the batch; a speculative batch reserves all 1 + D verify
        slots of every row (rejected ones are trimmed after acceptance)."""
        if not len(batch):
            return
        if batch.shortfall is not None and batch.shortfall[0] == self.blocks.version:
            self.blocks.allocate(batch.slots, shortfall=batch.shortfall[1])
            return
        extra = np.where(batch.num_new == 1, batch.draft_len, batch.draft_lens) if batch.is_spec \
            else batch.draft_lens
        self.blocks.allocate(batch.slots, self.kv_slots(batch.start + batch.num_new + extra))

    # -- a step's launches and results ------------------------------------------------------
    def launched(self, batch: StepBatch, fills: bool) -> None:
        """A forward step launched: its positions are computed, sampling rows have a token
        pending on the device; with `fills`, the proposer's KV has read them too (a draft
        model also the sampled token)."""
        t, slots = self.table, batch.slots
        computed = batch.start + batch.num_new
        t.computed[slots] = computed
        t.pending[slots] += batch.samples
        if fills and self.config.proposer_model is not None:
            t.proposer_computed[slots] = computed + self.config.kv_ahead * batch.samples

    def caught_up(self, slots: np.ndarray, known: np.ndarray) -> None:
        """The proposer's KV of these rows was filled up to `known` (a catch-up fill)."""
        self.table.proposer_computed[slots] = known

    def update(self, batch: StepBatch, result, now: int) -> StepOutput:
        """A step's result on the host (a `ForwardResult` or a `VerifyResult`): accepted lengths
        and speculation counters booked, tokens emitted, requests finished, rejected candidates'
        pages given back. Rows whose request finished while the step was in flight keep nothing."""
        t, slots = self.table, batch.slots
        accepted = getattr(result, "accepted", None)
        if accepted is None:  # a forward: its sampled tokens are no longer pending
            t.pending[slots[batch.samples & live_rows(batch, t)]] -= 1
            rows = batch.samples.nonzero()[0]
            return self._emit(batch, rows, np.asarray(result.tokens)[rows, None], None, now)
        accepted = np.asarray(accepted, dtype=np.int64)
        before = t.num_tokens(slots)
        t.computed[slots] += 1 + accepted  # the KV covers the last token and the accepted drafts
        t.record_spec(slots, np.asarray(result.draft_lens, dtype=np.int64), accepted)
        # draft model: every emitted token after its fill; heads: up to the new last token
        t.proposer_computed[slots] = before + accepted + self.config.kv_ahead
        out = self._emit(batch, np.arange(len(batch)), np.asarray(result.tokens), accepted + 1, now)
        live = live_rows(batch, t)  # rows still running keep the pages of their tokens only
        rows = slots if every(live) else slots[live]
        self.blocks.trim(rows, "target", t.num_tokens(rows))
        return out

    def _emit(self, batch, rows, tokens, lens, now) -> StepOutput:
        em = emit(self.table, batch, rows, tokens, lens, eos=self.eos, keep_ids=self.keep_ids,
                  marked=self._marked, now=now)
        out = StepOutput(em.counts, em.tokens)
        self._finish(em.by_length, "length", now, out.finished)
        for req, reason in em.ends:
            self._finish([req], marked_reason(req) if reason == "marked" else reason, now, out.finished)
        return out

    # -- queues and slots (the general path's moves) ------------------------------------------
    def running_slots(self) -> np.ndarray:
        """[R] slots of the running requests, in their order."""
        if self._running_slots is None:
            self._running_slots = np.fromiter((r.slot for r in self.running), dtype=np.int64,
                                              count=len(self.running))
        return self._running_slots

    def kv_slots(self, target):
        """KV slots per model for `target` target slots (an int, or an array over rows): a
        proposer's KV is reserved one token ahead (a draft model also sees the sampled token)."""
        slots = {"target": target}
        if self.config.proposer_model is not None:
            slots[self.config.proposer_model] = target + 1
        return slots

    def admit(self, reqs: list[Request]) -> None:
        """The first len(reqs) waiting requests start running."""
        for r in reqs:
            self.waiting.popleft()
            r.state = RequestState.RUNNING
        self.running.extend(reqs)
        self._running_slots = None

    def preempt(self, victim: Request) -> None:
        """A running request gives its pages back and waits, first in line, to be recomputed."""
        self.running.remove(victim)
        self._running_slots = None
        self.blocks.free([victim.slot])
        victim.state = RequestState.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_proposer_computed = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)

    def make_batch(self, reqs: list[Request], slots: np.ndarray, start: np.ndarray, num_new: np.ndarray,
                   draft_lens: np.ndarray, prefill: np.ndarray, preempted: list[Request], draft: int = 0,
                   decision: object = None, samples: np.ndarray | None = None) -> StepBatch:
        """The step's batch; `samples` (rows that reach their last token) unless given."""
        if samples is None:
            samples = start + num_new >= self.table.num_tokens(slots)
        batch = StepBatch(self._step, reqs, slots, start, num_new, draft_lens, samples,
                          prefill, self.table.gen[slots], preempted, draft, decision)
        self._step += 1
        return batch

    def empty_batch(self, preempted: list[Request]) -> StepBatch:
        self._step += 1
        return empty_batch(self._step - 1, preempted)

    # -- finishing --------------------------------------------------------------------------
    def _finish(self, reqs: list[Request], reason: str, now: int, finished: list[Request],
                error: str | None = None) -> None:
        """End requests not yet finished: queues, pages and slots freed in one pass each."""
        reqs = [r for r in reqs if not r.is_finished]
        state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        for r in reqs:
            r.state, r.finish_reason, r.error, r.finish_ns = state, reason, error, now
        self._remove(reqs)
        finished.extend(reqs)

    def _remove(self, reqs: list[Request]) -> None:
        """Take requests out of the queues and free their pages and slots (the same pages and
        slots, in the same order, as one by one)."""
        reqs = [r for r in reqs if r.request_id in self.requests]
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
        self.blocks.free([r.slot for r in reqs])
        self.table.detach(reqs)
        for r in reqs:
            del self.requests[r.request_id]
            self._marked.pop(r.request_id, None)
