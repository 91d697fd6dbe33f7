"""Tests for specsched.scheduler.block_manager: page accounting, all-or-nothing allocation, trimming,
a stateful property test of random allocate/append/trim/free/preempt sequences, and the whole-array
paths against row by row."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from specsched.scheduler.block_manager import BlockManager, OutOfPagesError

MODELS = ("target", "draft")


def one(row: int) -> np.ndarray:
    return np.array([row])


def test_constructor_rejects_empty_pools() -> None:
    with pytest.raises(ValueError, match="num_pages and page_size must be >= 1"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="num_pages and page_size must be >= 1"):
        BlockManager(4, 0)


def test_pages_for_rounds_up() -> None:
    bm = BlockManager(8, 4)
    assert [bm.pages_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_grows_and_never_shrinks() -> None:
    bm = BlockManager(10, 4, MODELS)
    assert bm.page_table(3) == [] and bm.page_table(300) == []
    bm.allocate(one(3), {"target": 5, "draft": 6})
    assert len(bm.page_table(3)) == 2 and len(bm.page_table(3, "draft")) == 2
    assert bm.num_free_pages == 6 and bm.num_used_pages == 4
    before = list(bm.page_table(3))
    bm.allocate(one(3), {"target": 9})  # growing an existing table
    assert bm.page_table(3)[:2] == before  # existing pages keep their place
    assert len(bm.page_table(3)) == 3
    bm.allocate(one(3), {"target": 1, "draft": 0})  # smaller: no-op
    assert len(bm.page_table(3)) == 3 and len(bm.page_table(3, "draft")) == 2
    assert bm.num_free_pages == 5
    bm.allocate(one(40), {"target": 1})  # a row past the tables' height grows them
    assert len(bm.page_table(40)) == 1 and bm.page_table(3)[:2] == before
    bm.check_invariants()


def test_pages_needed_counts_only_missing_pages() -> None:
    bm = BlockManager(6, 4, MODELS)
    bm.allocate(one(0), {"target": 4})
    assert bm.pages_needed(one(0), {"target": 8, "draft": 9}).tolist() == [1 + 3]
    assert bm.pages_needed(np.array([0, 1]), {"target": np.array([8, 8])}).tolist() == [1, 2]
    short = bm.shortfall(np.array([0, 1]), {"target": 8, "draft": 1})
    assert {m: c.tolist() for m, c in short.items()} == {"target": [1, 2], "draft": [1, 1]}


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(5, 2, MODELS)
    bm.allocate(one(0), {"target": 2, "draft": 2})
    tables = {m: list(bm.page_table(0, m)) for m in MODELS}
    # target would fit (2 more pages), draft too on its own, but not both: nothing changes
    with pytest.raises(OutOfPagesError, match="1 rows need 4 pages, 3 free"):
        bm.allocate(one(0), {"target": 6, "draft": 6})
    assert {m: bm.page_table(0, m) for m in MODELS} == tables
    assert bm.num_free_pages == 3
    with pytest.raises(OutOfPagesError):
        bm.allocate(np.array([1, 2]), {"target": 2, "draft": 2})
    assert bm.page_table(1) == [] and bm.page_table(2, "draft") == []
    assert bm.num_free_pages == 3
    bm.check_invariants()


def test_lifo_reuse_of_freed_pages() -> None:
    bm = BlockManager(8, 4)
    bm.allocate(one(0), {"target": 12})
    assert bm.page_table(0) == [0, 1, 2]
    pages = list(bm.page_table(0))
    assert bm.free([0]) == 3
    bm.allocate(one(1), {"target": 12})
    assert bm.page_table(1) == pages  # freed pages come back first, in table order


def test_trim_frees_exactly_the_pages_beyond_the_kept_length() -> None:
    bm = BlockManager(10, 4, MODELS)
    bm.allocate(one(0), {"target": 17, "draft": 8})  # target 5 pages, draft 2
    table = list(bm.page_table(0))
    assert bm.trim(one(0), "target", 9) == 2  # 9 slots -> 3 pages kept
    assert bm.page_table(0) == table[:3]
    assert bm.num_free_pages == 10 - 3 - 2
    assert bm.trim(one(0), "target", 12) == 0  # exactly 3 pages
    assert bm.trim(one(0), "target", 100) == 0  # never grows
    assert bm.page_table(0) == table[:3]
    assert len(bm.page_table(0, "draft")) == 2  # other model untouched
    assert bm.trim(one(0), "target", 0) == 3
    assert bm.page_table(0) == []
    assert bm.trim(one(0), "target", 0) == 0
    assert bm.trim(one(1), "draft", 0) == 0
    # trimmed pages are immediately reusable
    bm.allocate(one(1), {"target": 4 * 8})
    bm.check_invariants()
    assert bm.num_free_pages == 0


def test_free_is_idempotent_and_covers_every_model() -> None:
    bm = BlockManager(6, 2, MODELS)
    bm.allocate(one(0), {"target": 3, "draft": 4})
    assert bm.free([0]) == 4
    assert bm.free([0]) == 0
    assert bm.num_free_pages == 6
    assert bm.page_table(0) == [] and bm.page_table(0, "draft") == []


def test_unknown_model_is_a_clear_error() -> None:
    bm = BlockManager(4, 2)
    with pytest.raises(ValueError, match=r"unknown model 'draft'; this pool has tables for \('target',\)"):
        bm.allocate(one(0), {"draft": 2})
    with pytest.raises(ValueError, match="unknown model 'mtp'"):
        bm.page_table(0, "mtp")
    with pytest.raises(ValueError, match="unknown model 'mtp'"):
        bm.trim(one(0), "mtp", 0)
    assert bm.num_free_pages == 4


def test_stats_count_pages_by_model_and_request() -> None:
    bm = BlockManager(10, 2, MODELS)
    bm.allocate(np.array([0, 5]), {"target": np.array([3, 1]), "draft": np.array([4, 0])})
    s = bm.stats({"a": 0, "b": 5, "c": 9})
    assert (s.num_used_pages, s.num_free_pages) == (5, 5)
    assert s.used_pages_by_model == {"target": 3, "draft": 2}
    assert s.pages_by_request == {"a": {"target": 2, "draft": 2}, "b": {"target": 1}}


def test_check_invariants_detects_leaks_and_double_frees() -> None:
    bm = BlockManager(4, 2)
    bm.allocate(one(0), {"target": 4})
    bm._stack[bm._top] = bm.page_table(0)[0]  # double reference: a held page also free
    bm._top += 1
    with pytest.raises(AssertionError, match="page leak or double free"):
        bm.check_invariants()
    bm = BlockManager(4, 2)
    bm._top -= 1  # leaked page
    with pytest.raises(AssertionError, match="page leak or double free"):
        bm.check_invariants()
    bm = BlockManager(3, 2)
    bm._stack[0] = 7  # a page id outside the pool
    with pytest.raises(AssertionError, match="page leak or double free"):
        bm.check_invariants()


# -- stateful property test -------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a small pool shared by "target" and "draft" through random request lives (a request
    a row) and keeps its own model: the number of pages each (row, model) table must hold."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.page_size = 1
        self.bm = BlockManager(1, 1, MODELS)
        self.expected: dict[tuple[int, str], int] = {}
        self.next_row = 0

    @initialize(num_pages=st.integers(1, 24), page_size=st.integers(1, 5))
    def configure(self, num_pages: int, page_size: int) -> None:
        self.bm = BlockManager(num_pages, page_size, MODELS)
        self.page_size = page_size

    def _pages(self, slots: int) -> int:
        return -(-slots // self.page_size)

    def _used(self) -> int:
        return sum(self.expected.values())

    def _snapshot(self) -> dict:
        return {(row, m): list(self.bm.page_table(row, m)) for row in range(self.next_row) for m in MODELS}

    def _grow(self, row: int, target: int, draft: int) -> None:
        slots = {"target": target, "draft": draft}
        need = sum(max(0, self._pages(n) - self.expected.get((row, m), 0)) for m, n in slots.items())
        assert self.bm.pages_needed(one(row), slots).tolist() == [need]
        before = self._snapshot()
        if need > self.bm.num_pages - self._used():
            with pytest.raises(OutOfPagesError):
                self.bm.allocate(one(row), slots)
            assert self._snapshot() == before  # all or nothing
            return
        self.bm.allocate(one(row), slots)
        for m, n in slots.items():
            old = before.get((row, m), [])
            assert self.bm.page_table(row, m)[: len(old)] == old  # growth appends only
            self.expected[(row, m)] = max(self.expected.get((row, m), 0), self._pages(n))

    @rule(target=requests, prompt=st.integers(1, 40))
    def allocate(self, prompt: int) -> int:
        row = self.next_row
        self.next_row += 1
        self._grow(row, prompt, prompt + 1)
        return row

    @rule(row=requests, extra=st.integers(0, 12))
    def append(self, row: int, extra: int) -> None:
        have = len(self.bm.page_table(row)) * self.page_size
        self._grow(row, have + extra, have + extra + 1)

    @rule(row=requests, model=st.sampled_from(MODELS), keep=st.integers(0, 60))
    def trim(self, row: int, model: str, keep: int) -> None:
        had = self.expected.get((row, model), 0)
        kept_pages = min(had, self._pages(keep))
        table = list(self.bm.page_table(row, model))
        free_before = self.bm.num_free_pages
        assert self.bm.trim(one(row), model, keep) == had - kept_pages
        assert self.bm.page_table(row, model) == table[:kept_pages]
        assert self.bm.num_free_pages == free_before + had - kept_pages
        if had:
            self.expected[(row, model)] = kept_pages

    @rule(row=requests)
    def finish(self, row: int) -> None:
        held = sum(self.expected.pop((row, m), 0) for m in MODELS)
        assert self.bm.free([row]) == held
        assert self.bm.free([row]) == 0  # idempotent
        assert all(self.bm.page_table(row, m) == [] for m in MODELS)

    @rule(row=requests, recompute=st.integers(1, 40))
    def preempt_and_recompute(self, row: int, recompute: int) -> None:
        self.finish(row)
        self._grow(row, recompute, recompute + 1)

    @invariant()
    def accounting_matches_the_model(self) -> None:
        self.bm.check_invariants()
        assert self.bm.num_used_pages == self._used()
        assert self.bm.num_free_pages == self.bm.num_pages - self._used()
        for (row, m), n in self.expected.items():
            assert len(self.bm.page_table(row, m)) == n

    def teardown(self) -> None:
        self.bm.free(list(range(self.next_row)))
        self.bm.check_invariants()
        assert self.bm.num_free_pages == self.bm.num_pages


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None
)


# -- whole-array paths against row by row ------------------------------------------------------

# up to 20 rows: both the row-by-row (up to SMALL_BATCH rows) and the whole-array paths
batches = st.lists(st.tuples(st.integers(0, 23), st.integers(0, 30), st.integers(0, 30)),
                   min_size=1, max_size=20, unique_by=lambda t: t[0])


def next_pages(bm: BlockManager) -> list[int]:
    """The order the pool hands out its free pages (all taken by a row of their own)."""
    bm.allocate(one(99), {"target": bm.num_free_pages * bm.page_size})
    return bm.page_table(99)


def row_by_row(bm: BlockManager, rows, slots: dict) -> None:
    for i, r in enumerate(rows):
        bm.allocate(one(r), {m: int(n[i]) for m, n in slots.items()})


@settings(max_examples=200, deadline=None, database=None)
@given(history=st.lists(st.tuples(st.integers(0, 23), st.integers(0, 20)), max_size=10), batch=batches,
       num_pages=st.integers(4, 40))
def test_allocate_gives_the_pages_of_row_by_row_allocation(history, batch, num_pages) -> None:
    single, many = BlockManager(num_pages, 4, MODELS), BlockManager(num_pages, 4, MODELS)
    for bm in (single, many):  # the same earlier allocations and frees in both
        for r, n in history:
            if n == 0:
                bm.free([r])
            elif not bm.pages_needed(one(r), {"target": n, "draft": n + 1})[0] > bm.num_free_pages:
                bm.allocate(one(r), {"target": n, "draft": n + 1})
    rows = np.array([r for r, _, _ in batch])
    slots = {"target": np.array([t for _, t, _ in batch]), "draft": np.array([d for _, _, d in batch])}
    need = many.pages_needed(rows, slots)
    assert need.tolist() == [int(single.pages_needed(one(r), {"target": t, "draft": d})[0]) for r, t, d in batch]
    before = {(r, m): many.page_table(r, m) for r in rows.tolist() for m in MODELS}
    if int(need.sum()) > many.num_free_pages:
        with pytest.raises(OutOfPagesError):
            many.allocate(rows, slots)
        assert {(r, m): many.page_table(r, m) for r in rows.tolist() for m in MODELS} == before
        return
    many.allocate(rows, slots)
    row_by_row(single, rows.tolist(), slots)
    for r in rows.tolist():
        for m in MODELS:
            assert many.page_table(r, m) == single.page_table(r, m)
    tables, counts = many.tables("target", rows)
    assert [tables[i, : counts[i]].tolist() for i in range(len(rows))] == [single.page_table(r) for r in rows.tolist()]
    assert many.num_free_pages == single.num_free_pages
    many.check_invariants()


@settings(max_examples=100, deadline=None, database=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=9, max_size=30), grow=st.data())
def test_a_decode_steps_one_page_growth_gives_the_pages_of_row_by_row_allocation(sizes, grow) -> None:
    """The steady state's path: more than a handful of rows, each short of at most one page
    per model (a decode step's few new slots)."""
    single, many = BlockManager(400, 4, MODELS), BlockManager(400, 4, MODELS)
    rows = list(range(len(sizes)))
    for bm in (single, many):
        row_by_row(bm, rows, {"target": sizes, "draft": [n + 1 for n in sizes]})
    # each row grows by up to 4 slots (at most one page of 4), the draft model one slot ahead
    ends = np.array([n + grow.draw(st.integers(0, 4)) for n in sizes])
    many.allocate(np.array(rows), {"target": ends, "draft": ends + 1})
    row_by_row(single, rows, {"target": ends, "draft": ends + 1})
    for r in rows:
        for m in MODELS:
            assert many.page_table(r, m) == single.page_table(r, m)
    assert many.num_free_pages == single.num_free_pages
    many.check_invariants()


@settings(max_examples=200, deadline=None, database=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=20),
       picks=st.lists(st.integers(0, 19), min_size=1, max_size=20, unique=True))
