"""The host's side of every device launch: released slots ride along, the launch and its wait are recorded as spans
(in the simulator, charged as host time), the policy feed hears of it; a step's outcome goes to the sink and the trace.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from specsched.scheduler import messages, packing
from specsched.scheduler.draft_policy import PolicyFeed
from specsched.scheduler.outputs import StepOutput
from specsched.scheduler.protocols import Clock, Device, DeviceError, OutputSink
from specsched.scheduler.scheduler import Scheduler
from specsched.scheduler.small_arrays import total
from specsched.scheduler.step_batch import StepBatch
from specsched.scheduler.step_trace import Launch, StepTrace


class Launcher:
    def __init__(self, scheduler: Scheduler, device: Device, clock: Clock, sink: OutputSink,
                 trace: StepTrace, feed: PolicyFeed):
        self.scheduler = scheduler
        self.clock = clock
        self.now = clock.now_ns  # bound once: read ~40 times a step
        self.sink = sink
        self.trace = trace
        self.feed = feed
        self.with_plan = device.needs_plans
        self.main = device.stream("main")
        self.aux = device.stream("draft")
        self.release: list[int] = []  # slots whose device state goes with the next launch
        # Simulator hook: (stage name, attributes) -> virtual ns, passed to the clock's `advance_ns` (busy time).
        # None in the engine: real host work takes real time.
        self.host_cost: Any = None

    # -- launches and waits ------------------------------------------------------------------
    def launch(self, stream: Any, msg: messages.Message) -> Launch:
        if self.release:
            msg = replace(msg, release=tuple(self.release))
            self.release = []
        t0 = self.now()
        attrs = msg.shape.attrs()
        launch = Launch(stream.launch(msg.op, msg), msg.step, msg.op, attrs)
        # charged after the virtual device took the launch, whose lead (launch -> device start) covers the packing
        self.charge("launch:" + msg.op, attrs)
        if self.trace.tracer.enabled:
            self.trace.launched(launch, t0)
        self.feed.launched(launch)
        return launch

    async def sync(self, launch: Launch) -> Any:
        t0 = self.now()
        try:
            return await launch.event.wait()
        finally:
            self.span("sync", launch.step, t0, op=launch.op)

    async def wait(self, launch: Launch, batch: StepBatch):
        """The launch's result; None after a device error, which failed the batch."""
        try:
            return await self.sync(launch)
        except DeviceError as e:
            self.fail(batch, e)
            return None

    # -- host stages ---------------------------------------------------------------------------
    def charge(self, name: str, attrs: dict) -> None:
        """Simulator: a host stage's modelled cost passes as busy time, no other task running meanwhile, as on the real
        event loop (a request submitted then is seen at the pipeline's next real wait)."""
        if self.host_cost is not None:
            self.clock.advance_ns(int(self.host_cost(name, attrs)))

    def host(self, name: str, step: int, start_ns: int, **attrs: Any) -> None:
        """End of a host stage: charge its modelled cost (simulator), then record its span."""
        self.charge(name, attrs)
        self.span(name, step, start_ns, **attrs)

    def span(self, name: str, step: int, start_ns: int, **attrs: Any) -> None:
        self.trace.tracer.span("host", name, step, start_ns, self.now(), **attrs)

    @staticmethod
    def attrs(batch: StepBatch, computed: np.ndarray | None = None) -> dict:
        """The step's shape as span attributes; with `computed` (after the step's bookkeeping) the output stage's."""
        attrs = packing.batch_shape(batch, (1 + batch.draft_len)).attrs()
        if computed is not None:
            attrs["kv_tokens"] = total(computed + batch.num_new + batch.draft_lens)
        return attrs

    # -- outcomes ------------------------------------------------------------------------------
    def deliver(self, out: StepOutput, batch: StepBatch | None = None, result=None) -> list[int]:
        """New tokens to the sink (with their log-probabilities where the step's `result` has them), each finish to
        the device (released with the next launch), the trace and the sink. Returns [B] tokens each row kept."""
        on_tokens = self.sink.on_tokens
        at = 0
        for i, first, n in getattr(result, "prompt_spans", ()):
            r = batch.requests[i]
            self.sink.on_prompt_logprobs(r, first, result.prompt_logprobs.row(0, r.params.prompt_logprobs, n, at))
            at += n
        lp = getattr(result, "logprobs", None)
        rows = {} if lp is None else {id(r): i for i, r in enumerate(batch.requests) if r.params.logprobs is not None}
        for r, tokens in out.tokens:
            i = rows.get(id(r)) if rows else None
            if i is None:
                on_tokens(r, tokens)
            else:
                on_tokens(r, tokens, lp.row(i, r.params.logprobs, len(tokens)))
        if out.finished:
            self.release.extend([r.slot for r in out.finished])
            finish, on_finish = self.trace.tracer.finish, self.sink.on_finish
            for r in out.finished:
                first = r.first_token_ns
                finish(request_id=r.request_id, finish_ns=r.finish_ns, finish_reason=r.finish_reason,
                       output_len=r.num_output_tokens, first_token_ns=first,
                       ttft_ns=(first - r.arrival_ns) if first else None, error=r.error)
                on_finish(r)
        return out.counts

    def fail(self, batch: StepBatch, err: Exception) -> None:
        """A device error: the batch's requests finish with reason "error"."""
        self.deliver(self.scheduler.fail(batch, str(err), self.now()))
        self.trace.tracer.span("host", "error", batch.step, self.now(), self.now(), error=str(err))
