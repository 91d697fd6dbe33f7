"""What a request's consumer receives: `RequestOutput`s (with `TokenLogprob`s), and the stream that carries a
request's raw items from the pipeline's step loop (`StreamSink`, the engine's `OutputSink`) to its consumer,
`AsyncEngine.generate`, which detokenizes them and applies the stop strings off the step loop.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from specsched.scheduler.request import Request

if TYPE_CHECKING:
    from specsched.runtime.engine import AsyncEngine


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target (log-softmax of its raw logits, as vLLM's default
    `raw_logprobs`) and the most likely tokens there."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first: `SamplingParams.logprobs` of them


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens since the previous output
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_output_tokens: int = 0
    spec: dict = field(default_factory=dict)  # per-request speculative stats (on finish)
    logprobs: list[TokenLogprob] | None = None  # per new token, with `SamplingParams.logprobs`
    # with `SamplingParams.prompt_logprobs`, on the first output: per prompt token (None for the first, which nothing
    # scores)
    prompt_logprobs: list[TokenLogprob | None] | None = None


def token_logprobs(token_ids: list[int], logprobs: tuple | None) -> list[TokenLogprob] | None:
    """token_ids with their log-probabilities from the sink's arrays (`OutputSink.on_tokens`; None: none asked)."""
    if logprobs is None:
        return None
    tok, ids, lps = (a.tolist() for a in logprobs)
    return [TokenLogprob(t, tok[j], list(zip(ids[j], lps[j]))) for j, t in enumerate(token_ids)]


@dataclass
class Tokens:
    """Stream item: token ids the pipeline appended to the request's output (not decoded)."""
    token_ids: list[int]
    logprobs: tuple | None = None  # `OutputSink.on_tokens`' arrays


@dataclass
class PromptLogprobs:
    """Stream item: prompt tokens first, first + 1, ... scored (`OutputSink.on_prompt_logprobs`)."""
    first: int
    logprobs: tuple


@dataclass
class Finished:
    """Stream item: the pipeline finished the request."""
    reason: str | None
    error: str | None
    num_output_tokens: int
    spec: dict


class Stream:
    """Items of one request, from the pipeline to its consumer (`generate`); bounded by
    max_tokens + 1 items by construction (each `Tokens` holds at least one token)."""

    def __init__(self) -> None:
        self.items: deque[Tokens | Finished] = deque()
        self.event = anyio.Event()

    def push(self, item: Tokens | Finished) -> None:
        self.items.append(item)
        self.event.set()


class StreamSink:
    """The pipeline's side of each request's stream: raw token ids and the finish go into it;
    the step loop does no detokenizing (the consumer, `AsyncEngine.generate`, does)."""

    wants_token_ids = True

    def __init__(self, engine: "AsyncEngine"):
        self.engine = engine

    def on_tokens(self, req: Request, token_ids: list[int], logprobs: tuple | None = None) -> None:
        st = self.engine._streams.get(req.request_id)
        if st is not None and token_ids:
            st.push(Tokens(list(token_ids), logprobs))

    def on_prompt_logprobs(self, req: Request, first: int, logprobs: tuple) -> None:
        st = self.engine._streams.get(req.request_id)
        if st is not None:
            st.push(PromptLogprobs(first, logprobs))

    def on_finish(self, req: Request) -> None:
        st = self.engine._streams.get(req.request_id)
        if st is not None:
            st.push(Finished(req.finish_reason, req.error, req.num_output_tokens, req.spec_stats()))
