"""Structured output (vLLM's `structured_outputs`: a JSON schema, a regex or a choice of strings): at every step the
target's logits keep only the tokens the request's grammar allows next, before sampling and acceptance.

The grammar is a regular expression compiled against the tokenizer's vocabulary (outlines-core's `Index`, a token-level
automaton: `runtime/grammars.py`); each request walks it with a `Guide`. In a verify, column c is masked by the state after the drafts on its
path (a chain's columns before it, a tree's ancestors), so a draft the grammar forbids is rejected and every column
scores its draft with the distribution plain decoding would have sampled from: speculation stays lossless. After the
step the guide advances by the tokens the request kept. The proposers mask their own logits the same way while they
draft (`apply_masks` on a draft's or a tree node's logits), so drafts are text the grammar allows: forced tokens are
drafted, and accepted.

The masks need the drafts and the kept tokens on the host: a step with a structured row reads them there (a sync on a
GPU, for that step only); steps without one are untouched.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specsched.runtime.grammars import Walk
from specsched.runtime.sync_guard import host_side, read_now, to_device

_BITS = torch.arange(32, dtype=torch.int32)


class Guide(Walk):
    """One request's walk through its grammar in the worker (`Walk`: the advance by the tokens it keeps; dead, no mask
    from there on), and the tokens it allows after each path of drafts."""

    def masks(self, paths: Sequence[Sequence[int]], vocab: int) -> torch.Tensor | None:
        """[len(paths), vocab] bool: the tokens allowed after each path of drafts (from the state now; a path through
        a forbidden draft masks nothing: that column is never read). None once dead."""
        if self.dead:
            return None
        words = (vocab + 31) // 32
        bits = torch.zeros((len(paths), words), dtype=torch.int32)
        for c, path in enumerate(paths):
            walked = 0
            for t in path:
                if not self._g.accepts_tokens([int(t)]):
                    break
                self._g.advance(int(t), return_tokens=False)
                walked += 1
            if walked == len(path):
                self._g.write_mask_into(bits[c].data_ptr(), words, 4)
            else:
                bits[c] = -1
            if walked:
                self._g.rollback_state(walked)
        return ((bits.unsqueeze(-1) >> _BITS) & 1).bool().view(len(paths), -1)[:, :vocab]


def column_drafts(window: np.ndarray, path: torch.Tensor, width: int) -> list[list[list[int]]]:
    """Per row of a verify, per column: the drafts on the column's path (`window` [B, W] the columns' tokens on the
    host, `path` [W, W] which come before each)."""
    on_path = host_side(path[:width, :width]).tolist()
    return [[[int(row[j]) for j in range(width) if on_path[c][j]] for c in range(width)] for row in window]


def apply_masks(logits: torch.Tensor, rows: Sequence, drafts: Sequence | None = None) -> torch.Tensor:
    """logits [B, W, V] with -inf where a structured row's grammar forbids the token at that column, after the drafts
    on the column's path (`drafts[i][c]`, `column_drafts`; None: none); the logits themselves without such a row."""
    out = None
    for i, st in enumerate(rows):
        if st.guide is None:
            continue
        allowed = st.guide.masks([[]] * logits.shape[1] if drafts is None else drafts[i], logits.shape[-1])
        if allowed is None:
            continue
        out = logits.clone() if out is None else out
        out[i].masked_fill_(~to_device(allowed, out.device), float("-inf"))
    return logits if out is None else out


def mask_next(logits: torch.Tensor, rows: Sequence, drafted: torch.Tensor) -> torch.Tensor:
    """A proposer's logits [B, V] for each row's next draft, masked by its grammar after its drafts so far (`drafted`
    [B, k] on the device, read here)."""
    return apply_masks(logits.unsqueeze(1), rows, [[d] for d in read_now(drafted).tolist()]).squeeze(1)


def advance_guides(rows: Sequence, emitted: torch.Tensor, num_accepted: torch.Tensor | None) -> None:
    """Each structured row's guide advanced by the tokens it kept: emitted [B, K] up to num_accepted + 1 (a verify's
    accepted drafts and the token after them), or all K."""
    if not any(st.guide is not None for st in rows):
        return
    tokens = read_now(emitted).tolist()
    kept = [len(t) for t in tokens] if num_accepted is None else [n + 1 for n in read_now(num_accepted).tolist()]
    for st, toks, n in zip(rows, tokens, kept):
        if st.guide is not None:
            st.guide.advance(toks[:n])
