"""The names every package shares: proposer kinds and schedules, each defined once.

Why here: the trace header, EngineConfig, the scheduler's rule tables, the simulator and the
CLI all name proposers and schedules, and traces/ is the leaf package every other one imports.
What a kind of proposer or a schedule *does* is a row of a rules table in the scheduler
(`scheduler/proposer.py` RULES, `scheduler/schedules.py` SCHEDULE_RULES), keyed by these names.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Literal


class ProposerKind(StrEnum):
    NONE = "none"  # plain decoding
    DRAFT = "draft"  # a small draft LLM with a KV cache of its own
    MTP = "mtp"  # a multi-token-prediction head on the target's hidden states
    EAGLE = "eagle"  # an EAGLE-style head drafting a token tree
    NGRAM = "ngram"  # a lookup in the request's own tokens, on the host


class Schedule(StrEnum):
    SYNC = "sync"  # every launch awaited before the next stage: the baseline
    OVERLAP = "overlap"  # the proposer's fill runs while the host prepares the next step
    EAGER_FILL = "eager_fill"  # the fill is launched right behind the verify, before acceptance is known
    PLAIN_OVERLAP = "plain_overlap"  # plain decoding, each step launched before the last one's tokens return


PROPOSERS: tuple[str, ...] = tuple(k.value for k in ProposerKind)
SCHEDULES: tuple[str, ...] = tuple(s.value for s in Schedule)
# the pydantic field types of configs and trace headers (the values above, as Literals)
ProposerName = Literal[PROPOSERS]  # type: ignore[valid-type]
ScheduleName = Literal[SCHEDULES]  # type: ignore[valid-type]

# spellings of earlier releases, still accepted in configs, the CLI and old traces
SCHEDULE_ALIASES = {"mtp": Schedule.EAGER_FILL.value}


def schedule_name(name: str) -> str:
    """The schedule `name` stands for (an alias resolved); unknown names pass through, for the
    caller's validation to refuse by name."""
    return SCHEDULE_ALIASES.get(name, name) if isinstance(name, str) else name
