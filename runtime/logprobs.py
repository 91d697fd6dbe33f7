"""Log-probabilities of the tokens a step emits (`SamplingParams.logprobs`) and of a prompt's tokens
(`SamplingParams.prompt_logprobs`), on the worker: log-softmax of the target's raw logits -- before temperature,
top-k, top-p and min_tokens, as vLLM's default `raw_logprobs` -- at each scored token, with the k most likely there.
Computed on the device only for steps with rows that ask, and copied to the host with the step's result
(`scheduler.messages.TokenLogprobs`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from specsched.runtime.sync_guard import to_device
from specsched.runtime.token_state import SeqState, TokenBuffer
from specsched.scheduler.messages import TokenLogprobs

ToHost = Callable[[torch.Tensor], torch.Tensor]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int, to_host: ToHost) -> TokenLogprobs:
    """The log-probabilities of tokens [B, W] under logits [B, W, V] and the k most likely tokens there."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    token = lsm.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    top = lsm.topk(k, dim=-1)
    return TokenLogprobs(to_host(token), to_host(top.indices), to_host(top.values))


def asked(rows: list[SeqState]) -> int | None:
    """The most top tokens any of the rows asks for with its emitted tokens; None if none asks."""
    return max((st.logprobs for st in rows if st.logprobs is not None), default=None)


def forward_logprobs(rows: list[SeqState], sample_rows: np.ndarray, logits: torch.Tensor, tokens: torch.Tensor,
                     to_host: ToHost) -> TokenLogprobs | None:
    """A forward's, [B, 1]: of its sampled tokens [B] (-1 where a row samples nothing) under the logits [S, V] of
    its sampling rows `sample_rows` (their states `rows`); None if none asks."""
    k = asked(rows)
    if k is None:
        return None
    if sample_rows.size < tokens.shape[0]:  # rows that sample nothing: their (unread) entries
        logits = logits.new_zeros((tokens.shape[0], logits.shape[-1])).index_copy_(
            0, to_device(sample_rows, logits.device), logits)
    return token_logprobs(logits.unsqueeze(1), tokens.unsqueeze(1), k, to_host)


def verify_logprobs(rows: list[SeqState], logits: torch.Tensor, emitted: torch.Tensor,
                    accepted_nodes: torch.Tensor | None, to_host: ToHost) -> TokenLogprobs | None:
    """A verify's: of its emitted tokens [B, W] under its columns' raw logits [B, W, V] -- a tree's, emitted token j
    from the accepted node at depth j (`accepted_nodes` [B, depth]; the root at 0), a chain's column j (None); None
    if none of `rows` asks."""
    k = asked(rows)
    if k is None:
        return None
    if accepted_nodes is not None:
        node = torch.cat([torch.zeros_like(accepted_nodes[:, :1]), accepted_nodes.clamp(min=0)], 1)
        logits = logits.gather(1, node.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return token_logprobs(logits, emitted, k, to_host)


def prompt_spans(rows: list[SeqState], starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int, int]]:
    """(row, first position, count) of a forward's positions whose logits score the next prompt token, for the rows
    of requests with `prompt_logprobs` (position q scores prompt token q + 1, q + 1 < the prompt's length)."""
    out = []
    for i, st in enumerate(rows):
        if st.prompt_logprobs is not None:
            n = min(int(ends[i]), st.prompt_len - 1) - int(starts[i])
            if n > 0:
                out.append((i, int(starts[i]), n))
    return out


def prompt_logprobs(rows: list[SeqState], slots: np.ndarray, spans: list[tuple[int, int, int]],
                    logits: torch.Tensor, tokens: TokenBuffer, to_host: ToHost
                    ) -> tuple[tuple[tuple[int, int, int], ...], TokenLogprobs]:
    """The prompt tokens the spans (`prompt_spans`) score, as `ForwardResult` carries them: per span (row, index of the
    first prompt token scored, count), and their TokenLogprobs [1, sum of counts, ...] one span after another, from
    the logits [sum of counts, V] of the spans' positions."""
    k = max(rows[i].prompt_logprobs for i, _, _ in spans)
    scored = tokens.at(np.concatenate([np.full(n, slots[i]) for i, _, n in spans]),
                       np.concatenate([q + 1 + np.arange(n) for _, q, n in spans]))
    return (tuple((i, q + 1, n) for i, q, n in spans),
            token_logprobs(logits.unsqueeze(0), scored.unsqueeze(0), k, to_host))
