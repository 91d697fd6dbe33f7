"""The async step pipeline: CPU stages as coroutines overlapped with device work.

Why: this one object runs in the engine (real clock, worker-process or CUDA device) and in
the simulator (virtual clock and device). It only sees the Clock/Device protocols, a sink
for outputs and a tracer, so a simulated schedule *is* the production schedule.

Stages (host unless noted; names are span names): schedule, kv_alloc, plan, draft (device),
verify (device), accept (device), sync, fill (device: the proposer's KV fill, called
`draft_fill` in traces), output.

Schedules:
  sync           every launch is awaited before the next stage: the baseline.
  overlap        after the sync on acceptance the draft fill is launched and *not* awaited;
                 the output stage and the next step's schedule/kv_alloc/plan run while it
                 executes (the next draft launch queues behind it on the draft stream).
  mtp            the head's fill re-uses the verify batch, so it is launched right behind the
                 verify before any sync; the host learns accepted lengths when the verify's
                 result arrives and schedules the next step while the fill runs.
  plain_overlap  plain decoding one step ahead: step N+1 is launched before step N's tokens
                 reach the host (finished requests waste one step's slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from specsched.scheduler import messages
from specsched.scheduler.batch_builder import BatchBuilder, StepBatch
from specsched.scheduler.protocols import Clock, Device, DeviceError, OutputSink
from specsched.scheduler.proposer import ProposerSpec, validate_combination
from specsched.scheduler.request import Request, RequestState
from specsched.scheduler.step_trace import Launch, StepTrace, batch_attrs
from specsched.traces.hook import NULL_TRACER


def _ints(values: Any) -> list[int]:
    """Per-row counts from a device result (a numpy array from a worker, a list from the
    simulator) as Python ints: the bookkeeping indexes them once per row."""
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "sync"
    proposer: ProposerSpec = ProposerSpec()

    def __post_init__(self) -> None:
        validate_combination(self.proposer.kind, self.schedule, self.proposer.draft_len)


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        builder: BatchBuilder,
        device: Device,
        clock: Clock,
        sink: OutputSink,
        tracer: Any = None,
        *,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.config = config
        self.spec = config.proposer
        self.builder = builder
        self.blocks = builder.blocks
        self.clock = clock
        self.sink = sink
        # the clock's reading, bound once (the pipeline reads it ~40 times a step)
        self._now = clock.now_ns
        self.trace = StepTrace(tracer if tracer is not None else NULL_TRACER, self._now)
        self.eos = set(eos_token_ids)
        # a device that only models time (the simulator's) needs no attention metadata
        self.with_plan = getattr(device, "needs_plans", True)
        self.main = device.stream("main")
        self.aux = device.stream("draft")
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._release: list[int] = []
        self._pending_fill: Launch | None = None
        self._inflight: tuple[StepBatch, Launch] | None = None
        self._wake = anyio.Event()
        self._stopping = False
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        # Simulator hook: virtual nanoseconds a host stage costs, given its attributes; the
        # pipeline passes them on the clock's `advance_ns` (busy time). The engine leaves it
        # None: real host work takes real time.
        self.host_cost: Any = None

    @property
    def tracer(self) -> Any:
        return self.trace.tracer

    @tracer.setter
    def tracer(self, tracer: Any) -> None:  # a benchmark may attach one after a warm-up
        self.trace.tracer = tracer

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.builder.add(req)  # raises InvalidRequestError before anything is held
        if self._free_slots:
            req.slot = self._free_slots.pop()
        else:
            req.slot = self._next_slot
            self._next_slot += 1
        self.requests[req.request_id] = req
        p = req.params
        self.tracer.request(
            request_id=req.request_id, arrival_ns=req.arrival_ns, prompt_len=req.num_prompt_tokens,
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            seed=p.seed,
        )
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary; pages are freed then. False if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        req.abort_requested = True
        self._wake.set()
        return True

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.is_finished:
            return
        req.state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finish_ns = self._now()
        self.builder.remove(req)
        self._release.append(req.slot)
        self._free_slots.append(req.slot)
        self.requests.pop(req.request_id, None)
        self.tracer.finish(
            request_id=req.request_id, finish_ns=req.finish_ns, finish_reason=reason,
            output_len=req.num_output_tokens, first_token_ns=req.first_token_ns,
            ttft_ns=(req.first_token_ns - req.arrival_ns) if req.first_token_ns else None,
            error=error,
        )
        self.sink.on_finish(req)

    def _process_aborts(self) -> None:
        for req in list(self.requests.values()):
            if req.abort_requested and not self._in_flight(req):
                self._finish(req, "abort")

    def _in_flight(self, req: Request) -> bool:
        return self._inflight is not None and any(s.request is req for s in self._inflight[0].seqs)

    # -- tracing helpers --------------------------------------------------------------------
    def _attrs(self, batch: StepBatch) -> dict:
        return batch_attrs(batch, 1 + self.spec.num_candidates)

    def _charge(self, name: str, attrs: dict) -> None:
        """Simulator: a host stage's modelled cost passes as busy time -- the virtual clock
        advances and no other task runs meanwhile, as during a CPU stage on the real event
        loop (a request submitted then is seen at the pipeline's next real wait)."""
        if self.host_cost is not None:
            self.clock.advance_ns(int(self.host_cost(name, attrs)))

    def _host(self, name: str, step: int, start_ns: int, **attrs: Any) -> None:
        """End of a host stage: charge its modelled cost (simulator), then record its span."""
        self._charge(name, attrs)
        self._span(name, step, start_ns, **attrs)

    def _span(self, name: str, step: int, start_ns: int, **attrs: Any) -> None:
        self.tracer.span("host", name, step, start_ns, self._now(), **attrs)

    def _launch(self, stream: Any, op: str, msg: dict, step: int, **attrs: Any) -> Launch:
        if self._release:
            msg["release"] = self._release
            self._release = []
        t0 = self._now()
        msg["attrs"] = attrs  # the step's shape travels with the work (virtual device costs)
        launch = Launch(stream.launch(op, msg), step, op, attrs)
        # simulator: the host's launch work is charged after the virtual device took the
        # launch, whose lead (launch start -> device start) covers the packing already
        self._charge("launch:" + op, attrs)
        if self.tracer.enabled:
            self.trace.launched(launch, t0)
        return launch

    async def _sync(self, launch: Launch) -> Any:
        t0 = self._now()
        try:
            return await launch.event.wait()
        finally:
            self._span("sync", launch.step, t0, op=launch.op)

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve until `stop()`; then drain in-flight work and return."""
        while True:
            self._process_aborts()
            if not self.builder.has_work:
                await self._drain()
                self._process_aborts()
                if self._stopping:
                    break
                if not self.builder.has_work:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
            await self.step()
        self.trace.record_device_spans(force=True)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def finish_abandoned(self) -> None:
        """After `run` was cancelled mid-step (not stopped): every request left is finished as
        aborted, so its pages are freed and its finish recorded. In-flight device work is not
        waited for; the device is being closed."""
        self._inflight = None
        for req in list(self.requests.values()):
            self._finish(req, "abort")

    async def _drain(self) -> None:
        if self._inflight is not None:
            batch, launch = self._inflight
            self._inflight = None
            await self._complete_forward(batch, launch)
        if self._pending_fill is not None:
            fill, self._pending_fill = self._pending_fill, None
            try:
                await self._sync(fill)
            except DeviceError:
                pass  # the next launch for these rows reports it
        self.trace.flush_steps()
        self.trace.record_device_spans()

    async def step(self) -> None:
        if self._inflight is not None and self.blocks.num_free_pages < len(self.builder.running) + 1:
            await self._drain()  # preemption may be needed: never preempt a request in flight
        self._charge("step_gap", {})  # host work between steps that no stage span covers
        t_step = self._now()
        t0 = t_step
        batch = self.builder.schedule()
        shape = self._attrs(batch)  # the step's shape until its bookkeeping (output recomputes)
        self._host("schedule", batch.step, t0, **shape)
        if not batch.seqs:
            await self._drain()
            if not batch.seqs and self.builder.has_work and self._inflight is None:
                await anyio.sleep(0)
            return
        t0 = self._now()
        self.builder.allocate(batch)
        self._host("kv_alloc", batch.step, t0, pages_used=self.blocks.num_used_pages, **shape)
        if batch.is_spec:
            await self._spec_step(batch, t_step, shape)
        else:
            await self._forward_step(batch, t_step, shape)
        self.num_steps += 1
        self.trace.flush_steps()
        # no pause between steps: the real pipeline goes from one step's output straight into
        # the next step's schedule (a request submitted meanwhile waits for the step after)
        self.trace.record_device_spans()

    # -- plain / prefill steps ----------------------------------------------------------------
    async def _forward_step(self, batch: StepBatch, t_step: int, shape: dict) -> None:
        spec = self.spec
        t0 = self._now()
        msg = messages.forward_message(batch, self.blocks, self.with_plan)
        fill_msg = None
        if spec.kv_model is not None:
            fill_msg = messages.prefill_fill_message(batch, self.blocks, spec, self.with_plan)
        self._host("plan", batch.step, t0, **shape)
        launch = self._launch(self.main, "forward", msg, batch.step, kind=batch.kind, **shape)
        launch.t_step = t_step
        for s in batch.seqs:
            r = s.request
            samples = s.samples
            r.num_computed_tokens += s.num_new_tokens
            if samples:
                r.num_pending_tokens += 1
            if spec.kv_model is not None:
                r.num_proposer_computed = r.num_computed_tokens + (spec.kv_ahead if samples else 0)
        s_fill = None
        if fill_msg is not None:
            self.aux.wait_event(launch.event)
            s_fill = self._launch(self.aux, "fill", fill_msg, batch.step, after="forward",
                                  **fill_msg["shape"])
        if self.config.schedule == "plain_overlap":
            prev, self._inflight = self._inflight, (batch, launch)
            if prev is not None:
                await self._complete_forward(*prev)
            return
        await self._complete_forward(batch, launch)
        if s_fill is not None:
            if self.config.schedule == "sync":
                await self._await_fill(s_fill, batch)
            else:
                self._pending_fill = s_fill

    async def _await_fill(self, launch: Launch, batch: StepBatch) -> None:
        try:
            await self._sync(launch)
        except DeviceError as e:
            self._fail_batch(batch, e)

    async def _complete_forward(self, batch: StepBatch, launch: Launch) -> None:
        try:
            result = await self._sync(launch)
        except DeviceError as e:
            self._fail_batch(batch, e)
            return
        t0 = self._now()
        tokens = result["tokens"]
        out_counts = []
        for i, s in enumerate(batch.seqs):
            r = s.request
            if s.samples:
                r.num_pending_tokens -= 1
                out_counts.append(self._emit(r, [int(tokens[i])]))
            else:
                out_counts.append(0)
        self._host("output", batch.step, t0, **self._attrs(batch), emitted=sum(out_counts))
        self.trace.step_done(batch, launch.t_step if launch.t_step is not None else t0, out_counts, [0] * len(batch), [0] * len(batch))

    # -- speculative steps --------------------------------------------------------------------
    async def _spec_step(self, batch: StepBatch, t_step: int, shape: dict) -> None:
        spec, sched = self.spec, self.config.schedule
        t0 = self._now()
        vmsg = messages.verify_message(batch, self.blocks, spec, self.with_plan)
        dmsg = messages.draft_message(batch, self.blocks, spec)
        fmsg = messages.verify_fill_message(batch, self.blocks, spec, self.with_plan) if spec.fill_same_batch else None
        self._host("plan", batch.step, t0, **shape)
        # rows stop drafting at their own count; the first token of each comes from logits
        # the fill computed, every further one is a proposer forward (what the cost follows)
        nd = [s.num_draft for s in batch.seqs]
        d_launch = self._launch(self.aux, "draft", dmsg, batch.step, **shape, num_draft=max(nd),
                                draft_tokens=sum(nd), draft_forwards=sum(d - 1 for d in nd if d > 1))
        self._pending_fill = None  # the draft queues behind any pending fill on its stream
        if sched == "sync":
            try:
                await self._sync(d_launch)
            except DeviceError as e:
                self._fail_batch(batch, e)
                return
        self.main.wait_event(d_launch.event)
        v_launch = self._launch(self.main, "verify", vmsg, batch.step, **shape)
        f_launch = None
        if fmsg is not None and sched == "mtp":
            self.aux.wait_event(v_launch.event)
            f_launch = self._launch(self.aux, "fill", fmsg, batch.step, after="verify",
                                    **fmsg["shape"])
        try:
            result = await self._sync(v_launch)
        except DeviceError as e:
            self._fail_batch(batch, e)
            return
        accepted = _ints(result["accepted"])
        emitted = result["tokens"]
        num_drafts = _ints(result["num_drafts"]) if "num_drafts" in result else nd
        starts_before = [s.request.num_tokens for s in batch.seqs]
        # host bookkeeping of the accepted lengths, then the proposer's fill
        for s, a in zip(batch.seqs, accepted):
            s.request.num_computed_tokens += 1 + a
        if spec.kv_model is not None and f_launch is None:
            t0 = self._now()
            fm = fmsg if spec.fill_same_batch else messages.accept_fill_message(
                batch, starts_before, accepted, self.blocks, spec, self.with_plan)
            self._host("plan", batch.step, t0, kind="fill", **fm["shape"])
            self.aux.wait_event(v_launch.event)
            f_launch = self._launch(self.aux, "fill", fm, batch.step, after="verify",
                                    **fm["shape"])
        t0 = self._now()
        out_counts = []
        for i, s in enumerate(batch.seqs):
            r = s.request
            r.record_spec(num_drafts[i], accepted[i])
            # draft model: every emitted token after its fill; heads: up to the new last token
            r.num_proposer_computed = starts_before[i] + accepted[i] + spec.kv_ahead
            out_counts.append(self._emit(r, [int(t) for t in emitted[i]]))
            if not r.is_finished:
                self.blocks.trim(r.request_id, "target", r.num_tokens)
        self._host("output", batch.step, t0, **self._attrs(batch), emitted=sum(out_counts))
        self.trace.step_done(batch, t_step, out_counts, num_drafts, accepted)
        if f_launch is not None:
            if sched == "sync":
                await self._await_fill(f_launch, batch)
            else:
                self._pending_fill = f_launch

    # -- outputs and failures -----------------------------------------------------------------
    def _emit(self, req: Request, tokens: list[int]) -> int:
        """Append new tokens, applying max_tokens / EOS / the sink's stop strings."""
        if req.is_finished:
            return 0
        if req.abort_requested:
            self._finish(req, "abort")
            return 0
        room = req.params.max_tokens - req.num_output_tokens
        tokens = tokens[:room]
        reason = None
        if not req.params.ignore_eos:
            for j, t in enumerate(tokens):
                if t in self.eos:
                    tokens = tokens[: j + 1]
                    reason = "stop"
                    break
        if req.first_token_ns is None and tokens:
            req.first_token_ns = self._now()
        keep, sink_reason = self.sink.on_tokens(req, tokens)
        tokens = tokens[:keep]
        req.output_token_ids.extend(tokens)
        reason = sink_reason or reason
        if reason is None and req.num_output_tokens >= req.params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
        return len(tokens)

    def _fail_batch(self, batch: StepBatch, err: Exception) -> None:
        for s in batch.seqs:
            s.request.num_pending_tokens = 0
            self._finish(s.request, "error", error=str(err))
        self.tracer.span("host", "error", batch.step, self._now(), self._now(), error=str(err))
