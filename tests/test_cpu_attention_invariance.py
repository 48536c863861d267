"""Batch invariance of the CPU attention kernel: a query row's outputs are the same bits alone
or in any ragged batch, in any order, chunked, with any number of threads, with or without its
sequence's draft tree; and the tree mask of a chain is causal attention bit for bit."""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels.cpu import CpuKernels
from specbatch.model.layers.attention import AttentionMetadata
from specbatch.model.layers.cpu_attention import CpuAttentionBackend
from specbatch.model.layers.tree_mask import causal_tree_mask
from tests.helpers import random_paged_batch
from tests.test_cpu_attention import DTYPES, RAGGED, VERIFY, random_trees, to_cpu_layout


def written(kern: CpuKernels, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's caches in the CPU layout with its new keys and values written."""
    _, k, v, k_cache, v_cache, meta, _ = batch
    kc, vc = to_cpu_layout(k_cache, v_cache)
    kern.write_kv(k, v, meta.slot_mapping, kc, vc)
    return kc, vc


def attend(kern, q, caches, q_lens, s_lens, tables, tree=None, threads=1) -> torch.Tensor:
    meta = AttentionMetadata.from_lists(q_lens, s_lens, tables, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kern.paged_attention(
            q, meta.query_start_loc, meta.seq_lens, meta.block_tables, *caches, 0.125, tree
        )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("hq", [2, 4, 8])
def test_a_rows_bits_do_not_depend_on_its_company(
    dtype: torch.dtype, tree: bool, hq: int, attn_kern: CpuKernels
) -> None:
    """Verifications of 1-17 rows with 1, 2 and 4 query heads a kv head (up to 68 query vectors
    of a kv head, several tiles): each sequence alone, the batch reversed and on two threads give
    the batch's bits; a causal row alone, as a decode over the keys it sees, too."""
    q_lens, s_lens = VERIFY
    batch = random_paged_batch(q_lens, s_lens, 16, hq, 2, 64, seed=9, dtype=dtype)
    q, tables = batch[0], batch[6]
    caches = written(attn_kern, batch)
    mask = random_trees(q_lens, seed=2) if tree else None
    whole = attend(attn_kern, q, caches, q_lens, s_lens, tables, mask)
    assert torch.equal(attend(attn_kern, q, caches, q_lens, s_lens, tables, mask, threads=2), whole)
    starts = [sum(q_lens[:b]) for b in range(len(q_lens) + 1)]
    order = list(reversed(range(len(q_lens))))
    rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in order])
    reordered = attend(attn_kern, q[rows], caches, [q_lens[b] for b in order],
                       [s_lens[b] for b in order], [tables[b] for b in order],
                       mask[rows] if mask is not None else None)  # fmt: skip
    assert torch.equal(reordered, whole[rows]), "the batch reversed differs"
    for b, (q_len, s_len) in enumerate(zip(q_lens, s_lens, strict=True)):
        own = slice(starts[b], starts[b + 1])
        alone = attend(attn_kern, q[own], caches, [q_len], [s_len], [tables[b]],
                       mask[own] if mask is not None else None)  # fmt: skip
        assert torch.equal(alone, whole[own]), f"sequence {b} differs alone"
        if mask is None and 1 < q_len <= 17:
            for i in range(q_len):
                row = q[starts[b] + i : starts[b] + i + 1]
                one = attend(attn_kern, row, caches, [1], [s_len - q_len + i + 1], [tables[b]])
                assert torch.equal(one[0], whole[starts[b] + i]), f"row {i} of {b} differs alone"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chain_tree_is_causal_attention_bit_for_bit(
    dtype: torch.dtype, attn_kern: CpuKernels
) -> None:
    q_lens, s_lens = VERIFY
    batch = random_paged_batch(q_lens, s_lens, 16, 4, 2, 64, seed=4, dtype=dtype)
    caches = written(attn_kern, batch)
    causal = attend(attn_kern, batch[0], caches, q_lens, s_lens, batch[6])
    chain = attend(attn_kern, batch[0], caches, q_lens, s_lens, batch[6], causal_tree_mask(q_lens))
    assert torch.equal(chain, causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_row_does_not_depend_on_the_batch_or_the_chunking(
    dtype: torch.dtype, attn_kern: CpuKernels
) -> None:
    """A sequence's outputs are bit-identical alone and inside the ragged batch, and when its
    new tokens come in two chunks instead of one."""
    q, k, v, k_cache, v_cache, meta, tables = random_paged_batch(
        *RAGGED, 16, 6, 2, 64, seed=9, dtype=dtype
    )
    backend = CpuAttentionBackend(attn_kern)
    kc, vc = to_cpu_layout(k_cache, v_cache)
    whole = backend.forward(q, k, v, kc, vc, meta, 0.125)
    for b in (1, 3, 6):  # a decode, a chunk on cached context, a whole prompt
        rows = slice(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
        q_len, seq_len = RAGGED[0][b], RAGGED[1][b]
        alone = AttentionMetadata.from_lists([q_len], [seq_len], [tables[b]], 16)
        got = backend.forward(q[rows], k[rows], v[rows], kc, vc, alone, 0.125)
        assert torch.equal(got, whole[rows]), f"sequence {b} differs alone"
        if q_len > 1:
            first = q_len // 3
            parts = []
            for lo, hi in ((0, first), (first, q_len)):
                part = AttentionMetadata.from_lists(
                    [hi - lo], [seq_len - q_len + hi], [tables[b]], 16
                )
                sl = slice(rows.start + lo, rows.start + hi)
                parts.append(backend.forward(q[sl], k[sl], v[sl], kc, vc, part, 0.125))
            assert torch.equal(torch.cat(parts), whole[rows]), f"sequence {b} differs chunked"
