"""A request's life: waiting -> running -> (preempted -> waiting ->) finished | aborted.

Token accounting follows vLLM: `num_computed_tokens` counts tokens whose KV is in the
target cache. Between steps the last emitted token is not yet computed (it is the next
step's input), so a running decode request has num_computed_tokens == num_tokens - 1.
Draft tokens are extra scheduled tokens of a step; the rejected ones roll back.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specsched.scheduler.sampling_params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


FINISHED_STATES = (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_ns: int
    slot: int = -1  # dense index the device uses for per-request state
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens with KV in the target cache
    num_pending_tokens: int = 0  # sampled on the device, not yet seen by the host
    num_proposer_computed: int = 0  # tokens with KV in the proposer's cache (draft / head)
    abort_requested: bool = False
    num_preemptions: int = 0
    first_token_ns: int | None = None
    finish_ns: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # speculative accounting
    num_drafts: int = 0  # steps in which this request was drafted for
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [D] drafts accepted at >= k+1
    drafted_per_pos: list[int] = field(default_factory=list)  # [D] drafts with >= k+1 tokens

    def __post_init__(self) -> None:
        self._num_prompt = len(self.prompt_token_ids)  # the prompt never changes

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, including ones sampled on the device but not yet seen."""
        return self._num_prompt + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def in_prefill(self) -> bool:
        """True while the prompt, or some token before the last, still lacks KV (prompt or
        recompute). A token sampled on the device but not yet seen counts as emitted."""
        c = self.num_computed_tokens
        return c < self._num_prompt or c < self._num_prompt + len(self.output_token_ids) + self.num_pending_tokens - 1

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output_tokens - self.num_pending_tokens

    def record_spec(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_drafted_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_per_pos) < num_drafted:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for k in range(num_drafted):
            self.drafted_per_pos[k] += 1
            if k < num_accepted:
                self.accepted_per_pos[k] += 1

    def spec_stats(self) -> dict:
        return {
            "drafts": self.num_drafts,
            "drafted_tokens": self.num_drafted_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "mean_accept_len": (1.0 + self.num_accepted_tokens / self.num_drafts)
            if self.num_drafts
            else None,
            "accept_rate_per_pos": [
                a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)
            ],
        }
