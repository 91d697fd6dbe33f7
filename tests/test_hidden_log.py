"""The hidden states a head has not read yet (runtime/proposers/hidden_log.py): gathered by
slot and position across the forwards that kept them, a recompute winning over what it
replaces, dropped once read or released."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specsched.runtime.proposers.hidden_log import HiddenLog


def _h(slot: int, pos: np.ndarray) -> torch.Tensor:
    """A recognisable hidden state per (slot, position): [len(pos), 2]."""
    pos = torch.as_tensor(pos, dtype=torch.float32)
    return torch.stack([torch.full_like(pos, float(slot)), pos], dim=1)


def _keep(log: HiddenLog, rows: list[tuple[int, int, int]], tag: float = 0.0) -> None:
    """One forward's rows (slot, first position, positions)."""
    slots = np.array([r[0] for r in rows])
    starts = np.array([r[1] for r in rows])
    lens = np.array([r[2] for r in rows])
    hidden = torch.cat([_h(s, np.arange(a, a + n)) for s, a, n in rows]) + torch.tensor([tag, 0.0])
    log.keep(slots, starts, np.concatenate([[0], np.cumsum(lens)]), hidden)


def test_a_catch_up_gathers_positions_across_forwards_in_row_order():
    log = HiddenLog()
    _keep(log, [(3, 0, 5), (1, 0, 4)])  # two prompts
    for p in range(3):  # three decode steps of both rows
        _keep(log, [(1, 4 + p, 1), (3, 5 + p, 1)])
    out = log.gather(np.array([1, 3]), np.array([2, 0]), np.array([7, 8]))
    want = torch.cat([_h(1, np.arange(2, 7)), _h(3, np.arange(0, 8))])
    assert torch.equal(out, want)
    assert len(log) == 0  # everything kept was read


def test_what_a_catch_up_did_not_reach_stays_and_a_recompute_wins():
    log = HiddenLog()
    _keep(log, [(0, 0, 6)])
    _keep(log, [(0, 0, 6)], tag=10.0)  # the request was preempted and its prompt recomputed
    out = log.gather(np.array([0]), np.array([0]), np.array([4]))
    assert torch.equal(out, _h(0, np.arange(4)) + torch.tensor([10.0, 0.0]))
    assert len(log) == 2  # positions 4..5 not read yet
    assert torch.equal(log.gather(np.array([0]), np.array([4]), np.array([6])),
                       _h(0, np.arange(4, 6)) + torch.tensor([10.0, 0.0]))
    assert len(log) == 0


def test_a_released_slot_is_dropped_and_missing_positions_are_an_error():
    log = HiddenLog()
    _keep(log, [(0, 0, 3), (1, 0, 3)])
    log.release(1)
    with pytest.raises(RuntimeError, match="slot 1 positions \\[0, 3\\)"):
        log.gather(np.array([1]), np.array([0]), np.array([3]))
    with pytest.raises(RuntimeError, match="slot 0 positions \\[0, 5\\)"):
        log.gather(np.array([0]), np.array([0]), np.array([5]))  # positions 3, 4 never kept
    log.release(0)
    assert len(log) == 0
