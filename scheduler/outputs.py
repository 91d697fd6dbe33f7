"""A step's emitted tokens: which each request keeps (cut at max_tokens and EOS) and which requests that ends,
whole-array where the batch is large, one row at a time where a row has an EOS, an abort or a stop pending. The
scheduler applies the finishes (pages and slots freed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specsched.scheduler.request import Request
from specsched.scheduler.slot_state import SlotTable
from specsched.scheduler.small_arrays import SMALL_BATCH
from specsched.scheduler.step_batch import StepBatch


@dataclass
class StepOutput:
    """What a step's result did to its rows (`Scheduler.update`) or what a boundary ended."""

    counts: list[int] = field(default_factory=list)  # [B] tokens each row kept
    tokens: list[tuple[Request, list[int]]] = field(default_factory=list)  # new token ids, per request
    finished: list[Request] = field(default_factory=list)  # ended here: reason set, pages and slot freed


@dataclass
class Emitted:
    counts: list[int]  # [B] tokens each row kept
    tokens: list[tuple[Request, list[int]]] = field(default_factory=list)  # kept token ids, per request
    by_length: list[Request] = field(default_factory=list)  # reached max_tokens (whole-array rows)
    # one-row-at-a-time ends, in row order: "stop" (EOS), "length", or "marked" (an abort or a
    # stop string asked for: `Scheduler.abort` / `Scheduler.stop`)
    ends: list[tuple[Request, str]] = field(default_factory=list)


def emit(t: SlotTable, batch: StepBatch, rows: np.ndarray, tokens, lens: np.ndarray | None, *,
         eos: frozenset[int], keep_ids: bool, marked: dict[str, None], now: int) -> Emitted:
    """rows[j] of the batch gets tokens[j] (its first lens[j] when given): a list per row, or a
    [len(rows), W] array. Counts and first-token times are booked here; finishes are returned."""
    out = Emitted([0] * len(batch))
    if not rows.size:
        return out
    small = rows.size <= SMALL_BATCH  # a handful of rows: the array calls would cost more
    if not small and not keep_ids and not eos and not marked:
        return _counts(t, batch, rows, lens if lens is not None else
                       np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens)), now, out)
    if isinstance(tokens, np.ndarray):
        tokens = tokens.tolist()
    reqs = batch.requests
    if lens is not None:
        tokens = [tk[:n] for tk, n in zip(tokens, lens.tolist())]
    if small:
        for i, tk in zip(rows.tolist(), tokens):
            out.counts[i] = _one(reqs[i], tk, eos, keep_ids, now, out)
        return out
    slots = batch.slots[rows]
    live = t.gen[slots] == batch.gen[rows]  # a finished row keeps nothing
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    room = t.max_tokens[slots] - t.num_output[slots]
    keep = np.where(live, np.minimum(lens, room), 0)
    index = rows.tolist()
    one_by_one = np.zeros(len(index), dtype=bool)
    if marked:
        one_by_one |= np.fromiter((reqs[i].request_id in marked for i in index), dtype=bool, count=len(index))
    if eos:
        one_by_one |= np.fromiter((not eos.isdisjoint(tk) and not reqs[i].params.ignore_eos
                                   for i, tk in zip(index, tokens)), dtype=bool, count=len(index))
    bulk = (keep > 0) & ~one_by_one
    keep_l = keep.tolist()
    for j in bulk.nonzero()[0].tolist():
        r, tk, k = reqs[index[j]], tokens[j], keep_l[j]
        if r.first_token_ns is None:
            r.first_token_ns = now
        if keep_ids:
            tk = tk[:k] if k < len(tk) else tk
            r.output_token_ids.extend(tk)
            out.tokens.append((r, tk))
        out.counts[index[j]] = k
    t.num_output[slots[bulk]] += keep[bulk]
    out.by_length = [reqs[index[j]] for j in (bulk & (keep >= room)).nonzero()[0].tolist()]
    for j in (one_by_one & live).nonzero()[0].tolist():
        out.counts[index[j]] = _one(reqs[index[j]], tokens[j], eos, keep_ids, now, out)
    return out


def marked_reason(req: Request) -> str:
    """Why a marked request ends: "abort", or "stop" with its output cut after the stop string (`stop_at` tokens)."""
    if req.abort_requested:
        return "abort"
    if req.stop_at < req.num_output_tokens:
        del req.output_token_ids[req.stop_at:]
        req.num_output_tokens = req.stop_at
    return "stop"


def _counts(t: SlotTable, batch: StepBatch, rows: np.ndarray, lens: np.ndarray, now: int, out: Emitted) -> Emitted:
    """`emit` where no token ids are kept and no EOS, abort or stop applies: counts, first-token times and finishes by
    length, whole-array but for the rows that get their first token or finish."""
    reqs = batch.requests
    slots = batch.slots[rows]
    have = t.num_output[slots]
    room = t.max_tokens[slots] - have
    keep = np.where(t.gen[slots] == batch.gen[rows], np.minimum(lens, room), 0)  # a finished row keeps nothing
    got = keep > 0
    for i in rows[(got & (have == 0)).nonzero()[0]].tolist():
        reqs[i].first_token_ns = now
    t.num_output[slots] += keep  # distinct slots; rows that keep nothing add 0
    if rows.size == len(batch):  # every row (rows in order)
        out.counts = keep.tolist()
    else:
        counts = np.zeros(len(batch), dtype=np.int64)
        counts[rows] = keep
        out.counts = counts.tolist()
    out.by_length = [reqs[i] for i in rows[(got & (keep >= room)).nonzero()[0]].tolist()]
    return out


def _one(req: Request, tokens: list[int], eos: frozenset[int], keep_ids: bool, now: int, out: Emitted) -> int:
    """One row's tokens, cut at max_tokens and EOS; an abort or stop asked for ends it instead."""
    if req.is_finished:
        return 0
    if req.abort_requested or req.stop_at is not None:
        out.ends.append((req, "marked"))
        return 0
    params = req.params
    room = params.max_tokens - req.num_output_tokens
    if len(tokens) > room:
        tokens = tokens[:room]
    reason = None
    if eos and not params.ignore_eos and not eos.isdisjoint(tokens):
        for j, tok in enumerate(tokens):
            if tok in eos:
                tokens = tokens[: j + 1]
                reason = "stop"
                break
    if not tokens:
        return 0
    if req.first_token_ns is None:
        req.first_token_ns = now
    if keep_ids:
        req.extend_output(tokens)
        out.tokens.append((req, tokens))
    else:
        req.num_output_tokens += len(tokens)
    if reason is None and req.num_output_tokens >= params.max_tokens:
        reason = "length"
    if reason is not None:
        out.ends.append((req, reason))
    return len(tokens)
