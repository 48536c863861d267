"""The CPU attention kernel (``kernels/csrc/attention.c``) against the pure-torch references on
ragged batches of prompts, chunks, decodes, verifications of 1-17 rows and draft trees, every
head grouping (MHA, GQA 2/3/4/8, MQA), odd block sizes and contexts that end inside a block, in
float32 and bfloat16 on every build this CPU runs (``attn_kern``); and a row's outputs bit for bit
the same whatever its company, its chunking and the threads."""

from __future__ import annotations

import random

import pytest
import torch

from specbatch.kernels.cpu import CpuKernels
from specbatch.model.layers.attention import TorchAttentionBackend, write_kv
from specbatch.model.layers.cpu_attention import CpuAttentionBackend
from specbatch.model.layers.tree_mask import (
    TREE_ROWS,
    causal_tree_mask,
    check_tree_mask,
    paged_attention_reference,
    tree_bits,
)
from tests.helpers import random_paged_batch

DTYPES = [torch.float32, torch.bfloat16]
# (query_lens, seq_lens): whole prompts, a prompt chunk on cached context, one-token decodes,
# gamma + 1 verifications, and a long prompt spanning many blocks, in one ragged batch.
RAGGED = ([7, 1, 3, 20, 1, 5, 40, 2], [7, 1, 30, 45, 64, 5, 40, 9])
# verifications of 1-17 rows on contexts that end inside a block, and a 70-token prompt
VERIFY = ([1, 17, 3, 5, 2, 9, 1, 13, 4, 70], [1, 40, 19, 70, 33, 100, 16, 13, 21, 70])
# (block_size, hq, hkv, d): GQA 2, 3, 4 and 8, MQA, MHA; odd block sizes
SHAPES = [
    (4, 4, 2, 16),
    (16, 4, 2, 64),
    (32, 6, 2, 32),
    (16, 8, 2, 64),
    (7, 16, 2, 32),
    (16, 8, 1, 128),
    (16, 3, 3, 64),
    (5, 4, 2, 32),
]


