"""The verifier: which drafted tokens a step keeps, and the one token the target adds.

Definitions used throughout specsched:

- **draft tokens** x_1..x_D: what a proposer guessed to follow the last emitted token. Rows of
  a batch may draft fewer: `num_drafts` [B] <= D; positions past it are padding, never read.
- **target distributions** p_0..p_D: one target forward over [last token, x_1..x_D] gives
  D+1 next-token distributions; p_i is what the target predicts after x_i (p_0: after the
  last emitted token). q_1..q_D are the distributions the drafts were sampled from (one-hot
  for deterministic proposers such as n-gram lookup or a greedy draft).
- **accepted tokens**: the longest prefix x_1..x_a of the drafts the verifier keeps,
  0 <= a <= num_drafts.
- **recovered token**: when a < num_drafts, x_{a+1} was rejected and one token is drawn in
  its place from the target at that position: argmax p_a when greedy, otherwise from the
  residual normalize(max(p_a - q_{a+1}, 0)).
- **bonus token**: when every draft is accepted (a = num_drafts), one token drawn from
  p_a, the target's distribution after the last draft token.

A step emits a + 1 tokens: the accepted ones, then the recovered or the bonus token. In
tensors, column i of `draft_tokens` [B, D] holds x_{i+1} and column i of the target's
[B, D+1, V] holds p_i, so the target row scored for draft column i is column i.

Modes: `greedy_verify` (exact match with the target's argmax), `rejection_verify` (lossless
sampling, Leviathan et al. 2023 / Chen et al. 2023: the emitted tokens are distributed
exactly as sampling from the target), `threshold_verify` (LOSSY: keeps drafts the target
finds likely enough), and for token trees `greedy_tree_verify` and `sampled_tree_verify` (lossless
sampling of a tree of deterministic picks). Everything is batched and loop-free over
tokens (a tree's walk loops over its depths and siblings, not over rows); nothing here waits on the device except input checks, which run for CPU tensors only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specsched.runtime.sampling import sample, uniform_noise
from specsched.runtime.sync_guard import to_device
from specsched.scheduler.errors import InvalidRequestError

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


def _check_linear(draft_tokens: torch.Tensor, num_drafts: torch.Tensor, target: torch.Tensor, what: str) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, D], got {tuple(draft_tokens.shape)}")
    b, d = draft_tokens.shape
    if num_drafts.shape != (b,):
        raise ValueError(f"num_drafts must be [B={b}], got {tuple(num_drafts.shape)}")
    if tuple(target.shape[:2]) != (b, d + 1):
        raise ValueError(f"{what} must be [B={b}, D+1={d + 1}, ...], got {tuple(target.shape)}")
    if num_drafts.device.type == "cpu":  # a host array's check reads no device value
        counts = num_drafts.numpy()
        if ((counts < 0) | (counts > d)).any():
            raise ValueError(f"num_drafts must lie in [0, D={d}], got {counts.tolist()}")


def _accepted_prefix(keep: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in keep [B, D], counting only the first num_drafts."""
    positions = torch.arange(keep.shape[1], device=keep.device)
    keep = keep & (positions < num_drafts.unsqueeze(-1))
    return keep.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> VerifyResult:
    b, d = draft_tokens.shape
    out = torch.cat([draft_tokens.to(torch.int64), draft_tokens.new_full((b, 1), -1, dtype=torch.int64)], dim=1)
    positions = torch.arange(d + 1, device=out.device)
    out = out.masked_fill(positions >= num_accepted.unsqueeze(-1), -1)
    out.scatter_(1, num_accepted.unsqueeze(-1), next_token.to(torch.int64).unsqueeze(-1))
    return VerifyResult(num_accepted=num_accepted, output_tokens=out, num_output=num_accepted + 1)


