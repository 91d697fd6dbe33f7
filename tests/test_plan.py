"""Tests for specsched.scheduler.plan: FlashInfer paged-KV layout arrays, checked by hand and by property."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsched.scheduler.plan import AttentionPlan, build_plan


def _eq(a: np.ndarray, b: list) -> None:
    np.testing.assert_array_equal(a, np.asarray(b))


def test_ragged_batch_hand_checked() -> None:
    # page_size 4
    #   seq 0: prefill of 3 tokens, pages [7]                 -> slots 28 29 30
    #   seq 1: decode at position 5, pages [2, 5, 9]; page 9 is reserved (for drafts) and
    #          must be ignored                                -> page 5, offset 1 -> 21
    #   seq 2: chunk of 5 tokens at positions 4..8, pages [3, 0, 1] (shuffled ids)
    #          4..7 -> page 0 offsets 0..3 -> 0 1 2 3; 8 -> page 1 offset 0 -> 4
    plan = build_plan([3, 1, 5], [3, 6, 9], [[7], [2, 5, 9], [3, 0, 1]], 4)
    _eq(plan.qo_indptr, [0, 3, 4, 9])
    _eq(plan.paged_kv_indptr, [0, 1, 3, 6])
    _eq(plan.paged_kv_indices, [7, 2, 5, 3, 0, 1])
    _eq(plan.paged_kv_last_page_len, [3, 2, 1])
    _eq(plan.kv_lens, [3, 6, 9])
    _eq(plan.positions, [0, 1, 2, 5, 4, 5, 6, 7, 8])
    _eq(plan.slot_mapping, [28, 29, 30, 21, 0, 1, 2, 3, 4])
    assert plan.custom_mask is None
    assert plan.num_seqs == 3 and plan.num_tokens == 9 and plan.page_size == 4
    _eq(plan.qo_lens, [3, 1, 5])
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "kv_lens"):
        assert getattr(plan, name).dtype == np.int32, name
    assert plan.positions.dtype == np.int64 and plan.slot_mapping.dtype == np.int64


def test_full_last_page_and_exact_boundaries() -> None:
    # seq 0: 4 new tokens fill the second page exactly (last_page_len == page_size)
    # seq 1: one token that opens a new page (kv_len 5 -> 2 pages, last_page_len 1)
    # seq 2: one token that closes a page (kv_len 8 -> 2 pages, last_page_len 4)
    plan = build_plan([4, 1, 1], [8, 5, 8], [[6, 3], [1, 4, 8], [11, 10]], 4)
    _eq(plan.paged_kv_indptr, [0, 2, 4, 6])
    _eq(plan.paged_kv_indices, [6, 3, 1, 4, 11, 10])
    _eq(plan.paged_kv_last_page_len, [4, 1, 4])
    _eq(plan.positions, [4, 5, 6, 7, 4, 7])
    _eq(plan.slot_mapping, [12, 13, 14, 15, 16, 43])


def test_page_size_one() -> None:
    plan = build_plan([2, 1], [3, 2], [[5, 0, 2], [9, 4, 7]], 1)
    _eq(plan.paged_kv_indptr, [0, 3, 5])
    _eq(plan.paged_kv_indices, [5, 0, 2, 9, 4])
    _eq(plan.paged_kv_last_page_len, [1, 1])
    _eq(plan.slot_mapping, [0, 2, 4])
    _eq(plan.positions, [1, 2, 1])


def test_numpy_page_tables_and_lengths_are_accepted() -> None:
    plan = build_plan(np.array([2]), np.array([6]), [np.array([8, 1, 3])], 4)
    _eq(plan.paged_kv_indices, [8, 1])
    _eq(plan.slot_mapping, [4, 5])  # logical 4, 5 -> page 1, offsets 0, 1


def test_empty_batch() -> None:
    plan = build_plan([], [], [], 16)
    _eq(plan.qo_indptr, [0])
    _eq(plan.paged_kv_indptr, [0])
    assert plan.paged_kv_indices.shape == (0,) and plan.slot_mapping.shape == (0,)
    assert plan.num_seqs == 0 and plan.num_tokens == 0


def test_position_overrides_for_a_tree() -> None:
    # seq 0: root at position 6 + tree nodes at depths 1, 1, 2 -> positions 6 7 7 8,
    # while the KV slots stay consecutive (6..9).
    # seq 1: no override -> positions follow the KV index.
    plan = build_plan(
        [4, 2], [10, 3], [[0, 1, 2], [5]], 4,
        positions=[np.array([6, 7, 7, 8]), None],
    )
    _eq(plan.positions, [6, 7, 7, 8, 1, 2])
    _eq(plan.slot_mapping, [6, 7, 8, 9, 21, 22])


def test_custom_masks_flattened_in_flashinfer_order() -> None:
    # FlashInfer's custom_mask: for each request i in order, its [qo_len_i, kv_len_i] mask
    # flattened row-major, concatenated. A None entry in a mixed batch becomes causal.
    m0 = np.array([[1, 0, 1], [0, 1, 1]], dtype=bool)  # qo 2, kv 3
    m2 = np.array([[True, False]])  # qo 1, kv 2
    plan = build_plan([2, 2, 1], [3, 4, 2], [[0], [1], [2]], 4, custom_masks=[m0, None, m2])
    causal_1 = [1, 1, 1, 0, 1, 1, 1, 1]  # qo 2 at kv positions 2, 3 of 4
    expected = [1, 0, 1, 0, 1, 1] + causal_1 + [1, 0]
    assert plan.custom_mask is not None and plan.custom_mask.dtype == bool
    _eq(plan.custom_mask, np.array(expected, dtype=bool))
    assert plan.custom_mask.size == sum(q * k for q, k in [(2, 3), (2, 4), (1, 2)])


def test_all_none_masks_mean_causal() -> None:
    plan = build_plan([2], [2], [[0]], 4, custom_masks=[None])
    assert plan.custom_mask is None


def test_tree_mask_placed_after_the_prefix() -> None:
    from specsched.scheduler.proposer import ProposerSpec

    spec = ProposerSpec("eagle", 2, (-1, -1, 0))
    tree = spec.tree_mask()  # [4, 4]
    prefix = 5
    m = np.ones((4, prefix + 4), dtype=bool)
    m[:, prefix:] = tree
    plan = build_plan([4], [prefix + 4], [[3, 2, 7]], 4, custom_masks=[m],
                      positions=[prefix + np.concatenate([[0], spec.tree_depths()])])
    assert plan.custom_mask is not None
    rows = plan.custom_mask.reshape(4, prefix + 4)
    assert rows[:, :prefix].all()
    np.testing.assert_array_equal(rows[:, prefix:], tree)
    _eq(plan.positions, [5, 6, 6, 7])


def test_a_plan_crosses_to_a_worker_process_intact() -> None:
    plan = build_plan([2, 1], [5, 3], [[4, 1], [0]], 4, custom_masks=[None, np.ones((1, 3), bool)])
    back = pickle.loads(pickle.dumps(plan))  # what the pipe to a worker process does
    for name in AttentionPlan.__slots__:
        a, b = getattr(plan, name), getattr(back, name)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b
    assert build_plan([1], [1], [[0]], 4).custom_mask is None


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([3], [9], [[0, 1]], 4), {}, r"sequence 0: 9 KV tokens need 3 pages, page table has 2"),
        (([1, 1], [1, 5], [[0], [1]], 4), {}, r"sequence 1: 5 KV tokens need 2 pages, page table has 1"),
        (([1], [1], [[]], 4), {}, r"sequence 0: 1 KV tokens need 1 pages, page table has 0"),
        (([0], [4], [[0]], 4), {}, r"sequence 0: qo_len 0, kv_len 4"),
        (([1, 5], [1, 4], [[0], [1, 2]], 4), {}, r"sequence 1: qo_len 5, kv_len 4"),
        (([1, 1], [1], [[0], [1]], 4), {}, r"one entry per sequence"),
        (([1], [1], [[0], [1]], 4), {}, r"one entry per sequence"),
        (([1], [1], [[0]], 0), {}, r"page_size must be >= 1"),
        (([2], [2], [[0]], 4), {"positions": [np.array([0])]}, r"sequence 0: 1 positions for 2 tokens"),
        (([2], [2], [[0]], 4), {"positions": [None, None]}, r"positions has 2 entries for 1 sequences"),
        (([2], [2], [[0]], 4), {"custom_masks": [np.ones((2, 3), bool)]},
         r"sequence 0: custom mask \(2, 3\), expected \(2, 2\)"),
        (([2, 1], [2, 1], [[0], [1]], 4), {"custom_masks": [np.ones((2, 2), bool)]},
         r"custom_masks has 1 entries for 2 sequences"),
    ],
)
def test_bad_input_raises_clear_errors(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_plan(*args, **kwargs)


# -- property: new tokens land in distinct slots of their own pages at the right offset ----------


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[list[int]]]:
    page_size = draw(st.integers(1, 8))
    num_seqs = draw(st.integers(1, 6))
    kv_lens = [draw(st.integers(1, 40)) for _ in range(num_seqs)]
    qo_lens = [draw(st.integers(1, k)) for k in kv_lens]
    extra = [draw(st.integers(0, 2)) for _ in range(num_seqs)]
    sizes = [-(-k // page_size) + e for k, e in zip(kv_lens, extra)]
    pool = draw(st.permutations(range(sum(sizes) + draw(st.integers(0, 5)))))
    tables, at = [], 0
    for n in sizes:
        tables.append(list(pool[at : at + n]))
        at += n
    return page_size, qo_lens, kv_lens, tables


@given(batches())
@settings(max_examples=150, deadline=None, database=None)
def test_slot_mapping_property(batch: tuple[int, list[int], list[int], list[list[int]]]) -> None:
    page_size, qo_lens, kv_lens, tables = batch
    plan = build_plan(qo_lens, kv_lens, tables, page_size)
    assert len(set(plan.slot_mapping.tolist())) == plan.num_tokens == sum(qo_lens)
    _eq(plan.qo_lens, qo_lens)
    for i, (q, k, table) in enumerate(zip(qo_lens, kv_lens, tables)):
        n_pages = -(-k // page_size)
        pages = plan.paged_kv_indices[plan.paged_kv_indptr[i] : plan.paged_kv_indptr[i + 1]]
        _eq(pages, table[:n_pages])
        assert 1 <= plan.paged_kv_last_page_len[i] <= page_size
        assert (n_pages - 1) * page_size + plan.paged_kv_last_page_len[i] == k
        lo, hi = plan.qo_indptr[i], plan.qo_indptr[i + 1]
        for j, (slot, pos) in enumerate(zip(plan.slot_mapping[lo:hi], plan.positions[lo:hi])):
            logical = k - q + j
            assert pos == logical
            page, offset = divmod(int(slot), page_size)
            assert page == table[logical // page_size]
            assert offset == logical % page_size


@given(batches(), st.integers(0, 3))
@settings(max_examples=150, deadline=None, database=None)
def test_padded_table_array_gives_the_plan_of_per_sequence_lists(batch, pad: int) -> None:
    """The block manager's layout -- one [B, max_pages] array, padded, with the page counts --
    plans exactly what the per-sequence lists plan."""
    page_size, qo_lens, kv_lens, tables = batch
    width = max(len(t) for t in tables) + pad
    array = np.full((len(tables), width), 999, dtype=np.int32)  # padding: pages that are not the row's
    for i, t in enumerate(tables):
        array[i, : len(t)] = t
    lens = np.array([len(t) for t in tables])
    pa = build_plan(qo_lens, kv_lens, tables, page_size)
    pb = build_plan(qo_lens, kv_lens, array, page_size, table_lens=lens)
    # the whole table with the rows named (the block manager's own array, rows in any order)
    order = np.random.default_rng(len(tables)).permutation(len(tables) + 2)[: len(tables)]
    whole = np.full((len(tables) + 2, width), 777, dtype=np.int32)
    whole[order] = array
    pc = build_plan(qo_lens, kv_lens, whole, page_size, table_lens=lens, table_rows=order)
    a = {k: getattr(pa, k) for k in AttentionPlan.__slots__}
    for other in (pb, pc):
        b = {k: getattr(other, k) for k in AttentionPlan.__slots__}
        for key in a:
            if isinstance(a[key], np.ndarray):
                assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


def test_padded_table_array_too_short_is_named() -> None:
    with pytest.raises(ValueError, match="sequence 1: 9 KV tokens need 3 pages, page table has 2"):
        build_plan([1, 1], [4, 9], np.array([[0, 1, 7], [2, 3, 7]]), 4, table_lens=np.array([1, 2]))


@given(st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(1, 4), st.integers(0, 2**16))
@settings(max_examples=60, deadline=None, database=None)
def test_a_tree_for_every_row_plans_what_per_row_masks_and_positions_plan(starts, page_size, seed):
    """`tree=` builds in whole arrays the positions and custom mask that per-sequence lists give."""
    from specsched.scheduler.proposer import ProposerSpec, default_tree

    spec = ProposerSpec("eagle", 3, default_tree(3, 2, 6))
    width = 1 + spec.num_candidates
    offsets, tree = np.concatenate([[0], spec.tree_depths()]), spec.tree_mask()
    kv = [s + width for s in starts]
    rng = np.random.default_rng(seed)
    tables = [rng.permutation(200)[: -(-k // page_size)].tolist() for k in kv]
    masks = []
    for s0 in starts:
        m = np.ones((width, s0 + width), dtype=bool)
        m[:, s0:] = tree
        masks.append(m)
    want = build_plan([width] * len(starts), kv, tables, page_size,
                      positions=[s + offsets for s in starts], custom_masks=masks)
    got = build_plan([width] * len(starts), kv, tables, page_size, tree=(offsets, tree))
    for name in AttentionPlan.__slots__:
        a, b = getattr(want, name), getattr(got, name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, name


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 30)), min_size=2, max_size=6), st.integers(1, 4),
       st.booleans(), st.data())
@settings(max_examples=60, deadline=None, database=None)
def test_a_plan_of_some_rows_is_the_plan_of_those_rows_alone(rows, page_size, masked, data):
    """`AttentionPlan.rows(lo, hi)` (a verify micro-batch) equals planning rows [lo, hi) alone."""
    qo = [q for q, _ in rows]
    kv = [q + p for q, p in rows]
    rng = np.random.default_rng(len(rows))
    tables = [rng.permutation(300)[: -(-k // page_size)].tolist() for k in kv]
    masks = [rng.random((q, k)) < 0.5 for q, k in zip(qo, kv)] if masked else None
    lo = data.draw(st.integers(0, len(rows) - 1))
    hi = data.draw(st.integers(lo + 1, len(rows)))
    whole = build_plan(qo, kv, tables, page_size, custom_masks=masks)
    alone = build_plan(qo[lo:hi], kv[lo:hi], tables[lo:hi], page_size,
                       custom_masks=masks[lo:hi] if masks else None)
    part = whole.rows(lo, hi)
    for name in AttentionPlan.__slots__:
        a, b = getattr(alone, name), getattr(part, name)
        assert (a is None and b is None) or (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), name


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 30)), min_size=2, max_size=6), st.integers(1, 4),
       st.data())
@settings(max_examples=60, deadline=None, database=None)
def test_a_plan_of_any_rows_is_the_plan_of_those_rows_alone(rows, page_size, data):
    """`AttentionPlan.select(rows)` (a mixed step's decode rows, say) equals planning them alone."""
    qo = [q for q, _ in rows]
    kv = [q + p for q, p in rows]
    rng = np.random.default_rng(len(rows))
    tables = [rng.permutation(300)[: -(-k // page_size)].tolist() for k in kv]
    pick = sorted(data.draw(st.sets(st.integers(0, len(rows) - 1), min_size=1)))
    whole = build_plan(qo, kv, tables, page_size)
    alone = build_plan([qo[i] for i in pick], [kv[i] for i in pick], [tables[i] for i in pick], page_size)
    part = whole.select(np.array(pick))
    for name in AttentionPlan.__slots__:
        a, b = getattr(alone, name), getattr(part, name)
        assert (a is None and b is None) or (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), name


def test_attention_groups_keep_decode_rows_apart_and_longer_rows_by_length_class() -> None:
    from specsched.scheduler.plan import attention_groups

    groups = attention_groups(np.array([1, 40, 1, 3, 2, 33, 1, 200]))
    assert [g.tolist() for g in groups] == [[0, 2, 6], [3, 4], [1, 5], [7]]
    assert [g.tolist() for g in attention_groups(np.array([1, 1, 1]))] == [[0, 1, 2]]
    assert [g.tolist() for g in attention_groups(np.array([9, 12, 15]))] == [[0, 1, 2]]  # one class


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=24))
def test_attention_groups_of_few_rows_and_of_many_are_the_same_rule(qo: list[int]) -> None:
    """A few rows are grouped in Python, many with numpy: both are the length classes (one
    token; 2-3; 4-7; ...) in class order, rows in order, one group when one class."""
    from specsched.scheduler.plan import attention_groups, length_class

    groups = [g.tolist() for g in attention_groups(np.array(qo, dtype=np.int64))]
    classes = sorted({length_class(q) for q in qo})
    want = [[i for i, q in enumerate(qo) if length_class(q) == c] for c in classes] if len(classes) > 1 \
        else [list(range(len(qo)))]
    assert groups == want
    assert all(length_class(q) == (0 if q == 1 else int(np.floor(np.log2(q))) + 1) for q in qo)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 5000)), min_size=1, max_size=40))
def test_padded_attention_is_each_groups_rows_times_its_longest_query_and_kv(rows: list[tuple[int, int]]) -> None:
    """The whole-array padded attention (what a launch's cost model reads at many rows) is the
    sum over `attention_groups` of rows x longest query x longest KV."""
    from specsched.scheduler.packing import _padded
    from specsched.scheduler.plan import attention_groups, padded_attention

    qo = np.array([q for q, _ in rows], dtype=np.int64)
    kv = np.array([k for _, k in rows], dtype=np.int64)
    want = sum(len(g) * int(qo[g].max()) * int(kv[g].max()) for g in attention_groups(qo))
    assert padded_attention(qo, kv) == want
    assert _padded(len(qo), qo, kv) == want
