"""The verifier for token trees (EAGLE-style): which path of a drafted tree a step keeps.

A tree's node 0 is the root (the last emitted token); nodes 1..T-1 are drafts, each after its
parent; one target forward scores every node (row i of the target's output: its distribution
after node i). `greedy_tree_verify` keeps the deepest path whose every token is the target's
argmax at its parent (token-identical to plain greedy decoding); `sampled_tree_verify` walks the
tree with multi-draft rejection so that the emitted tokens follow the target's distribution
(docs/architecture.md, "Why tree sampling is lossless"). The linear modes and the terms used
here (accepted, recovered, bonus) are in `specsched.runtime.verify`. Batched over rows: a walk
loops over the tree's depths and siblings only, and nothing waits on the device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specsched.runtime.sampling import sample, uniform_noise
from specsched.runtime.sync_guard import to_device
from specsched.scheduler.errors import InvalidRequestError

_TINY = torch.finfo(torch.float32).tiny


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
    paths: torch.Tensor | None = None  # [T, max_depth] int64, the nodes from depth 1 down to each node; -1 pad
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
        top = max(depths)
        paths = [[] for _ in par]
        for i in range(1, len(par)):
            paths[i] = paths[par[i]] + [i]
        paths = torch.tensor([p + [-1] * (top - len(p)) for p in paths], dtype=torch.int64).reshape(len(par), top)
        return cls(torch.tensor(par, dtype=torch.int64), torch.tensor(depths, dtype=torch.int64), mask, top,
                   children, paths)

    @classmethod
    def chain(cls, draft_len: int) -> "TreeSpec":
        """The linear special case: root followed by draft_len drafts."""
        return cls.from_parents([-1, *range(draft_len)])

    def to(self, device: torch.device | str) -> "TreeSpec":
        """This tree on `device` (itself where it is there; a copy made once per device)."""
        device = torch.device(device)
        if self.parents.device == device:
            return self
        if device not in self._copies:
            self._copies[device] = TreeSpec(to_device(self.parents, device), to_device(self.depths, device),
                                            to_device(self.mask, device), self.max_depth,
                                            to_device(self.children, device), to_device(self.paths, device))
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
    has_tree: Sequence[bool] | None = None,
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
    seeded row repeats itself; `has_tree` (on the host): a seeded row without a tree draws none, so its
    tokens do not depend on its neighbours.
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
    coins = uniform_noise((b, max(depth_max, 1), width), generators, device,
                          None if has_tree is None else [depth_max if h else 0 for h in has_tree])
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

    nodes = spec.paths[best]  # the accepted path, a node per depth
    tokens = torch.where(nodes >= 0, tree_tokens.to(torch.int64).gather(1, nodes.clamp(min=0)), -1)
    out = torch.cat([tokens, tokens.new_full((b, 1), -1)], dim=1)
    out.scatter_(1, num_accepted.unsqueeze(-1), argmax.gather(1, best.unsqueeze(-1)))
    return TreeVerifyResult(num_accepted, best, nodes, out, num_accepted + 1)


def synthetic_tree_verify(
    tree_tokens: torch.Tensor,
    tree: TreeSpec,
    target_probs: torch.Tensor,
    num_accepted: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    allowed: torch.Tensor | None = None,
) -> TreeVerifyResult:
    """Forced acceptance on a tree (`runtime.verify.synthetic_verify`'s for chains): row i keeps
    the path to the first node (lowest index) at depth num_accepted[i], then the target's token
    after it, drawn from p there (a greedy row's is its argmax). tree_tokens [B, T],
    target_probs [B, T, V] (row j: after node j), num_accepted [B] drawn on the device.
    `allowed` [B, T-1]: whether the request allows each node's token (`allowed_drafts`); a path
    keeps none it forbids (the deepest allowed path up to the drawn depth, the first there)."""
    spec = tree.to(tree_tokens.device)
    b, t = tree_tokens.shape
    nodes = torch.arange(t, device=tree_tokens.device)
    depth = num_accepted.to(tree_tokens.device).clamp(0, spec.max_depth)
    ok = torch.ones((b, t), dtype=torch.bool, device=tree_tokens.device)  # the root, and every node unless forbidden
    if allowed is not None:
        ok[:, 1:] = allowed.to(tree_tokens.device)
    # the nodes whose whole path is allowed, within the drawn depth: the deepest, then the first (every depth has a
    # node, so with nothing forbidden the first node at the drawn depth)
    fits = ((spec.paths < 0) | ok[:, spec.paths.clamp(min=0)]).all(-1) & (spec.depths <= depth.unsqueeze(-1))
    best = torch.where(fits, spec.depths * t + (t - 1 - nodes), -1).argmax(-1)
    depth = spec.depths[best]
    path = spec.paths[best]
    tokens = torch.where(path >= 0, tree_tokens.to(torch.int64).gather(1, path.clamp(min=0)), -1)
    bonus = sample(target_probs[torch.arange(b, device=tree_tokens.device), best].float(), generators)
    out = torch.cat([tokens, tokens.new_full((b, 1), -1)], dim=1)
    out.scatter_(1, depth.unsqueeze(-1), bonus.to(torch.int64).unsqueeze(-1))
    return TreeVerifyResult(depth, best, path, out, depth + 1)
