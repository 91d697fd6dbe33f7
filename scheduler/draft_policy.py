"""The draft length of each decode-only step: the `DraftPolicy` seam and the fixed policy. The scheduler asks a policy
for each decode-only step's D; the pipeline tells it once per step what that step did (`StepOutcome`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Decision:
    draft_len: int  # the step's D
    draft_lens: np.ndarray  # [B] tokens each row drafts (<= draft_len)
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
    # chooses D from what it observes: the pipeline records each step's D and sends it every `StepOutcome`
    adaptive: bool
    # may choose D = 0 on a decode step: a proposer with lazy fills then skips them until drafting resumes
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


class PolicyFeed:
    """What an adaptive policy is told (the step's verify, its wall time, the device intervals of launches completed
    since), gathered over a step and delivered once before the next choice. Nothing is gathered for a fixed policy."""

    def __init__(self, policy: DraftPolicy):
        self.policy = policy
        self._launches: list = []  # launches whose device intervals are still to come
        self._step: tuple | None = None  # (batch, wall_ns or None, (drafted, accepted) or None)

    @property
    def pending(self) -> bool:
        return bool(self._launches) or self._step is not None

    def launched(self, launch) -> None:
        if self.policy.adaptive:
            self._launches.append(launch)

    def verified(self, batch, drafted: np.ndarray, accepted: np.ndarray) -> None:
        if self.policy.adaptive:
            self._step = (batch, None, (drafted, accepted))

    def stepped(self, batch, wall_ns: int) -> None:
        """A step whose D the policy chose ended after `wall_ns`."""
        self._step = (batch, wall_ns, self._step[2] if self._step is not None else None)

    def deliver(self, gen: np.ndarray) -> None:
        """The gathered `StepOutcome`; `gen` [slots]: each slot's generation now (a verified row whose request has gone
        teaches the engine-wide estimates only)."""
        keep, done = [], []
        for launch in self._launches:
            ev = launch.event
            if not ev.query():
                keep.append(launch)
            elif ev.start_ns is not None and ev.end_ns is not None:
                done.append((launch.op, launch.attrs, ev.end_ns - ev.start_ns))
        self._launches = keep
        step, self._step = self._step, None
        if step is None and not done:
            return
        batch, wall_ns, verify = step if step is not None else (None, None, None)
        if verify is not None:
            verify = VerifyOutcome(batch.slots, gen[batch.slots] == batch.gen, batch.draft_lens, *verify)
        self.policy.observe(StepOutcome(batch.decision if batch is not None else None, wall_ns, verify,
                                        tuple(done)))


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
        draft_lens = np.minimum(d, np.maximum(0, view.remaining[:rows] - 1))
        self.last = Decision(d, draft_lens, rows, None)
        return self.last

    def observe(self, outcome: StepOutcome) -> None:
        pass

    def warmed_up(self) -> None:
        self.last = None
