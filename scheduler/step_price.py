"""What a decode step costs on the device at a draft length, from the adaptive draft length's
cost models, and which of a row's drafts are worth theirs.

Why a module of its own: scheduler/adaptive.py decides; pricing a step -- its target forward
or verify, the proposer's draft and fill -- is arithmetic on the cost models
(scheduler/online_cost.py) and the proposer's shape, the same for every decision. Each row
verifies what it drafts (1 + its drafts), so a draft costs a verify position even where the
proposer makes it from logits already there.
"""
from __future__ import annotations

import numpy as np

from specsched.scheduler.online_cost import FEATURES, OnlineCost, draft_terms


class StepPrice:
    """`costs`: the policy's models (target, draft, fill), updated in place as they learn;
    `has_fill`: the proposer fills its KV, `fill_same_batch` over the verify window (a head;
    a draft model under `eager_fill`), else over the accepted tokens and `kv_ahead` more (a draft
    model under `sync` / `overlap`); `catches_up`: its fills
    wait while speculation is off; `draft_op`: it drafts in a device launch (not on the host,
    where the step overhead takes the lookup's time)."""

    def __init__(self, costs: dict[str, OnlineCost], *, has_fill: bool, kv_ahead: int, fill_same_batch: bool,
                 catches_up: bool, draft_op: bool = True):
        self.costs = costs
        self.draft_op = draft_op
        self.has_fill, self.kv_ahead, self.fill_same_batch = has_fill, kv_ahead, fill_same_batch
        self.catches_up = catches_up

    def step_ns(self, rows: int, d: int, forwards: int, kv_tokens: int, catch_up: float = 0.0,
                drafts: int | None = None, refit: bool = True) -> float | None:
        """Predicted device time of a step of `rows` at D = d whose rows make `forwards` proposer
        row-forwards and verify `drafts` drafts in all (default rows x d), a draft model's fill
        covering `catch_up` more tokens (None while a needed model is unknown); `refit=False`:
        with the models as last fitted (`OnlineCost.at`)."""
        c = self.costs
        if d == 0:
            t = c["target"].at(rows, rows, kv_tokens + rows, 0.0, refit)
            # a head without lazy fills fills after every forward
            f = (c["fill"].at(rows, rows, kv_tokens + rows, 0.0, refit)
                 if self.has_fill and self.fill_same_batch and not self.catches_up else 0.0)
            return None if t is None or f is None else t + f
        verified = rows * (1 + d) if drafts is None else rows + drafts
        dr = c["draft"].at(*draft_terms(d - 1, forwards), kv_tokens * (d - 1), 0.0, refit) if self.draft_op else 0.0
        t = c["target"].at(verified, rows, kv_tokens + verified, 1.0, refit)
        f = 0.0
        if self.has_fill:
            # a fill over the verify window covers its positions; a draft model's otherwise the
            # last accepted token and the bonus (it wrote its drafts' KV while drafting); either,
            # what it catches up
            fill = (verified if self.fill_same_batch else rows * (1 + self.kv_ahead)) + catch_up
            f = c["fill"].at(fill, rows, kv_tokens + verified, 0.0, refit)
        return None if dr is None or t is None or f is None else dr + t + f

    def per_row(self, num_draft: np.ndarray, reach: np.ndarray, rate: float, kv_rows: np.ndarray,
                probe: bool) -> np.ndarray:
        """A row's j-th draft is kept while the tokens it is expected to add, reach[j], are worth
        its cost at the step's rate: a verify position (a head's fill covers it too) and, from the
        second on, a proposer forward; a request whose drafts keep failing drafts none, but in a
        probe, which is there to find out whether they still fail."""
        m, c = self.costs["draft"], [self.costs[k].coef for k in ("target", "fill")]
        if (self.draft_op and m.coef is None) or c[0] is None:
            return num_draft
        # a verify position: a token that is also a KV token, and so is the fill's over it
        t, f = FEATURES["target"], FEATURES["fill"]
        per_token = c[0][t.index("tokens")] + c[0][t.index("kv_tokens")]
        if self.fill_same_batch and c[1] is not None:
            per_token += c[1][f.index("tokens")] + c[1][f.index("kv_tokens")]
        names = FEATURES["draft"]  # one more forward of a row in a step that runs: its work and a read of its KV
        per_forward = (m.coef[names.index("draft_extra_rows")] + m.coef[names.index("draft_kv")] * kv_rows
                       if self.draft_op else np.zeros(len(kv_rows)))
        cost = np.full(reach.shape, per_token)
        cost[:, 1:] += per_forward[:, None]
        worth = reach >= rate * cost
        worth[:, 0] |= probe
        keep = np.cumprod(worth, axis=1).sum(axis=1)  # leading positions worth drafting
        return np.minimum(num_draft, keep)

