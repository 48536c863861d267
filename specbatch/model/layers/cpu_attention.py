"""The CPU attention backend: specbatch's own kernel over the paged cache (``kernels/csrc``).

One call per layer covers the whole ragged batch, reading keys and values in place through the
block tables; its cache layout is its own (``CpuKernels.kv_cache_shapes``), so a cache written
by it is read only by it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from specbatch.kernels.cpu import CpuKernels
from specbatch.model.layers.attention import AttentionBackend, AttentionMetadata


class CpuAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    @staticmethod
    def supports(kernels: CpuKernels, head_dim: int, dtype: torch.dtype | None) -> str | None:
        """None when the kernel runs this model, else why not."""
        if dtype not in (torch.float32, torch.bfloat16):
            return f"dtype {dtype} (float32 or bfloat16 only)"
        if head_dim % 16 or head_dim > kernels.max_head_dim:
            return f"head_dim {head_dim} (a multiple of 16, at most {kernels.max_head_dim})"
        return None

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.kernels.kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim)

    def slot_rows(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kernels.slot_elements(k_cache, v_cache)
        return keys(slots).reshape(-1), values(slots).reshape(-1)

    @staticmethod
    def cache_rows(cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.kernels.write_kv(k, v, meta.slot_mapping, k_cache, v_cache)
        return self.kernels.paged_attention(
            q, meta.query_start_loc, meta.seq_lens, meta.block_tables, k_cache, v_cache, scale,
            meta.tree_masks, meta.tree_starts,
        )  # fmt: skip
