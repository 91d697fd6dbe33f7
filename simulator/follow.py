"""A replay of an adaptive trace that takes each step's draft length from the trace.

Why: the policy inside a replay decides on the simulator's costs, and where two draft lengths
are nearly tied a cost a few percent off tips a decision the captured run took the other way
(and, from plain decoding with a draft model, a catch-up of every row's context with it): the
replay's makespan then measures that choice as much as the cost models. Following the
captured choices separates the two -- `validate` reports both.

A step's choice is looked up by its rows: for each request (by its position in the trace's
arrival order, as the replay names them) and tokens it has left, the draft length of the
captured step that served it there and the tokens it drafted. The replay's step takes the
draft length most of its rows were served at; a row the trace never served at that point
(the replay's steps came out otherwise) drafts what the policy chose for it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np


def recorded_choices(trace) -> dict[tuple[str, int], tuple[int, int]]:
    """(replay request id, tokens left before the step) -> (the step's D, tokens the row
    drafted) for every row of every step whose draft length the captured policy chose."""
    reqs = sorted(trace.requests, key=lambda r: r.arrival_ns)
    fin = {f.request_id: f for f in trace.finishes}
    name = {r.request_id: f"r{i}" for i, r in enumerate(reqs)}
    left = {r.request_id: max(1, fin[r.request_id].output_len if r.request_id in fin else r.max_tokens) for r in reqs}
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for s in sorted(trace.steps, key=lambda s: s.step):
        for rid, drafted, emitted in zip(s.request_ids, s.num_drafted, s.num_output):
            if rid not in left:
                continue
            if s.draft_len is not None:
                out[(name[rid], left[rid])] = (s.draft_len, drafted)
            left[rid] -= emitted
    return out


def follow_choices(policy, scheduler, choices: dict[tuple[str, int], tuple[int, int]]) -> None:
    """Make `policy` (the replay's, which still learns from what it observes) decide each step
    as the captured run did (see the module docstring)."""
    choose = policy.choose

    def followed(view):
        dec = choose(view)
        slots, remaining, budget = view.slots, view.remaining, view.budget
        by_slot = {r.slot: r.request_id for r in scheduler.running}
        rec = [choices.get((by_slot.get(int(s)), int(left))) for s, left in zip(slots.tolist(), remaining.tolist())]
        seen = [c[0] for c in rec if c is not None]
        if not seen:
            return dec
        d = Counter(seen).most_common(1)[0][0]
        rows = int(min(len(slots), budget // (1 + d)))
        fallback = np.minimum(np.maximum(remaining[:rows] - 1, 0), d)
        draft_lens = np.array([c[1] if c is not None and c[0] == d else f for c, f in zip(rec[:rows], fallback.tolist())],
                             dtype=np.int64)
        if d and not draft_lens.any():
            d, rows, draft_lens = 0, int(min(len(slots), budget)), np.zeros(min(len(slots), budget), dtype=np.int64)
        out = replace(dec, draft_len=d, draft_lens=draft_lens, rows=rows, explored=False, device_ns=None)
        policy.last = out
        return out

    policy.choose = followed
