"""The paged KV pool's memory: zero everywhere, and on a CPU committed only as pages are written."""
from __future__ import annotations

import sys

import pytest
import torch

from specsched.runtime.kv_cache import PagedKVCache


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_reads_zero_and_keeps_what_is_written(layout, dtype):
    kv = PagedKVCache(3, 10, 4, 2, 8, dtype=dtype, layout=layout)
    assert kv.data.dtype == dtype and kv.data.is_contiguous() and not kv.data.any()
    assert kv[1].shape == ((11, 2, 4, 2, 8) if layout == "NHD" else (11, 2, 2, 4, 8))
    kv[2][5].fill_(1.5)
    assert kv.data.sum().item() == 1.5 * kv[2][5].numel()
    assert not kv[1].any() and not kv[2][4].any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpu_pool_takes_memory_as_its_pages_are_used():
    before = _resident_bytes()
    kv = PagedKVCache(8, 2048, 16, 8, 64)  # 1.07 GB of pages
    assert kv.total_bytes > 1e9
    made = _resident_bytes()
    assert made - before < 64e6
    kv[0][:64].fill_(1.0)  # 64 pages of one layer: 4 MB
    assert 4e6 <= _resident_bytes() - made < 64e6
