"""The host-sync guard: inside `no_host_sync`, reading a device tensor on the host raises."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specsched.runtime.sync_guard import HostSyncError, host_side, no_host_sync

READS = {
    "tolist": lambda t: t.tolist(),
    "item": lambda t: t[0].item(),
    "numpy": lambda t: t.numpy(),
    "np.asarray": lambda t: np.asarray(t),
    "int": lambda t: int(t[0]),
    "float": lambda t: float(t[0]),
    "bool": lambda t: bool(t[0]),
    "if": lambda t: 1 if t[0] else 0,
    "index": lambda t: list(range(0, 100, 10))[t[1]],
}
OUTSIDE = {"tolist": [2, 4, 6], "item": 2, "numpy": [2, 4, 6], "np.asarray": [2, 4, 6], "int": 2, "float": 2.0,
           "bool": True, "if": 1, "index": 40}  # of [2, 4, 6]


@pytest.mark.parametrize("read", sorted(READS))
def test_every_host_read_of_a_device_tensor_raises_inside_and_works_outside(read):
    made_before = torch.tensor([1, 2, 3])
    with no_host_sync("cpu", what="op_verify"):
        made_inside = made_before * 2  # device work is fine
        for t in (made_before, made_inside):
            with pytest.raises(HostSyncError, match=r"op_verify: Tensor\.\w+\(\) reads a cpu value"):
                READS[read](t)
    got = READS[read](made_inside)  # outside the block the same read just works
    assert np.array_equal(np.asarray(got), np.asarray(OUTSIDE[read]))


def test_host_side_buffers_and_other_devices_may_be_read():
    with no_host_sync("cpu"):
        out = host_side(torch.zeros(3, dtype=torch.int64))
        out.copy_(torch.arange(3))  # the op fills its result buffer on the device stream
        assert out.tolist() == [0, 1, 2]  # what the host reads once the op's event is done
    # an op on CUDA may read host tensors: only values on the op's device wait for it
    with no_host_sync("cuda"):
        assert torch.arange(4).sum().item() == 6


def test_the_guard_ends_with_its_block_and_nests():
    t = torch.ones(2)
    with no_host_sync("cpu", what="outer"):
        with no_host_sync("cpu", what="inner"):
            with pytest.raises(HostSyncError, match="inner"):
                t.tolist()
        with pytest.raises(HostSyncError, match="outer"):
            t.tolist()
    assert t.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):  # an error inside the block leaves no guard behind
        with no_host_sync("cpu"):
            raise ValueError
    assert t.sum().item() == 2.0


def test_record_mode_lists_each_read_with_its_place_and_lets_it_happen():
    seen: list = []
    with no_host_sync("cpu", what="op_forward", record=seen):
        t = torch.arange(3) + 1
        values = t.tolist()
        first = int(t[0])
    assert (values, first) == ([1, 2, 3], 1)
    assert [(w, m) for w, m, _ in seen] == [("op_forward", "tolist"), ("op_forward", "__int__")]
    assert all(place.startswith("tests/test_sync_guard.py:") for _, _, place in seen)
