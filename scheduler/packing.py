"""Packing a scheduled step into its device messages: each op's rows, positions, launch shape and attention plan."""
from __future__ import annotations

from typing import Any

import numpy as np

from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.messages import (DraftMessage, FillMessage, ForwardMessage, LaunchShape, Registration,
                                          VerifyMessage)
from specsched.scheduler.plan import build_plan, length_class, padded_attention
from specsched.scheduler.proposer import ProposerSpec
from specsched.scheduler.small_arrays import largest, smallest, total
from specsched.scheduler.step_batch import StepBatch
from specsched.scheduler.synthetic import request_key


def shape(qo_lens: np.ndarray, kv_lens: np.ndarray, **extra: Any) -> LaunchShape:
    """A launch's shape from its rows' computed and KV tokens."""
    n = len(qo_lens)
    return LaunchShape(n, total(qo_lens), total(kv_lens), padded_attn=_padded(n, qo_lens, kv_lens), **extra)


def _padded(n: int, qo_lens: np.ndarray | int, kv_lens: np.ndarray) -> int:
    """`LaunchShape.padded_attn` of rows computing `qo_lens` tokens (an int: every row) with KV `kv_lens`: each row
    padded to the longest query and KV of its `plan.attention_groups` group."""
    if not n:
        return 0
    if isinstance(qo_lens, int):
        return n * qo_lens * largest(kv_lens)
    q = largest(qo_lens)
    if q > 1 and n > 1 and length_class(smallest(qo_lens)) != length_class(q):  # groups attended apart
        return padded_attention(qo_lens, kv_lens)
    return n * q * largest(kv_lens)


def batch_shape(batch: StepBatch, row_tokens: int = 0, **extra: Any) -> LaunchShape:
    """Shape of a step for traces and cost models. With `row_tokens` a speculative step counts that many tokens per row
    (a tree's verify: 1 + its nodes; the token budget: 1 + D); without, each row's own (1 + its drafts)."""
    cache = batch.shape_cache  # asked for by several stages of the step
    if not extra:
        got = cache.get(row_tokens)
        if got is not None:
            return got
    n = len(batch)
    spec = row_tokens and batch.is_spec
    tokens = n * row_tokens if spec else batch.num_tokens
    kv = cache.get("kv_tokens")
    if kv is None:
        ends = cache["ends"] = batch.start + batch.num_new + batch.draft_lens
        kv = cache["kv_tokens"] = total(ends)
    padded = _padded(n, row_tokens if spec else batch.num_new + batch.draft_lens, cache["ends"])
    if extra:
        return LaunchShape(n, tokens, kv, padded_attn=padded, **extra)
    got = cache[row_tokens] = LaunchShape(n, tokens, kv, padded_attn=padded)
    return got


def _tables(blocks: BlockManager, slots: np.ndarray, model: str = "target") -> dict:
    """`build_plan`'s page-table arguments: the model's whole table, the rows in it and their page counts."""
    table, counts = blocks.table_of(model)
    return {"page_tables": table, "table_rows": slots, "table_lens": counts[slots]}


def registrations(batch: StepBatch, eos: frozenset[int] = frozenset()) -> tuple[Registration, ...]:
    """Rows the device has no state for yet (nothing computed): prefill rows only."""
    out = []
    for i in (batch.start == 0).nonzero()[0].tolist():
        r = batch.requests[i]
        p = r.params
        suppress = tuple(sorted(eos | set(p.stop_token_ids))) if p.min_tokens else ()
        out.append(Registration(r.slot, r.all_token_ids, p.temperature, p.top_k, p.top_p, p.seed, p.synthetic(),
                                request_key(r.request_id), p.logprobs, p.min_p, p.prompt_logprobs,
                                r.num_prompt_tokens, p.min_tokens, suppress, p.logits_adjust(),
                                p.structured_outputs.pattern if p.structured_outputs else None, r.grammar_index))
    return tuple(out)


def forward_message(batch: StepBatch, blocks: BlockManager, with_plan: bool = True,
                    keep_hidden: bool = False, eos: frozenset[int] = frozenset()) -> ForwardMessage:
    ends = batch.start + batch.num_new
    plan = build_plan(batch.num_new, ends, page_size=blocks.page_size,
                      **_tables(blocks, batch.slots)) if with_plan else None
    return ForwardMessage(step=batch.step, slots=batch.slots, shape=batch_shape(batch, kind=batch.kind),
                          start=batch.start, num_new=batch.num_new, samples=batch.samples,
                          register=registrations(batch, eos), plan=plan, keep_hidden=keep_hidden)


def verify_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec,
                   with_plan: bool = True, draft_lens: np.ndarray | None = None,
                   drafts: np.ndarray | None = None, uniform: bool = False) -> VerifyMessage:
    """Target over each row's last token and its candidates: 1 + the row's drafts (`draft_lens`, default the batch's
    asked-for ones) or, for a tree, 1 + its nodes. `uniform`: every row verifies 1 + the step's D positions (a CUDA
    graph's shape; positions past a row's drafts are never accepted, their KV is in reserved pages, trimmed after).
    `drafts`: the draft tokens, where the host made them."""
    nd = batch.draft_lens if draft_lens is None else draft_lens
    start = batch.start
    n = len(batch)
    if spec.is_tree or uniform:
        width = 1 + (spec.num_candidates if spec.is_tree else batch.draft_len)
        qo = np.full(n, width)
        shape_ = batch_shape(batch, width)
    else:
        qo = 1 + nd
        shape_ = batch_shape(batch) if draft_lens is None else shape(qo, start + qo)
    plan = None
    if with_plan:
        # a tree: node j at the last token's position + its depth, the root the last token
        tree = (np.concatenate([[0], spec.tree_depths()]), spec.tree_mask()) if spec.is_tree else None
        plan = build_plan(qo, start + qo, page_size=blocks.page_size, **_tables(blocks, batch.slots), tree=tree)
    return VerifyMessage(step=batch.step, slots=batch.slots, shape=shape_, start=start, draft_lens=nd, plan=plan,
                         drafts=drafts)


