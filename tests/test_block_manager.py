"""Tests for specsched.scheduler.block_manager: page accounting, all-or-nothing allocation, trimming,
and a stateful property test of random allocate/append/trim/free/abort/preempt sequences."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from specsched.scheduler.block_manager import BlockManager, OutOfPagesError

MODELS = ("target", "draft")


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
    assert bm.page_table("a") == [] and bm.num_slots("a") == 0
    bm.allocate("a", {"target": 5, "draft": 6})
    assert len(bm.page_table("a")) == 2 and len(bm.page_table("a", "draft")) == 2
    assert bm.num_free_pages == 6 and bm.num_used_pages == 4
    before = list(bm.page_table("a"))
    bm.allocate("a", {"target": 9})  # growing an existing table
    assert bm.page_table("a")[:2] == before  # existing pages keep their place
    assert len(bm.page_table("a")) == 3 and bm.num_slots("a") == 12
    bm.allocate("a", {"target": 1, "draft": 0})  # smaller: no-op
    assert len(bm.page_table("a")) == 3 and len(bm.page_table("a", "draft")) == 2
    assert bm.num_free_pages == 5
    bm.check_invariants()


def test_pages_needed_and_can_allocate_count_only_missing_pages() -> None:
    bm = BlockManager(6, 4, MODELS)
    bm.allocate("a", {"target": 4})
    assert bm.pages_needed("a", {"target": 8, "draft": 9}) == 1 + 3
    assert bm.can_allocate("a", {"target": 8, "draft": 9})
    assert not bm.can_allocate("a", {"target": 8, "draft": 9}, reserve_pages=2)
    assert bm.can_allocate("a", {"target": 24})
    assert not bm.can_allocate("a", {"target": 25})


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(5, 2, MODELS)
    bm.allocate("a", {"target": 2, "draft": 2})
    tables = {m: list(bm.page_table("a", m)) for m in MODELS}
    # target would fit (2 more pages), draft too on its own, but not both: nothing changes
    with pytest.raises(OutOfPagesError, match="request a: needs 4 pages, 3 free"):
        bm.allocate("a", {"target": 6, "draft": 6})
    assert {m: bm.page_table("a", m) for m in MODELS} == tables
    assert bm.num_free_pages == 3
    with pytest.raises(OutOfPagesError):
        bm.allocate("b", {"target": 4, "draft": 4})
    assert bm.page_table("b") == [] and bm.page_table("b", "draft") == []
    assert bm.num_free_pages == 3
    bm.check_invariants()


def test_lifo_reuse_of_freed_pages() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("a", {"target": 12})
    assert bm.page_table("a") == [0, 1, 2]
    pages = list(bm.page_table("a"))
    assert bm.free("a") == 3
    bm.allocate("b", {"target": 12})
    assert bm.page_table("b") == pages  # freed pages come back first, in table order


def test_trim_frees_exactly_the_pages_beyond_the_kept_length() -> None:
    bm = BlockManager(10, 4, MODELS)
    bm.allocate("a", {"target": 17, "draft": 8})  # target 5 pages, draft 2
    table = list(bm.page_table("a"))
    assert bm.trim("a", "target", 9) == 2  # 9 slots -> 3 pages kept
    assert bm.page_table("a") == table[:3]
    assert bm.num_free_pages == 10 - 3 - 2
    assert bm.trim("a", "target", 12) == 0  # exactly 3 pages
    assert bm.trim("a", "target", 100) == 0  # never grows
    assert bm.page_table("a") == table[:3]
    assert len(bm.page_table("a", "draft")) == 2  # other model untouched
    assert bm.trim("a", "target", 0) == 3
    assert bm.page_table("a") == []
    assert bm.trim("a", "target", 0) == 0
    assert bm.trim("nobody", "draft", 0) == 0
    # trimmed pages are immediately reusable
    bm.allocate("b", {"target": 4 * 8})
    bm.check_invariants()
    assert bm.num_free_pages == 0


def test_trim_rejects_negative_lengths() -> None:
    bm = BlockManager(4, 1)
    bm.allocate("a", {"target": 3})
    with pytest.raises(ValueError, match="cannot trim to -1 slots"):
        bm.trim("a", "target", -1)
    assert len(bm.page_table("a")) == 3


def test_free_is_idempotent_and_covers_every_model() -> None:
    bm = BlockManager(6, 2, MODELS)
    bm.allocate("a", {"target": 3, "draft": 4})
    assert bm.free("a") == 4
    assert bm.free("a") == 0
    assert bm.num_free_pages == 6
    assert bm.page_table("a") == [] and bm.page_table("a", "draft") == []


def test_unknown_model_is_a_clear_error() -> None:
    bm = BlockManager(4, 2)
    with pytest.raises(ValueError, match=r"unknown model 'draft'; this pool has tables for \('target',\)"):
        bm.allocate("a", {"draft": 2})
    with pytest.raises(ValueError, match="unknown model 'mtp'"):
        bm.page_table("a", "mtp")
    with pytest.raises(ValueError, match="unknown model 'mtp'"):
        bm.trim("a", "mtp", 0)
    assert bm.num_free_pages == 4


def test_check_invariants_detects_leaks_and_double_frees() -> None:
    bm = BlockManager(4, 2)
    bm.allocate("a", {"target": 4})
    bm._stack[bm._top] = bm.page_table("a")[0]  # double reference: a held page also free
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
    """Drives a small pool shared by "target" and "draft" through random request lives and
    keeps its own model: the number of pages each (request, model) table must hold."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.page_size = 1
        self.bm = BlockManager(1, 1, MODELS)
        self.expected: dict[tuple[str, str], int] = {}
        self.next_id = 0

    @initialize(num_pages=st.integers(1, 24), page_size=st.integers(1, 5))
    def configure(self, num_pages: int, page_size: int) -> None:
        self.bm = BlockManager(num_pages, page_size, MODELS)
        self.page_size = page_size

    def _pages(self, slots: int) -> int:
        return -(-slots // self.page_size)

    def _used(self) -> int:
        return sum(self.expected.values())

    def _snapshot(self) -> dict:
        return {
            (rid, m): list(self.bm.page_table(rid, m))
            for rid in {r for r, _ in self.expected} | {f"r{i}" for i in range(self.next_id)}
            for m in MODELS
        }

    def _grow(self, rid: str, target: int, draft: int) -> None:
        slots = {"target": target, "draft": draft}
        need = sum(
            max(0, self._pages(n) - self.expected.get((rid, m), 0)) for m, n in slots.items()
        )
        assert self.bm.pages_needed(rid, slots) == need
        fits = need <= self.bm.num_pages - self._used()
        assert self.bm.can_allocate(rid, slots) == fits
        before = self._snapshot()
        if not fits:
            with pytest.raises(OutOfPagesError):
                self.bm.allocate(rid, slots)
            assert self._snapshot() == before  # all or nothing
            return
        self.bm.allocate(rid, slots)
        for m, n in slots.items():
            old = before.get((rid, m), [])
            assert self.bm.page_table(rid, m)[: len(old)] == old  # growth appends only
            self.expected[(rid, m)] = max(self.expected.get((rid, m), 0), self._pages(n))

    @rule(target=requests, prompt=st.integers(1, 40))
    def allocate(self, prompt: int) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self._grow(rid, prompt, prompt + 1)
        return rid

    @rule(rid=requests, extra=st.integers(0, 12))
    def append(self, rid: str, extra: int) -> None:
        have = self.bm.num_slots(rid, "target")
        self._grow(rid, have + extra, have + extra + 1)

    @rule(rid=requests, model=st.sampled_from(MODELS), keep=st.integers(0, 60))
    def trim(self, rid: str, model: str, keep: int) -> None:
        had = self.expected.get((rid, model), 0)
        kept_pages = min(had, self._pages(keep))
        table = list(self.bm.page_table(rid, model))
        free_before = self.bm.num_free_pages
        assert self.bm.trim(rid, model, keep) == had - kept_pages
        assert self.bm.page_table(rid, model) == table[:kept_pages]
        assert self.bm.num_free_pages == free_before + had - kept_pages
        if had:
            self.expected[(rid, model)] = kept_pages

    def _release(self, rid: str) -> None:
        held = sum(self.expected.pop((rid, m), 0) for m in MODELS)
        assert self.bm.free(rid) == held
        assert self.bm.free(rid) == 0  # idempotent
        for m in MODELS:
            assert self.bm.page_table(rid, m) == []

    @rule(rid=requests)
    def finish(self, rid: str) -> None:
        self._release(rid)

    @rule(rid=requests)
    def abort(self, rid: str) -> None:
        self._release(rid)

    @rule(rid=requests, recompute=st.integers(1, 40))
    def preempt_and_recompute(self, rid: str, recompute: int) -> None:
        self._release(rid)
        self._grow(rid, recompute, recompute + 1)

    @invariant()
    def accounting_matches_the_model(self) -> None:
        self.bm.check_invariants()
        assert self.bm.num_used_pages == self._used()
        assert self.bm.num_free_pages == self.bm.num_pages - self._used()
        for (rid, m), n in self.expected.items():
            assert len(self.bm.page_table(rid, m)) == n
            assert self.bm.num_slots(rid, m) == n * self.page_size

    def teardown(self) -> None:
        for rid in {r for r, _ in self.expected}:
            self.bm.free(rid)
        self.bm.check_invariants()
        assert self.bm.num_free_pages == self.bm.num_pages


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None
)


