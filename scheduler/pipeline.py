"""The async step pipeline: CPU stages as coroutines overlapped with device work.

Why: this one object runs in the engine (real clock, worker-process or CUDA device) and in
the simulator (virtual clock and device). It only sees the Clock/Device protocols, a sink
for outputs and a tracer, so a simulated schedule *is* the production schedule.

Stages (host unless noted; names are span names): schedule, kv_alloc, plan, draft (device),
verify (device), accept (device), sync, fill (device: the proposer's KV fill, called
`draft_fill` in traces), output.

A schedule (`sync`, `overlap`, `eager_fill`, `plain_overlap`) is a runner
(scheduler/schedules.py): the order of one step's launches and waits, over the step
primitives of scheduler/spec_step.py and scheduler/forward_step.py. The loop here knows no
schedule or proposer by name. With an adaptive draft length, `overlap` and `eager_fill` run
their plain steps (speculation off) one step ahead too; a step that drafts waits for the one in
flight (`Runner.runs_ahead`).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
import numpy as np

from specsched.scheduler import messages
from specsched.scheduler.batch_builder import BatchBuilder
from specsched.scheduler.draft_policy import PolicyFeed
from specsched.scheduler.forward_step import ForwardStep
from specsched.scheduler.output_stage import OutputStage
from specsched.scheduler.proposer import ProposerSpec, validate_combination
from specsched.scheduler.protocols import Clock, Device, DeviceError, OutputSink
from specsched.scheduler.request import Request, RequestState
from specsched.scheduler.schedules import Runner, runner
from specsched.scheduler.spec_step import SpeculativeStep
from specsched.scheduler.small_arrays import total
from specsched.scheduler.step_batch import StepBatch
from specsched.scheduler.step_trace import Launch, StepTrace
from specsched.traces.hook import NULL_TRACER


# target positions whose hidden states a head's deferred fills may leave on the device
MAX_KEPT_TOKENS = 16384


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "sync"
    proposer: ProposerSpec = ProposerSpec()
    # with an adaptive draft length, a head whose fills wait while speculation is off leaves
    # the target's hidden states of the positions it has not read on the device; past this
    # many over a step's rows it catches up at D = 0, which frees them (forward_step.py)
    max_kept_tokens: int = MAX_KEPT_TOKENS

    def __post_init__(self) -> None:
        validate_combination(self.proposer.kind, self.schedule, self.proposer.draft_len)
        if self.max_kept_tokens < 1:
            raise ValueError(f"max_kept_tokens must be >= 1, got {self.max_kept_tokens}")


class Pipeline(OutputStage, ForwardStep, SpeculativeStep):
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
        drafter: Any = None,
    ):
        self.config = config
        # a proposer that drafts on the host (`ProposerRules.host_drafts`) drafts through this
        # (`HostDrafter`: the engine's lookup, the simulator's draws)
        self.drafter = drafter
        if config.proposer.rules.host_drafts and drafter is None:
            raise ValueError(f"proposer {config.proposer.kind!r} drafts on the host: the pipeline needs a drafter")
        self.spec = config.proposer
        self.runner: Runner = runner(config.schedule)
        self.builder = builder
        self.blocks = builder.blocks
        self.clock = clock
        self.sink = sink
        # the clock's reading, bound once (the pipeline reads it ~40 times a step)
        self._now = clock.now_ns
        # the draft length's policy: the builder asks it each decode-only step's D; an adaptive
        # one is told what each step did (`PolicyFeed`), a fixed one nothing
        self.policy = builder.policy
        self.feed = PolicyFeed(self.policy)
        self.trace = StepTrace(tracer if tracer is not None else NULL_TRACER, self._now, builder.computed_now,
                               chosen_draft_lens=self.policy.adaptive)
        # the proposer's fills wait while speculation is off and catch up when it resumes
        self.lazy_fills = self.policy.pauses and self.spec.rules.lazy_fill
        self.eos = set(eos_token_ids)
        # a sink that needs no token ids (the simulator's) gets counts only: the output stage
        # then keeps no per-request token lists (scheduler/output_stage.py)
        self.keep_ids = sink.wants_token_ids
        # a device that only models time (the simulator's) needs no attention metadata
        self.with_plan = device.needs_plans
        self.main = device.stream("main")
        self.aux = device.stream("draft")
        self.table = builder.table  # per-slot counters (scheduler/slot_state.py)
        self._release: list[int] = []  # slots whose device state goes with the next launch
        self._aborts: set[str] = set()  # ids to abort or stop at the next step boundary
        self._pending_fill: Launch | None = None
        self._inflight: tuple[StepBatch, Launch] | None = None
        self._wake = anyio.Event()
        self._idle: anyio.Event | None = None  # set when the run loop next waits for work (`warming_up`)
        # pages a running row may take in a step (`_most_pages`): it grows by 1 + D tokens (a
        # draft model's table by one more) in each model's table, at most ceil((2 + D) / page_size)
        self._row_pages = -(-(2 + self.spec.draft_len) // self.blocks.page_size) * len(self.blocks.models)
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
        self.builder.add(req)  # gives it a slot; raises InvalidRequestError before anything is held
        self.requests[req.request_id] = req
        p = req.params
        self.trace.tracer.request(
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
        self._aborts.add(request_id)
        self._wake.set()
        return True

    def stop_request(self, request_id: str, num_output_tokens: int) -> bool:
        """The request's consumer found a stop string in its text: finish it with reason
        "stop" at the next step boundary, its output cut to its first `num_output_tokens`
        tokens (tokens produced meanwhile are dropped). False if unknown or finished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        if req.stop_at is None or num_output_tokens < req.stop_at:
            req.stop_at = num_output_tokens
        self._aborts.add(request_id)
        self._wake.set()
        return True

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.is_finished:
            return
        req.state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finish_ns = self._now()
        self._release.append(req.slot)
        self.builder.remove(req)  # frees its pages and its slot
        self.requests.pop(req.request_id, None)
        self._aborts.discard(req.request_id)
        self.trace.tracer.finish(
            request_id=req.request_id, finish_ns=req.finish_ns, finish_reason=reason,
            output_len=req.num_output_tokens, first_token_ns=req.first_token_ns,
            ttft_ns=(req.first_token_ns - req.arrival_ns) if req.first_token_ns else None,
            error=error,
        )
        self.sink.on_finish(req)

    def _finish_many(self, reqs: list[Request], reason: str) -> None:
        """`_finish` for many requests at once (the output stage's finishes by length): the
        queues, pages and slots are freed in one pass each, then every finish is recorded
        and handed to the sink, in the order given."""
        reqs = [r for r in reqs if not r.is_finished]
        if len(reqs) <= 1:
            for r in reqs:
                self._finish(r, reason)
            return
        now = self._now()
        state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        for r in reqs:
            r.state, r.finish_reason, r.error, r.finish_ns = state, reason, None, now
        self._release.extend([r.slot for r in reqs])
        self.builder.remove_many(reqs)
        finish, on_finish = self.trace.tracer.finish, self.sink.on_finish
        for r in reqs:
            rid = r.request_id
            self.requests.pop(rid, None)
            self._aborts.discard(rid)
            first = r.first_token_ns
            finish(request_id=rid, finish_ns=now, finish_reason=reason, output_len=r.num_output_tokens,
                   first_token_ns=first, ttft_ns=(first - r.arrival_ns) if first else None, error=None)
            on_finish(r)

    def _process_aborts(self) -> None:
        if not self._aborts:
            return
        for rid in list(self._aborts):
            req = self.requests.get(rid)
            if req is None:
                self._aborts.discard(rid)
            elif not self._in_flight(req):
                if req.abort_requested:
                    self._finish(req, "abort")
                else:
                    self._finish_stopped(req)

    def _in_flight(self, req: Request) -> bool:
        return self._inflight is not None and any(r is req for r in self._inflight[0].requests)

    # -- tracing helpers --------------------------------------------------------------------
    def _attrs(self, batch: StepBatch, computed: np.ndarray | None = None) -> dict:
        """The step's shape as span attributes; with `computed` (the rows' computed tokens
        after the step's bookkeeping) the output stage's."""
        attrs = messages.batch_shape(batch, batch.width).attrs()
        if computed is not None:
            attrs["kv_tokens"] = total(computed + batch.num_new + batch.num_draft)
        return attrs

    def _charge(self, name: str, attrs: dict) -> None:
        """Simulator: a host stage's modelled cost passes as busy time -- the virtual clock
        advances and no other task runs meanwhile, as during a CPU stage on the real event
        loop (a request submitted then is seen at the pipeline's next real wait)."""
        if self.host_cost is not None:
            self.clock.advance_ns(int(self.host_cost(name, attrs)))

    def _host(self, name: str, step: int, start_ns: int, **attrs: Any) -> None:
        """End of a host stage: charge its modelled cost (simulator), then record its span."""
        if self.host_cost is not None:
            self.clock.advance_ns(int(self.host_cost(name, attrs)))
        self.trace.tracer.span("host", name, step, start_ns, self._now(), **attrs)

    def _span(self, name: str, step: int, start_ns: int, **attrs: Any) -> None:
        self.trace.tracer.span("host", name, step, start_ns, self._now(), **attrs)

    def _launch(self, stream: Any, msg: messages.Message) -> Launch:
        if self._release:
            msg = replace(msg, release=tuple(self._release))
            self._release = []
        t0 = self._now()
        attrs = msg.shape.attrs()  # the launch's spans' attributes
        launch = Launch(stream.launch(msg.op, msg), msg.step, msg.op, attrs)
        # simulator: the host's launch work is charged after the virtual device took the
        # launch, whose lead (launch start -> device start) covers the packing already
        self._charge("launch:" + msg.op, attrs)
        if self.trace.tracer.enabled:
            self.trace.launched(launch, t0)
        self.feed.launched(launch)
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
                    if self._idle is not None:
                        self._idle.set()
                    await self._wake.wait()
                    continue
            await self.step()
        self.trace.record_device_spans(force=True)

    @asynccontextmanager
    async def warming_up(self) -> AsyncIterator[None]:
        """The requests served inside are the engine's start-up warm-up (the engine's and the
        simulator's replay alike): untraced; on leaving, the run loop has drained (a step
        launched ahead of their finish would otherwise be recorded when it completes) and the
        draft-length policy keeps what they taught but not its last choice (`warmed_up`)."""
        tracer, self.tracer = self.tracer, NULL_TRACER
        try:
            yield
            self._idle = anyio.Event()
            self._wake.set()  # a loop already waiting for work goes round once and reports
            await self._idle.wait()
        finally:
            self._idle, self.tracer = None, tracer
        if self.feed.pending:
            self.feed.deliver(self.table.gen)  # the warm-up's last step teaches too
        self.policy.warmed_up()

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
        await self._complete_inflight()
        if self._pending_fill is not None:
            fill, self._pending_fill = self._pending_fill, None
            try:
                await self._sync(fill)
            except DeviceError:
                pass  # the next launch for these rows reports it
        self.trace.flush_steps()
        self.trace.record_device_spans()

    def _most_pages(self) -> int:
        """Pages a step may need at most: every running row's `_row_pages`."""
        return len(self.builder.running) * self._row_pages + 1

    async def step(self) -> None:
        if self._inflight is not None and self.blocks.num_free_pages < self._most_pages():
            await self._drain()  # preemption may be needed: never preempt a request in flight
        self._charge("step_gap", {})  # host work between steps that no stage span covers
        if self.feed.pending:
            self.feed.deliver(self.table.gen)
        t_step = self._now()
        t0 = t_step
        batch = self.builder.schedule()
        shape = self._attrs(batch)  # the step's shape until its bookkeeping (output recomputes)
        self._host("schedule", batch.step, t0, **shape)
        if not len(batch):
            await self._drain()
            if not len(batch) and self.builder.has_work and self._inflight is None:
                await anyio.sleep(0)
            return
        if self._inflight is not None and not self.runner.runs_ahead(self, batch):
            # this step reads the tokens the plain step in flight samples (its drafts, its
            # proposer's fill): they reach the host first, and rows that finish on them leave
            # the batch before it holds pages. The step's time runs from here: the wait is the
            # previous step's device time
            await self._complete_inflight()
            batch = self.builder.without_finished(batch)
            if not len(batch):
                return
            shape, t_step = self._attrs(batch), self._now()
        t0 = self._now()
        self.builder.allocate(batch)
        self._host("kv_alloc", batch.step, t0, pages_used=self.blocks.num_used_pages, **shape)
        if batch.is_spec:
            await self.runner.spec_step(self, self._plan_spec(batch, t_step, shape))
        else:
            await self.runner.forward_step(self, batch, *self._launch_forward(batch, t_step, shape))
        self.num_steps += 1
        if self.policy.adaptive and batch.decision is not None:
            self.feed.stepped(batch, self._now() - t_step)
        self.trace.flush_steps()
        # no pause between steps: the real pipeline goes from one step's output straight into
        # the next step's schedule (a request submitted meanwhile waits for the step after)
        self.trace.record_device_spans()

    # -- failures ------------------------------------------------------------------------------
    def _fail_batch(self, batch: StepBatch, err: Exception) -> None:
        for r in batch.requests:
            if not r.is_finished:
                r.num_pending_tokens = 0
            self._finish(r, "error", error=str(err))
        self.tracer.span("host", "error", batch.step, self._now(), self._now(), error=str(err))