def test_free_frees_what_freeing_row_by_row_frees(sizes, picks) -> None:
    single, many = BlockManager(400, 3, MODELS), BlockManager(400, 3, MODELS)
    rows = [(7 * i) % 20 for i in range(len(sizes))]  # rows out of order
    for bm in (single, many):
        row_by_row(bm, rows, {"target": [t for t, _ in sizes], "draft": [d for _, d in sizes]})
    freed = [rows[i] for i in picks if i < len(sizes)]
    if not freed:
        return
    assert many.free(freed) == sum(single.free([r]) for r in freed)
    assert next_pages(many) == next_pages(single)  # the free pages come back in the same order
    for r in rows:
        for m in MODELS:
            assert many.page_table(r, m) == single.page_table(r, m)
    many.check_invariants()
    assert many.free(freed + [50]) == 0  # idempotent; a row never used frees nothing


@pytest.mark.parametrize("num_rows", [6, 20])
@pytest.mark.parametrize("model", ["target", "draft"])
def test_trim_on_few_and_many_rows_frees_what_row_by_row_trims_free(model, num_rows) -> None:
    rng = np.random.default_rng(num_rows)
    sizes = [int(n) for n in rng.integers(10, 40, 24)]
    keep = [int(n) for n in rng.integers(0, 9, 24)]  # most rows give pages back
    single, many = (BlockManager(1000, 3, MODELS) for _ in range(2))
    for bm in (single, many):
        row_by_row(bm, (5 * np.arange(24) % 24).tolist(), {"target": sizes, "draft": [n + 1 for n in sizes]})
    rows = np.array(rng.permutation(24)[:num_rows])
    freed = sum(single.trim(one(i), model, keep[i]) for i in rows.tolist())
    assert many.trim(rows, model, np.array([keep[i] for i in rows.tolist()])) == freed
    for i in range(24):
        assert many.page_table(i, model) == single.page_table(i, model)
    assert next_pages(many) == next_pages(single)  # the free pages come back in the same order
    many.check_invariants()
