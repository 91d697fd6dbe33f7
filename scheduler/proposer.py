"""What the pipeline needs to know about a proposer (which lives in the runtime), without importing it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specsched.scheduler.schedules import schedule_rules
from specsched.traces.names import PROPOSERS, ProposerKind, Schedule, schedule_name


@dataclass(frozen=True)
class ProposerRules:
    """One row of `RULES` per kind of proposer; the pipeline and the packing read these, never the proposer's name."""

    kv_model: str | None  # its own page table in the shared pool; None without a KV cache
    kv_ahead: int  # tokens its KV runs ahead of the target's (a draft model also reads the sampled token)
    fill_same_batch: bool  # its fill reuses the verify batch (a head on the target's hidden states)
    tree: bool  # drafts a token tree, verified with a custom mask, its accepted path compacted
    checkpoint: str | None = None  # the EngineConfig option naming its weights ("draft", "mtp_head")
    # what its per-position agreement with an output measures (traces): "teacher_forced" (a
    # model of its own, exact at any draft length) or "first_token" (a head: exact at D = 1)
    agreement: str | None = None
    # its fills may wait while speculation is off (D = 0) and catch up in one fill when it drafts again: a draft
    # model re-reads the tokens, a head reads the kept hidden states (`ForwardMessage.keep_hidden`)
    lazy_fill: bool = False
    # drafts on the host by a lookup in the request's own history (`HostDrafter`): no draft launch; the verify carries
    # the drafts and covers what each row drafted (fewer than asked, or none)
    host_drafts: bool = False
    # its fill after a verify may cover the whole verify window, launched before the accepted lengths are known (the
    # `eager_fill` schedule). A draft model's window is the verified positions one ahead; a tree's is its root and one
    # node per depth, the accepted path the verify compacted on the device (padded past it); a linear head's fill is
    # always its verify batch (`fill_same_batch`)
    window_fill: bool = False


RULES = {
    ProposerKind.NONE: ProposerRules(kv_model=None, kv_ahead=0, fill_same_batch=False, tree=False),
    ProposerKind.DRAFT: ProposerRules(kv_model="draft", kv_ahead=1, fill_same_batch=False, tree=False,
                           checkpoint="draft", agreement="teacher_forced", lazy_fill=True, window_fill=True),
    ProposerKind.MTP: ProposerRules(kv_model="mtp", kv_ahead=0, fill_same_batch=True, tree=False,
                         checkpoint="mtp_head", agreement="first_token", lazy_fill=True, window_fill=True),
    ProposerKind.EAGLE: ProposerRules(kv_model="mtp", kv_ahead=0, fill_same_batch=False, tree=True,
                           checkpoint="mtp_head", agreement="first_token", window_fill=True),
    ProposerKind.NGRAM: ProposerRules(kv_model=None, kv_ahead=0, fill_same_batch=False, tree=False,
                           agreement="teacher_forced", host_drafts=True),
}
assert set(RULES) == set(ProposerKind)