# -- whole-batch operations against the one-row ones -------------------------------------------

# up to 20 rows: both the row-by-row (up to SMALL_BATCH rows) and the whole-array paths
batches = st.lists(st.tuples(st.integers(0, 23), st.integers(0, 30), st.integers(0, 30)),
                   min_size=1, max_size=20, unique_by=lambda t: t[0])


@settings(max_examples=200, deadline=None, database=None)
@given(history=st.lists(st.tuples(st.integers(0, 23), st.integers(0, 20)), max_size=10), batch=batches,
       num_pages=st.integers(4, 40))
def test_allocate_many_gives_the_pages_of_row_by_row_allocation(history, batch, num_pages) -> None:
    one, many = BlockManager(num_pages, 4, MODELS), BlockManager(num_pages, 4, MODELS)
    for bm in (one, many):  # the same earlier allocations and frees in both
        for r, n in history:
            if n == 0:
                bm.free(f"r{r}")
            elif bm.can_allocate(f"r{r}", {"target": n, "draft": n + 1}):
                bm.allocate(f"r{r}", {"target": n, "draft": n + 1})
    rids = [f"r{r}" for r, _, _ in batch]
    slots = {"target": np.array([t for _, t, _ in batch]), "draft": np.array([d for _, _, d in batch])}
    rows = many.rows(rids)
    need = many.pages_needed_many(rows, slots)
    assert need.tolist() == [one.pages_needed(r, {"target": t, "draft": d}) for r, (_, t, d) in zip(rids, batch)]
    before = {(r, m): many.page_table(r, m) for r in rids for m in MODELS}
    if int(need.sum()) > many.num_free_pages:
        with pytest.raises(OutOfPagesError):
            many.allocate_many(rows, slots)
        assert {(r, m): many.page_table(r, m) for r in rids for m in MODELS} == before
        return
    many.allocate_many(rows, slots)
    for r, (_, t, d) in zip(rids, batch):
        one.allocate(r, {"target": t, "draft": d})
    for r in rids:
        for m in MODELS:
            assert many.page_table(r, m) == one.page_table(r, m)
    tables, counts = many.tables("target", rows)
    assert [tables[i, : counts[i]].tolist() for i in range(len(rids))] == [one.page_table(r) for r in rids]
    assert many.num_free_pages == one.num_free_pages
    many.check_invariants()


