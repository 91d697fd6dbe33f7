"""The pipeline's speculative step: draft, verify, acceptance, the proposer's fill.

Why a module of its own: scheduler/pipeline.py holds the step loop and its plain steps; the
speculative step -- the launches whose order and waits make up the `sync`, `overlap` and
`eager_fill` schedules (see scheduler/schedules.py), and a draft model's catch-up after steps that
did not speculate -- is this mixin's. It works on the pipeline's state and helpers (`_launch`,
`_sync`, `_host`, `_output`, the streams, the slot table).
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler import messages
from specsched.scheduler.protocols import DeviceError
from specsched.scheduler.small_arrays import total
from specsched.scheduler.step_batch import StepBatch


class SpeculativeStep:
    async def _spec_step(self, batch: StepBatch, t_step: int, shape: dict) -> None:
        spec, rules, t, slots = self.spec, self.rules, self.table, batch.slots
        if spec.rules.lazy_fill:
            self._catch_up(batch)
        t0 = self._now()
        fmsg = None
        if spec.rules.host_drafts:
            # a lookup on the host: no draft launch; the verify carries the drafts and covers
            # what each row drafted (a row whose lookup found nothing verifies its last token)
            drafts, nd = self.drafter.draft(batch)
            nd = np.minimum(np.asarray(nd, dtype=np.int64), batch.num_draft)
            self._host("draft", batch.step, t0, requests=len(batch), tokens=total(nd))
            t0 = self._now()
            vmsg = messages.verify_message(batch, self.blocks, spec, self.with_plan, num_draft=nd, drafts=drafts)
            self._host("plan", batch.step, t0, **shape)
        else:
            vmsg = messages.verify_message(batch, self.blocks, spec, self.with_plan)
            dmsg = messages.draft_message(batch, self.blocks, spec, self.with_plan)
            if spec.fill_same_batch:
                fmsg = messages.verify_fill_message(batch, self.blocks, spec, self.with_plan)
            self._host("plan", batch.step, t0, **shape)
            # rows stop drafting at their own count; the first token of each comes from logits
            # the fill computed, every further one is a proposer forward (what the cost follows)
            d_launch = self._launch(self.aux, dmsg)
            self._pending_fill = None  # the draft queues behind any pending fill on its stream
            if rules.awaits_launches:
                try:
                    await self._sync(d_launch)
                except DeviceError as e:
                    self._fail_batch(batch, e)
                    return
            self.main.wait_event(d_launch.event)
        v_launch = self._launch(self.main, vmsg)
        f_launch = None
        if fmsg is not None and rules.fill_behind_verify:
            self.aux.wait_event(v_launch.event)
            f_launch = self._launch(self.aux, fmsg)
        try:
            result = await self._sync(v_launch)
        except DeviceError as e:
            self._fail_batch(batch, e)
            return
        accepted = np.asarray(result.accepted, dtype=np.int64)
        num_drafts = np.asarray(result.num_drafts, dtype=np.int64)
        starts_before = self.builder.advance_verify(batch, accepted)
        if spec.kv_model is not None and f_launch is None:
            t0 = self._now()
            fm = fmsg if spec.fill_same_batch else messages.accept_fill_message(
                batch, starts_before, accepted, t.proposer_computed[slots], self.blocks, spec, self.with_plan)
            fs = fm.shape
            self._host("plan", batch.step, t0, kind="fill", requests=fs.requests, tokens=fs.tokens,
                       kv_tokens=fs.kv_tokens)
            self.aux.wait_event(v_launch.event)
            f_launch = self._launch(self.aux, fm)
        t0 = self._now()
        self.builder.record_verify(batch, starts_before, accepted, num_drafts, spec.kv_ahead)
        self._verified(batch, num_drafts, accepted)
        # [B, W] emitted tokens, row i's first accepted[i] + 1 valid
        out_counts = self._output(batch, np.arange(len(batch)), np.asarray(result.tokens), accepted + 1)
        self.builder.trim_rejected(batch)
        self._host("output", batch.step, t0, **self._attrs(batch, self.builder.computed_now(batch)),
                   emitted=sum(out_counts))
        self.trace.step_done(batch, t_step, out_counts, num_drafts, accepted)
        if f_launch is not None:
            if rules.awaits_launches:
                await self._await_fill(f_launch, batch)
            else:
                self._pending_fill = f_launch

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
