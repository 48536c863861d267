"""The tensor-parallel group a model shard belongs to, passed explicitly (no module-level state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """Rank and size of one tensor-parallel shard, and the collectives between shards.

    With ``size == 1`` every collective is the identity, so single-process code pays nothing.
    """

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (in rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallelGroup()
