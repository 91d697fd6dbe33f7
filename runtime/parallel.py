"""Tensor parallelism (Megatron style) over a torch.distributed process group.

Why: one rank's memory or bandwidth may not hold or stream the target; split every decoder
layer over N ranks and each streams 1/N of the weights and holds 1/N of the KV cache, at
the cost of two all-reduces of [tokens, hidden] per layer. The model code takes a `TPGroup`
(None: one process, no communication at all) and asks it only for `rank`, `size` and the
collectives below, so the same code runs over gloo (CPU, tests) or NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from specsched.runtime.config import ModelConfig

SHARDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: `rank` of `size`, communicating over
    `group` (a torch.distributed ProcessGroup; None: the default group, which must then be
    exactly the tensor-parallel ranks)."""

    rank: int
    size: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank {self.rank} of size {self.size} is out of range")

    @classmethod
    def from_group(cls, group: Any = None) -> "TPGroup":
        """This process's rank and the size of an initialised process group (None: default)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that samples, accepts and answers the host."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (t must be contiguous); returns t."""
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `t`s concatenated along `dim`, in rank order (a new tensor)."""
        parts = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim)


def shard_range(n: int, rank: int, size: int, name: str = "dimension") -> slice:
    """Rank `rank`'s contiguous slice of `n` items split evenly over `size` ranks; ValueError
    naming `name` when `n` does not split evenly (uneven shards would need padding and
    per-rank shapes everywhere)."""
    if n % size:
        raise ValueError(f"{name}={n} is not divisible by tensor_parallel_size={size}")
    per = n // size
    return slice(rank * per, (rank + 1) * per)


def check_tp_config(config: ModelConfig, tp_size: int) -> None:
    """ValueError naming the first field a `tp_size`-way split cannot divide evenly. KV heads
    must split too: each rank's query heads then map onto its own consecutive KV heads."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    for name in SHARDED_FIELDS:
        shard_range(getattr(config, name), 0, tp_size, name)


__all__ = ["TPGroup", "shard_range", "check_tp_config", "SHARDED_FIELDS"]