@settings(max_examples=100, deadline=None, database=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=9, max_size=30), grow=st.data())
def test_a_decode_steps_one_page_growth_gives_the_pages_of_row_by_row_allocation(sizes, grow) -> None:
    """The steady state's path: more than a handful of rows, each short of at most one page
    per model (a decode step's few new slots)."""
    one, many = BlockManager(400, 4, MODELS), BlockManager(400, 4, MODELS)
    for bm in (one, many):
        for i, n in enumerate(sizes):
            bm.allocate(f"r{i}", {"target": n, "draft": n + 1})
    # each row grows by up to 4 slots (at most one page of 4), the draft model one slot ahead
    ends = [n + grow.draw(st.integers(0, 4)) for n in sizes]
    rids = [f"r{i}" for i in range(len(sizes))]
    rows = many.rows(rids)
    many.allocate_many(rows, {"target": np.array(ends), "draft": np.array(ends) + 1})
    for r, e in zip(rids, ends):
        one.allocate(r, {"target": e, "draft": e + 1})
    for r in rids:
        for m in MODELS:
            assert many.page_table(r, m) == one.page_table(r, m)
    assert many.num_free_pages == one.num_free_pages
    many.check_invariants()


@settings(max_examples=200, deadline=None, database=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=20),
       picks=st.lists(st.integers(0, 19), min_size=1, max_size=20, unique=True))
