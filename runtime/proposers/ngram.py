"""Prompt-lookup (n-gram) proposer: model-free drafts copied from the request's own history.

If the last n tokens occurred earlier in the prompt or output, guess that what followed
them then follows them now. No weights, no KV cache, no device work: it pays off on
repetitive workloads (code edits, extraction, summaries quoting their input). Drafts are
deterministic, so the verifier treats q as one-hot (`rejection_verify(draft_probs=None)`).

Matching is vectorized: one numpy compare per suffix length k < max_n over the whole
sequence keeps, for every earlier end position, whether the last k+1 tokens still match;
no Python loop runs over positions.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the host drafter runs in the engine's process, which loads no torch
    import torch


class NgramProposer:
    """Propose up to `num_tokens` tokens by matching the last n tokens, max_n down to min_n."""

    def __init__(self, min_n: int, max_n: int, num_tokens: int) -> None:
        if min_n < 1:
            raise ValueError(f"ngram min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"ngram max_n must be >= min_n ({min_n}), got {max_n}")
        if num_tokens < 1:
            raise ValueError(f"ngram num_tokens must be >= 1, got {num_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = num_tokens

    def find_match(self, token_ids: np.ndarray | Sequence[int]) -> tuple[int, int]:
        """(n, start): the longest n in [min_n, max_n] whose last-n suffix occurred earlier,
        and the index right after its most recent earlier occurrence; (0, -1) if none."""
        seq = np.asarray(token_ids)
        if seq.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {seq.shape}")
        length = seq.shape[0]
        best = (0, -1)
        if length < self.min_n + 1:
            return best
        alive = np.ones(length - 1, dtype=bool)  # alive[e]: seq[e-k..e] == seq[L-1-k..L-1]
        for k in range(min(self.max_n, length - 1)):
            alive[:k] = False
            alive[k:] &= seq[: length - 1 - k] == seq[length - 1 - k]
            hits = np.flatnonzero(alive)
            if hits.size == 0:
                break
            if k + 1 >= self.min_n:
                best = (k + 1, int(hits[-1]) + 1)
        return best

    def propose(self, token_ids: np.ndarray | Sequence[int], num_tokens: int | None = None) -> list[int]:
        """Up to num_tokens (default: the proposer's) tokens that followed the match; [] if none."""
        k = self.num_tokens if num_tokens is None else num_tokens
        if k < 1:
            raise ValueError(f"num_tokens must be >= 1, got {k}")
        n, start = self.find_match(token_ids)
        if n == 0:
            return []
        return [int(x) for x in np.asarray(token_ids)[start : start + k]]

    def propose_batch(
        self,
        sequences: Sequence[np.ndarray | Sequence[int]],
        num_tokens: int | None = None,
        pad_id: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for a batch: tokens [B, num_tokens] int64 padded with pad_id (0 keeps the
        padding a valid embedding index; the verifier never reads it), counts [B] int64."""
        import torch

        k = self.num_tokens if num_tokens is None else num_tokens
        tokens = torch.full((len(sequences), k), pad_id, dtype=torch.int64)
        counts = torch.zeros(len(sequences), dtype=torch.int64)
        for i, seq in enumerate(sequences):
            draft = self.propose(seq, k)
            if draft:
                tokens[i, : len(draft)] = torch.tensor(draft, dtype=torch.int64)
                counts[i] = len(draft)
        return tokens, counts


class NgramHostDrafter:
    """The n-gram lookup as the pipeline's `HostDrafter` (scheduler/protocols.py): each row's
    drafts looked up in its request's tokens, which the host has under `sync` -- no draft
    launch, no round trip to the device before the verify.

    Each slot keeps its request's tokens in a growing int64 array, extended by the outputs
    that arrived since the last lookup: rebuilding prompt + output as a list and converting it
    every step costs O(context) per row (~70 us at 4k tokens), the lookup itself ~10 us.

    A structured request (`SamplingParams.structured_outputs`; `grammars`: the engine's compiler) drafts by its
    grammar, walked here with the tokens it keeps (`Walk.draft`): a token the grammar forces (the only one it allows:
    a schema's keys, its punctuation) is drafted whatever the lookup says -- the target, masked to it, emits it --
    and the lookup's tokens are drafted while the grammar allows them and no forced token displaced them."""

    def __init__(self, min_n: int, max_n: int, num_tokens: int, grammars: Any = None) -> None:
        self.lookup = NgramProposer(min_n, max_n, num_tokens)
        self.grammars = grammars  # the engine's `runtime.grammars.Grammars`
        self._rows: dict[int, _HostTokens] = {}  # slot -> the tokens of the request there

    def tokens(self, req) -> np.ndarray:
        """The request's prompt and output tokens as an array (a view of the slot's buffer)."""
        row = self._rows.get(req.slot)
        out = req.output_token_ids
        n = len(req.prompt_token_ids) + len(out)
        if row is None or row.request is not req or n < row.filled:
            row = self._rows[req.slot] = _HostTokens(req, np.asarray(req.all_token_ids, dtype=np.int64))
            so = req.params.structured_outputs
            if so is not None and self.grammars is not None:
                row.walk = self.grammars.walk(so.pattern, 64)  # steps back over any draft
                row.walk.advance(out)
        elif n > row.filled:
            new = out[row.filled - len(req.prompt_token_ids):]
            row.extend(new)
            if row.walk is not None:
                row.walk.advance(new)
        return row.buf[: row.filled]

    def draft(self, batch) -> tuple[np.ndarray, np.ndarray]:
        nd = batch.draft_lens.tolist()
        tokens = np.zeros((len(nd), max(nd, default=0) or 1), dtype=np.int64)
        counts = np.zeros(len(nd), dtype=np.int64)
        find = self.lookup.find_match
        for i, (req, d) in enumerate(zip(batch.requests, nd)):
            if d > 0:
                seq = self.tokens(req)
                n, start = find(seq)
                got = seq[start : start + d] if n else seq[:0]
                walk = self._rows[req.slot].walk
                if walk is not None and not walk.dead:
                    got = walk.draft(got, d)
                tokens[i, : len(got)] = got
                counts[i] = len(got)
        return tokens, counts


class _HostTokens:
    """One request's tokens in a buffer that doubles when full."""

    __slots__ = ("request", "buf", "filled", "walk")

    def __init__(self, request, tokens: np.ndarray) -> None:
        self.request = request
        self.buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.buf[: len(tokens)] = tokens
        self.filled = len(tokens)
        self.walk = None  # a structured request's walk through its grammar (`runtime.grammars.Walk`)

    def extend(self, new: list[int]) -> None:
        end = self.filled + len(new)
        if end > len(self.buf):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[: self.filled] = self.buf[: self.filled]
            self.buf = grown
        self.buf[self.filled : end] = new
        self.filled = end


def host_drafter(spec, min_n: int, max_n: int, grammars: Any = None) -> NgramHostDrafter | None:
    """The pipeline's drafter for `spec` (a ProposerSpec): the lookup where its proposer drafts
    on the host (`ProposerRules.host_drafts`), else None; `grammars`: structured requests' compiler."""
    return NgramHostDrafter(min_n, max_n, spec.draft_len, grammars) if spec.rules.host_drafts else None
