"""The pipeline's plain steps: prefill, mixed and plain decode forwards, as primitives a
schedule's runner orders (scheduler/schedules.py): launch, run ahead, complete.

Why a module of its own: scheduler/pipeline.py holds the step loop; a forward step's launch,
the proposer's fill behind it (or none while speculation is off), its completion and the
one-step-ahead launches of `plain_overlap` (and of an adaptive draft length's plain steps under
`overlap` and `eager_fill`) are this mixin's, as the speculative step's are spec_step.py's. It
works on the pipeline's state and helpers (`_launch`, `_sync`, `_host`, `_output`, the
streams, the slot table, `_inflight`).
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler import messages
from specsched.scheduler.protocols import DeviceError
from specsched.scheduler.small_arrays import total
from specsched.scheduler.step_batch import StepBatch
from specsched.scheduler.step_trace import Launch


class ForwardStep:
    def _lazy(self, batch: StepBatch) -> bool:
        """Whether this forward step leaves the proposer's fill for a catch-up: its fills may
        wait (`lazy_fills`) and speculation is off -- this step is a plain decode the policy
        chose, or it prefills after one or before the policy's first decision (the first
        drafting step catches up)."""
        if not self.lazy_fills:
            return False
        last = self.policy.last
        return batch.decision is not None or last is None or last.draft_len == 0

    async def _complete_inflight(self) -> None:
        if self._inflight is not None:
            batch, launch = self._inflight
            self._inflight = None
            await self._complete_forward(batch, launch)

    def _launch_forward(self, batch: StepBatch, t_step: int, shape: dict) -> tuple[Launch, Launch | None]:
        """Plan and launch a plain step's target forward and, unless it waits (`_lazy`), the
        proposer's fill behind it; their bookkeeping. Returns (forward, fill or None)."""
        spec, t, slots = self.spec, self.table, batch.slots
        t0 = self._now()
        fill_msg = None
        # speculation off: a proposer with lazy fills skips them, prompts included, and catches
        # up in one fill when drafting resumes (`_catch_up`), so a load at which speculation
        # does not pay costs what plain decoding does; a head then needs the target's hidden
        # states of the positions it missed, which the device keeps for it
        lazy = self._lazy(batch)
        keep = (self.lazy_fills and spec.kv_ahead == 0
                and (lazy or bool((t.proposer_computed[slots] < batch.start).any())))
        msg = messages.forward_message(batch, self.blocks, self.with_plan, keep_hidden=keep)
        if spec.kv_model is not None and not lazy:
            fill_msg = messages.prefill_fill_message(batch, self.blocks, spec, t.proposer_computed[slots],
                                                     self.with_plan)
        self._host("plan", batch.step, t0, **shape)
        launch = self._launch(self.main, msg)
        launch.t_step = t_step
        if keep and total(batch.start + batch.num_new - t.proposer_computed[slots]) > self.config.max_kept_tokens:
            # the kept hidden states of these rows past the budget: the head reads those of the
            # positions before this forward now (behind it on its stream), and the device drops them
            self.aux.wait_event(launch.event)
            self._catch_up(batch)
        self.builder.advance_forward(batch, spec.kv_ahead if spec.kv_model is not None and not lazy else None)
        s_fill = None
        if fill_msg is not None:
            self.aux.wait_event(launch.event)
            s_fill = self._launch(self.aux, fill_msg)
        return launch, s_fill

    async def _run_ahead(self, batch: StepBatch, launch: Launch) -> None:
        """Leave this forward in flight and complete the one before it: the next step is
        scheduled before this one's tokens reach the host."""
        prev, self._inflight = self._inflight, (batch, launch)
        if prev is not None:
            await self._complete_forward(*prev)

    async def _complete_forward(self, batch: StepBatch, launch: Launch) -> None:
        try:
            result = await self._sync(launch)
        except DeviceError as e:
            self._fail_batch(batch, e)
            return
        t0 = self._now()
        # rows whose request finished while this step was in flight (plain_overlap) are
        # left alone: their slot may hold a new request by now
        self.builder.complete_forward(batch)
        rows = batch.samples.nonzero()[0]
        out_counts = self._output(batch, rows, np.asarray(result.tokens)[rows, None])
        self._host("output", batch.step, t0, **self._attrs(batch, self.builder.computed_now(batch)),
                   emitted=sum(out_counts))
        zeros = np.zeros(len(batch), dtype=np.int64)
        self.trace.step_done(batch, launch.t_step if launch.t_step is not None else t0, out_counts, zeros, zeros)
