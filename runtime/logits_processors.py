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

from specsched.runtime.structured_output import apply_masks, column_drafts
from specsched.runtime.sync_guard import read_now, to_device
from specsched.runtime.token_state import SeqState, TokenBuffer
from specsched.runtime.tree_verify import TreeSpec
from specsched.scheduler.plan import concat_ranges


def window_paths(width: int, tree_parents: Sequence[int] = ()) -> torch.Tensor:
    """[W, W] bool: path[c, j] -- the window's column j (a draft; column 0 is the last emitted token) comes before
    column c on its path: the tree's ancestor-or-self mask (`TreeSpec.mask`; a chain's for linear drafts, node i of
    `tree_parents` at column i + 1) without the root's column."""
    tree = (TreeSpec.from_parents([-1, *(p + 1 for p in tree_parents)]) if tree_parents
            else TreeSpec.chain(width - 1))
    path = tree.mask.clone()
    path[:, 0] = False
    return path


def process_logits(logits: torch.Tensor, rows: Sequence[SeqState], tokens: TokenBuffer, slots: np.ndarray,
                   ends: np.ndarray, depths: np.ndarray, window: torch.Tensor | None = None,
                   path: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, W, V] with each row's grammar, min_tokens, logit bias and penalties applied (a copy), or the logits
    themselves where no row asks for any (the module's docstring says which tokens each column sees)."""
    depths = np.asarray(depths[: logits.shape[1]], dtype=np.int64)
    if any(st.guide is not None for st in rows):
        w = logits.shape[1]
        logits = apply_masks(logits, rows, None if window is None else column_drafts(read_now(window).numpy(), path, w))
    logits = hold_back(logits, rows, ends[:, None] + depths[None, :])
    adjusted = [i for i, st in enumerate(rows) if st.adjust is not None]
    if not adjusted:
        return logits
    every = len(adjusted) == len(rows)
    idx = None if every else to_device(np.asarray(adjusted, dtype=np.int64), logits.device)
    sub = logits.clone() if every else logits.index_select(0, idx)
    adj = [rows[i].adjust for i in adjusted]
    for k, a in enumerate(adj):
        if a.logit_bias:
            ids, bias = zip(*a.logit_bias)
            sub[k, :, to_device(ids, sub.device, torch.int64)] += to_device(bias, sub.device, sub.dtype)
    if any(a.repetition_penalty != 1.0 or a.frequency_penalty or a.presence_penalty for a in adj):
        sel = np.asarray(adjusted)
        prompt_lens = np.asarray([rows[i].prompt_len for i in adjusted], dtype=np.int64)
        counts = _counts(tokens, slots[sel], prompt_lens, ends[sel], sub.shape[-1]).unsqueeze(1)  # [P, 1, V]
        w = sub.shape[1]
        if window is not None and w > 1:  # each column's own counts: the drafts on its path added
            counts = counts.repeat(1, w, 1)
            on_path = to_device(path[:w, :w], sub.device, sub.dtype).unsqueeze(0).expand(len(adjusted), w, w)
            drafts = (window if every else window.index_select(0, idx))[:, :w].clamp(min=0)
            counts.scatter_add_(2, drafts.unsqueeze(1).expand(-1, w, -1), on_path)
        sub = _penalize(sub, counts, [rows[i] for i in adjusted], tokens, slots[sel])
    return sub if every else logits.clone().index_copy_(0, idx, sub)


def _counts(tokens: TokenBuffer, slots: np.ndarray, prompt_lens: np.ndarray, ends: np.ndarray,
            vocab: int) -> torch.Tensor:
    """Per row: how often each token is in its output before `ends` ([P, V] float)."""
    out_lens = np.maximum(ends - prompt_lens, 0)
    ids = tokens.at(np.repeat(slots, out_lens), concat_ranges(prompt_lens, out_lens))
    rows = to_device(np.repeat(np.arange(len(slots), dtype=np.int64) * vocab, out_lens), tokens.device)
    return torch.bincount(rows + ids, minlength=len(slots) * vocab).view(len(slots), vocab).float()


def _in_prompt(st: SeqState, tokens: TokenBuffer, slot: int, vocab: int) -> torch.Tensor:
    """[V] bool: the tokens of the row's prompt (made once, kept with its state)."""
    if st.prompt_seen is None or st.prompt_seen.shape[0] != vocab:
        seen = torch.zeros(vocab, dtype=torch.bool, device=tokens.device)
        seen[tokens.at(np.full(st.prompt_len, slot), np.arange(st.prompt_len))] = True
        st.prompt_seen = seen
    return st.prompt_seen


def _penalize(logits: torch.Tensor, counts: torch.Tensor, rows: Sequence[SeqState], tokens: TokenBuffer,
              slots: np.ndarray) -> torch.Tensor:
    """vLLM's `apply_penalties` on logits [P, W, V] with each column's output counts [P, W or 1, V]; each penalty
    only where a row has it."""
    adj = [st.adjust for st in rows]

    def per_row(name: str) -> torch.Tensor:
        return to_device([getattr(a, name) for a in adj], logits.device, logits.dtype).view(-1, 1, 1)

    if any(a.repetition_penalty != 1.0 for a in adj):
        vocab = logits.shape[-1]
        in_prompt = torch.stack([_in_prompt(st, tokens, int(s), vocab) for st, s in zip(rows, slots)]).unsqueeze(1)
        rep = torch.where((counts > 0) | in_prompt, per_row("repetition_penalty"), 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    if any(a.frequency_penalty for a in adj):
        logits = logits - per_row("frequency_penalty") * counts
    if any(a.presence_penalty for a in adj):
        logits = logits - per_row("presence_penalty") * (counts > 0).to(logits.dtype)
    return logits


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
    out = logits.clone()
    for i, cols, ids in held:
        c = to_device(cols, logits.device, torch.int64)
        out[i, c.unsqueeze(-1), to_device(ids, logits.device, torch.int64)] = float("-inf")
        if rows[i].guide is not None:  # where the grammar allows only a stop, it ends the output: min_tokens yields
            ended = ~torch.isfinite(out[i, c]).any(-1, keepdim=True)
            out[i, c] = torch.where(ended, logits[i, c], out[i, c])
    return out
