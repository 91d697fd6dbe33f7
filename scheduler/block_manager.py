"""Paged KV block manager: one pool of pages, one page table per (request, model).

Why: target and draft (or MTP head) caches are allocated from one pool so KV pressure is
shared, as in production engines; each model's cache tensor has `num_pages` pages and a page
id means the same page index in whichever model's cache its table belongs to.

Check/act pairs: `can_allocate` / `allocate` grow tables to cover a number of KV slots
(prefill, decode, or the D+1 slots a verification needs); `trim` releases slots beyond a
length (rejected drafts); `free` releases everything of a request (finish, abort, preempt).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class OutOfPagesError(RuntimeError):
    pass


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
        # LIFO free list: recently freed pages are reused first (cache friendly).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._tables: dict[str, dict[str, list[int]]] = {m: {} for m in models}

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_slots: int) -> int:
        return (num_slots + self.page_size - 1) // self.page_size

    def _model_tables(self, model: str) -> dict[str, list[int]]:
        try:
            return self._tables[model]
        except KeyError:
            raise ValueError(f"unknown model {model!r}; this pool has tables for {self.models}") from None

    def page_table(self, request_id: str, model: str = "target") -> list[int]:
        return self._model_tables(model).get(request_id, [])

    def num_slots(self, request_id: str, model: str = "target") -> int:
        return len(self.page_table(request_id, model)) * self.page_size

    def pages_needed(self, request_id: str, slots: Mapping[str, int]) -> int:
        # the scheduler asks this for every running request every step: kept lean
        need = 0
        ps = self.page_size
        tables = self._tables
        for model, n in slots.items():
            t = tables.get(model)
            if t is None:
                self._model_tables(model)  # raises the error naming the pool's models
            short = (n + ps - 1) // ps - len(t.get(request_id, ()))
            if short > 0:
                need += short
        return need

    # -- check / act -----------------------------------------------------------------------
    def can_allocate(self, request_id: str, slots: Mapping[str, int], *, reserve_pages: int = 0) -> bool:
        """Could every model's table of `request_id` cover slots[model] KV slots?"""
        return self.pages_needed(request_id, slots) + reserve_pages <= len(self._free)

    def allocate(self, request_id: str, slots: Mapping[str, int]) -> None:
        """Grow tables so each covers slots[model] slots (never shrinks). All or nothing."""
        need = self.pages_needed(request_id, slots)
        if need > len(self._free):
            raise OutOfPagesError(f"request {request_id}: needs {need} pages, {len(self._free)} free")
        if not need:
            return
        free = self._free
        for model, n in slots.items():
            table = self._tables[model].setdefault(request_id, [])
            short = self.pages_for(n) - len(table)
            if short > 0:
                table.extend(free[-short:][::-1])  # the same pages, in the order pop() gives
                del free[-short:]

    def trim(self, request_id: str, model: str, num_slots: int) -> int:
        """Release pages wholly beyond `num_slots` (rejected draft slots). Returns pages freed."""
        if num_slots < 0:
            raise ValueError(f"request {request_id}: cannot trim to {num_slots} slots")
        table = self._model_tables(model).get(request_id)
        if not table:
            return 0
        keep = self.pages_for(num_slots)
        freed = table[keep:]
        del table[keep:]
        self._free.extend(reversed(freed))
        return len(freed)

    def free(self, request_id: str) -> int:
        """Release every page of the request in every model. Idempotent."""
        n = 0
        for tables in self._tables.values():
            table = tables.pop(request_id, None)
            if table:
                self._free.extend(reversed(table))
                n += len(table)
        return n

    def stats(self) -> KVPoolStats:
        by_request: dict[str, dict[str, int]] = {}
        for model, tables in self._tables.items():
            for rid, table in tables.items():
                if table:
                    by_request.setdefault(rid, {})[model] = len(table)
        return KVPoolStats(
            page_size=self.page_size, num_pages=self.num_pages, num_free_pages=self.num_free_pages,
            num_used_pages=self.num_used_pages,
            used_pages_by_model={m: sum(map(len, t.values())) for m, t in self._tables.items()},
            pages_by_request=by_request,
        )

    def check_invariants(self) -> None:
        """Every page is either free or in exactly one table (tests, debugging)."""
        seen = list(self._free)
        for tables in self._tables.values():
            for t in tables.values():
                seen.extend(t)
        if len(seen) != self.num_pages or set(seen) != set(range(self.num_pages)):
            raise AssertionError(f"page leak or double free: {len(seen)} refs, {len(set(seen))} unique")
