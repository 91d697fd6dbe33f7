"""The draft length of each decode-only step: the `DraftPolicy` seam and the fixed policy.

Why a protocol: the batch builder asks a policy for each decode-only step's D, and the
pipeline tells it once per step what that step did (`StepOutcome`: its verify's acceptance,
the device intervals of the launches completed since, the step's wall time). A fixed D is
`FixedPolicy`; the adaptive one is scheduler/adaptive.py's `DraftLenPolicy`; a test that needs
a given sequence of draft lengths writes a policy of its own instead of patching one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Decision:
    draft_len: int  # the step's D
    num_draft: np.ndarray  # [B] tokens each row drafts (<= draft_len)
    rows: int  # rows the step serves (the token budget holds B·(1 + D))
    gain: float | None  # predicted tokens/s at D over D = 0 (None where nothing was predicted)
    explored: bool = False
    device_ns: float | None = None  # the step's predicted device time


@dataclass(frozen=True)
class StepView:
    """A decode-only step as its policy sees it: the rows that may decode, in order."""

    slots: np.ndarray  # [n] int64: the rows' slots
    remaining: np.ndarray  # [n] int64: output tokens each row has left
    computed: np.ndarray  # [n] int64: KV tokens each row holds
    budget: int  # tokens the step may take: it holds B·(1 + D) verify tokens
    lag: np.ndarray | None = None  # [n] int64: tokens each row's proposer has not read (lazy fills)


@dataclass(frozen=True)
class VerifyOutcome:
    slots: np.ndarray  # [B] int64: the verified rows' slots
    live: np.ndarray  # [B] bool: the row's request still holds its slot (its own estimates apply)
    asked: np.ndarray  # [B] int64: drafts each row was asked for
    drafted: np.ndarray  # [B] int64: drafts each row made (fewer where a lookup found none)
    accepted: np.ndarray  # [B] int64: drafts each row had accepted


@dataclass(frozen=True)
class StepOutcome:
    """What one step did, as its policy learns it (delivered before the next step's choice)."""

    decision: Decision | None  # the step's, if its D was chosen (a decode-only step)
    wall_ns: int | None  # the step's wall time, schedule to output (None: it ran one step ahead)
    verify: VerifyOutcome | None  # its verification, if it speculated
    # launches completed since the last outcome: (op, the launch's shape attributes, device ns)
    launches: tuple[tuple[str, dict, int], ...] = ()


class DraftPolicy(Protocol):
    max_draft_len: int
    # it chooses D step by step from what it observes: the pipeline then records each step's D
    # and sends it every `StepOutcome` (a fixed policy is sent none)
    adaptive: bool
    # it may choose D = 0 on a decode step: a proposer with lazy fills then skips them and
    # catches up when drafting resumes
    pauses: bool
    last: Decision | None  # the latest decision

    def start(self, slot: int) -> None:
        """A request took `slot`."""
        ...

    def choose(self, view: StepView) -> Decision: ...

    def observe(self, outcome: StepOutcome) -> None: ...

    def warmed_up(self) -> None:
        """The engine's start-up warm-up is done: what it taught stays, its last choice goes."""
        ...


class FixedPolicy:
    """Every decode-only step drafts D tokens a row (fewer where a request has fewer left)."""

    adaptive = False
    pauses = False

    def __init__(self, draft_len: int):
        if draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {draft_len}")
        self.max_draft_len = draft_len
        self.last: Decision | None = None

    def start(self, slot: int) -> None:
        pass

    def choose(self, view: StepView) -> Decision:
        d = self.max_draft_len
        rows = min(len(view.slots), view.budget // (1 + d))
        num_draft = np.minimum(d, np.maximum(0, view.remaining[:rows] - 1))
        self.last = Decision(d, num_draft, rows, None)
        return self.last

    def observe(self, outcome: StepOutcome) -> None:
        pass

    def warmed_up(self) -> None:
        self.last = None