def draft_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec,
                  with_plan: bool = True) -> DraftMessage:
    """The proposer's D steps in one launch; the device derives per-step plans from the page tables (none sent
    without plans: a device that only models time)."""
    nd = batch.draft_lens
    s = batch_shape(batch, (1 + batch.draft_len))
    shape_ = LaunchShape(s.requests, s.tokens, s.kv_tokens, draft_len=largest(nd) if nd.size else 0,
                         draft_tokens=total(nd), draft_forwards=total(np.maximum(nd - 1, 0)))
    tables = counts = None
    if spec.kv_model is not None and with_plan:
        tables, counts = blocks.tables(spec.kv_model, batch.slots)
    return DraftMessage(step=batch.step, slots=batch.slots, shape=shape_, start=batch.start, draft_lens=nd,
                        page_size=blocks.page_size, page_tables=tables, table_lens=counts)


def fill_message(step: int, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 blocks: BlockManager, spec: ProposerSpec, *, after: str,
                 with_plan: bool = True, window: bool = False) -> FillMessage:
    """Proposer KV fill over positions [starts[i], ends[i]) of each row. after="forward"/"verify": a head (MTP)
    consumes that launch's target hidden states, so its rows and positions are the target batch's."""
    assert spec.kv_model is not None
    lens = ends - starts
    plan = build_plan(lens, ends, page_size=blocks.page_size,
                      **_tables(blocks, slots, spec.kv_model)) if with_plan else None
    return FillMessage(step=step, slots=slots, shape=shape(lens, ends, after=after), after=after,
                       start=starts, end=ends, plan=plan, window=window)


def prefill_fill_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec,
                         proposer_computed: np.ndarray, with_plan: bool = True) -> FillMessage | None:
    """The proposer's fill after a forward step (None if no row needs one). A head (or EAGLE) fills the target's new
    positions, and a row it is behind on (`ProposerRules.lazy_fill`) from what it has read: then the whole fill reads
    the kept hidden states (after="catch_up"; the forward needs keep_hidden=True). A draft model catches up from
    `proposer_computed` ([B]) to the new last token, a sampled one included (its KV runs one ahead of the target's)."""
    after = "forward"
    if spec.kv_ahead == 0:  # a head: also any positions it missed before the new ones
        a, b = np.minimum(proposer_computed, batch.start), batch.start + batch.num_new
        if (a < batch.start).any():
            after = "catch_up"
    else:
        a = proposer_computed
        b = batch.start + batch.num_new + spec.kv_ahead * batch.samples
    rows = (b > a).nonzero()[0]
    if not rows.size:
        return None
    if rows.size < len(batch):
        return fill_message(batch.step, batch.slots[rows], a[rows], b[rows], blocks, spec,
                            after=after, with_plan=with_plan)
    return fill_message(batch.step, batch.slots, a, b, blocks, spec, after=after, with_plan=with_plan)


def verify_fill_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec,
                        with_plan: bool = True) -> FillMessage:
    """The proposer's fill over the verify window, packed before acceptance (`FillMessage.window`): an MTP head's over
    the verify's positions, a draft model's over them one ahead (it reads the tokens the verify emits: accepted
    drafts, then the bonus or recovered token), a tree's over the root and one position per depth (where the verify
    compacts the accepted path; a row that drafted no tree: its root alone)."""
    start = batch.start + spec.kv_ahead
    if spec.is_tree:  # a row asked for any drafts drafts its whole tree (the worker's EagleProposer)
        span = np.where(batch.draft_lens > 0, spec.max_accept, 0)
    else:
        span = batch.draft_lens
    return fill_message(batch.step, batch.slots, start, start + 1 + span, blocks, spec,
                        after="verify", with_plan=with_plan, window=True)


def accept_fill_message(batch: StepBatch, starts_before: np.ndarray, accepted: np.ndarray,
                        proposer_computed: np.ndarray, blocks: BlockManager, spec: ProposerSpec,
                        with_plan: bool = True) -> FillMessage:
    """The proposer's fill once the accepted lengths are known. `starts_before[i]`/`proposer_computed[i]`: row i's
    token count / proposer KV length before the step. KV written while drafting stays valid up to the first
    rejection; the fill covers the rest of the accepted tokens (and a draft model's bonus token)."""
    end = starts_before + accepted
    if spec.is_tree:  # a tree's accepted path is compacted in place: rewritten from the last token
        valid = starts_before - 1
    else:
        valid = proposer_computed + np.minimum(accepted, np.maximum(batch.draft_lens - 1, 0))
    return fill_message(batch.step, batch.slots, np.minimum(valid, end), end + spec.kv_ahead, blocks,
                        spec, after="verify", with_plan=with_plan)
