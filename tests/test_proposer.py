"""Tests for specsched.scheduler.proposer: spec validation, tree shapes and masks, schedule pairs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsched.scheduler.proposer import RULES, ProposerSpec, default_tree, validate_combination
from specsched.scheduler.schedules import SCHEDULE_RULES, schedule_rules
from specsched.traces.names import PROPOSERS, SCHEDULES, schedule_name

# -- ProposerSpec -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "medusa", "draft_len": 2}, "unknown proposer 'medusa'"),
        ({"kind": "none", "draft_len": 3}, "takes no draft length"),
        ({"kind": "draft", "draft_len": 0}, "needs draft_len >= 1"),
        ({"kind": "ngram", "draft_len": -1}, "needs draft_len >= 1"),
        ({"kind": "eagle", "draft_len": 2}, "needs a tree shape"),
        ({"kind": "eagle", "draft_len": 2, "tree_parents": (-1, 1)}, "tree node 1: parent 1"),
        ({"kind": "eagle", "draft_len": 2, "tree_parents": (0,)}, "tree node 0: parent 0"),
        ({"kind": "eagle", "draft_len": 2, "tree_parents": (-2,)}, "tree node 0: parent -2"),
        ({"kind": "draft", "draft_len": 2, "tree_parents": (-1, 0)}, "only 'eagle' takes a tree"),
        ({"kind": "eagle", "draft_len": 1, "tree_parents": (-1, 0)}, "depth 2 is deeper than draft_len 1"),
    ],
)
def test_spec_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProposerSpec(**kwargs)


def test_spec_properties_per_kind() -> None:
    none = ProposerSpec()
    assert (none.speculative, none.kv_model, none.num_candidates, none.max_accept) == (False, None, 0, 0)
    draft = ProposerSpec("draft", 4)
    assert (draft.speculative, draft.kv_model, draft.num_candidates, draft.max_accept) == (True, "draft", 4, 4)
    assert not draft.fill_same_batch
    mtp = ProposerSpec("mtp", 1)
    assert (mtp.kv_model, mtp.num_candidates, mtp.fill_same_batch) == ("mtp", 1, True)
    ngram = ProposerSpec("ngram", 3)
    assert (ngram.kv_model, ngram.num_candidates, ngram.fill_same_batch) == (None, 3, False)
    tree = default_tree(3, 2, 8)
    eagle = ProposerSpec("eagle", 3, tree)
    assert (eagle.kv_model, eagle.num_candidates, eagle.fill_same_batch) == ("mtp", 8, False)
    assert eagle.max_accept == 3


def test_eagle_max_accept_is_the_tree_depth_when_the_node_budget_cuts_it() -> None:
    tree = default_tree(6, 2, 8)  # 8 nodes reach only depth 3
    spec = ProposerSpec("eagle", 6, tree)
    assert int(spec.tree_depths().max()) == 3
    assert spec.max_accept == 3
    assert spec.num_candidates == 8


# -- trees ------------------------------------------------------------------------------------


def test_default_tree_hand_checked_shapes() -> None:
    assert default_tree(0) == ()
    assert default_tree(1) == (-1, -1)
    assert default_tree(1, top_k=3) == (-1, -1, -1)
    # depth 2: root's children 0, 1; node 0 (best) gets two children, node 1 one
    assert default_tree(2) == (-1, -1, 0, 0, 1)
    assert default_tree(3) == (-1, -1, 0, 0, 1, 2, 2, 3, 4)
    assert default_tree(3, top_k=2, max_nodes=8) == (-1, -1, 0, 0, 1, 2, 2, 3)
    assert default_tree(4, top_k=1) == (-1, 0, 1, 2)
    assert default_tree(2, top_k=3) == (-1, -1, -1, 0, 0, 0, 1, 2)


@pytest.mark.parametrize("depth, top_k, max_nodes", [(-1, 2, 8), (2, 0, 8), (2, 2, 0)])
def test_default_tree_rejects_bad_arguments(depth: int, top_k: int, max_nodes: int) -> None:
    with pytest.raises(ValueError, match="need depth >= 0, top_k >= 1, max_nodes >= 1"):
        default_tree(depth, top_k, max_nodes)


@given(depth=st.integers(1, 7), top_k=st.integers(1, 4), max_nodes=st.integers(1, 40))
@settings(max_examples=60, deadline=None, database=None)
def test_default_tree_is_bfs_and_bounded(depth: int, top_k: int, max_nodes: int) -> None:
    tree = default_tree(depth, top_k, max_nodes)
    spec = ProposerSpec("eagle", depth, tree)  # validates parents point to earlier nodes
    depths = spec.tree_depths()
    assert 1 <= len(tree) <= max_nodes
    assert depths.max() <= depth
    assert list(depths) == sorted(depths)  # breadth-first order
    uncapped = default_tree(depth, top_k, 10_000)
    # level j has 1 + j*(k-1) nodes without a cap: the best node has k children, the rest one
    assert len(uncapped) == sum(1 + j * (top_k - 1) for j in range(1, depth + 1))
    assert tree == uncapped[: len(tree)]


def test_tree_depths_and_mask_hand_checked() -> None:
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    #    |
    #    5
    spec = ProposerSpec("eagle", 3, (-1, -1, 0, 0, 1, 2))
    assert list(spec.tree_depths()) == [1, 1, 2, 2, 2, 3]
    m = spec.tree_mask()
    expected = np.array(
        [
            # r  0  1  2  3  4  5
            [1, 0, 0, 0, 0, 0, 0],  # root (last emitted token)
            [1, 1, 0, 0, 0, 0, 0],  # 0
            [1, 0, 1, 0, 0, 0, 0],  # 1
            [1, 1, 0, 1, 0, 0, 0],  # 2
            [1, 1, 0, 0, 1, 0, 0],  # 3
            [1, 0, 1, 0, 0, 1, 0],  # 4
            [1, 1, 0, 1, 0, 0, 1],  # 5
        ],
        dtype=bool,
    )
    assert m.dtype == bool
    np.testing.assert_array_equal(m, expected)


@st.composite
def trees(draw: st.DrawFn) -> tuple[int, ...]:
    n = draw(st.integers(1, 20))
    return tuple(draw(st.integers(-1, i - 1)) for i in range(n))


@given(trees())
@settings(max_examples=100, deadline=None, database=None)
def test_tree_mask_is_ancestors_and_self(parents: tuple[int, ...]) -> None:
    depth_ref = []
    for p in parents:
        depth_ref.append(1 if p < 0 else depth_ref[p] + 1)
    spec = ProposerSpec("eagle", max(depth_ref), parents)
    assert list(spec.tree_depths()) == depth_ref
    m = spec.tree_mask()
    t = len(parents)
    assert m.shape == (t + 1, t + 1)
    assert m[:, 0].all()
    assert not m[0, 1:].any()
    for i in range(t):
        ancestors = {i}
        p = parents[i]
        while p >= 0:
            ancestors.add(p)
            p = parents[p]
        row = {j for j in range(t) if m[i + 1, j + 1]}
        assert row == ancestors
        assert m[i + 1].sum() == depth_ref[i] + 1  # root + one node per level


# -- proposer / schedule pairs ----------------------------------------------------------------

NATURAL = {
    ("none", "sync"), ("none", "plain_overlap"),
    ("draft", "sync"), ("draft", "overlap"), ("draft", "eager_fill"),
    ("mtp", "sync"), ("mtp", "eager_fill"),
    ("eagle", "sync"), ("eagle", "overlap"), ("eagle", "eager_fill"),
    ("ngram", "sync"),
}


def _draft_len(proposer: str) -> int:
    return 0 if proposer == "none" else 3


@pytest.mark.parametrize("proposer, schedule", sorted(NATURAL))
def test_natural_pairs_are_accepted(proposer: str, schedule: str) -> None:
    validate_combination(proposer, schedule, _draft_len(proposer))


REJECTED = sorted(set(itertools.product(PROPOSERS, SCHEDULES)) - NATURAL)


@pytest.mark.parametrize("proposer, schedule", REJECTED)
def test_other_pairs_are_rejected_with_a_reason(proposer: str, schedule: str) -> None:
    with pytest.raises(ValueError) as info:
        validate_combination(proposer, schedule, _draft_len(proposer))
    msg = str(info.value)
    assert f"'{schedule}'" in msg
    reasons = {
        "overlap": "overlaps a proposer's fill run",
        "eager_fill": ("re-runs the proposer over the verify window" if proposer != "none"
                       else "overlaps a proposer's fill run"),
        "plain_overlap": "is for plain decoding",
    }
    assert reasons[schedule] in msg


def test_rejected_pairs_cover_every_non_natural_pair() -> None:
    assert len(REJECTED) == len(PROPOSERS) * len(SCHEDULES) - len(NATURAL) == 9


def test_names_are_defined_once_and_every_one_has_its_rules() -> None:
    assert set(RULES) == set(PROPOSERS) and set(SCHEDULE_RULES) == set(SCHEDULES)


@pytest.mark.parametrize("proposer", sorted(p for p, s in NATURAL if s == "eager_fill"))
def test_the_old_schedule_name_mtp_is_read_as_eager_fill(proposer: str) -> None:
    validate_combination(proposer, "mtp", _draft_len(proposer))
    assert schedule_name("mtp") == "eager_fill" and schedule_rules("mtp") == schedule_rules("eager_fill")


def test_only_eager_fill_fills_behind_the_verify_and_only_overlap_defers_the_fill_after_acceptance() -> None:
    assert [s for s in SCHEDULES if schedule_rules(s).fill_behind_verify] == ["eager_fill"]
    assert [s for s in SCHEDULES if schedule_rules(s).defers_fill] == ["overlap"]


@pytest.mark.parametrize(
    "proposer, schedule, draft_len, match",
    [
        ("medusa", "sync", 2, "unknown proposer 'medusa'"),
        ("draft", "async", 2, "unknown schedule 'async'"),
        ("draft", "overlap", 0, "proposer 'draft' needs draft_len >= 1"),
        ("ngram", "sync", -1, "proposer 'ngram' needs draft_len >= 1"),
    ],
)
def test_validate_combination_rejects_unknown_names_and_bad_lengths(
    proposer: str, schedule: str, draft_len: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        validate_combination(proposer, schedule, draft_len)
