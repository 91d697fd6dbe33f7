"""The async step pipeline: CPU stages as coroutines overlapped with device work. It runs in the engine and in the
simulator (virtual clock and device) alike, seeing only the Clock/Device protocols, a sink and a tracer, so a
simulated schedule *is* the production schedule.

Stages (host unless noted; names are span names): schedule, kv_alloc, plan, draft (device), verify (device), accept
(device), sync, fill (device: the proposer's KV fill), output.

Each step the scheduler picks the batch and allocates its pages, then the schedule's runner orders its launches and
waits; the loop knows no schedule or proposer by name. With an adaptive draft length, `overlap` and `eager_fill` run
their plain steps (speculation off) one step ahead too; a step that drafts waits for the one in flight.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from specsched.scheduler.draft_policy import PolicyFeed
from specsched.scheduler.launcher import Launcher
from specsched.scheduler.proposer import ProposerSpec, validate_combination
from specsched.scheduler.protocols import Clock, Device, OutputSink
from specsched.scheduler.request import Request
from specsched.scheduler.scheduler import Scheduler
from specsched.scheduler.schedules import Runner, runner
from specsched.scheduler.step_batch import without_finished
from specsched.scheduler.step_ops import StepOps
from specsched.scheduler.step_trace import StepTrace
from specsched.traces.hook import NULL_TRACER


# target positions whose hidden states a head's deferred fills may leave on the device
MAX_KEPT_TOKENS = 16384


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "sync"
    proposer: ProposerSpec = ProposerSpec()
    # a head whose fills wait while speculation is off leaves the hidden states of positions it has not read on the
    # device; past this many over a step's rows it catches up at D = 0, which frees them
    max_kept_tokens: int = MAX_KEPT_TOKENS
    # every verify row computes 1 + D positions, even if it drafted fewer: one shape a step (CUDA graphs)
    uniform_verify: bool = False

    def __post_init__(self) -> None:
        validate_combination(self.proposer.kind, self.schedule, self.proposer.draft_len)
        if self.max_kept_tokens < 1:
            raise ValueError(f"max_kept_tokens must be >= 1, got {self.max_kept_tokens}")


class Pipeline:
    def __init__(
        self,
        config: PipelineConfig,
        scheduler: Scheduler,
        device: Device,
        clock: Clock,
        sink: OutputSink,
        tracer: Any = None,
        *,
        drafter: Any = None,
    ):
        spec = config.proposer
        if spec.rules.host_drafts and drafter is None:
            raise ValueError(f"proposer {spec.kind!r} drafts on the host: the pipeline needs a drafter")
        self.runner: Runner = runner(config.schedule)
        self.scheduler = scheduler
        self.blocks = scheduler.blocks
        # the draft-length policy: an adaptive one is told what each step did, a fixed one nothing
        self.policy = scheduler.policy
        self.feed = PolicyFeed(self.policy)
        self.trace = StepTrace(tracer if tracer is not None else NULL_TRACER, clock.now_ns, scheduler.table,
                               chosen_draft_lens=self.policy.adaptive)
        self.launcher = Launcher(scheduler, device, clock, sink, self.trace, self.feed)
        self.ops = StepOps(self.launcher, spec, drafter=drafter, lazy_fills=self.policy.pauses and spec.rules.lazy_fill,
                           max_kept_tokens=config.max_kept_tokens, uniform_verify=config.uniform_verify)
        self._now = clock.now_ns
        self._wake = anyio.Event()
        self._idle: anyio.Event | None = None  # set when the run loop next waits for work (`warming_up`)
        # pages a running row may take in a step (`_most_pages`): it grows by 1 + D tokens (a
        # draft model's table by one more) in each model's table, at most ceil((2 + D) / page_size)
        self._row_pages = -(-(2 + spec.draft_len) // self.blocks.page_size) * len(self.blocks.models)
        self._stopping = False
        self.num_steps = 0

    @property
    def tracer(self) -> Any:
        return self.trace.tracer

    @tracer.setter
    def tracer(self, tracer: Any) -> None:  # a benchmark may attach one after a warm-up
        self.trace.tracer = tracer

    # -- requests ----------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """The requests queued or running, by id."""
        return self.scheduler.requests

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)  # gives it a slot; raises InvalidRequestError before anything is held
        p = req.params
        self.trace.tracer.request(
            request_id=req.request_id, arrival_ns=req.arrival_ns, prompt_len=req.num_prompt_tokens,
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            seed=p.seed, **p.model_dump(include={"synthetic_acceptance_length", "synthetic_acceptance_rates"},
                                        exclude_none=True),
        )
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary; pages are freed then. False if unknown/finished."""
        if not self.scheduler.abort(request_id):
            return False
        self._wake.set()
        return True

    def stop_request(self, request_id: str, num_output_tokens: int) -> bool:
        """A stop string was found: finish with reason "stop" at the next step boundary, the output cut to its first
        `num_output_tokens` tokens (later ones dropped). False if unknown or finished."""
        if not self.scheduler.stop(request_id, num_output_tokens):
            return False
        self._wake.set()
        return True

    def _process_aborts(self) -> None:
        inflight = self.ops.inflight
        self.launcher.deliver(self.scheduler.finish_marked(inflight[0] if inflight else None, self._now()))

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve until `stop()`; then drain in-flight work and return."""
        while True:
            self._process_aborts()
            if not self.scheduler.has_work:
                await self.ops.drain()
                self._process_aborts()
                if self._stopping:
                    break
                if not self.scheduler.has_work:
                    self._wake = anyio.Event()
                    if self._idle is not None:
                        self._idle.set()
                    await self._wake.wait()
                    continue
            await self.step()
        self.trace.record_device_spans(force=True)

    @asynccontextmanager
    async def warming_up(self) -> AsyncIterator[None]:
        """The requests served inside are the start-up warm-up, untraced; on leaving, the loop has drained (else a step
        launched ahead of their finish would be recorded) and the policy keeps what they taught, not its last choice."""
        tracer, self.tracer = self.tracer, NULL_TRACER
        try:
            yield
            self._idle = anyio.Event()
            self._wake.set()  # a loop already waiting for work goes round once and reports
            await self._idle.wait()
        finally:
            self._idle, self.tracer = None, tracer
        if self.feed.pending:
            self.feed.deliver(self.scheduler.table.gen)  # the warm-up's last step teaches too
        self.policy.warmed_up()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def finish_abandoned(self) -> None:
        """After `run` was cancelled mid-step: every request left is finished as aborted (pages freed, finish recorded).
        In-flight device work is not waited for; the device is being closed."""
        self.ops.abandon()
        self.launcher.deliver(self.scheduler.finish_all(self._now()))

    def _most_pages(self) -> int:
        """Pages a step may need at most: every running row's `_row_pages`."""
        return len(self.scheduler.running) * self._row_pages + 1

    async def step(self) -> None:
        l, ops = self.launcher, self.ops
        if ops.inflight is not None and self.blocks.num_free_pages < self._most_pages():
            await self.ops.drain()  # preemption may be needed: never preempt a request in flight
        l.charge("step_gap", {})  # host work between steps that no stage span covers
        if self.feed.pending:
            self.feed.deliver(self.scheduler.table.gen)
        t_step = self._now()
        t0 = t_step
        batch = self.scheduler.schedule()
        shape = l.attrs(batch)  # the step's shape until its bookkeeping (output recomputes)
        l.host("schedule", batch.step, t0, **shape)
        if not len(batch):
            await self.ops.drain()
            if not len(batch) and self.scheduler.has_work and ops.inflight is None:
                await anyio.sleep(0)
            return
        if ops.inflight is not None and not self.runner.runs_ahead(ops, batch):
            # this step reads the tokens the plain step in flight samples: they reach the host first, and rows that
            # finish on them leave the batch before it holds pages. The step's time runs from here (the wait is the
            # previous step's device time)
            await ops.complete_inflight()
            batch = without_finished(batch, self.scheduler.table)
            if not len(batch):
                return
            shape, t_step = l.attrs(batch), self._now()
        t0 = self._now()
        self.scheduler.allocate(batch)
        l.host("kv_alloc", batch.step, t0, pages_used=self.blocks.num_used_pages, **shape)
        if batch.is_spec:
            await self.runner.spec_step(ops, ops.plan_spec(batch, t_step, shape))
        else:
            await self.runner.forward_step(ops, batch, *ops.launch_forward(batch, t_step, shape))
        self.num_steps += 1
        if self.policy.adaptive and batch.decision is not None:
            self.feed.stepped(batch, self._now() - t_step)
        self.trace.flush_steps()
        # no pause between steps: the real pipeline goes from one step's output straight into
        # the next step's schedule (a request submitted meanwhile waits for the step after)
        self.trace.record_device_spans()
