"""RunConfig: the settings of an engine run that the scheduling core reads and a replay reproduces -- proposer, draft
length, schedule, acceptance, KV pool, batch limits, padded shapes, warm-up. `runtime.engine_config.EngineConfig` adds
the model, device and worker settings; the simulator's replay builds its configuration with this class from a trace
header (`RunConfig.from_header`): the run's defaults and checks, without the recording machine's paths and devices.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specsched.scheduler.errors import ConfigurationError, field_errors
from specsched.scheduler.pipeline import MAX_KEPT_TOKENS
from specsched.scheduler.proposer import ProposerSpec, validate_combination
from specsched.scheduler.sampling_params import SamplingParams
from specsched.scheduler.synthetic import SyntheticAcceptance
from specsched.scheduler.wiring import (DEFAULT_DRAFT_LEN, NATURAL_SCHEDULE, TREE_MAX_NODES, TREE_TOP_K,
                                        WARMUP_TOKENS, proposer_spec)
from specsched.traces.names import ProposerKind, ProposerName, ScheduleName, schedule_name

# The engine's start-up warm-up request, which the simulator's replay emulates (without a tokenizer, giving it the
# first replayed request's prompt length); `warmup_params`: greedy, at most WARMUP_TOKENS tokens, EOS ignored.
WARMUP_ID = "specsched-warmup"
WARMUP_PROMPT = "def main():\n    return 0\n"


# vLLM's default capture sizes up to 256 rows
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def capture_sizes(sizes: Iterable[int] | None) -> tuple[int, ...]:
    """`sizes` sorted and checked (None: the defaults); ValueError naming a size that is not a positive integer."""
    if sizes is None:
        return DEFAULT_CAPTURE_SIZES
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise ValueError(f"cuda_graph_sizes: {s!r} is not a positive number of rows")
        out.append(int(s))
    if not out:
        raise ValueError("cuda_graph_sizes: give at least one size (or turn CUDA graphs off)")
    return tuple(sorted(set(out)))


def warmup_params(max_tokens: int = WARMUP_TOKENS) -> SamplingParams:
    """The warm-up request's sampling parameters, at most `max_tokens` output tokens."""
    return SamplingParams(max_tokens=min(WARMUP_TOKENS, max_tokens), ignore_eos=True)


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    proposer: ProposerName = ProposerKind.NONE.value
    draft_len: int | Literal["auto"] | None = Field(
        None, description="D (tree depth for eagle); 'auto': chosen per step up to max_draft_len "
        "(scheduler/adaptive.py); None = proposer default")
    max_draft_len: int = Field(4, description="with draft_len 'auto': the longest D it may choose")
    draft_profile: str | None = Field(None, description="with draft_len 'auto': a cost profile (JSON, "
                                      "`specsched fit-profile`) seeding its step-time models")
    schedule: ScheduleName | None = Field(
        None, description="None = the proposer's natural schedule; 'mtp' is read as 'eager_fill'"
    )
    ngram_min: int = 1
    ngram_max: int = 3
    tree_top_k: int = TREE_TOP_K
    tree_max_nodes: int = TREE_MAX_NODES
    acceptance: Literal["lossless", "threshold", "synthetic"] = Field(
        "lossless", description="how a verify accepts drafts: lossless, threshold (lossy), or synthetic "
        "(vLLM's: forced to the acceptance below, for benchmarks; scheduler/synthetic.py)")
    threshold: float = Field(0.3, description="lossy threshold mode: min target prob per token")
    synthetic_acceptance_length: float | None = Field(
        None, description="acceptance 'synthetic': the mean acceptance length, bonus token counted")
    synthetic_acceptance_rates: list[float] | None = Field(
        None, description="acceptance 'synthetic': per-position unconditional rates, non-increasing")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="the seed of the engine's own draws (synthetic "
                      "acceptance); a request's sampling is seeded by its SamplingParams.seed")
    synthetic_acceptance_independent: bool = Field(
        False, description="acceptance 'synthetic': draw each position on its own, not one uniform per row")
    page_size: int = Field(16, ge=1)
    num_pages: int = Field(4096, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_kept_hidden_tokens: int = Field(MAX_KEPT_TOKENS, ge=1, description="with draft_len 'auto' and an MTP "
                                        "head: the most target positions whose hidden states the device keeps for "
                                        "the head's fills that wait while speculation is off (over a step's rows); "
                                        "past it the head catches up at D = 0, which frees them")
    cuda_graphs: bool | None = Field(None, description="run steps of uniform rows (decodes, verifies, draft "
                                     "steps, window fills) at padded row counts, the shapes CUDA graphs are "
                                     "captured for (runtime/padding.py; on a CPU worker the padded shapes run "
                                     "eagerly); None: off. False = vLLM's enforce_eager")
    cuda_graph_sizes: list[int] | None = Field(None, description="the padded row counts (capture sizes); "
                                               "default 1, 2, 4, 8, 16, 24, 32, ..., 256")
    skip_warmup: bool = Field(False, description="start serving without the warm-up request that runs "
                              "each device op once first (their first launches pay one-off costs)")

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_alias(cls, value: object) -> object:
        return schedule_name(value)

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.draft_len is None:
            self.draft_len = DEFAULT_DRAFT_LEN[self.proposer]
        if self.draft_len == "auto":
            if self.proposer in (ProposerKind.NONE, ProposerKind.EAGLE):
                raise ValueError(f"draft_len 'auto' needs a linear proposer (draft, mtp, ngram), not "
                                 f"{self.proposer!r}")
            if self.max_draft_len < 1:
                raise ValueError(f"max_draft_len must be >= 1, got {self.max_draft_len}")
        elif self.draft_profile is not None:
            raise ValueError("draft_profile seeds the adaptive draft length: it needs draft_len 'auto'")
        if self.schedule is None:
            self.schedule = NATURAL_SCHEDULE[self.proposer]
        if self.cuda_graph_sizes is not None:
            if self.cuda_graphs is False:
                raise ValueError("cuda_graph_sizes pads steps for CUDA graphs, which cuda_graphs false "
                                 "(--enforce-eager) turns off")
            capture_sizes(self.cuda_graph_sizes)
        if self.proposer == ProposerKind.NGRAM and not (1 <= self.ngram_min <= self.ngram_max):
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.acceptance == "threshold" and not (0.0 < self.threshold < 1.0):
            raise ValueError("threshold must be in (0, 1)")
        validate_combination(self.proposer, self.schedule, self.longest_draft_len)
        spec = self.proposer_spec()  # validates the draft length
        self._check_synthetic(spec)
        # a step must hold one verification row (last token + candidates), or no speculative request is ever scheduled
        width = 1 + spec.num_candidates
        if self.max_num_batched_tokens < width:
            what = (f"1 + the eagle tree's {spec.num_candidates} nodes" if self.proposer == ProposerKind.EAGLE
                    else f"1 + draft_len ({self.longest_draft_len})")
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) cannot hold one "
                f"verification of {what} = {width} tokens; raise it to at least {width}"
            )
        return self

    def _check_synthetic(self, spec: ProposerSpec) -> None:
        given = [k for k in ("synthetic_acceptance_length", "synthetic_acceptance_rates") if getattr(self, k) is not None]
        if self.acceptance != "synthetic":
            if given:
                raise ValueError(f"{given[0]} needs acceptance 'synthetic' (acceptance is {self.acceptance!r})")
            return
        if self.proposer == ProposerKind.NONE:
            raise ValueError("acceptance 'synthetic' needs a proposer (draft, mtp, eagle, ngram), not 'none'")
        self.synthetic().check(spec.max_accept)

    def synthetic(self) -> SyntheticAcceptance | None:
        """The synthetic acceptance asked for (None unless acceptance is 'synthetic')."""
        if self.acceptance != "synthetic":
            return None
        rates = self.synthetic_acceptance_rates
        return SyntheticAcceptance(self.synthetic_acceptance_length, None if rates is None else tuple(rates),
                                   self.synthetic_acceptance_independent)

    def graph_sizes(self) -> tuple[int, ...]:
        """The row counts uniform steps are padded to; () where every step runs at its own shape."""
        if not self.cuda_graphs:
            return ()
        return capture_sizes(self.cuda_graph_sizes)

    @property
    def adaptive(self) -> bool:
        return self.draft_len == "auto"

    @property
    def longest_draft_len(self) -> int:
        """The proposer's D: the fixed one, or the longest the adaptive one may choose."""
        return self.max_draft_len if self.draft_len == "auto" else self.draft_len

    def proposer_spec(self) -> ProposerSpec:
        return proposer_spec(self.proposer, self.longest_draft_len, tree_top_k=self.tree_top_k,
                             tree_max_nodes=self.tree_max_nodes, schedule=self.schedule)

    @classmethod
    def make(cls, **kwargs) -> "RunConfig":
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise ConfigurationError(describe(e)) from None

    @classmethod
    def from_header(cls, recorded: Mapping[str, Any], **changes: Any) -> "RunConfig":
        """A trace header's `engine_config` with `changes` (a replay's what-ifs) on top. Settings this release no longer
        has are dropped, missing ones take their defaults; anything else invalid is a ConfigurationError naming it."""
        data = {k: v for k, v in recorded.items() if k in cls.model_fields}
        data.update(changes)
        try:
            return cls(**data)
        except ValidationError as e:
            raise ConfigurationError(f"{describe(e)} (the trace header's engine_config, with the replay's "
                                     "changes)") from None

def describe(e: ValidationError) -> str:
    """pydantic's errors as one message naming each field."""
    return "invalid engine config: " + "; ".join(f"{loc or 'config'}: {msg}" for loc, msg in field_errors(e.errors()))
