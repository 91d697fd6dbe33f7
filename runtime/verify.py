"""The verifier: which drafted tokens a step keeps, and the one token the target adds.

Definitions used throughout specsched:

- **draft tokens** x_1..x_D: what a proposer guessed to follow the last emitted token. Rows of
  a batch may draft fewer: `draft_lens` [B] <= D; positions past it are padding, never read.
- **target distributions** p_0..p_D: one target forward over [last token, x_1..x_D] gives
  D+1 next-token distributions; p_i is what the target predicts after x_i (p_0: after the
  last emitted token). q_1..q_D are the distributions the drafts were sampled from (one-hot
  for deterministic proposers such as n-gram lookup or a greedy draft).
- **accepted tokens**: the longest prefix x_1..x_a of the drafts the verifier keeps,
  0 <= a <= draft_lens.
- **recovered token**: when a < draft_lens, x_{a+1} was rejected and one token is drawn in
  its place from the target at that position: argmax p_a when greedy, otherwise from the
  residual normalize(max(p_a - q_{a+1}, 0)).
- **bonus token**: when every draft is accepted (a = draft_lens), one token drawn from
  p_a, the target's distribution after the last draft token.

A step emits a + 1 tokens: the accepted ones, then the recovered or the bonus token. In
tensors, column i of `draft_tokens` [B, D] holds x_{i+1} and column i of the target's
[B, D+1, V] holds p_i, so the target row scored for draft column i is column i.

Modes: `greedy_verify` (exact match with the target's argmax), `rejection_verify` (lossless
sampling, Leviathan et al. 2023 / Chen et al. 2023: the emitted tokens are distributed
exactly as sampling from the target), `threshold_verify` (LOSSY: keeps drafts the target
finds likely enough); token trees are verified in `specsched.runtime.tree_verify`. Everything is
batched and loop-free over tokens; nothing here waits on the device except input checks, which run for CPU tensors only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specsched.runtime.sampling import logits_to_probs, sample, uniform_noise
from specsched.runtime.sync_guard import host_side, to_device
from specsched.scheduler.synthetic import accepted_counts

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class VerifyResult:
    """Outcome of verifying one batch of linear drafts."""

    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens a
    output_tokens: torch.Tensor  # [B, D+1] int64, accepted then recovered/bonus; -1 padding
    num_output: torch.Tensor  # [B] int64, a + 1 tokens emitted

    def to_lists(self) -> list[list[int]]:
        """Emitted tokens per row (one host sync)."""
        rows = self.output_tokens.tolist()
        return [row[:n] for row, n in zip(rows, self.num_output.tolist())]


def _check_linear(draft_tokens: torch.Tensor, draft_lens: torch.Tensor, target: torch.Tensor, what: str) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, D], got {tuple(draft_tokens.shape)}")
    b, d = draft_tokens.shape
    if draft_lens.shape != (b,):
        raise ValueError(f"draft_lens must be [B={b}], got {tuple(draft_lens.shape)}")
    if tuple(target.shape[:2]) != (b, d + 1):
        raise ValueError(f"{what} must be [B={b}, D+1={d + 1}, ...], got {tuple(target.shape)}")
    if draft_lens.device.type == "cpu":  # a host array's check reads no device value
        counts = draft_lens.numpy()
        if ((counts < 0) | (counts > d)).any():
            raise ValueError(f"draft_lens must lie in [0, D={d}], got {counts.tolist()}")


def _accepted_prefix(keep: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in keep [B, D], counting only the first draft_lens."""
    positions = torch.arange(keep.shape[1], device=keep.device)
    keep = keep & (positions < draft_lens.unsqueeze(-1))
    return keep.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> VerifyResult:
    b, d = draft_tokens.shape
    out = torch.cat([draft_tokens.to(torch.int64), draft_tokens.new_full((b, 1), -1, dtype=torch.int64)], dim=1)
    positions = torch.arange(d + 1, device=out.device)
    out = out.masked_fill(positions >= num_accepted.unsqueeze(-1), -1)
    out.scatter_(1, num_accepted.unsqueeze(-1), next_token.to(torch.int64).unsqueeze(-1))
    return VerifyResult(num_accepted=num_accepted, output_tokens=out, num_output=num_accepted + 1)


def _draft_prob(probs: torch.Tensor, draft_tokens: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """probs [B, >=D, V] read at each draft token -> [B, D] (padded positions read token 0)."""
    d = draft_tokens.shape[1]
    valid = torch.arange(d, device=draft_tokens.device) < draft_lens.unsqueeze(-1)
    tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens)).to(torch.int64)
    return probs[:, :d].gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()


def greedy_verify_ids(draft_tokens: torch.Tensor, draft_lens: torch.Tensor, target_ids: torch.Tensor) -> VerifyResult:
    """Greedy verification from the target's argmax tokens [B, D+1]."""
    _check_linear(draft_tokens, draft_lens, target_ids, "target_ids")
    d = draft_tokens.shape[1]
    num_accepted = _accepted_prefix(draft_tokens == target_ids[:, :d], draft_lens)
    # the accepted drafts are the target's own tokens, and so is the next one: the emitted row
    # is the target's, cut after position num_accepted (a third of the ops of `_emit`)
    positions = torch.arange(d + 1, device=target_ids.device)
    out = target_ids.to(torch.int64).masked_fill(positions > num_accepted.unsqueeze(-1), -1)
    return VerifyResult(num_accepted=num_accepted, output_tokens=out, num_output=num_accepted + 1)


