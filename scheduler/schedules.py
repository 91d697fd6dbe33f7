"""What each schedule does, as one row of flags the pipeline reads (never the schedule's name).

Why a table: a schedule is an ordering of the same launches and waits. The pipeline's steps
read these flags where the orderings differ, and `validate_combination` refuses a proposer a
schedule cannot run, so a new schedule is a new row here, not a new `if name == ...`.

  sync           every launch is awaited before the next stage: the baseline.
  overlap        after the sync on acceptance the proposer's fill is launched and not awaited;
                 the output stage and the next step's schedule/kv_alloc/plan run while it
                 executes (the next draft launch queues behind it on the draft stream).
  eager_fill     the fill covers the verify window, so it is launched right behind the verify
                 before any sync; the host learns accepted lengths when the verify's result
                 arrives and schedules the next step while the fill runs (`mtp` is its alias).
  plain_overlap  plain decoding one step ahead: step N+1 is launched before step N's tokens
                 reach the host (finished requests waste one step's slot).
"""
from __future__ import annotations

from dataclasses import dataclass

from specsched.traces.names import Schedule, schedule_name


@dataclass(frozen=True)
class ScheduleRules:
    speculative: bool | None  # runs a proposer (True), plain decoding only (False), either (None)
    awaits_launches: bool  # every launch (draft, verify, fill) is awaited before the next stage
    fill_behind_verify: bool  # the fill is launched behind the verify, before acceptance is known
    # the proposer's fill of the accepted tokens runs behind the next step's host work (so the
    # proposer needs such a fill: a KV cache of its own, filled once acceptance is known)
    defers_fill: bool
    # a plain step with no proposer fill may launch while the step before it is in flight
    # (under `overlap` and `eager_fill`: an adaptive draft length's steps at D = 0)
    plain_ahead: bool


SCHEDULE_RULES: dict[str, ScheduleRules] = {
    Schedule.SYNC: ScheduleRules(None, awaits_launches=True, fill_behind_verify=False, defers_fill=False,
                                 plain_ahead=False),
    Schedule.OVERLAP: ScheduleRules(True, awaits_launches=False, fill_behind_verify=False, defers_fill=True,
                                    plain_ahead=True),
    Schedule.EAGER_FILL: ScheduleRules(True, awaits_launches=False, fill_behind_verify=True, defers_fill=False,
                                       plain_ahead=True),
    Schedule.PLAIN_OVERLAP: ScheduleRules(False, awaits_launches=False, fill_behind_verify=False,
                                          defers_fill=False, plain_ahead=True),
}
assert set(SCHEDULE_RULES) == set(Schedule)


def schedule_rules(schedule: str) -> ScheduleRules:
    """The row of `schedule` (an alias resolved); ValueError naming the schedules for another."""
    rules = SCHEDULE_RULES.get(schedule_name(schedule))
    if rules is None:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {tuple(s.value for s in Schedule)}")
    return rules
