"""What requests change in the target's logits before sampling and acceptance, in vLLM's order: a structured output's
grammar masking what it forbids (`runtime.structured_output`), `min_tokens` holding EOS and the stop token ids back,
`logit_bias`, then the penalties (repetition, frequency, presence).

A step's logits are [B, W, V]: column c of row i emits the token at position `ends[i] + depths[c]`, after the row's
tokens before `ends[i]` and, in a verify, the drafts on the column's path (`window[i, j]` where `path[c, j]`: the
drafts before it in a chain, its ancestors in a tree). The penalties count those drafts as the output they would be
if accepted, so each column scores its draft with the distribution plain decoding would have sampled it from, and
speculation stays lossless. Rows that change nothing cost nothing; the logits are copied only where one does.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specsched.runtime.structured_output import apply_masks
from specsched.runtime.sync_guard import read_now, to_device
from specsched.runtime.token_state import SeqState, TokenBuffer
from specsched.scheduler.plan import concat_ranges


def window_paths(width: int, tree_parents: Sequence[int] = ()) -> torch.Tensor:
    """[W, W] bool: path[c, j] -- the window's column j (a draft; column 0 is the last emitted token) comes before
    column c on its path. A chain's columns 1..c; a tree's (node i at column i + 1, `tree_parents` as
    `ProposerSpec.tree_parents`) the ancestors of column c and itself."""
    path = torch.zeros((width, width), dtype=torch.bool)
    parents = [-1, *(p + 1 for p in tree_parents)] if tree_parents else [-1, *range(width - 1)]
    for c in range(1, width):
        path[c] = path[parents[c]]
        path[c, c] = True
    return path


def process_logits(logits: torch.Tensor, rows: Sequence[SeqState], tokens: TokenBuffer, slots: np.ndarray,
                   ends: np.ndarray, depths: np.ndarray, window: torch.Tensor | None = None,
                   path: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, W, V] with each row's grammar, min_tokens, logit bias and penalties applied (a copy), or the logits
    themselves where no row asks for any (the module's docstring says which tokens each column sees)."""
    depths = np.asarray(depths[: logits.shape[1]], dtype=np.int64)
    if any(st.guide is not None for st in rows):
        logits = apply_masks(logits, rows, None if window is None else read_now(window).numpy(), path)
    logits = hold_back(logits, rows, ends[:, None] + depths[None, :])
    adjusted = [i for i, st in enumerate(rows) if st.adjust is not None]
    if not adjusted:
        return logits
    idx = to_device(np.asarray(adjusted, dtype=np.int64), logits.device)
    sub = logits.index_select(0, idx)
    adj = [rows[i].adjust for i in adjusted]
    for k, a in enumerate(adj):
        if a.logit_bias:
            ids, bias = zip(*a.logit_bias)
            sub[k, :, to_device(ids, sub.device, torch.int64)] += torch.tensor(bias, dtype=sub.dtype).to(sub.device)
    if any(a.repetition_penalty != 1.0 or a.frequency_penalty or a.presence_penalty for a in adj):
        sel = np.asarray(adjusted)
        prompt_lens = np.asarray([rows[i].prompt_len for i in adjusted], dtype=np.int64)
        counts, in_prompt = _counts(tokens, slots[sel], prompt_lens, ends[sel], sub.shape[-1])
        counts = counts.unsqueeze(1).repeat(1, sub.shape[1], 1)  # [P, W, V]
        if window is not None and sub.shape[1] > 1:
            w = sub.shape[1]
            on_path = path[:w, :w].to(sub.device, sub.dtype).unsqueeze(0).expand(len(adjusted), w, w)
            drafts = window.index_select(0, idx)[:, :w].clamp(min=0).unsqueeze(1).expand(-1, w, -1)
            counts.scatter_add_(2, drafts, on_path)
        sub = _penalize(sub, counts, in_prompt, adj)
    return logits.clone().index_copy_(0, idx, sub)


def _counts(tokens: TokenBuffer, slots: np.ndarray, prompt_lens: np.ndarray, ends: np.ndarray,
            vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: how often each token is in its output before `ends` ([P, V] float), and whether it is in its prompt
    ([P, V] bool)."""
    dev = tokens.device
    out_lens = np.maximum(ends - prompt_lens, 0)
    counts = torch.zeros((len(slots), vocab), dtype=torch.float32, device=dev)
    if out_lens.sum():
        ids = tokens.at(np.repeat(slots, out_lens), concat_ranges(prompt_lens, out_lens))
        rows = to_device(np.repeat(np.arange(len(slots)), out_lens), dev, torch.int64)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    in_prompt = torch.zeros((len(slots), vocab), dtype=torch.bool, device=dev)
    ids = tokens.at(np.repeat(slots, prompt_lens), concat_ranges(np.zeros_like(prompt_lens), prompt_lens))
    in_prompt[to_device(np.repeat(np.arange(len(slots)), prompt_lens), dev, torch.int64), ids] = True
    return counts, in_prompt


def _penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, adj: Sequence) -> torch.Tensor:
    """vLLM's `apply_penalties` on logits [P, W, V] with each column's output counts [P, W, V]."""
    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(a, name) for a in adj], dtype=logits.dtype).to(logits.device).view(-1, 1, 1)

    rep = per_row("repetition_penalty")
    seen = (counts > 0) | in_prompt.unsqueeze(1)
    scale = torch.where(seen, rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - per_row("frequency_penalty") * counts - per_row("presence_penalty") * (counts > 0).to(logits.dtype)


def hold_back(logits: torch.Tensor, rows: Sequence, positions: np.ndarray) -> torch.Tensor:
    """vLLM's min_tokens: logits [B, W, V] whose column j of row i emits the token at positions[i, j] -- a copy with
    the row's held-back ids (`suppress`: EOS and its stop token ids) at -inf wherever that token is among its first
    `min_tokens` outputs; the logits themselves where no row holds anything back. Sampling and acceptance both read
    the result, so speculation stays lossless (a draft of a held-back token is rejected)."""
    held = []
    for i, st in enumerate(rows):
        if st.min_tokens:
            cols = np.flatnonzero(positions[i] - st.prompt_len < st.min_tokens)
            if cols.size:
                held.append((i, cols, list(st.suppress)))
    if not held:
        return logits
    logits = logits.clone()
    for i, cols, ids in held:
        logits[i, to_device(cols, logits.device, torch.int64).unsqueeze(-1),
               to_device(ids, logits.device, torch.int64)] = float("-inf")
    return logits