def greedy_verify(draft_tokens: torch.Tensor, draft_lens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Accept drafts while they equal the target's argmax; the next argmax is recovered/bonus."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, D+1, V], got {tuple(target_logits.shape)}")
    return greedy_verify_ids(draft_tokens, draft_lens, target_logits.argmax(dim=-1))


def rejection_verify(
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    row_lens: Sequence[int] | None = None,
) -> VerifyResult:
    """Lossless speculative sampling.

    Accept x_i with probability min(1, p(x_i) / q(x_i)) (uniform u < p/q, computed as
    u*q < p); at the first rejection draw the recovered token from normalize(max(p - q, 0));
    if all are accepted draw the bonus token from p at column draft_lens. `draft_probs`
    [B, D, V] must be the distributions the drafts were actually sampled from (after the
    draft's own temperature / top-k / top-p); None means one-hot q (deterministic proposer).
    `target_probs` [B, D+1, V] come from `logits_to_probs`, so greedy requests (one-hot p)
    reduce to exact greedy verification. Per row: D uniforms, then V exponentials, from that
    row's generator (global RNG for None); `row_lens` (`draft_lens` on the host): a seeded row draws
    its own count of uniforms, not its batch's D, so its tokens do not depend on its neighbours.
    """
    _check_linear(draft_tokens, draft_lens, target_probs, "target_probs")
    b, d = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (b, d, vocab):
        raise ValueError(f"draft_probs must be [B={b}, D={d}, V={vocab}], got {tuple(draft_probs.shape)}")
    device = target_probs.device
    p_draft = _draft_prob(target_probs, draft_tokens, draft_lens)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else _draft_prob(draft_probs, draft_tokens, draft_lens)
    u = uniform_noise((b, d), generators, device, row_lens)
    num_accepted = _accepted_prefix(u * q_draft < p_draft, draft_lens)

    rows = torch.arange(b, device=device)
    p_next = target_probs[rows, num_accepted].float()
    if d > 0:
        at = num_accepted.clamp(max=d - 1)
        if draft_probs is None:
            token = draft_tokens[rows, at].to(torch.int64).clamp(0, vocab - 1)
            q_next = torch.zeros_like(p_next).scatter_(1, token.unsqueeze(-1), 1.0)
        else:
            q_next = draft_probs[rows, at].float()
        residual = (p_next - q_next).clamp_min_(0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > _TINY, residual / mass.clamp_min(_TINY), p_next)
        rejected = (num_accepted < draft_lens).unsqueeze(-1)
        p_next = torch.where(rejected, residual, p_next)
    next_token = sample(p_next, generators)
    return _emit(draft_tokens, num_accepted, next_token)


def threshold_verify(
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    target_probs: torch.Tensor,
    threshold: float,
    generators: Sequence[torch.Generator | None] | None = None,
) -> VerifyResult:
    """LOSSY verification: keep the longest prefix with p_{i-1}(x_i) >= threshold for each draft.

    The next token comes from the target at the first position not kept: its argmax when
    `generators` is None, else sampled from p there (with the rejected draft still allowed).
    Output no longer follows the target's distribution: a lower threshold accepts more and
    drifts further. With one-hot p (greedy requests) it equals greedy verification.
    """
    if not (0.0 < threshold <= 1.0):
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    _check_linear(draft_tokens, draft_lens, target_probs, "target_probs")
    p_draft = _draft_prob(target_probs, draft_tokens, draft_lens)
    num_accepted = _accepted_prefix(p_draft >= threshold, draft_lens)
    rows = torch.arange(draft_tokens.shape[0], device=target_probs.device)
    p_next = target_probs[rows, num_accepted]
    next_token = p_next.argmax(dim=-1) if generators is None else sample(p_next, generators)
    return _emit(draft_tokens, num_accepted, next_token)


class SyntheticDraws:
    """A worker's synthetic acceptance (scheduler/synthetic.py): its thresholds on the device
    (copied once per draft width) and the engine's seed. A row's draw is a hash of the seed,
    its request's key and its last token's position (`accepted_counts`, computed on the
    device): the same on every tensor-parallel rank and in the simulator's replay. A request
    with its own (`SamplingParams.synthetic_acceptance_*`) gets its thresholds in a step's
    [rows, D] table, built on the host from what it knows."""

    def __init__(self, synthetic, device: torch.device, seed: int = 0):
        self.synthetic, self.device, self.seed = synthetic, device, seed
        self._thresholds: dict[int, torch.Tensor] = {}

    def accepted(self, width: int, keys: Sequence[int], positions: np.ndarray, own: Sequence[Any] = ()) -> torch.Tensor:
        """[rows] drafts accepted of rows drafting up to `width`: row i is request `keys[i]`
        with its last token at `positions[i]`; `own[i]`: its own synthetic acceptance, or None."""
        independent = self.synthetic.independent
        if any(a is not None for a in own):
            thresholds = to_device(self.synthetic.table(width, own), self.device, torch.int64)
        else:
            thresholds = self._thresholds.get(width)
            if thresholds is None:
                thresholds = self._thresholds[width] = to_device(self.synthetic.thresholds(width).copy(),
                                                                 self.device, torch.int64)
        return accepted_counts(thresholds, None, self.seed, to_device(np.asarray(keys, dtype=np.int64), self.device,
                                                                       torch.int64),
                               to_device(np.asarray(positions, dtype=np.int64), self.device, torch.int64), independent)


def synthetic_verify(draft_tokens: torch.Tensor, draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     num_accepted: torch.Tensor, generators: Sequence[torch.Generator | None],
                     allowed: torch.Tensor | None = None) -> VerifyResult:
    """Forced acceptance: row i keeps its first num_accepted[i] drafts (at most draft_lens[i]),
    then the target's token after them, drawn from p there (`sample`: a greedy row's is its
    argmax) -- the drafts at accepted positions and the target's bonus token, as vLLM emits.
    `allowed` [B, D]: whether the request allows each draft (`allowed_drafts`); none past the
    first it forbids is kept (a grammar, min_tokens or a banned token stays obeyed)."""
    _check_linear(draft_tokens, draft_lens, target_probs, "target_probs")
    accepted = torch.minimum(num_accepted.to(draft_lens.device), draft_lens).to(target_probs.device)
    if allowed is not None:
        accepted = _accepted_prefix(allowed.to(accepted.device), accepted)
    rows = torch.arange(draft_tokens.shape[0], device=target_probs.device)
    return _emit(draft_tokens, accepted, sample(target_probs[rows, accepted].float(), generators))


def allowed_drafts(logits: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
    """[B, D] whether each draft [B, D] has a finite logit where it is scored -- a chain's draft j at column j of
    logits [B, 1+D, V], a tree's node j+1 at its parent's column (`parents` [1+D], the root's -1) -- after the
    request's grammar, min_tokens and logit bias: False where the request forbids it."""
    cols = torch.arange(drafts.shape[1], device=logits.device) if parents is None else parents[1:].to(logits.device)
    scored = logits[:, cols.clamp(min=0)].gather(-1, drafts.clamp(min=0).to(torch.int64).unsqueeze(-1)).squeeze(-1)
    return torch.isfinite(scored)


def as_grid(qo_indptr: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify's rows, row i's tokens [qo_indptr[i], qo_indptr[i+1]) of `input_ids` [N] and `logits` [N, V], as
    grids [B, W] and [B, W, V], W the longest row's (a shorter row's columns past its end: zeros, never read)."""
    qo = np.diff(qo_indptr)
    b, width = qo.size, int(qo.max())
    if int(qo.min()) == width:
        return input_ids.view(b, width), logits.view(b, width, -1)
    at = to_device(np.repeat(np.arange(b) * width - qo_indptr[:-1], qo) + np.arange(int(qo_indptr[-1])),
                   input_ids.device, torch.int64)
    grid = input_ids.new_zeros(b * width).index_copy_(0, at, input_ids).view(b, width)
    return grid, logits.new_zeros((b * width, logits.shape[-1])).index_copy_(0, at, logits).view(b, width, -1)


def accept_chain(w: Any, msg: Any, rows: Sequence[Any], drafts: torch.Tensor, logits: torch.Tensor,
                 draft_lens: list[int]) -> VerifyResult:
    """A verify's linear drafts [B, D] against its (processed) logits [B, 1+D, V], row i's first draft_lens[i]
    counting, by the worker `w`'s acceptance: synthetic draws, a threshold, greedy where every row is, else lossless
    rejection sampling against the proposer's draft distributions. The chain's counterpart of a tree proposer's
    `accept_tree`; `rows` are the rows' SeqStates, `msg` the VerifyMessage."""
    b, width = logits.shape[:2]
    nd = torch.tensor(draft_lens, dtype=torch.int64)  # counts known on the host
    nd = host_side(nd) if w.device.type == "cpu" else to_device(nd, w.device)
    if w.acceptance not in ("synthetic", "threshold") and all(st.greedy for st in rows):
        return greedy_verify(drafts, nd, logits)
    probs = logits_to_probs(logits.reshape(b * width, -1), w.sampling_tensors(rows, width)).view(b, width, -1)
    generators = [st.generator for st in rows]
    if w.acceptance == "synthetic":
        drawn = w.synthetic.accepted(width - 1, [st.key for st in rows], msg.start, [st.synthetic for st in rows])
        return synthetic_verify(drafts, nd, probs, drawn, generators, allowed_drafts(logits, drafts))
    if w.acceptance == "threshold":
        return threshold_verify(drafts, nd, probs, w.threshold, generators=generators)
    q = w.proposer.draft_probs(rows, msg.slots.tolist(), msg.start, width - 1)
    return rejection_verify(drafts, nd, q, probs, generators, row_lens=draft_lens)
