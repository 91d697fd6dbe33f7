"""The batch builder's bookkeeping: a step's rows' counters after its launches, whole-array.

Why a module of its own: scheduler/batch_builder.py decides what runs (the schedule and
kv_alloc stages); what a launched or completed step does to its rows' counters -- positions
computed, tokens pending on the device, accepted lengths, the proposer's KV extent,
rejected candidates' pages given back -- is this mixin's, one whole-array update per stage
whatever the batch. It works on the builder's slot table (scheduler/slot_state.py) and block
manager. Rows whose request finished while the step was in flight
(their slot given back, maybe to a new request) are told apart by the slot's generation.
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.small_arrays import every, some
from specsched.scheduler.step_batch import StepBatch


class RowBookkeeping:
    def live(self, batch: StepBatch) -> np.ndarray:
        """[B] rows whose request still holds its slot (one that finished while the batch was
        in flight gave it back; a new request may hold it now)."""
        return self.table.gen[batch.slots] == batch.gen

    def without_finished(self, batch: StepBatch) -> StepBatch:
        """The batch without the rows whose request finished since it was scheduled (on the
        tokens of a step then in flight), before it is allocated; the batch itself if none did."""
        live = self.live(batch)
        if every(live):
            return batch
        keep = live.nonzero()[0]
        return StepBatch(batch.step, [batch.requests[i] for i in keep.tolist()], batch.slots[keep],
                         batch.start[keep], batch.num_new[keep], batch.num_draft[keep], batch.samples[keep],
                         batch.prefill[keep], batch.gen[keep], batch.preempted, batch.width, batch.decision)

    def computed_now(self, batch: StepBatch) -> np.ndarray:
        """[B] num_computed_tokens of the batch's rows now (a finished row's own, kept in its
        handle once its slot went back)."""
        t = self.table
        computed = t.computed[batch.slots]
        gone = t.gen[batch.slots] != batch.gen
        if some(gone):
            for i in gone.nonzero()[0].tolist():
                computed[i] = batch.requests[i].num_computed_tokens
        return computed

    def advance_forward(self, batch: StepBatch, kv_ahead: int | None) -> None:
        """A forward step launched: its positions are computed, sampling rows have a token
        pending on the device; a proposer with KV (`kv_ahead` not None) has read them too (a
        draft model also the sampled token)."""
        t, slots = self.table, batch.slots
        computed = batch.start + batch.num_new
        t.computed[slots] = computed
        t.pending[slots] += batch.samples
        if kv_ahead is not None:
            t.proposer_computed[slots] = computed + kv_ahead * batch.samples

    def complete_forward(self, batch: StepBatch) -> None:
        """A forward step's tokens reached the host: they are no longer pending (the pipeline
        then appends them to the outputs)."""
        t = self.table
        t.pending[batch.slots[batch.samples & self.live(batch)]] -= 1

    def advance_verify(self, batch: StepBatch, accepted: np.ndarray) -> np.ndarray:
        """A verification's accepted lengths arrived: each row's KV now covers its last token
        and `accepted[i]` drafts. Returns [B] each row's token count before the step."""
        t, slots = self.table, batch.slots
        before = t.num_tokens(slots)
        t.computed[slots] += 1 + accepted
        return before

    def record_verify(self, batch: StepBatch, before: np.ndarray, accepted: np.ndarray,
                      num_drafts: np.ndarray, kv_ahead: int) -> None:
        """Speculation counters and the proposer's KV extent after a verification (before
        its tokens are appended: a request that finishes on them keeps its counts)."""
        t, slots = self.table, batch.slots
        t.record_spec(slots, num_drafts, accepted)
        # draft model: every emitted token after its fill; heads: up to the new last token
        t.proposer_computed[slots] = before + accepted + kv_ahead

    def trim_rejected(self, batch: StepBatch) -> int:
        """After a verification's tokens were appended: the pages of rejected candidates go
        back, for rows still running (a finished row's pages went with it). Returns pages freed."""
        t, slots = self.table, batch.slots
        live = self.live(batch)
        rows = slots if every(live) else slots[live]
        return self.blocks.trim_many(rows, "target", t.num_tokens(rows))
