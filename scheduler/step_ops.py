"""A step's primitives (pack, launch, book), which a schedule's runner orders, and the device work they leave in flight
across steps: a plain step launched ahead and the proposer's fill left running.

With an adaptive draft length a proposer's fills may wait while speculation is off (`lazy`) and catch up in one fill
when drafting resumes, so a load at which speculation does not pay costs what plain decoding does; a head then reads
the target's hidden states of the positions it missed, which the device keeps (`ForwardMessage.keep_hidden`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specsched.scheduler import messages, packing
from specsched.scheduler.launcher import Launcher
from specsched.scheduler.proposer import ProposerSpec
from specsched.scheduler.protocols import DeviceError
from specsched.scheduler.small_arrays import total
from specsched.scheduler.step_batch import StepBatch, computed_now
from specsched.scheduler.step_trace import Launch


@dataclass
class SpecPlan:
    """One speculative step's packed launches, before any is made."""

    batch: StepBatch
    t_step: int  # host time the step started
    verify: messages.Message
    draft: messages.Message | None  # None: the drafts were looked up on the host
    fill: messages.Message | None  # the fill over the verify window, packed before acceptance


class StepOps:
    def __init__(self, launcher: Launcher, spec: ProposerSpec, *, drafter: Any, lazy_fills: bool,
                 max_kept_tokens: int, uniform_verify: bool = False):
        self.l = launcher
        self.scheduler = launcher.scheduler
        self.table = self.scheduler.table
        self.blocks = self.scheduler.blocks
        self.spec = spec
        self.drafter = drafter  # `HostDrafter`, for `ProposerRules.host_drafts`
        self.lazy_fills = lazy_fills  # the proposer's fills wait while speculation is off
        self.max_kept_tokens = max_kept_tokens  # `PipelineConfig.max_kept_tokens`
        self.uniform_verify = uniform_verify  # `PipelineConfig.uniform_verify`
        self.inflight: tuple[StepBatch, Launch] | None = None  # a plain step launched ahead
        self.pending_fill: Launch | None = None  # the proposer's fill left running

    async def wait(self, launch: Launch, batch: StepBatch):
        return await self.l.wait(launch, batch)

    # -- plain steps ---------------------------------------------------------------------------
    def lazy(self, batch: StepBatch) -> bool:
        """Whether this forward step leaves the proposer's fill for a catch-up: fills may wait and speculation is off
        (a plain decode the policy chose, or a prefill after one or before the policy's first decision)."""
        if not self.lazy_fills:
            return False
        last = self.scheduler.policy.last
        return batch.decision is not None or last is None or last.draft_len == 0

    def launch_forward(self, batch: StepBatch, t_step: int, shape: dict) -> tuple[Launch, Launch | None]:
        """Plan and launch a plain step's forward and, unless `lazy`, the proposer's fill behind it: (forward, fill)."""
        l, spec, t, slots = self.l, self.spec, self.table, batch.slots
        t0 = l.now()
        fill_msg = None
        lazy = self.lazy(batch)
        keep = (self.lazy_fills and spec.kv_ahead == 0
                and (lazy or bool((t.proposer_computed[slots] < batch.start).any())))
        msg = packing.forward_message(batch, self.blocks, l.with_plan, keep_hidden=keep, eos=self.scheduler.eos)
        if spec.kv_model is not None and not lazy:
            fill_msg = packing.prefill_fill_message(batch, self.blocks, spec, t.proposer_computed[slots], l.with_plan)
        l.host("plan", batch.step, t0, **shape)
        launch = l.launch(l.main, msg)
        launch.t_step = t_step
        if keep and total(batch.start + batch.num_new - t.proposer_computed[slots]) > self.max_kept_tokens:
            # kept hidden states past the budget: the head reads those before this forward now, the device drops them
            l.aux.wait_event(launch.event)
            self.catch_up(batch)
        self.scheduler.launched(batch, fills=not lazy)
        s_fill = None
        if fill_msg is not None:
            l.aux.wait_event(launch.event)
            s_fill = l.launch(l.aux, fill_msg)
        return launch, s_fill

    async def run_ahead(self, batch: StepBatch, launch: Launch) -> None:
        """Leave this forward in flight, complete the one before it (the next step is scheduled before its tokens)."""
        prev, self.inflight = self.inflight, (batch, launch)
        if prev is not None:
            await self.complete_forward(*prev)

    async def complete_inflight(self) -> None:
        if self.inflight is not None:
            batch, launch = self.inflight
            self.inflight = None
            await self.complete_forward(batch, launch)

    async def complete_forward(self, batch: StepBatch, launch: Launch) -> None:
        l = self.l
        try:
            result = await l.sync(launch)
        except DeviceError as e:
            l.fail(batch, e)
            return
        t0 = l.now()
        # rows whose request finished while this step was in flight are left alone
        out_counts = l.deliver(self.scheduler.update(batch, result, t0), batch, result)
        l.host("output", batch.step, t0, **l.attrs(batch, computed_now(batch, self.table)), emitted=sum(out_counts))
        zeros = np.zeros(len(batch), dtype=np.int64)
        l.trace.step_done(batch, launch.t_step if launch.t_step is not None else t0, out_counts, zeros, zeros)

    def abandon(self) -> None:
        """Forget the device work left in flight (the device is being closed, nothing waits for it)."""
        self.inflight = self.pending_fill = None

    async def drain(self) -> None:
        """Complete the step in flight and wait for the fill left running."""
        await self.complete_inflight()
        if self.pending_fill is not None:
            fill, self.pending_fill = self.pending_fill, None
            try:
                await self.l.sync(fill)
            except DeviceError:
                pass  # the next launch for these rows reports it
        self.l.trace.flush_steps()
        self.l.trace.record_device_spans()

    # -- speculative steps -----------------------------------------------------------------------
    def plan_spec(self, batch: StepBatch, t_step: int, shape: dict) -> SpecPlan:
        """The `plan` stage: catch a lazy proposer up, then pack the draft, the verify and the verify-window fill."""
        l, spec = self.l, self.spec
        if spec.rules.lazy_fill:
            self.catch_up(batch)
        t0 = l.now()
        if spec.rules.host_drafts:
            # no draft launch: the verify carries the drafts (a row whose lookup found none verifies its last token)
            drafts, nd = self.drafter.draft(batch)
            nd = np.minimum(np.asarray(nd, dtype=np.int64), batch.draft_lens)
            l.host("draft", batch.step, t0, requests=len(batch), tokens=total(nd))
            t0 = l.now()
            vmsg = packing.verify_message(batch, self.blocks, spec, l.with_plan, draft_lens=nd, drafts=drafts,
                                          uniform=self.uniform_verify)
            l.host("plan", batch.step, t0, **shape)
            return SpecPlan(batch, t_step, vmsg, None, None)
        vmsg = packing.verify_message(batch, self.blocks, spec, l.with_plan, uniform=self.uniform_verify)
        dmsg = packing.draft_message(batch, self.blocks, spec, l.with_plan)
        fmsg = packing.verify_fill_message(batch, self.blocks, spec, l.with_plan) if spec.fill_same_batch else None
        l.host("plan", batch.step, t0, **shape)
        return SpecPlan(batch, t_step, vmsg, dmsg, fmsg)

    def launch_draft(self, plan: SpecPlan) -> Launch | None:
        """The draft, on the proposer's stream behind any pending fill (whose logits give its first token)."""
        if plan.draft is None:
            return None
        launch = self.l.launch(self.l.aux, plan.draft)
        self.pending_fill = None  # the draft queues behind it on its stream
        return launch

    def launch_verify(self, plan: SpecPlan, draft: Launch | None) -> Launch:
        if draft is not None:
            self.l.main.wait_event(draft.event)
        return self.l.launch(self.l.main, plan.verify)

    def launch_fill_behind(self, plan: SpecPlan, verify: Launch) -> Launch | None:
        """The fill over the verify window, queued behind the verify before acceptance is known."""
        if plan.fill is None:
            return None
        self.l.aux.wait_event(verify.event)
        return self.l.launch(self.l.aux, plan.fill)

    def accept(self, plan: SpecPlan, result, verify: Launch, fill: Launch | None) -> Launch | None:
        """Book the verify's result: launch the proposer's fill if none is yet, then the scheduler's update (accepted
        lengths, tokens output, rejected candidates' pages freed). Returns the step's fill, if any."""
        l, batch, spec, t, slots = self.l, plan.batch, self.spec, self.table, plan.batch.slots
        accepted = np.asarray(result.accepted, dtype=np.int64)
        draft_lens = np.asarray(result.draft_lens, dtype=np.int64)
        if spec.kv_model is not None and fill is None:
            t0 = l.now()
            fm = plan.fill if spec.fill_same_batch else packing.accept_fill_message(
                batch, t.num_tokens(slots), accepted, t.proposer_computed[slots], self.blocks, spec, l.with_plan)
            self._plan_fill(batch, t0, fm)
            l.aux.wait_event(verify.event)
            fill = l.launch(l.aux, fm)
        t0 = l.now()
        l.feed.verified(batch, draft_lens, accepted)
        out_counts = l.deliver(self.scheduler.update(batch, result, t0), batch, result)
        l.host("output", batch.step, t0, **l.attrs(batch, computed_now(batch, self.table)), emitted=sum(out_counts))
        l.trace.step_done(batch, plan.t_step, out_counts, draft_lens, accepted)
        return fill

    def defer_fill(self, fill: Launch | None) -> None:
        """Leave the fill running: the next launch on the proposer's stream queues behind it."""
        if fill is not None:
            self.pending_fill = fill

    def catch_up(self, batch: StepBatch) -> None:
        """A proposer that skipped fills reads what it missed in one fill ahead of the draft on its stream: a draft
        model the tokens up to the last one, a head the kept hidden states up to the last token's position."""
        l, t, slots = self.l, self.table, batch.slots
        # a draft model reads the last token too
        have, known = t.proposer_computed[slots], batch.start + self.spec.kv_ahead
        behind = (have < known).nonzero()[0]
        if not behind.size:
            return
        t0 = l.now()
        msg = packing.fill_message(batch.step, slots[behind], have[behind], known[behind], self.blocks, self.spec,
                                    after="catch_up", with_plan=l.with_plan)
        self._plan_fill(batch, t0, msg)
        self.pending_fill = l.launch(l.aux, msg)
        self.scheduler.caught_up(slots[behind], known[behind])

    def _plan_fill(self, batch: StepBatch, t0: int, msg: messages.FillMessage) -> None:
        s = msg.shape
        self.l.host("plan", batch.step, t0, kind="fill", requests=s.requests, tokens=s.tokens, kv_tokens=s.kv_tokens)