def _draft_prob(probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """probs [B, >=D, V] read at each draft token -> [B, D] (padded positions read token 0)."""
    d = draft_tokens.shape[1]
    valid = torch.arange(d, device=draft_tokens.device) < num_drafts.unsqueeze(-1)
    tokens = torch.where(valid, draft_tokens, torch.zeros_like(draft_tokens)).to(torch.int64)
    return probs[:, :d].gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()


def greedy_verify_ids(draft_tokens: torch.Tensor, num_drafts: torch.Tensor, target_ids: torch.Tensor) -> VerifyResult:
    """Greedy verification from the target's argmax tokens [B, D+1]."""
    _check_linear(draft_tokens, num_drafts, target_ids, "target_ids")
    d = draft_tokens.shape[1]
    num_accepted = _accepted_prefix(draft_tokens == target_ids[:, :d], num_drafts)
    next_token = target_ids.gather(1, num_accepted.unsqueeze(-1)).squeeze(-1)
    return _emit(draft_tokens, num_accepted, next_token)


def greedy_verify(draft_tokens: torch.Tensor, num_drafts: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Accept drafts while they equal the target's argmax; the next argmax is recovered/bonus."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, D+1, V], got {tuple(target_logits.shape)}")
    return greedy_verify_ids(draft_tokens, num_drafts, target_logits.argmax(dim=-1))


def rejection_verify(
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> VerifyResult:
    """Lossless speculative sampling.

    Accept x_i with probability min(1, p(x_i) / q(x_i)) (uniform u < p/q, computed as
    u*q < p); at the first rejection draw the recovered token from normalize(max(p - q, 0));
    if all are accepted draw the bonus token from p at column num_drafts. `draft_probs`
    [B, D, V] must be the distributions the drafts were actually sampled from (after the
    draft's own temperature / top-k / top-p); None means one-hot q (deterministic proposer).
    `target_probs` [B, D+1, V] come from `logits_to_probs`, so greedy requests (one-hot p)
    reduce to exact greedy verification. Per row: D uniforms, then V exponentials, from that
    row's generator (global RNG for None).
    """
    _check_linear(draft_tokens, num_drafts, target_probs, "target_probs")
    b, d = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (b, d, vocab):
        raise ValueError(f"draft_probs must be [B={b}, D={d}, V={vocab}], got {tuple(draft_probs.shape)}")
    device = target_probs.device
    p_draft = _draft_prob(target_probs, draft_tokens, num_drafts)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else _draft_prob(draft_probs, draft_tokens, num_drafts)
    u = uniform_noise((b, d), generators, device)
    num_accepted = _accepted_prefix(u * q_draft < p_draft, num_drafts)

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
        rejected = (num_accepted < num_drafts).unsqueeze(-1)
        p_next = torch.where(rejected, residual, p_next)
    next_token = sample(p_next, generators)
    return _emit(draft_tokens, num_accepted, next_token)


def threshold_verify(
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
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
    _check_linear(draft_tokens, num_drafts, target_probs, "target_probs")
    p_draft = _draft_prob(target_probs, draft_tokens, num_drafts)
    num_accepted = _accepted_prefix(p_draft >= threshold, num_drafts)
    rows = torch.arange(draft_tokens.shape[0], device=target_probs.device)
    p_next = target_probs[rows, num_accepted]
    next_token = p_next.argmax(dim=-1) if generators is None else sample(p_next, generators)
    return _emit(draft_tokens, num_accepted, next_token)


# --- token trees (EAGLE-style) -------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TreeSpec:
    """Shape of a token tree. Node 0 is the root: the last emitted token, whose target logits
    score the depth-1 candidates; nodes 1..T-1 are drafts, topologically ordered (parent index
    < node index; BFS order qualifies). The verify forward runs over all T nodes."""

    parents: torch.Tensor  # [T] int64, parent node index; -1 for the root
    depths: torch.Tensor  # [T] int64, 0 for the root
    mask: torch.Tensor  # [T, T] bool, mask[i, j]: node i attends to node j (j ancestor-or-self)
    max_depth: int  # longest root-to-leaf path, in drafts
    children: torch.Tensor | None = None  # [T, K] int64, each node's children in index order; -1 pad
    # its copies on other devices: a tree's tensors are constant, so each device gets them once
    _copies: dict = field(default_factory=dict, repr=False)

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    @classmethod
    def from_parents(cls, parents: Sequence[int] | torch.Tensor) -> "TreeSpec":
        par = [int(x) for x in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
        if not par or par[0] != -1:
            raise ValueError(f"tree parents must start with -1 (node 0 is the root), got {par[:4]}")
        bad = [i for i in range(1, len(par)) if not 0 <= par[i] < i]
        if bad:
            raise ValueError(f"tree nodes must come after their parent (0 <= parent < index); bad nodes {bad}")
        depths = [0] * len(par)
        mask = torch.eye(len(par), dtype=torch.bool)
        kids: list[list[int]] = [[] for _ in par]
        for i in range(1, len(par)):
            depths[i] = depths[par[i]] + 1
            mask[i] |= mask[par[i]]
            kids[par[i]].append(i)
        width = max(1, max(len(k) for k in kids))
        children = torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.int64)
        return cls(torch.tensor(par, dtype=torch.int64), torch.tensor(depths, dtype=torch.int64), mask, max(depths),
                   children)

    @classmethod
    def chain(cls, num_drafts: int) -> "TreeSpec":
        """The linear special case: root followed by num_drafts drafts."""
        return cls.from_parents([-1, *range(num_drafts)])

    def to(self, device: torch.device | str) -> "TreeSpec":
        """This tree on `device` (itself where it is there; a copy made once per device)."""
        device = torch.device(device)
        if self.parents.device == device:
            return self
        if device not in self._copies:
            self._copies[device] = TreeSpec(to_device(self.parents, device), to_device(self.depths, device),
                                            to_device(self.mask, device), self.max_depth,
                                            to_device(self.children, device))
        return self._copies[device]


def tree_attention_mask(tree: TreeSpec) -> torch.Tensor:
    """[T, T] bool: each node attends to its ancestors and itself (the committed prefix,
    which every node also sees, is not part of this block)."""
    return tree.mask


def tree_positions(tree: TreeSpec, base_pos: int | torch.Tensor) -> torch.Tensor:
    """Position ids of the nodes: root at base_pos, depth-k nodes at base_pos + k.
    int base_pos -> [T]; base_pos [B] -> [B, T]."""
    if isinstance(base_pos, torch.Tensor):
        return base_pos.to(torch.int64).unsqueeze(-1) + tree.to(base_pos.device).depths
    return tree.depths + base_pos


@dataclass
class TreeVerifyResult:
    """Outcome of verifying a batch of same-shaped trees."""

    num_accepted: torch.Tensor  # [B] int64, accepted drafts = depth of best_node
    best_node: torch.Tensor  # [B] int64, deepest accepted node (0 = root: nothing accepted)
    accepted_nodes: torch.Tensor  # [B, max_depth] int64, node index per accepted depth; -1 pad
    output_tokens: torch.Tensor  # [B, max_depth+1] int64, accepted then bonus; -1 padding
    num_output: torch.Tensor  # [B] int64, num_accepted + 1

    def to_lists(self) -> list[list[int]]:
        rows = self.output_tokens.tolist()
        return [row[:n] for row, n in zip(rows, self.num_output.tolist())]


def sampled_tree_verify(
    tree_tokens: torch.Tensor,
    tree: TreeSpec | Sequence[int],
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Lossless verification of a token tree for sampled rows: the emitted tokens are
    distributed exactly as sampling from the target (SpecInfer's multi-draft rejection).

    From the root down, a node's children are tried in index order: child token x, drawn from
    q, is kept with probability min(1, p(x) / q(x)), where p is the target's distribution at the
    node with the residual of each sibling tried before taken: p <- normalize(max(p - q, 0)). A
    kept child becomes the node (its own distribution next); where none is kept, the emitted
    token is drawn from that residual, and where the walk ends on a leaf, from the leaf's
    distribution (the bonus). Lossless when a node's children are independent draws from q
    (with replacement), or deterministic picks (a head's top-k: q one-hot, so a child is kept
    with probability p(x) and its residual is p without x, SGLang's target-only tree sampling).

    tree_tokens [B, T] (node 0 = root, unread; a node token < 0 is no candidate: a row without
    a tree); target_probs [B, T, V] (row i = the target's distribution after node i; one-hot
    rows verify greedily, exactly as `greedy_tree_verify`); draft_probs [B, T, V] (row i = the
    q node i was drawn from; the root's row unread) or None (every node a deterministic pick);
    one generator (or None) per row. The coins are drawn up front, a fixed number per row, so a
    seeded row repeats itself.
    """
    spec = tree if isinstance(tree, TreeSpec) else TreeSpec.from_parents(tree)
    b, t = tree_tokens.shape
    if t != spec.num_nodes or target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (b, t):
        raise ValueError(
            f"tree of {spec.num_nodes} nodes needs tree_tokens [B, {spec.num_nodes}] and target_probs "
            f"[B, {spec.num_nodes}, V]; got {tuple(tree_tokens.shape)} and {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must be shaped as target_probs {tuple(target_probs.shape)}, "
                         f"got {tuple(draft_probs.shape)}")
    device = tree_tokens.device
    spec = spec.to(device)
    probs = target_probs.float()
    tokens = tree_tokens.to(torch.int64)
    rows = torch.arange(b, device=device)
    depth_max, width = spec.max_depth, spec.children.shape[1]
    coins = uniform_noise((b, max(depth_max, 1), width), generators, device)
    node = torch.zeros(b, dtype=torch.int64, device=device)
    walking = torch.ones(b, dtype=torch.bool, device=device)
    p = probs[:, 0]
    nodes = torch.full((b, depth_max), -1, dtype=torch.int64, device=device)
    for depth in range(depth_max):
        kept = torch.zeros(b, dtype=torch.bool, device=device)
        for s in range(width):
            child = spec.children[node, s]
            x = tokens.gather(1, child.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            tried = walking & ~kept & (child >= 0) & (x >= 0)
            xs = x.clamp(min=0).unsqueeze(-1)
            px = p.gather(1, xs).squeeze(-1)
            if draft_probs is None:  # q one-hot at x: kept with probability p(x), residual p without x
                take = tried & (coins[:, depth, s] < px)
                residual = p.scatter(1, xs, 0.0)
            else:  # kept with probability min(1, p(x) / q(x))
                q = draft_probs[rows, child.clamp(min=0)].float()
                take = tried & (coins[:, depth, s] * q.gather(1, xs).squeeze(-1) < px)
                residual = (p - q).clamp_min(0.0)
            drop = (tried & ~take).unsqueeze(-1)
            p = torch.where(drop, residual / residual.sum(-1, keepdim=True).clamp_min(_TINY), p)
            kept |= take
            node = torch.where(take, child, node)
        nodes[:, depth] = torch.where(kept, node, -1)
        p = torch.where(kept.unsqueeze(-1), probs[rows, node], p)
        walking &= kept
    num_accepted = (nodes >= 0).sum(-1)
    path = torch.where(nodes >= 0, tokens.gather(1, nodes.clamp(min=0)), -1)
    out = torch.cat([path, path.new_full((b, 1), -1)], dim=1)
    out.scatter_(1, num_accepted.unsqueeze(-1), sample(p, generators).unsqueeze(-1))
    best = torch.where(num_accepted > 0, nodes.gather(1, (num_accepted - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1),
                       torch.zeros_like(num_accepted))
    return TreeVerifyResult(num_accepted, best, nodes, out, num_accepted + 1)


def check_tree_greedy(temperature: torch.Tensor | Sequence[float]) -> None:
    """`greedy_tree_verify` scores greedily; raise InvalidRequestError for any sampled row."""
    temps = temperature.tolist() if isinstance(temperature, torch.Tensor) else list(temperature)
    rows = [i for i, t in enumerate(temps) if t != 0]
    if rows:
        raise InvalidRequestError(
            "greedy_tree_verify verifies greedily only (temperature 0); rows "
            f"{rows} have temperature {[temps[i] for i in rows]}: use sampled_tree_verify for them."
        )


def greedy_tree_verify(
    tree_tokens: torch.Tensor,
    tree: TreeSpec | Sequence[int],
    target_logits: torch.Tensor,
    temperature: torch.Tensor | Sequence[float] | None = None,
) -> TreeVerifyResult:
    """Longest root-to-node path whose every token equals the target's argmax at its parent,
    plus the bonus token (argmax at the path's last node).

    tree_tokens [B, T] (or [T]; node 0 = root token, unread); target_logits [B, T, V] (or
    [T, V]): row i = the target's logits after node i. Ties between equally deep paths go to
    the lower node index. Pass `temperature` [B] to reject sampled requests up front.
    """
    if temperature is not None:
        check_tree_greedy(temperature)
    spec = tree if isinstance(tree, TreeSpec) else TreeSpec.from_parents(tree)
    if tree_tokens.dim() == 1:
        tree_tokens, target_logits = tree_tokens.unsqueeze(0), target_logits.unsqueeze(0)
    b, t = tree_tokens.shape
    if t != spec.num_nodes or target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (b, t):
        raise ValueError(
            f"tree of {spec.num_nodes} nodes needs tree_tokens [B, {spec.num_nodes}] and target_logits "
            f"[B, {spec.num_nodes}, V]; got {tuple(tree_tokens.shape)} and {tuple(target_logits.shape)}"
        )
    device = tree_tokens.device
    spec = spec.to(device)
    argmax = target_logits.argmax(dim=-1)  # [B, T]
    parent = spec.parents.clamp(min=0)
    match = tree_tokens.to(torch.int64) == argmax[:, parent]
    match[:, 0] = True
    bad_ancestors = (~match).float() @ spec.mask.T.float()  # [B, T]
    score = torch.where(bad_ancestors == 0, spec.depths, torch.full_like(spec.depths, -1))
    best = score.argmax(dim=-1)
    num_accepted = spec.depths[best]

    max_depth = spec.max_depth
    nodes = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=device)
    node = best
    for _ in range(max_depth):
        depth = spec.depths[node]
        column = torch.where(depth > 0, depth - 1, torch.full_like(depth, max_depth))
        nodes.scatter_(1, column.unsqueeze(-1), torch.where(depth > 0, node, -1).unsqueeze(-1))
        node = parent[node]
    nodes = nodes[:, :max_depth]
    tokens = torch.where(nodes >= 0, tree_tokens.to(torch.int64).gather(1, nodes.clamp(min=0)), -1)
    out = torch.cat([tokens, tokens.new_full((b, 1), -1)], dim=1)
    out.scatter_(1, num_accepted.unsqueeze(-1), argmax.gather(1, best.unsqueeze(-1)))
    return TreeVerifyResult(num_accepted, best, nodes, out, num_accepted + 1)