def to_cpu_layout(
    k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard ``[block, slot, head, d]`` caches in the CPU backend's layout: keys
    ``[block, head, d, slot]``, values ``[block, head, slot, d]`` (slots padded to an even
    count with NaN), and in bfloat16 with the elements of a block's head in pairs: keys
    ``[d / 2, slot, 2]``, values ``[slot / 2, d, 2]``."""
    n, bs, h, d = k_cache.shape
    if bs % 2:
        pad = torch.full((n, 1, h, d), float("nan"), dtype=v_cache.dtype)
        v_cache = torch.cat([v_cache, pad], dim=1)
    kc, vc = k_cache.permute(0, 2, 3, 1), v_cache.permute(0, 2, 1, 3)
    if k_cache.dtype == torch.bfloat16:
        kc = kc.reshape(n, h, d // 2, 2, bs).transpose(3, 4)
        vc = vc.reshape(n, h, -1, 2, d).transpose(3, 4)
    return kc.contiguous().view(n, h, d, bs), vc.contiguous().view(n, h, -1, d)


def random_trees(query_lens: list[int], seed: int) -> torch.Tensor:
    """A random draft tree per sequence (each token's parent an earlier token, or none), as a
    tree mask; rows of sequences too long for a mask get random bits (to be ignored)."""
    rng = random.Random(seed)
    bits: list[int] = []
    for n in query_lens:
        if n > TREE_ROWS:
            bits += [rng.randrange(-(1 << 63), 1 << 63) for _ in range(n)]
        else:
            bits += tree_bits([rng.randrange(-1, i) for i in range(n)])
    return torch.tensor(bits, dtype=torch.int64)


def cpu_attention(kern: CpuKernels, batch: tuple, scale: float, tree=None) -> torch.Tensor:
    """The batch's new K/V written into fresh CPU-layout caches, then attention over them."""
    q, k, v, k_cache, v_cache, meta, _ = batch
    kc, vc = to_cpu_layout(k_cache, v_cache)
    kern.write_kv(k, v, meta.slot_mapping, kc, vc)
    return kern.paged_attention(
        q, meta.query_start_loc, meta.seq_lens, meta.block_tables, kc, vc, scale, tree
    )


def reference(batch: tuple, scale: float, tree=None) -> torch.Tensor:
    q, k, v, k_cache, v_cache, meta, _ = batch
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention_reference(q, k_cache, v_cache, meta, scale, tree)


def assert_close_by_sequence(got: torch.Tensor, ref: torch.Tensor, meta, tol: float) -> None:
    assert not got.isnan().any(), "an unwritten (NaN) slot was read"
    for b in range(meta.num_seqs):
        rows = slice(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
        torch.testing.assert_close(
            got[rows], ref[rows], atol=tol, rtol=tol, msg=lambda m, b=b: f"sequence {b}: {m}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [RAGGED, VERIFY], ids=["mixed", "verify"])
@pytest.mark.parametrize(("block_size", "hq", "hkv", "d"), SHAPES)
def test_attention_matches_reference(
    dtype: torch.dtype,
    lens: tuple,
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    attn_kern: CpuKernels,
) -> None:
    q, k, v, k_cache, v_cache, meta, _ = random_paged_batch(
        *lens, block_size, hq, hkv, d, seed=block_size + d, dtype=dtype
    )
    backend = CpuAttentionBackend(attn_kern)
    assert backend.kv_cache_shapes(k_cache.shape[0], block_size, hkv, d) == (
        (k_cache.shape[0], hkv, d, block_size),
        (k_cache.shape[0], hkv, block_size + block_size % 2, d),
    )
    kc, vc = to_cpu_layout(k_cache, v_cache)
    qkv = torch.cat([q, k, v], dim=1).reshape(q.shape[0], -1)  # q, k, v as strided views
    qs = qkv[:, : hq * d].view(-1, hq, d)
    ks = qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d)
    vs = qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
    got = backend.forward(qs, ks, vs, kc, vc, meta, d**-0.5)
    ref = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
    assert_close_by_sequence(got, ref, meta, 1e-2 if dtype == torch.bfloat16 else 1e-5)
    # the new keys and values landed in their slots of the CPU layout, and nothing else moved
    ref_kc, ref_vc = to_cpu_layout(k_cache, v_cache)
    torch.testing.assert_close(kc, ref_kc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, ref_vc, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "hq", "hkv", "d"), [SHAPES[1], SHAPES[4], SHAPES[5]])
def test_tree_attention_matches_reference(
    dtype: torch.dtype, block_size: int, hq: int, hkv: int, d: int, attn_kern: CpuKernels
) -> None:
    """Each row sees the context and its ancestors in its sequence's draft tree; the 70-token
    prompt's mask entries are ignored (causal)."""
    batch = random_paged_batch(*VERIFY, block_size, hq, hkv, d, seed=d, dtype=dtype)
    tree = random_trees(VERIFY[0], seed=block_size)
    got = cpu_attention(attn_kern, batch, d**-0.5, tree)
    ref = reference(batch, d**-0.5, tree)
    assert_close_by_sequence(got, ref, batch[5], 1e-2 if dtype == torch.bfloat16 else 1e-5)
    causal = reference(batch, d**-0.5)
    assert not torch.allclose(got[:-70], causal[:-70], atol=1e-2), "the tree mask was ignored"


@pytest.mark.parametrize("dtype", DTYPES)
def test_peaked_scores_match_reference(dtype: torch.dtype, attn_kern: CpuKernels) -> None:
    """Scores tens apart, so that the running max moves between spans of keys."""
    q, k, v, k_cache, v_cache, meta, tables = random_paged_batch(
        *VERIFY, 16, 4, 2, 64, seed=3, dtype=dtype
    )
    batch = (q * 6, k * 2, v, k_cache * 2, v_cache, meta, tables)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    got = cpu_attention(attn_kern, batch, 0.125)
    assert_close_by_sequence(got, reference(batch, 0.125), meta, tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_over_a_large_cache_matches_reference(
    threads: int, attn_kern: CpuKernels
) -> None:
    """A call that reads more keys and values than a core's L2 prefetches the blocks of the
    spans ahead, across a thread's items: every item still runs once, with its own outputs."""
    query_lens = [1, 3, 1, 5] * 6  # decodes and verifications
    seq_lens = [300 + 7 * i for i in range(24)]  # 7.5 MB of float32 keys and values
    q, k, v, k_cache, v_cache, meta, _ = random_paged_batch(
        query_lens, seq_lens, 16, 4, 2, 64, seed=11
    )
    kc, vc = to_cpu_layout(k_cache, v_cache)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = CpuAttentionBackend(attn_kern).forward(q, k, v, kc, vc, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    ref = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_attention_reads_each_sequence_own_slots(attn_kern: CpuKernels) -> None:
    """Changing one cached key changes exactly the outputs of the sequence holding it, from the
    first query row that sees its position."""
    q, k, v, k_cache, v_cache, meta, tables = random_paged_batch(*RAGGED, 16, 4, 2, 64, seed=5)
    backend = CpuAttentionBackend(attn_kern)
    kc, vc = to_cpu_layout(k_cache, v_cache)
    before = backend.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    b, pos = 4, 37  # sequence 4: one decode row at position 63, context 0..62
    blk, off = tables[b][pos // 16], pos % 16
    kc[blk, 0, :, off] += 1.0  # kv head 0 -> query heads 0 and 1
    after = backend.forward(q, k, v, kc, vc, meta, 0.125)
    row = int(meta.query_start_loc[b])
    changed = (after != before).any(dim=-1)  # [T, Hq]
    expected = torch.zeros_like(changed)
    expected[row, :2] = True
    assert torch.equal(changed, expected)


def test_tree_mask_helpers_and_their_errors(attn_kern: CpuKernels) -> None:
    assert attn_kern.tree_rows == TREE_ROWS
    # a root, its two children, a grandchild under the second child
    assert tree_bits([-1, 0, 0, 2]) == [0b1, 0b11, 0b101, 0b1101]
    assert causal_tree_mask([3, 1]).tolist() == [0b1, 0b11, 0b111, 0b1]
    assert causal_tree_mask([65])[-1].item() == 0  # too long for a mask: causal, entries unused
    with pytest.raises(ValueError, match="token 2's parent"):
        tree_bits([-1, 0, 2])
    check_tree_mask(torch.tensor([*tree_bits([-1, 0, 0]), 1]), [3, 1])
    with pytest.raises(ValueError, match="row 1 must see itself"):
        check_tree_mask(torch.tensor([0b1, 0b01, 0b1]), [2, 1])
    with pytest.raises(ValueError, match="row 0 must see itself and only the 1 new tokens"):
        check_tree_mask(torch.tensor([0b11]), [1])
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        check_tree_mask(torch.tensor([1, 3], dtype=torch.int32), [2])
    q, _, _, kc, vc, meta, _ = random_paged_batch([2], [5], 4, 4, 2, 16)
    kc, vc = to_cpu_layout(kc, vc)
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        attn_kern.paged_attention(
            q, meta.query_start_loc, meta.seq_lens, meta.block_tables, kc, vc, 0.25,
            torch.tensor([1, 3], dtype=torch.int32),
        )  # fmt: skip
