"""Paged KV block manager: one pool of pages, one page table per (request, model).

Why: target and draft (or MTP head) caches are allocated from one pool so KV pressure is
shared, as in production engines; each model's cache tensor has `num_pages` pages and a page
id means the same page index in whichever model's cache its table belongs to.

Check/act pairs: `can_allocate` / `allocate` grow tables to cover a number of KV slots
(prefill, decode, or the D+1 slots a verification needs); `trim` releases slots beyond a
length (rejected drafts); `free` releases everything of a request (finish, abort, preempt).

State is arrays, so that a step over hundreds of rows is a few whole-array operations
(`tables`; `pages_needed_many`, `allocate_many`, `trim_many`, `free_many` in
scheduler/block_batch_ops.py): per model a page table
`[rows, max_pages]` (int32) with a page count per row, and the free pages as an array stack
(LIFO: recently freed pages are reused first, which keeps a cache warm). A request's row is
its slot: the scheduler `bind`s it when the request is added (rows are then the same
indices as the scheduler's per-slot arrays, scheduler/slot_state.py) and the whole-array
methods take rows; the methods keyed by request id serve the general path and tests, and
give a row of their own to an id that was never bound (a manager used on its own).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specsched.scheduler.block_batch_ops import BatchPageOps
from specsched.scheduler.errors import OutOfPagesError


@dataclass(frozen=True)
class KVPoolStats:
    """A read-only snapshot of the page pool (`AsyncEngine.kv_stats()`)."""

    page_size: int  # KV slots per page
    num_pages: int  # pages in the pool, shared by every model's cache
    num_free_pages: int
    num_used_pages: int
    used_pages_by_model: dict[str, int]  # model ("target", "draft", "mtp") -> pages in its tables
    pages_by_request: dict[str, dict[str, int]]  # request id -> model -> pages it holds


class BlockManager(BatchPageOps):
    def __init__(self, num_pages: int, page_size: int, models: tuple[str, ...] = ("target",)):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.models = models
        # free pages, the next to hand out at the top (the end): the stack starts with page 0 on top
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_pages
        self.version = 0  # bumped whenever pages change hands (a plan of shortfalls goes stale)
        self._row_of: dict[str, int] = {}  # request id -> its row in every model's table
        self._owner: dict[int, str] = {}  # row -> request id
        self._free_rows: list[int] = []  # rows `_new_row` gave out and got back
        self._bound: set[int] = set()  # rows given by `bind` (the caller owns their reuse)
        self._num_rows = 0  # rows ever handed out (the tables' used height)
        rows, cols = 8, min(num_pages, 16)
        self._tables = {m: np.zeros((rows, cols), dtype=np.int32) for m in models}  # [rows, max_pages]
        self._counts = {m: np.zeros(rows, dtype=np.int64) for m in models}  # [rows] pages per row

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self._top

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self._top

    def pages_for(self, num_slots: int) -> int:
        return (num_slots + self.page_size - 1) // self.page_size

    def _model_counts(self, model: str) -> np.ndarray:
        try:
            return self._counts[model]
        except KeyError:
            raise ValueError(f"unknown model {model!r}; this pool has tables for {self.models}") from None

    def page_table(self, request_id: str, model: str = "target") -> list[int]:
        counts = self._model_counts(model)
        row = self._row_of.get(request_id)
        if row is None:
            return []
        return self._tables[model][row, : counts[row]].tolist()

    def num_slots(self, request_id: str, model: str = "target") -> int:
        counts = self._model_counts(model)
        row = self._row_of.get(request_id)
        return 0 if row is None else int(counts[row]) * self.page_size

    def pages_needed(self, request_id: str, slots: Mapping[str, int]) -> int:
        row = self._row_of.get(request_id)
        ps = self.page_size
        need = 0
        for model, n in slots.items():
            counts = self._model_counts(model)
            short = (n + ps - 1) // ps - (int(counts[row]) if row is not None else 0)
            if short > 0:
                need += short
        return need

    def bind(self, request_id: str, row: int) -> None:
        """Make `row` the request's row in every model's table (the request's slot)."""
        owner = self._owner.get(row)
        if owner is not None and owner != request_id:
            raise ValueError(f"row {row} is bound to request {owner!r}")
        if request_id in self._row_of and self._row_of[request_id] != row:
            raise ValueError(f"request {request_id!r} is bound to row {self._row_of[request_id]}")
        self._ensure_height(row + 1)
        self._num_rows = max(self._num_rows, row + 1)
        if self._free_rows and row in self._free_rows:
            self._free_rows.remove(row)
        self._bound.add(row)
        self._row_of[request_id] = row
        self._owner[row] = request_id

    def rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """[B] each request's row in the tables (a row is given to a request that has none)."""
        row_of = self._row_of
        return np.fromiter((row_of[r] if r in row_of else self._new_row(r) for r in request_ids),
                           dtype=np.int64, count=len(request_ids))

    def tables(self, model: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([B, max_pages] page tables, [B] page counts) of `rows`: copies, padded past each
        row's count with pages that are not the row's."""
        counts = self._model_counts(model)
        return self._tables[model][rows], counts[rows]

    def table_of(self, model: str) -> tuple[np.ndarray, np.ndarray]:
        """(the [rows, max_pages] page table, [rows] page counts) of `model` itself, for
        readers that gather their rows from it (`build_plan`'s `table_rows`); not to be
        written to."""
        return self._tables[model], self._model_counts(model)

    # -- check / act -----------------------------------------------------------------------
    def can_allocate(self, request_id: str, slots: Mapping[str, int], *, reserve_pages: int = 0) -> bool:
        """Could every model's table of `request_id` cover slots[model] KV slots?"""
        return self.pages_needed(request_id, slots) + reserve_pages <= self._top

    def allocate(self, request_id: str, slots: Mapping[str, int]) -> None:
        """Grow tables so each covers slots[model] slots (never shrinks). All or nothing."""
        need = self.pages_needed(request_id, slots)
        if need > self._top:
            raise OutOfPagesError(f"request {request_id}: needs {need} pages, {self._top} free")
        if not need:
            return
        row = self._row_of.get(request_id)
        if row is None:
            row = self._new_row(request_id)
        ps = self.page_size
        for model, n in slots.items():
            counts = self._counts[model]
            have = int(counts[row])
            short = (n + ps - 1) // ps - have
            if short > 0:
                table = self._table_with_room(model, have + short)
                # the pages in the order popping them one at a time gives
                table[row, have : have + short] = self._stack[self._top - short : self._top][::-1]
                self._top -= short
                self.version += 1
                counts[row] = have + short

    def trim(self, request_id: str, model: str, num_slots: int) -> int:
        """Release pages wholly beyond `num_slots` (rejected draft slots). Returns pages freed."""
        if num_slots < 0:
            raise ValueError(f"request {request_id}: cannot trim to {num_slots} slots")
        counts = self._model_counts(model)
        row = self._row_of.get(request_id)
        if row is None:
            return 0
        have, keep = int(counts[row]), self.pages_for(num_slots)
        if keep >= have:
            return 0
        self._push(self._tables[model][row, keep:have])
        counts[row] = keep
        return have - keep

    def release_pages(self, request_id: str) -> int:
        """Release every page of the request in every model, keeping its row (preemption:
        the request keeps its slot). Returns pages freed."""
        row = self._row_of.get(request_id)
        if row is None:
            return 0
        n = 0
        for model in self.models:
            have = int(self._counts[model][row])
            if have:
                self._push(self._tables[model][row, :have])
                self._counts[model][row] = 0
                n += have
        return n

    def free(self, request_id: str) -> int:
        """Release every page of the request in every model, and its row. Idempotent."""
        n = self.release_pages(request_id)
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._drop_row(row)
        return n

    def _drop_row(self, row: int) -> None:
        """A freed request's row: unowned, and back to the pool of rows unless `bind` gave it."""
        del self._owner[row]
        if row in self._bound:
            self._bound.discard(row)
        else:
            self._free_rows.append(row)

    def stats(self) -> KVPoolStats:
        by_request: dict[str, dict[str, int]] = {}
        for rid, row in self._row_of.items():
            held = {m: int(self._counts[m][row]) for m in self.models if self._counts[m][row]}
            if held:
                by_request[rid] = held
        return KVPoolStats(
            page_size=self.page_size, num_pages=self.num_pages, num_free_pages=self.num_free_pages,
            num_used_pages=self.num_used_pages,
            used_pages_by_model={m: int(self._counts[m][: self._num_rows].sum()) for m in self.models},
            pages_by_request=by_request,
        )

    def check_invariants(self) -> None:
        """Every page is either free or in exactly one table (tests, debugging)."""
        seen = [self._stack[: self._top]]
        for model in self.models:
            counts = self._counts[model]
            for row in self._row_of.values():
                seen.append(self._tables[model][row, : counts[row]])
            held = set(self._row_of.values())
            if any(counts[r] for r in range(self._num_rows) if r not in held):
                raise AssertionError(f"page leak: a released row still counts pages in {model}")
        pages = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int32)
        if pages.size != self.num_pages or not np.array_equal(np.sort(pages), np.arange(self.num_pages)):
            raise AssertionError(f"page leak or double free: {pages.size} refs, {np.unique(pages).size} unique")

    # -- internals -----------------------------------------------------------------------------
    def _new_row(self, request_id: str) -> int:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._num_rows
            self._num_rows += 1
            self._ensure_height(row + 1)
        self._row_of[request_id] = row
        self._owner[row] = request_id
        return row

    def _ensure_height(self, rows: int) -> None:
        height = self._counts[self.models[0]].shape[0]
        if rows > height:
            new = max(rows, 2 * height)
            for m in self.models:
                t = np.zeros((new, self._tables[m].shape[1]), dtype=np.int32)
                t[:height] = self._tables[m]
                c = np.zeros(new, dtype=np.int64)
                c[:height] = self._counts[m]
                self._tables[m], self._counts[m] = t, c

    def _table_with_room(self, model: str, num_pages: int) -> np.ndarray:
        table = self._tables[model]
        if num_pages > table.shape[1]:
            wider = np.zeros((table.shape[0], min(self.num_pages, max(num_pages, 2 * table.shape[1]))),
                             dtype=np.int32)
            wider[:, : table.shape[1]] = table
            table = self._tables[model] = wider
        return table

    def _push(self, pages: np.ndarray) -> None:
        """Return pages to the pool so that popping gives them back in their order."""
        k = pages.shape[0]
        self._stack[self._top : self._top + k] = pages[::-1]
        self._top += k
        self.version += 1
