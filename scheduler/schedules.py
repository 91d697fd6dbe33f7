"""The schedules: each a runner (the order of one step's launches and waits) and a row of `SCHEDULE_RULES` (which
proposers it runs, whether a fill covers the verify window). A new schedule is a runner and a row here.

  sync           every launch is awaited before the next stage: the baseline.
  overlap        after the sync on acceptance the proposer's fill is launched and not awaited; the output stage and
                 the next step's schedule/kv_alloc/plan run while it executes (the next draft queues behind it).
  eager_fill     the fill covers the verify window, launched right behind the verify before any sync; the host
                 schedules the next step while it runs (`mtp` is its alias).
  plain_overlap  plain decoding one step ahead: step N+1 is launched before step N's tokens reach the host
                 (finished requests waste one step's slot).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specsched.traces.names import Schedule, schedule_name

if TYPE_CHECKING:
    from specsched.scheduler.step_batch import StepBatch
    from specsched.scheduler.step_ops import SpecPlan, StepOps
    from specsched.scheduler.step_trace import Launch


@dataclass(frozen=True)
class ScheduleRules:
    speculative: bool | None  # runs a proposer (True), plain decoding only (False), either (None)
    fill_behind_verify: bool  # the fill is launched behind the verify, before acceptance is known
    # the fill of the accepted tokens runs behind the next step's host work (needs a proposer KV cache of its own)
    defers_fill: bool


SCHEDULE_RULES: dict[str, ScheduleRules] = {
    Schedule.SYNC: ScheduleRules(None, fill_behind_verify=False, defers_fill=False),
    Schedule.OVERLAP: ScheduleRules(True, fill_behind_verify=False, defers_fill=True),
    Schedule.EAGER_FILL: ScheduleRules(True, fill_behind_verify=True, defers_fill=False),
    Schedule.PLAIN_OVERLAP: ScheduleRules(False, fill_behind_verify=False, defers_fill=False),
}
assert set(SCHEDULE_RULES) == set(Schedule)


def schedule_rules(schedule: str) -> ScheduleRules:
    """The row of `schedule` (an alias resolved); ValueError naming the schedules for another."""
    rules = SCHEDULE_RULES.get(schedule_name(schedule))
    if rules is None:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {tuple(s.value for s in Schedule)}")
    return rules


class Runner:
    """The launches and waits of one step under a schedule; `o`'s primitives pack, launch, wait and book."""

    def runs_ahead(self, o: "StepOps", batch: "StepBatch") -> bool:
        """Whether this plain step may be launched while the step before it is in flight."""
        return False

    async def spec_step(self, o: "StepOps", plan: "SpecPlan") -> None:
        raise NotImplementedError

    async def forward_step(self, o: "StepOps", batch: "StepBatch", forward: "Launch", fill: "Launch | None") -> None:
        """A launched plain step: complete it (its tokens to the host), its fill left or awaited."""
        if fill is None and self.runs_ahead(o, batch):
            await o.run_ahead(batch, forward)
            return
        await o.complete_forward(batch, forward)
        o.defer_fill(fill)


class SyncRunner(Runner):
    async def spec_step(self, o: "StepOps", plan: "SpecPlan") -> None:
        draft = o.launch_draft(plan)
        if draft is not None and await o.wait(draft, plan.batch) is None:
            return
        verify = o.launch_verify(plan, draft)
        result = await o.wait(verify, plan.batch)
        if result is None:
            return
        fill = o.accept(plan, result, verify, None)
        if fill is not None:
            await o.wait(fill, plan.batch)

    async def forward_step(self, o: "StepOps", batch: "StepBatch", forward: "Launch", fill: "Launch | None") -> None:
        await o.complete_forward(batch, forward)
        if fill is not None:
            await o.wait(fill, batch)


class _PlainAhead(Runner):
    def runs_ahead(self, o: "StepOps", batch: "StepBatch") -> bool:
        # a plain step with no proposer fill: speculation off (an adaptive draft length at D = 0)
        return not batch.is_spec and (o.spec.kv_model is None or o.lazy(batch))


class OverlapRunner(_PlainAhead):
    async def spec_step(self, o: "StepOps", plan: "SpecPlan") -> None:
        draft = o.launch_draft(plan)
        verify = o.launch_verify(plan, draft)
        result = await o.wait(verify, plan.batch)
        if result is None:
            return
        o.defer_fill(o.accept(plan, result, verify, None))  # behind the next step's host work


class EagerFillRunner(_PlainAhead):
    async def spec_step(self, o: "StepOps", plan: "SpecPlan") -> None:
        draft = o.launch_draft(plan)
        verify = o.launch_verify(plan, draft)
        fill = o.launch_fill_behind(plan, verify)  # before the host knows what was accepted
        result = await o.wait(verify, plan.batch)
        if result is None:
            return
        o.defer_fill(o.accept(plan, result, verify, fill))


class PlainOverlapRunner(Runner):
    def runs_ahead(self, o: "StepOps", batch: "StepBatch") -> bool:
        return True


RUNNERS: dict[str, type[Runner]] = {Schedule.SYNC: SyncRunner, Schedule.OVERLAP: OverlapRunner,
                                    Schedule.EAGER_FILL: EagerFillRunner, Schedule.PLAIN_OVERLAP: PlainOverlapRunner}
assert set(RUNNERS) == set(Schedule)


def runner(schedule: str) -> Runner:
    """The runner of `schedule` (an alias resolved); ValueError naming the schedules for another."""
    schedule_rules(schedule)
    return RUNNERS[schedule_name(schedule)]()
