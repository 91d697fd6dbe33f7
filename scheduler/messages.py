"""Packing a scheduled step into device messages (the `plan` stage's output).

Why: work crosses to the device as an op name plus plain arrays, so it can go over a pipe
to a worker process, to CUDA in-process, or to the simulator's virtual device unchanged.
The device keeps per-request token state (indexed by `slot`); messages say which
positions to compute, never the tokens the device itself produced, so the host need not
wait for them (the basis of the no-sync schedules).

Ops and their messages (per-row fields are lists of Python ints over the B scheduled rows:
a handful of rows, where numpy's per-call cost would exceed the work, and lists pickle
smaller to a worker; the attention plan's arrays are numpy):
  forward  target forward of prefill chunks / decodes; samples where `samples`
  draft    proposer makes up to `num_draft` tokens per row (one launch for all D steps)
  verify   target forward over the last token + candidates, acceptance, bonus token
  fill     proposer KV fill (draft model: unseen tokens; head: the previous target batch)
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np

from specsched.scheduler.batch_builder import StepBatch
from specsched.scheduler.block_manager import BlockManager
from specsched.scheduler.plan import build_plan
from specsched.scheduler.proposer import ProposerSpec
from specsched.scheduler.request import Request


def _tables(blocks: BlockManager, reqs: list[Request], model: str = "target") -> dict:
    """The rows' page tables as the plan takes them: one [B, max_pages] array and the counts."""
    tables, counts = blocks.tables(model, blocks.rows([r.request_id for r in reqs]))
    return {"page_tables": tables, "table_lens": counts}


def _params(req: Request) -> dict:
    p = req.params
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "seed": p.seed}


def _shape_only(qo_lens: list[int], kv_lens: list[int]) -> dict:
    """What a device that needs no attention metadata (the simulator's) gets instead of a
    plan: the plan's two shape fields as Python lists (a handful of rows: numpy's per-call
    cost would exceed the work; nothing reads them as arrays)."""
    return {"qo_indptr": [0, *accumulate(qo_lens)], "kv_lens": list(kv_lens)}


def shape(qo_lens: list[int], kv_lens: list[int]) -> dict:
    """A launch's shape for traces and cost models: rows, tokens computed, KV tokens."""
    return {"requests": len(qo_lens), "tokens": sum(qo_lens), "kv_tokens": sum(kv_lens)}


def registrations(batch: StepBatch) -> list[tuple[int, list[int], dict]]:
    """(slot, token ids, sampling params) for rows the device has no state for yet."""
    return [
        (s.request.slot, s.request.all_token_ids, _params(s.request))
        for s in batch.seqs
        if s.request.num_computed_tokens == 0
    ]


def forward_message(batch: StepBatch, blocks: BlockManager, with_plan: bool = True) -> dict:
    reqs = [s.request for s in batch.seqs]
    start_l = [r.num_computed_tokens for r in reqs]
    new_l = [s.num_new_tokens for s in batch.seqs]
    ends = [a + n for a, n in zip(start_l, new_l)]
    plan = build_plan(
        np.array(new_l, dtype=np.int64),
        np.array(ends, dtype=np.int64),
        page_size=blocks.page_size,
        **_tables(blocks, reqs),
    ).to_message() if with_plan else _shape_only(new_l, ends)
    return {
        "step": batch.step,
        "slots": [r.slot for r in reqs],
        "start": start_l,
        "num_new": new_l,
        "samples": [s.samples for s in batch.seqs],
        "register": registrations(batch),
        "plan": plan,
    }


def verify_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec, with_plan: bool = True) -> dict:
    """Target over [last token, candidates]: W = 1 + num_candidates tokens per row."""
    reqs = [s.request for s in batch.seqs]
    width = 1 + spec.num_candidates
    start_l = [r.num_computed_tokens for r in reqs]
    if not with_plan:
        plan_msg = _shape_only([width] * len(reqs), [a + width for a in start_l])
    else:
        start = np.array(start_l, dtype=np.int64)
        positions = masks = None
        if spec.is_tree:
            depths = np.concatenate([[0], spec.tree_depths()])
            positions = [s + depths for s in start]
            tree = spec.tree_mask()
            masks = []
            for s0 in start:
                m = np.ones((width, int(s0) + width), dtype=bool)
                m[:, s0:] = tree
                masks.append(m)
        plan_msg = build_plan(
            np.full(len(reqs), width),
            start + width,
            page_size=blocks.page_size,
            **_tables(blocks, reqs),
            positions=positions,
            custom_masks=masks,
        ).to_message()
    return {
        "step": batch.step,
        "slots": [r.slot for r in reqs],
        "start": start_l,
        "num_draft": [s.num_draft for s in batch.seqs],
        "plan": plan_msg,
    }