@dataclass(frozen=True)
class ProposerSpec:
    kind: str = ProposerKind.NONE.value  # one of PROPOSERS
    draft_len: int = 0  # D: linear draft tokens per step, or tree depth for "eagle"
    tree_parents: tuple[int, ...] = ()  # eagle: parent of tree node i (-1 = child of the root)
    # the fill after a verify covers the verify window (`ProposerRules.window_fill`)
    window_fill: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PROPOSERS:
            raise ValueError(f"unknown proposer {self.kind!r}; choose one of {PROPOSERS}")
        if self.kind == ProposerKind.NONE and self.draft_len:
            raise ValueError("proposer 'none' takes no draft length")
        if self.kind != ProposerKind.NONE and self.draft_len < 1:
            raise ValueError(f"proposer {self.kind!r} needs draft_len >= 1")
        if self.is_tree and not self.tree_parents:
            raise ValueError(f"the {self.kind} proposer needs a tree shape")
        if not self.is_tree and self.tree_parents:
            trees = ", ".join(repr(k.value) for k, r in RULES.items() if r.tree)
            raise ValueError(f"proposer {self.kind!r} drafts linearly; only {trees} takes a tree")
        if self.window_fill and not self.rules.window_fill:
            raise ValueError(f"proposer {self.kind!r} cannot fill over the verify window")
        for i, p in enumerate(self.tree_parents):
            if not (-1 <= p < i):
                raise ValueError(f"tree node {i}: parent {p} must be -1 or an earlier node")
        if self.tree_parents and int(self.tree_depths().max()) > self.draft_len:
            raise ValueError(
                f"tree of depth {int(self.tree_depths().max())} is deeper than draft_len {self.draft_len}"
            )

    @property
    def speculative(self) -> bool:
        return self.kind != ProposerKind.NONE

    @property
    def rules(self) -> ProposerRules:
        return RULES[self.kind]

    @property
    def kv_model(self) -> str | None:
        """Name of the proposer's own page table, or None (n-gram, none)."""
        return self.rules.kv_model

    @property
    def kv_ahead(self) -> int:
        """Tokens the proposer's KV runs ahead of the target's: 1 for a draft model (it also reads the sampled token), 0
        for a head (it reads the hidden states of exactly the target's positions)."""
        return self.rules.kv_ahead

    @property
    def is_tree(self) -> bool:
        """Drafts a token tree (EAGLE): verified with a custom mask at tree positions."""
        return self.rules.tree

    @property
    def num_candidates(self) -> int:
        """Tokens a verification adds after the last emitted token (D, or the tree's size)."""
        return len(self.tree_parents) if self.is_tree else self.draft_len

    @property
    def max_accept(self) -> int:
        """Most drafted tokens one verification can accept (a tree: its depth, maybe below draft_len)."""
        if self.is_tree:
            return int(self.tree_depths().max())
        return self.draft_len

    @property
    def fill_same_batch(self) -> bool:
        """The fill after a verify covers the verify window (an MTP head always; others with `window_fill`), so it can
        be launched before the accepted lengths are known; otherwise it covers the accepted path."""
        return self.rules.fill_same_batch or self.window_fill

    def tree_depths(self) -> np.ndarray:
        d = np.zeros(len(self.tree_parents), dtype=np.int64)
        for i, p in enumerate(self.tree_parents):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def tree_mask(self) -> np.ndarray:
        """bool [1+T, 1+T]: row = query (0 = last emitted token, i+1 = tree node i)."""
        t = len(self.tree_parents)
        m = np.zeros((t + 1, t + 1), dtype=bool)
        m[:, 0] = True
        for i, p in enumerate(self.tree_parents):
            m[i + 1] = m[p + 1] if p >= 0 else m[0]
            m[i + 1, i + 1] = True
        return m


def default_tree(depth: int, top_k: int = 2, max_nodes: int = 16) -> tuple[int, ...]:
    """A fixed EAGLE-1-like tree: at each depth the best node gets top_k children, every other node one. Parents in
    BFS order, at most max_nodes nodes."""
    if depth < 0 or top_k < 1 or max_nodes < 1:
        raise ValueError(f"need depth >= 0, top_k >= 1, max_nodes >= 1 (got {depth}, {top_k}, {max_nodes})")
    parents: list[int] = []
    frontier = [-1]
    for _ in range(depth):
        nxt = []
        for rank, node in enumerate(frontier):
            k = top_k if rank == 0 else 1
            for _ in range(k):
                if len(parents) >= max_nodes:
                    break
                parents.append(node)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return tuple(parents)


def validate_combination(proposer: str, schedule: str, draft_len: int) -> None:
    """Reject schedule/proposer pairs that make no sense, with a message saying why."""
    rules = schedule_rules(schedule)  # ValueError for an unknown schedule
    schedule = schedule_name(schedule)
    if proposer not in PROPOSERS:
        raise ValueError(f"unknown proposer {proposer!r}; choose one of {PROPOSERS}")
    if proposer != ProposerKind.NONE and draft_len < 1:
        raise ValueError(f"proposer {proposer!r} needs draft_len >= 1, got {draft_len}")
    if proposer == ProposerKind.NONE and rules.speculative:
        raise ValueError(
            f"schedule {schedule!r} overlaps a proposer's fill run; without a proposer use "
            f"{Schedule.SYNC.value!r} or {Schedule.PLAIN_OVERLAP.value!r}"
        )
    if proposer != ProposerKind.NONE and rules.speculative is False:
        raise ValueError(f"{schedule!r} is for plain decoding; speculative runs use "
                         f"{Schedule.SYNC.value}/{Schedule.OVERLAP.value}/{Schedule.EAGER_FILL.value}")
    prules = RULES[proposer]
    if rules.fill_behind_verify and not prules.window_fill:
        raise ValueError(
            f"the {schedule!r} schedule re-runs the proposer over the verify window before acceptance is "
            f"known; proposer {proposer!r} has no such fill (use {Schedule.SYNC.value!r} for n-gram)"
        )
    if rules.defers_fill and (prules.kv_model is None or prules.fill_same_batch):
        raise ValueError(
            f"the {schedule!r} schedule overlaps a proposer's fill run with the next step's host "
            f"work; proposer {proposer!r} has none to overlap (use {Schedule.EAGER_FILL.value!r} for an "
            f"MTP head, {Schedule.SYNC.value!r} for n-gram)"
        )
