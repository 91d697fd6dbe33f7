"""Paged KV block manager: one pool of pages, per model a page table.

Target and proposer (draft model, MTP head) caches share one pool, so KV pressure is shared as
in production engines: page id p is page p of whichever model's cache holds it. Each model's
table is `[rows, max_pages]` (int32) with a page count per row; a row is a request's slot
(scheduler/slot_state.py). Free pages are a stack: recently freed pages, still warm in a cache,
are reused first.

Every operation takes a step's rows (distinct) at once and is all or nothing. A handful of rows
goes row by row, cheaper than array calls; more rows take whole-array operations that hand out
and take back the same pages, in the same order, as going row by row (tested).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from specsched.scheduler.errors import OutOfPagesError
from specsched.scheduler.small_arrays import SMALL_BATCH, largest
from specsched.scheduler.small_arrays import total as array_total


@dataclass(frozen=True)
class KVPoolStats:
    """A read-only snapshot of the page pool (`AsyncEngine.kv_stats()`)."""

    page_size: int  # KV slots per page
    num_pages: int  # pages in the pool, shared by every model's cache
    num_free_pages: int
    num_used_pages: int
    used_pages_by_model: dict[str, int]  # model ("target", "draft", "mtp") -> pages in its tables
    pages_by_request: dict[str, dict[str, int]]  # request id -> model -> pages it holds


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, models: tuple[str, ...] = ("target",)):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.models = models
        # free pages, the next to hand out at the top (the end): page 0 on top at the start
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_pages
        self.version = 0  # bumped whenever pages change hands (a computed shortfall goes stale)
        rows, cols = 8, min(num_pages, 16)
        self._tables = {m: np.zeros((rows, cols), dtype=np.int32) for m in models}
        self._counts = {m: np.zeros(rows, dtype=np.int64) for m in models}

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self._top

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self._top

    def pages_for(self, num_slots: int) -> int:
        return (num_slots + self.page_size - 1) // self.page_size

    def page_table(self, row: int, model: str = "target") -> list[int]:
        counts = self._model_counts(model)
        return self._tables[model][row, : counts[row]].tolist() if row < len(counts) else []

    def tables(self, model: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([B, max_pages] page tables, [B] page counts) of `rows`: copies, padded past each
        row's count with pages that are not the row's."""
        counts = self._model_counts(model)
        return self._tables[model][rows], counts[rows]

    def table_of(self, model: str) -> tuple[np.ndarray, np.ndarray]:
        """The model's [rows, max_pages] page table and [rows] page counts themselves, for readers
        that gather their rows (`build_plan`'s `table_rows`); not to be written to."""
        return self._tables[model], self._model_counts(model)

    def shortfall(self, rows: np.ndarray, slots: Mapping[str, np.ndarray | int]) -> dict[str, np.ndarray]:
        """Model -> [B] pages each row is short of to cover slots[model] KV slots (what `allocate`
        takes as `shortfall` while `version` is unchanged)."""
        self._ensure_height(rows)
        ps, cols = self.page_size, {}
        for model, n in slots.items():
            short = -(-np.asarray(n, dtype=np.int64) // ps) - self._model_counts(model)[rows]
            cols[model] = np.maximum(short, 0, out=short)
        return cols

    def pages_needed(self, rows: np.ndarray, slots: Mapping[str, np.ndarray | int]) -> np.ndarray:
        """[B] pages each row is short of, over every model in `slots`."""
        cols = list(self.shortfall(rows, slots).values())
        return sum(cols[1:], cols[0]) if cols else np.zeros(len(rows), dtype=np.int64)

    # -- allocate, trim, free --------------------------------------------------------------
    def allocate(self, rows: np.ndarray, slots: Mapping[str, np.ndarray | int] | None = None,
                 shortfall: Mapping[str, np.ndarray] | None = None) -> None:
        """Grow each row's tables to cover slots[model] KV slots (never shrinks), all or nothing:
        the pages of allocating row by row, model by model, in order. `shortfall` instead of
        `slots`: what `shortfall(rows, slots)` returned, if no pages changed hands since."""
        if shortfall is None:
            shortfall = self.shortfall(rows, slots)
        models, cols = list(shortfall), list(shortfall.values())
        need = sum(map(array_total, cols))
        if need > self._top:
            raise OutOfPagesError(f"{len(rows)} rows need {need} pages, {self._top} free")
        if not need:
            return
        if len(rows) > SMALL_BATCH:
            needy = sum(cols[1:], cols[0]).nonzero()[0]  # rows short in some model
            if needy.size > SMALL_BATCH:
                self._allocate_arrays(rows, models, cols, need)
                return
            rows, cols = rows[needy], [c[needy] for c in cols]  # a decode step: few rows need a page
        stack, shorts = self._stack, [c.tolist() for c in cols]
        for i, row in enumerate(rows.tolist()):
            for model, short in zip(models, shorts):
                k = short[i]
                if k:
                    counts = self._counts[model]
                    have = int(counts[row])
                    self._table_with_room(model, have + k)[row, have : have + k] = \
                        stack[self._top - k : self._top][::-1]
                    self._top -= k
                    counts[row] = have + k
        self.version += 1

    def _allocate_arrays(self, rows: np.ndarray, models: list[str], cols: list[np.ndarray], need: int) -> None:
        short = np.stack(cols, axis=1)  # [B, M]
        taken = self._stack[self._top - need : self._top][::-1]
        flat = short.ravel()
        first = (np.cumsum(flat) - flat).reshape(short.shape)  # each (row, model)'s offset into `taken`
        for j, model in enumerate(models):
            picked = short[:, j].nonzero()[0]
            if not picked.size:
                continue
            counts, r = self._counts[model], rows[picked]
            have, reps = counts[r], short[picked, j]
            if largest(reps) == 1:  # one page each: no runs to lay out
                self._table_with_room(model, largest(have) + 1)[r, have] = taken[first[picked, j]]
            else:
                within = np.arange(array_total(reps)) - np.repeat(np.cumsum(reps) - reps, reps)
                table = self._table_with_room(model, largest(have + reps))
                table[np.repeat(r, reps), np.repeat(have, reps) + within] = \
                    taken[np.repeat(first[picked, j], reps) + within]
            counts[r] = have + reps
        self._top -= need
        self.version += 1

    def trim(self, rows: np.ndarray, model: str, num_slots: np.ndarray | int) -> int:
        """Release each row's pages wholly beyond num_slots >= 0 (rejected draft slots), the same
        pages in the same order as row by row; rows allocated before. Returns pages freed."""
        counts = self._model_counts(model)
        keep = (np.asarray(num_slots, dtype=np.int64) + self.page_size - 1) // self.page_size
        if keep.ndim == 0:
            keep = np.full(len(rows), keep)
        extra = counts[rows] - keep
        picked = (extra > 0).nonzero()[0]
        if not picked.size:
            return 0
        table = self._tables[model]
        if picked.size <= SMALL_BATCH:
            freed = 0
            for row, kp, ex in zip(rows[picked].tolist(), keep[picked].tolist(), extra[picked].tolist()):
                self._push(table[row, kp : kp + ex])
                counts[row] = kp
                freed += ex
            return freed
        reps, r = extra[picked], rows[picked]
        k = int(reps.sum())
        first = np.repeat(np.cumsum(reps) - reps, reps)
        within = np.arange(k) - first
        pages = table[np.repeat(r, reps), np.repeat(keep[picked], reps) + within]
        # the stack as pushing row by row leaves it: each row's pages reversed, rows in order
        self._stack[self._top : self._top + k] = pages[first + np.repeat(reps, reps) - 1 - within]
        self._top += k
        self.version += 1
        counts[r] = keep[picked]
        return k

    def free(self, rows: Sequence[int] | np.ndarray) -> int:
        """Release every page of each row in every model (a finish, abort or preemption): the
        stack as freeing row by row, each in model order, leaves it. Returns pages freed."""
        rows = np.asarray(rows, dtype=np.int64)
        self._ensure_height(rows)
        if len(rows) <= SMALL_BATCH:
            freed = 0
            for row in rows.tolist():
                for m in self.models:
                    have = int(self._counts[m][row])
                    if have:
                        self._push(self._tables[m][row, :have])
                        self._counts[m][row] = 0
                        freed += have
            return freed
        have = np.stack([self._counts[m][rows] for m in self.models], axis=1)  # [n, models]
        total = int(have.sum())
        if not total:
            return 0
        reps = have.ravel()  # (row, model) pairs in the order row by row visits them
        pair = np.repeat(np.arange(reps.size), reps)
        within = np.arange(total) - np.repeat(np.cumsum(reps) - reps, reps)
        pos = reps[pair] - 1 - within  # each pair's pages reversed
        which, row = pair % len(self.models), rows[pair // len(self.models)]
        pages = np.empty(total, dtype=np.int32)
        for k, m in enumerate(self.models):
            sel = which == k
            pages[sel] = self._tables[m][row[sel], pos[sel]]
        self._stack[self._top : self._top + total] = pages
        self._top += total
        self.version += 1
        for m in self.models:
            self._counts[m][rows] = 0
        return total

    # -- inspection ------------------------------------------------------------------------
    def stats(self, rows: Mapping[str, int]) -> KVPoolStats:
        """A snapshot, with the pages of each request in `rows` (request id -> its row)."""
        by_request: dict[str, dict[str, int]] = {}
        for rid, row in rows.items():
            held = {m: int(self._counts[m][row]) for m in self.models
                    if row < len(self._counts[m]) and self._counts[m][row]}
            if held:
                by_request[rid] = held
        return KVPoolStats(
            page_size=self.page_size, num_pages=self.num_pages, num_free_pages=self.num_free_pages,
            num_used_pages=self.num_used_pages,
            used_pages_by_model={m: int(self._counts[m].sum()) for m in self.models},
            pages_by_request=by_request,
        )

    def check_invariants(self) -> None:
        """Every page is either free or in exactly one table (tests, debugging)."""
        seen = [self._stack[: self._top]]
        for model in self.models:
            counts, table = self._counts[model], self._tables[model]
            seen.extend(table[row, : counts[row]] for row in counts.nonzero()[0].tolist())
        pages = np.concatenate(seen)
        if pages.size != self.num_pages or not np.array_equal(np.sort(pages), np.arange(self.num_pages)):
            raise AssertionError(f"page leak or double free: {pages.size} refs, {np.unique(pages).size} unique")

    # -- internals -------------------------------------------------------------------------
    def _model_counts(self, model: str) -> np.ndarray:
        try:
            return self._counts[model]
        except KeyError:
            raise ValueError(f"unknown model {model!r}; this pool has tables for {self.models}") from None

    def _ensure_height(self, rows: np.ndarray) -> None:
        height = len(self._counts[self.models[0]])
        if len(rows) and largest(rows) >= height:
            new = max(largest(rows) + 1, 2 * height)
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