def draft_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec) -> dict:
    """The proposer's D steps in one launch; the device derives per-step plans from the
    page tables (multi-step work that belongs together is one launch)."""
    reqs = [s.request for s in batch.seqs]
    msg = {
        "step": batch.step,
        "slots": [r.slot for r in reqs],
        "num_draft": [s.num_draft for s in batch.seqs],
        "page_size": blocks.page_size,
    }
    if spec.kv_model is not None:
        tables, counts = blocks.tables(spec.kv_model, blocks.rows([r.request_id for r in reqs]))
        msg["page_tables"] = [row[:n] for row, n in zip(tables.tolist(), counts.tolist())]
    return msg


def fill_message(
    step: int,
    reqs: list[Request],
    starts: list[int],
    ends: list[int],
    blocks: BlockManager,
    spec: ProposerSpec,
    *,
    after: str,
    with_plan: bool = True,
) -> dict:
    """Proposer KV fill over positions [starts[i], ends[i]) of each row.

    after="forward"/"verify": a head (MTP) consumes the target hidden states of that launch,
    so its rows and positions equal the target batch's; a draft model only needs tokens.
    """
    assert spec.kv_model is not None
    lens = [b - a for a, b in zip(starts, ends)]
    plan = build_plan(
        np.array(lens, dtype=np.int64),
        np.array(ends, dtype=np.int64),
        page_size=blocks.page_size,
        **_tables(blocks, reqs, spec.kv_model),
    ).to_message() if with_plan else _shape_only(lens, ends)
    return {
        "step": step,
        "after": after,
        "slots": [r.slot for r in reqs],
        "start": starts,
        "plan": plan,
        "shape": shape(lens, ends),  # the fill launch's attributes (traces, cost models)
    }


def prefill_fill_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec,
                         with_plan: bool = True) -> dict | None:
    """The proposer's fill after a forward step (None if no row needs one). Call before the
    step's bookkeeping advances `num_computed_tokens`. A head (or EAGLE) fills exactly the
    target's new positions; a draft model catches up from what it has seen to the new last
    token (including a sampled one: its KV runs one token ahead of the target's)."""
    reqs, starts, ends = [], [], []
    for s in batch.seqs:
        r = s.request
        if spec.kv_ahead == 0:  # a head: exactly the target's new positions
            a, b = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        else:  # a model of its own: from what it has read up to the sampled token
            a = r.num_proposer_computed
            b = r.num_computed_tokens + s.num_new_tokens + (spec.kv_ahead if s.samples else 0)
        if b > a:
            reqs.append(r)
            starts.append(a)
            ends.append(b)
    if not reqs:
        return None
    return fill_message(batch.step, reqs, starts, ends, blocks, spec, after="forward", with_plan=with_plan)


def verify_fill_message(batch: StepBatch, blocks: BlockManager, spec: ProposerSpec,
                        with_plan: bool = True) -> dict:
    """An MTP head's fill over exactly the verify batch's positions (it consumes the target's
    hidden states of that launch), so it can be packed before acceptance. Call before the
    step's bookkeeping advances `num_computed_tokens`."""
    reqs = [s.request for s in batch.seqs]
    width = 1 + spec.num_candidates
    starts = [r.num_computed_tokens for r in reqs]
    return fill_message(batch.step, reqs, starts, [a + width for a in starts], blocks, spec,
                        after="verify", with_plan=with_plan)


def accept_fill_message(batch: StepBatch, starts_before: list[int], accepted: list[int],
                        blocks: BlockManager, spec: ProposerSpec, with_plan: bool = True) -> dict:
    """The proposer's fill after a verification whose accepted lengths the host now knows.
    `starts_before[i]` is row i's token count before the step. Positions the proposer
    already wrote while drafting stay valid up to the first rejection; the fill covers the
    rest of the accepted tokens (and, for a draft model, the bonus token)."""
    reqs = [s.request for s in batch.seqs]
    starts, ends = [], []
    bonus = spec.kv_ahead  # a proposer whose KV runs ahead also reads the bonus token
    for r, s, L, a in zip(reqs, batch.seqs, starts_before, accepted):
        # a tree's accepted path is compacted in place: rewritten from the last emitted token
        valid = L - 1 if spec.is_tree else r.num_proposer_computed + min(a, max(s.num_draft - 1, 0))
        starts.append(min(valid, L + a))
        ends.append(L + a + bonus)
    return fill_message(batch.step, reqs, starts, ends, blocks, spec, after="verify", with_plan=with_plan)
