"""Paged KV cache storage, in one of FlashInfer's two page layouts.

Why: the scheduler's block manager hands out page ids; this module owns the memory they
index. One allocation holds every layer; `layers[i]` is a view of layer i, exactly the 5-D
tensor FlashInfer's paged kernels take: a page is [2, page_size, Hkv, D] in the "NHD" layout
(the FlashInfer backend's) or [2, Hkv, page_size, D] in "HND" (the torch backend's: a page's
keys of one head are one contiguous block, so a gather copies whole blocks and lands in SDPA's
[B, Hkv, L, D] order). A slot is `page * page_size + offset`, the unit
`AttentionPlan.slot_mapping` speaks; `read_slots` / `write_slots` / `copy_slots` take slots
in either layout.
"""

from __future__ import annotations

import math
import mmap

import torch

from specsched.runtime.sync_guard import to_device

LAYOUTS = ("NHD", "HND")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on a CPU one anonymous memory map, whose pages the OS hands out already zero
    when first touched: a pool sized for the longest run costs no time at start-up and no memory
    until its pages are used (`torch.zeros` writes every byte: 0.3 s for the bundled target's
    default pool)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    memory = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)  # the tensor keeps the map


class PagedKVCache:
    """KV pages for all layers of one model; page ids are shared across layers."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layout: str = "HND",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages),
                            ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"PagedKVCache: {name} must be >= 1, got {value}")
        if layout not in LAYOUTS:
            raise ValueError(f"PagedKVCache: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        self.layout = layout
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # [L, P + 1, 2, page_size, Hkv, D] (NHD) or [L, P + 1, 2, Hkv, page_size, D] (HND); zero so
        # padded/stale reads are finite. Page P is the scratch page: no request holds it, the pad
        # rows of a padded step use it (runtime/padding.py)
        page = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
        self.data = zeros((num_layers, num_pages + 1, 2, *page, head_dim), dtype, self.device)
        self.layers: list[torch.Tensor] = list(self.data.unbind(0))  # each [P + 1, 2, *page, D]

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.data.element_size()

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        return self.layers[layer_idx]

    def __len__(self) -> int:
        return self.num_layers

    def copy_slots(self, src_slots, dst_slots) -> None:
        """Copy K and V of slots `src_slots[i]` to `dst_slots[i]`, in every layer.

        Used to compact accepted tree branches into contiguous positions. All sources are
        read before any destination is written, so overlapping ranges are safe.
        """
        src = to_device(src_slots, self.device, torch.long).reshape(-1)
        dst = to_device(dst_slots, self.device, torch.long).reshape(-1)
        if src.shape != dst.shape:
            raise ValueError(f"copy_slots: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        if self.device.type == "cpu" and not isinstance(src_slots, torch.Tensor):  # host lists: checked
            lo = int(torch.minimum(src.min(), dst.min()))
            hi = int(torch.maximum(src.max(), dst.max()))
            if lo < 0 or hi >= self.num_slots:
                raise ValueError(f"copy_slots: slot out of range [0, {self.num_slots})")
        vals = self.data[self._at(slice(None), src)]  # [n, L, 2, Hkv, D]
        self.data[self._at(slice(None), dst)] = vals

    def _at(self, layer, slots: torch.Tensor) -> tuple:
        """The index of `slots` [n] in `data` (layer: an int or a slice), giving [n, (L,) 2, Hkv, D]."""
        page, offset = slots // self.page_size, slots % self.page_size
        if self.layout == "NHD":
            return layer, page, slice(None), offset
        return layer, page, slice(None), slice(None), offset

    def read_slots(self, layer_idx: int, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the given slots of one layer, each [n, Hkv, D] (for tests and debugging)."""
        s = to_device(slots, self.device, torch.long).reshape(-1)
        kv = self.data[self._at(layer_idx, s)]  # [n, 2, Hkv, D]
        return kv[:, 0], kv[:, 1]

    def write_slots(self, layer_idx: int, slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V [n, Hkv, D] at the given slots of one layer (tests, tools)."""
        s = to_device(slots, self.device, torch.long).reshape(-1)
        self.data[self._at(layer_idx, s)] = torch.stack((k, v), 1).to(self.dtype)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, pages={self.num_pages}, "
            f"page_size={self.page_size}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, {self.layout}, {self.total_bytes / 2**20:.1f} MiB)"
        )
