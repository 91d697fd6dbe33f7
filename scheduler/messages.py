"""The device messages and results: one frozen dataclass per op, so work goes unchanged (pickled) to a worker process,
to CUDA in-process or to the simulator's virtual device. The device keeps per-request token state (by slot); messages
say which positions to compute, never tokens the device produced, so the host need not wait for them (the basis of
the no-sync schedules).

Ops (per-row fields are [B] numpy arrays over the scheduled rows): forward (prefill chunks / decodes, sampling where
`samples`), draft (up to `draft_lens` tokens per row, one launch), verify (target over the last token + candidates,
acceptance, bonus token), fill (proposer KV: a draft model's unseen tokens, a head's target batch); outside the step
loop, agreement. A message carries its `LaunchShape` (traces and cost models read it; a virtual or paced device times
the launch by it) and the slots to `release` before the op runs. In results, `substages` are device-side
(name, start_ns, end_ns) stamps; on a tensor-parallel device `ranks` are the other ranks' intervals completed since
the previous result, as (rank, span name, step, start_ns, end_ns), and `comm` the op's (broadcast ns, all-reduce ns)
on the leader.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from specsched.scheduler.plan import AttentionPlan
from specsched.scheduler.sampling_params import LogitsAdjust
from specsched.scheduler.synthetic import SyntheticAcceptance


@dataclass(frozen=True, slots=True)
class LaunchShape:
    """A launch's shape: its spans' attributes and its cost features."""

    requests: int
    tokens: int
    kv_tokens: int
    kind: str | None = None  # a forward: prefill / decode / mixed
    after: str | None = None  # a fill: the target launch it follows ("forward" / "verify")
    draft_len: int | None = None  # a draft: the longest row's draft length
    draft_tokens: int | None = None
    draft_forwards: int | None = None
    # requests x longest query x longest KV: the cells of an attention padded to the longest row
    padded_attn: int | None = None
    # `attrs()` built once (several readers per launch)
    _attrs: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def attrs(self) -> dict[str, Any]:
        """The shape as span attributes (fields that are set): a new dict the caller may change."""
        got = self._attrs
        return (got if got is not None else self.view()).copy()

    def view(self) -> dict[str, Any]:
        """`attrs()` without the copy, for readers that do not change it."""
        got = self._attrs
        if got is not None:
            return got
        out: dict[str, Any] = {"requests": self.requests, "tokens": self.tokens, "kv_tokens": self.kv_tokens}
        if self.kind is not None:
            out["kind"] = self.kind
        if self.after is not None:
            out["after"] = self.after
        if self.draft_len is not None:
            out["draft_len"] = self.draft_len
            out["draft_tokens"] = self.draft_tokens
            out["draft_forwards"] = self.draft_forwards
        if self.padded_attn is not None:
            out["padded_attn"] = self.padded_attn
        object.__setattr__(self, "_attrs", out)
        return out


@dataclass(frozen=True, slots=True)
class Registration:
    """A request the device has no state for yet: its tokens so far and sampling params."""

    slot: int
    token_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    synthetic: SyntheticAcceptance | None = None  # its own synthetic acceptance (SamplingParams.synthetic)
    key: int = 0  # its synthetic draws' key (`request_key` of its id)
    logprobs: int | None = None  # `SamplingParams.logprobs`: its tokens' log-probabilities and this many top ones
    min_p: float = 0.0
    prompt_logprobs: int | None = None  # `SamplingParams.prompt_logprobs`
    prompt_len: int = 0  # its prompt's tokens (`token_ids` holds its output too after a preemption)
    min_tokens: int = 0  # `SamplingParams.min_tokens`: before them, `suppress` may not be generated
    suppress: tuple[int, ...] = ()  # EOS and the stop token ids, with min_tokens
    adjust: LogitsAdjust | None = None  # `SamplingParams.logits_adjust()`: logit bias and penalties
    grammar: str | None = None  # `SamplingParams.structured_outputs`: the regular expression its output matches
    grammar_index: bytes | None = None  # its automaton as the engine compiled it (`Request.grammar_index`)


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    op: ClassVar[str] = ""
    step: int
    slots: np.ndarray  # [B] int64
    shape: LaunchShape
    release: tuple[int, ...] = ()  # slots whose device state is dropped before the op


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardMessage(Message):
    op: ClassVar[str] = "forward"
    start: np.ndarray  # [B] first position computed
    num_new: np.ndarray  # [B] positions computed
    samples: np.ndarray  # [B] bool: sample a token after the row's last position
    register: tuple[Registration, ...] = ()
    plan: AttentionPlan | None = None  # None for a device that needs no attention metadata
    # a head's fill waits (speculation off): keep these positions' hidden states for its catch-up fill
    keep_hidden: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftMessage(Message):
    op: ClassVar[str] = "draft"
    start: np.ndarray  # [B] position of each row's last token (its length - 1)
    draft_lens: np.ndarray  # [B] tokens to draft
    page_size: int
    page_tables: np.ndarray | None = None  # [B, max_pages] the proposer's KV pages
    table_lens: np.ndarray | None = None  # [B] pages in each row


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyMessage(Message):
    op: ClassVar[str] = "verify"
    start: np.ndarray  # [B] position of each row's last token
    draft_lens: np.ndarray  # [B] drafts planned
    plan: AttentionPlan | None = None
    # [B, W] int64 host-made drafts (row i's first draft_lens[i] valid), put after each row's last token;
    # None: the proposer's draft launch put them there
    drafts: np.ndarray | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FillMessage(Message):
    op: ClassVar[str] = "fill"
    # "forward" / "verify": a head consumes that launch's target hidden states; "catch_up": the kept ones
    after: str
    start: np.ndarray  # [B] first position filled
    end: np.ndarray  # [B] end of the fill
    plan: AttentionPlan | None = None
    # over a verify's window, before acceptance is known: the device reads each row's tokens up to its new last one
    # (past it, that one again: KV the next steps overwrite) and carries the logits at the accepted index
    window: bool = False


@dataclass(frozen=True, slots=True)
class AgreementMessage:
    """Not a pipeline op: the proposer's teacher-forced greedy agreement with an output (traced for the simulator)."""

    op: ClassVar[str] = "agreement"
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True, slots=True)
class AgreementResult:
    agreement: list[int]  # per output token: 1 where the proposer's guess equals it


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    substages: tuple[tuple[str, int, int], ...] = ()
    ranks: tuple[tuple[int, str, int, int, int], ...] = ()
    comm: tuple[int, int] = ()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probabilities of a step's emitted tokens, for the rows that asked (`Registration.logprobs`; the other
    rows' entries are unread), position k of a row the k-th token it emitted."""

    token: np.ndarray  # [B, W] each emitted token's log-probability under the target
    top_ids: np.ndarray  # [B, W, K] the K most likely tokens there, most likely first
    top: np.ndarray  # [B, W, K] their log-probabilities

    def row(self, i: int, k: int, n: int | None = None, start: int = 0) -> tuple:
        """Row i's n positions from `start` (to its end: None) with its k most likely: ([n], [n, k] ids, [n, k]
        log-probabilities), as `OutputSink.on_tokens` takes them."""
        end = None if n is None else start + n
        return self.token[i, start:end], self.top_ids[i, start:end, :k], self.top[i, start:end, :k]


@dataclass(frozen=True, slots=True)
class ForwardResult(Result):
    tokens: np.ndarray  # [B] sampled token per row (-1 where the row does not sample)
    logprobs: TokenLogprobs | None = None  # W = 1
    # rows computing prompt tokens of a request with `prompt_logprobs`: (row, index of the first prompt token scored,
    # count n), their tokens' log-probabilities one row after another in `prompt_logprobs` (B = 1, W = the sum of n)
    prompt_spans: tuple[tuple[int, int, int], ...] = ()
    prompt_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class DraftResult(Result):
    draft_lens: np.ndarray  # [B] tokens drafted per row


@dataclass(frozen=True, slots=True)
class VerifyResult(Result):
    accepted: np.ndarray  # [B] drafts accepted per row
    tokens: np.ndarray  # [B, W] emitted tokens (accepted, then the bonus): row i's first accepted[i] + 1
    draft_lens: np.ndarray  # [B] drafts each row was scored on
    logprobs: TokenLogprobs | None = None  # W as `tokens`


@dataclass(frozen=True, slots=True)
class FillResult(Result):
    pass
