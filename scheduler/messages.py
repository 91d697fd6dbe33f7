"""The device messages: one frozen dataclass per op (packed from a scheduled step by
scheduler/packing.py).

Why: work crosses to the device as a typed message of arrays and scalars, so it can go over a
pipe to a worker process (pickled), to CUDA in-process, or to the simulator's virtual device
unchanged, and every reader (the worker, the proposers, the paced worker, the virtual device)
names the fields it reads. The device keeps per-request token state (indexed by slot);
messages say which positions to compute, never the tokens the device itself produced, so the
host need not wait for them (the basis of the no-sync schedules).

Ops and their messages (per-row fields are [B] numpy arrays over the scheduled rows):
  forward  `ForwardMessage`: target forward of prefill chunks / decodes; samples where `samples`
  draft    `DraftMessage`: the proposer makes up to `draft_lens` tokens per row (one launch)
  verify   `VerifyMessage`: target over the last token + candidates, acceptance, bonus token
  fill     `FillMessage`: proposer KV fill (draft model: unseen tokens; head: a target batch)
and, outside the step loop, `AgreementMessage` (the proposer's agreement with an output).
Every message carries its `LaunchShape` (what traces and cost models read: a virtual or
paced device times the launch by it) and the slots whose device state is to be `release`d
before the op runs. Results are typed the same way (`ForwardResult`, `DraftResult`,
`VerifyResult`, `FillResult`); `substages` are device-side (name, start_ns, end_ns) stamps.
On a tensor-parallel device a result also carries `ranks`, the other ranks' intervals that
completed since the previous result, as (rank, span name, step, start_ns, end_ns), and
`comm`, the op's (broadcast ns, all-reduce ns) on the leader.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from specsched.scheduler.plan import AttentionPlan
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
    # `attrs()` built once: a launch's pipeline, trace, device and cost model each ask for it
    _attrs: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def attrs(self) -> dict[str, Any]:
        """The shape as span attributes (fields that are set): a new dict the caller may change."""
        got = self._attrs
        return (got if got is not None else self.view()).copy()

    def view(self) -> dict[str, Any]:
        """`attrs()` without the copy, for readers that do not change it (the virtual device
        prices every launch by it)."""
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
    # a head's fill of these rows waits (speculation off): the device keeps the target's hidden
    # states of the forward's positions for the fill that catches the head up (after="catch_up")
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
    # [B, W] int64 drafts made on the host (`ProposerRules.host_drafts`; row i's first
    # draft_lens[i] valid), which the device puts after each row's last token; None: the
    # proposer's draft launch put them there
    drafts: np.ndarray | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FillMessage(Message):
    op: ClassVar[str] = "fill"
    # "forward" / "verify": a head consumes that launch's target hidden states; "catch_up": the
    # ones the device kept (`ForwardMessage.keep_hidden`) of the positions it missed
    after: str
    start: np.ndarray  # [B] first position filled
    end: np.ndarray  # [B] end of the fill
    plan: AttentionPlan | None = None
    # after a verify: the fill covers its window, launched before the accepted lengths are
    # known -- the device reads each row's tokens up to its new last one (past it, that one
    # again: KV the next steps overwrite) and carries the logits at the accepted index
    window: bool = False


@dataclass(frozen=True, slots=True)
class AgreementMessage:
    """Not a pipeline op: the proposer's teacher-forced greedy agreement with an output
    (recorded in traces for the simulator, `specsched bench`)."""

    op: ClassVar[str] = "agreement"
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True, slots=True)
class AgreementResult:
    agreement: list[int]  # per output token: 1 where the proposer's guess equals it


@dataclass(frozen=True, slots=True)
class ForwardResult:
    tokens: np.ndarray  # [B] sampled token per row (-1 where the row does not sample)
    substages: tuple[tuple[str, int, int], ...] = ()
    ranks: tuple[tuple[int, str, int, int, int], ...] = ()
    comm: tuple[int, int] = ()


@dataclass(frozen=True, slots=True)
class DraftResult:
    draft_lens: np.ndarray  # [B] tokens drafted per row
    substages: tuple[tuple[str, int, int], ...] = ()
    ranks: tuple[tuple[int, str, int, int, int], ...] = ()
    comm: tuple[int, int] = ()


@dataclass(frozen=True, slots=True)
class VerifyResult:
    accepted: np.ndarray  # [B] drafts accepted per row
    tokens: np.ndarray  # [B, W] emitted tokens (accepted, then the bonus): row i's first accepted[i] + 1
    draft_lens: np.ndarray  # [B] drafts each row was scored on
    substages: tuple[tuple[str, int, int], ...] = ()
    ranks: tuple[tuple[int, str, int, int, int], ...] = ()
    comm: tuple[int, int] = ()


@dataclass(frozen=True, slots=True)
class FillResult:
    substages: tuple[tuple[str, int, int], ...] = field(default=())
    ranks: tuple[tuple[int, str, int, int, int], ...] = ()
    comm: tuple[int, int] = ()
