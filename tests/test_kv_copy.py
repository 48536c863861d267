"""Copy on write: a block copied whole is the copy of each of its slots, in every cache layout
(the torch backend's, the CPU kernels' with bfloat16's paired elements), the other blocks
untouched, every source read before any copy is written."""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels.cpu import CpuKernels
from specbatch.model.layers.attention import AttentionBackend, TorchAttentionBackend
from specbatch.model.layers.cpu_attention import CpuAttentionBackend
from specbatch.worker.model_runner import copy_blocks, move_slots

BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 6, 4, 2, 8, 3


def caches(
    backend: AttentionBackend, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    k_shape, v_shape = backend.kv_cache_shapes(BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(k_shape, generator=gen).to(dtype),
            torch.randn(v_shape, generator=gen).to(dtype),
        )
        for _ in range(LAYERS)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["torch", "cpu"])
def test_a_block_copied_whole_is_its_slots_copied(
    kern: CpuKernels, layout: str, dtype: torch.dtype
):
    backend = TorchAttentionBackend() if layout == "torch" else CpuAttentionBackend(kern)
    # block 1 into 3 and 3 into 0: block 3 is read before it is written
    src, dst = [1, 3], [3, 0]
    by_slots = caches(backend, dtype)
    slots = [
        [b * BLOCK_SIZE + i for b in blocks for i in range(BLOCK_SIZE)] for blocks in (src, dst)
    ]
    move_slots(backend, by_slots, *slots, torch.device("cpu"))
    by_blocks = caches(backend, dtype)
    before = [(k.clone(), v.clone()) for k, v in by_blocks]
    copy_blocks(by_blocks, src, dst, torch.device("cpu"))
    for (k, v), (k_ref, v_ref), (k0, v0) in zip(by_blocks, by_slots, before, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        assert torch.equal(k[0], k0[3]) and torch.equal(k[3], k0[1])
        for b in (1, 2, 4, 5):
            assert torch.equal(k[b], k0[b]) and torch.equal(v[b], v0[b])
