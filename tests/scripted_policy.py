"""A draft-length policy that follows a script: how tests drive the pipeline through given
draft lengths (speculation off, then on again) through the `DraftPolicy` seam."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specsched.scheduler.draft_policy import Decision, StepOutcome, StepView


class ScriptedPolicy:
    """D of the i-th decision (from 1) is `script(i, view)`, at most `max_draft_len`; a row
    drafts what it has room for. It pauses (D = 0) like an adaptive policy, so a proposer with
    lazy fills skips them and catches up; `chosen` and `outcomes` record what it decided and
    was told."""

    adaptive = True
    pauses = True

    def __init__(self, max_draft_len: int, script: Callable[[int, StepView], int]):
        self.max_draft_len, self.script = max_draft_len, script
        self.last: Decision | None = None
        self.chosen: list[int] = []
        self.outcomes: list[StepOutcome] = []

    def start(self, slot: int) -> None:
        pass

    def choose(self, view: StepView) -> Decision:
        d = min(self.script(len(self.chosen) + 1, view), self.max_draft_len)
        rows = min(len(view.slots), view.budget // (1 + d))
        draft_lens = np.minimum(d, np.maximum(view.remaining[:rows] - 1, 0)).astype(np.int64)
        if d and not draft_lens.any():  # nobody has room to draft: a plain step
            d, rows = 0, min(len(view.slots), view.budget)
            draft_lens = np.zeros(rows, dtype=np.int64)
        self.last = Decision(d, draft_lens, rows, None)
        self.chosen.append(d)
        return self.last

    def observe(self, outcome: StepOutcome) -> None:
        self.outcomes.append(outcome)

    def warmed_up(self) -> None:
        self.last = None

    def state(self) -> dict:
        return {}
