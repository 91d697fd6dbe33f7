"""The pipeline's speculative step, as primitives a schedule's runner orders: plan, draft,
verify, a fill behind the verify, acceptance (bookkeeping, the fill after it, output).

Why a module of its own: scheduler/pipeline.py holds the step loop and scheduler/schedules.py
the runners, each a sequence of these launches and waits; what each primitive packs, launches
and books -- and a lazy proposer's catch-up after steps that did not speculate -- is here. It
works on the pipeline's state and helpers (`_launch`, `_sync`, `_host`, `_output`, the streams,
the slot table).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specsched.scheduler import messages
from specsched.scheduler.protocols import DeviceError
from specsched.scheduler.small_arrays import total
from specsched.scheduler.step_batch import StepBatch
from specsched.scheduler.step_trace import Launch


@dataclass
class SpecPlan:
    """One speculative step's packed launches, before any is made."""

    batch: StepBatch
    t_step: int  # host time the step started
    verify: messages.Message
    draft: messages.Message | None  # None: the drafts were looked up on the host
    fill: messages.Message | None  # the fill over the verify window, packed before acceptance


class SpeculativeStep:
    def _plan_spec(self, batch: StepBatch, t_step: int, shape: dict) -> SpecPlan:
        """Catch a lazy proposer up, then pack the draft, the verify and (over the verify
        window) the fill: the `plan` stage of a speculative step."""
        spec = self.spec
        if spec.rules.lazy_fill:
            self._catch_up(batch)
        t0 = self._now()
        if spec.rules.host_drafts:
            # a lookup on the host: no draft launch; the verify carries the drafts and covers
            # what each row drafted (a row whose lookup found nothing verifies its last token)
            drafts, nd = self.drafter.draft(batch)
            nd = np.minimum(np.asarray(nd, dtype=np.int64), batch.num_draft)
            self._host("draft", batch.step, t0, requests=len(batch), tokens=total(nd))
            t0 = self._now()
            vmsg = messages.verify_message(batch, self.blocks, spec, self.with_plan, num_draft=nd, drafts=drafts)
            self._host("plan", batch.step, t0, **shape)
            return SpecPlan(batch, t_step, vmsg, None, None)
        vmsg = messages.verify_message(batch, self.blocks, spec, self.with_plan)
        dmsg = messages.draft_message(batch, self.blocks, spec, self.with_plan)
        fmsg = messages.verify_fill_message(batch, self.blocks, spec, self.with_plan) if spec.fill_same_batch else None
        self._host("plan", batch.step, t0, **shape)
        return SpecPlan(batch, t_step, vmsg, dmsg, fmsg)

    def _launch_draft(self, plan: SpecPlan) -> Launch | None:
        """The draft, on the proposer's stream (behind any pending fill, whose logits its first
        token comes from): rows stop drafting at their own count."""
        if plan.draft is None:
            return None
        launch = self._launch(self.aux, plan.draft)
        self._pending_fill = None  # the draft queues behind it on its stream
        return launch

    def _launch_verify(self, plan: SpecPlan, draft: Launch | None) -> Launch:
        if draft is not None:
            self.main.wait_event(draft.event)
        return self._launch(self.main, plan.verify)

    def _launch_fill_behind(self, plan: SpecPlan, verify: Launch) -> Launch | None:
        """The fill over the verify window, queued behind the verify before acceptance is known."""
        if plan.fill is None:
            return None
        self.aux.wait_event(verify.event)
        return self._launch(self.aux, plan.fill)

    async def _wait(self, launch: Launch, batch: StepBatch):
        """The launch's result; None after a device error, which failed the batch."""
        try:
            return await self._sync(launch)
        except DeviceError as e:
            self._fail_batch(batch, e)
            return None

    def _accept(self, plan: SpecPlan, result, verify: Launch, fill: Launch | None) -> Launch | None:
        """The verify's result on the host: accepted lengths booked, the proposer's fill
        launched if none is yet (over the accepted tokens, or the verify window), the tokens
        output, rejected candidates' pages given back. Returns the step's fill, if any."""
        batch, spec, t, slots = plan.batch, self.spec, self.table, plan.batch.slots
        accepted = np.asarray(result.accepted, dtype=np.int64)
        num_drafts = np.asarray(result.num_drafts, dtype=np.int64)
        starts_before = self.builder.advance_verify(batch, accepted)
        if spec.kv_model is not None and fill is None:
            t0 = self._now()
            fm = plan.fill if spec.fill_same_batch else messages.accept_fill_message(
                batch, starts_before, accepted, t.proposer_computed[slots], self.blocks, spec, self.with_plan)
            fs = fm.shape
            self._host("plan", batch.step, t0, kind="fill", requests=fs.requests, tokens=fs.tokens,
                       kv_tokens=fs.kv_tokens)
            self.aux.wait_event(verify.event)
            fill = self._launch(self.aux, fm)
        t0 = self._now()
        self.builder.record_verify(batch, starts_before, accepted, num_drafts, spec.kv_ahead)
        self.feed.verified(batch, num_drafts, accepted)
        # [B, W] emitted tokens, row i's first accepted[i] + 1 valid
        out_counts = self._output(batch, np.arange(len(batch)), np.asarray(result.tokens), accepted + 1)
        self.builder.trim_rejected(batch)
        self._host("output", batch.step, t0, **self._attrs(batch, self.builder.computed_now(batch)),
                   emitted=sum(out_counts))
        self.trace.step_done(batch, plan.t_step, out_counts, num_drafts, accepted)
        return fill

    def _defer_fill(self, fill: Launch | None) -> None:
        """Leave the fill running: the next launch on the proposer's stream queues behind it."""
        if fill is not None:
            self._pending_fill = fill

    def _catch_up(self, batch: StepBatch) -> None:
        """A proposer that skipped fills (plain decode steps of an adaptive draft length) reads
        what it missed, in one fill launched ahead of the draft on its stream (which carries the
        logits the first draft token comes from): a draft model the tokens up to the last one,
        a head the target's hidden states the device kept, up to the last token's position."""
        t, slots = self.table, batch.slots
        # positions it has read, positions it needs: a draft model reads the last token too
        have, known = t.proposer_computed[slots], batch.start + self.spec.kv_ahead
        behind = (have < known).nonzero()[0]
        if not behind.size:
            return
        t0 = self._now()
        msg = messages.fill_message(batch.step, slots[behind], have[behind], known[behind], self.blocks, self.spec,
                                    after="catch_up", with_plan=self.with_plan)
        fs = msg.shape
        self._host("plan", batch.step, t0, kind="fill", requests=fs.requests, tokens=fs.tokens, kv_tokens=fs.kv_tokens)
        self._pending_fill = self._launch(self.aux, msg)
        t.proposer_computed[slots[behind]] = known[behind]
