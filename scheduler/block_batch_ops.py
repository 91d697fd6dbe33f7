"""The block manager's whole-batch operations: a step's rows at once, in array operations.

Why a module of its own: scheduler/block_manager.py holds the pool, the page tables and the
one-request operations (check/act by request id); what a step over hundreds of rows does to
them -- the pages each row is short of, allocating, trimming and freeing many rows at once --
is this mixin's, each the same pages in the same order as its one-by-one counterpart (tested
against it). A handful of rows takes the one-by-one path, which costs less there.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specsched.scheduler.errors import OutOfPagesError
from specsched.scheduler.small_arrays import SMALL_BATCH, largest
from specsched.scheduler.small_arrays import total as array_total


class BatchPageOps:
    def pages_needed_many(self, rows: np.ndarray, slots: Mapping[str, np.ndarray]) -> np.ndarray:
        """[B] pages each row is short of to cover slots[model][b] KV slots."""
        cols = self._shortfall(rows, slots)
        return sum(cols[1:], cols[0]) if cols else np.zeros(len(rows), dtype=np.int64)

    def shortfall(self, rows: np.ndarray, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Model -> [B] pages each row is short of to cover slots[model] (what
        `allocate_many` takes as `shortfall` while `version` is unchanged)."""
        return dict(zip(slots, self._shortfall(rows, slots)))

    def _shortfall(self, rows: np.ndarray, slots: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Per model in `slots` order, [B] pages each row is short of."""
        ps = self.page_size
        cols = []
        for model, n in slots.items():
            counts = self._model_counts(model)
            short = -(-np.asarray(n, dtype=np.int64) // ps)  # pages that cover n (one op fewer)
            short -= counts[rows]
            np.maximum(short, 0, out=short)
            cols.append(short)
        return cols

    def allocate_many(self, rows: np.ndarray, slots: Mapping[str, np.ndarray] | None = None,
                      shortfall: Mapping[str, np.ndarray] | None = None) -> None:
        """`allocate` for every row of a batch at once (rows distinct), all or nothing: the
        same pages as allocating row by row, model by model, in order. `shortfall` instead of
        `slots`: what `shortfall(rows, slots)` returned, if no pages changed hands since."""
        if shortfall is None:
            shortfall = self.shortfall(rows, slots)
        models, cols = list(shortfall), list(shortfall.values())
        total = sum(map(array_total, cols))
        if total > self._top:
            raise OutOfPagesError(f"a batch of {len(rows)} rows needs {total} pages, {self._top} free")
        if not total:
            return
        if len(rows) <= SMALL_BATCH:  # a handful of rows: the array calls would cost more
            self._allocate_rows(rows.tolist(), list(zip(models, (c.tolist() for c in cols))))
            return
        needy = sum(cols[1:], cols[0]).nonzero()[0]  # rows short in some model (counts are >= 0)
        if needy.size <= SMALL_BATCH:  # a decode step: most rows' last page has room
            self._allocate_rows(rows[needy].tolist(), [(m, c[needy].tolist()) for m, c in zip(models, cols)])
            return
        short = np.stack(cols, axis=1)  # [B, M]
        taken = self._stack[self._top - total : self._top][::-1]
        flat = short.ravel()
        first = (np.cumsum(flat) - flat).reshape(short.shape)  # offset into `taken`
        for j, model in enumerate(models):
            picked = short[:, j].nonzero()[0]
            if not picked.size:
                continue
            counts, r = self._counts[model], rows[picked]
            have, reps = counts[r], short[picked, j]
            if largest(reps) == 1:  # a decode step: one page each, no runs to lay out
                table = self._table_with_room(model, largest(have) + 1)
                table[r, have] = taken[first[picked, j]]
            else:
                within = np.arange(array_total(reps)) - np.repeat(np.cumsum(reps) - reps, reps)
                table = self._table_with_room(model, largest(have + reps))
                table[np.repeat(r, reps), np.repeat(have, reps) + within] = \
                    taken[np.repeat(first[picked, j], reps) + within]
            counts[r] = have + reps
        self._top -= total
        self.version += 1

    def _allocate_rows(self, rows: list[int], shortfall: list[tuple[str, list[int]]]) -> None:
        """`allocate_many` row by row, model by model (the order it reproduces)."""
        stack = self._stack
        for i, row in enumerate(rows):
            for model, short in shortfall:
                k = short[i]
                if k:
                    counts = self._counts[model]
                    have = int(counts[row])
                    table = self._table_with_room(model, have + k)
                    table[row, have : have + k] = stack[self._top - k : self._top][::-1]
                    self._top -= k
                    counts[row] = have + k
        self.version += 1

    def trim_many(self, rows: np.ndarray, model: str, num_slots: np.ndarray) -> int:
        """`trim` for every row of a batch at once (rows distinct): the same pages freed, in
        the same order, as trimming row by row. Returns pages freed."""
        counts = self._model_counts(model)
        ps = self.page_size
        keep = (np.asarray(num_slots, dtype=np.int64) + ps - 1) // ps
        have = counts[rows]
        extra = have - keep
        picked = (extra > 0).nonzero()[0]
        if not picked.size:
            return 0
        if picked.size <= SMALL_BATCH:  # a few rows: row by row costs less than the array calls
            table, freed = self._tables[model], 0
            for row, kp, ex in zip(rows[picked].tolist(), keep[picked].tolist(), extra[picked].tolist()):
                self._push(table[row, kp : kp + ex])
                counts[row] = kp
                freed += ex
            return freed
        reps = extra[picked]
        k = int(reps.sum())
        # each row's pages from its last kept page on, in table order, row after row
        first = np.repeat(np.cumsum(reps) - reps, reps)
        within = np.arange(k) - first
        r = rows[picked]
        pages = self._tables[model][np.repeat(r, reps), np.repeat(keep[picked], reps) + within]
        # the stack as `_push` row by row leaves it: each row's pages reversed, rows in order
        self._stack[self._top : self._top + k] = pages[first + np.repeat(reps, reps) - 1 - within]
        self._top += k
        self.version += 1
        counts[r] = keep[picked]
        return k

    def free_many(self, request_ids: Sequence[str]) -> int:
        """`free` for many (distinct) requests at once: the same pages back on the stack, in the same
        order, as freeing them one after another (request by request, each in model order,
        each row's pages reversed). Returns pages freed."""
        rows = [self._row_of.get(rid) for rid in request_ids]
        # an unknown id frees nothing, and some row was never bound; a handful of requests
        # (a step's finishes) cost less one by one than in array calls
        if len(rows) <= SMALL_BATCH or None in rows:
            return sum(self.free(rid) for rid in request_ids)
        r = np.asarray(rows, dtype=np.int64)
        have = np.stack([self._counts[m][r] for m in self.models], axis=1)  # [n, models]
        total = int(have.sum())
        if total:
            reps = have.ravel()  # (request, model) pairs in the order `free` visits them
            pair = np.repeat(np.arange(reps.size), reps)
            within = np.arange(total) - np.repeat(np.cumsum(reps) - reps, reps)
            pos = reps[pair] - 1 - within  # each pair's pages reversed
            which, row = pair % len(self.models), r[pair // len(self.models)]
            pages = np.empty(total, dtype=np.int32)
            for k, m in enumerate(self.models):
                sel = which == k
                pages[sel] = self._tables[m][row[sel], pos[sel]]
            self._stack[self._top : self._top + total] = pages
            self._top += total
            self.version += 1
            for m in self.models:
                self._counts[m][r] = 0
        for rid, row in zip(request_ids, rows):
            del self._row_of[rid]
            self._drop_row(row)
        return total