def test_free_many_frees_what_freeing_one_by_one_frees(sizes, picks) -> None:
    one, many = BlockManager(400, 3, MODELS), BlockManager(400, 3, MODELS)
    for bm in (one, many):
        for i, (t, d) in enumerate(sizes):
            bm.bind(f"r{i}", (7 * i) % 20)
            bm.allocate(f"r{i}", {"target": t, "draft": d})
    rids = [f"r{i}" for i in picks if i < len(sizes)]
    if not rids:
        return
    assert many.free_many(rids) == sum(one.free(rid) for rid in rids)
    assert many._stack[: many.num_free_pages].tolist() == one._stack[: one.num_free_pages].tolist()
    for i in range(len(sizes)):
        for m in MODELS:
            assert many.page_table(f"r{i}", m) == one.page_table(f"r{i}", m)
    many.check_invariants()
    assert many.free_many(rids + ["never-seen"]) == 0  # idempotent, an unknown id frees nothing


@pytest.mark.parametrize("num_rows", [6, 20])
@pytest.mark.parametrize("model", ["target", "draft"])
def test_trim_many_on_few_and_many_rows_frees_what_row_by_row_trims_free(model, num_rows) -> None:
    rng = np.random.default_rng(num_rows)
    sizes = [int(n) for n in rng.integers(10, 40, 24)]
    keep = [int(n) for n in rng.integers(0, 9, 24)]  # most rows give pages back
    one, many = (BlockManager(1000, 3, MODELS) for _ in range(2))
    for bm in (one, many):
        for i in (5 * np.arange(24) % 24).tolist():  # rows bound out of order
            bm.bind(f"r{i}", i)
        for i in range(24):
            bm.allocate(f"r{i}", {"target": sizes[i], "draft": sizes[i] + 1})
    rows = np.array(rng.permutation(24)[:num_rows])
    freed = sum(one.trim(f"r{i}", model, keep[i]) for i in rows.tolist())
    assert many.trim_many(rows, model, np.array([keep[i] for i in rows.tolist()])) == freed
    for i in range(24):
        assert many.page_table(f"r{i}", model) == one.page_table(f"r{i}", model)
    assert many._stack[: many.num_free_pages].tolist() == one._stack[: one.num_free_pages].tolist()
    many.check_invariants()
