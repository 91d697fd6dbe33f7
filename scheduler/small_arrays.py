"""Reductions over a step's rows that stay cheap when the rows are few: a numpy call costs about a microsecond whatever
the size, ten times a Python loop over a handful of ints, and a few-row step makes some twenty reductions.
"""
from __future__ import annotations

import numpy as np

# rows up to which per-step stages (these reductions, output, KV allocation, acceptance lookups) loop in Python
SMALL_BATCH = 8


def total(a: np.ndarray) -> int:
    """`int(a.sum())` of a 1-D int or bool array."""
    return sum(a.tolist()) if len(a) <= SMALL_BATCH else int(a.sum())


def some(a: np.ndarray) -> bool:
    """`bool(a.any())` of a 1-D array."""
    return any(a.tolist()) if len(a) <= SMALL_BATCH else bool(a.any())


def every(a: np.ndarray) -> bool:
    """`bool(a.all())` of a 1-D array."""
    return all(a.tolist()) if len(a) <= SMALL_BATCH else bool(a.all())


def largest(a: np.ndarray) -> int:
    """`int(a.max())` of a non-empty 1-D int array."""
    return max(a.tolist()) if len(a) <= SMALL_BATCH else int(a.max())


def smallest(a: np.ndarray) -> int:
    """`int(a.min())` of a non-empty 1-D int array."""
    return min(a.tolist()) if len(a) <= SMALL_BATCH else int(a.min())
