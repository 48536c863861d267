"""TorchAttentionBackend against a naive per-sequence, per-position reference."""

from __future__ import annotations

import pytest
import torch

from specbatch.errors import InvalidInputError
from specbatch.model.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
)
from specbatch.model.layers.backend_choice import select_backend
from tests.helpers import random_paged_batch

BLOCK_SIZE = 4


def naive_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    scale: float,
) -> torch.Tensor:
    """Reads every key position by position through the block table; float64 softmax."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    hq = q.shape[1]
    out = torch.empty_like(q)
    row = 0
    for q_len, s_len, table in zip(query_lens, seq_lens, tables, strict=True):
        keys = torch.stack([k_cache[table[p // bs], p % bs] for p in range(s_len)])  # [S,Hkv,D]
        vals = torch.stack([v_cache[table[p // bs], p % bs] for p in range(s_len)])
        for i in range(q_len):
            visible = s_len - q_len + i + 1
            for h in range(hq):
                kh = keys[:visible, h // (hq // hkv)].double()
                vh = vals[:visible, h // (hq // hkv)].double()
                w = torch.softmax(kh @ q[row + i, h].double() * scale, dim=0)
                out[row + i, h] = (w @ vh).to(q.dtype)
        row += q_len
    return out


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple:
    return random_paged_batch(query_lens, seq_lens, BLOCK_SIZE, hq, hkv, d, seed, dtype)


# prompt (long), decode, verification, long chunk on top of context, short prompt, short chunk
MIXED_Q = [20, 1, 4, 18, 16, 5]
MIXED_S = [20, 13, 30, 41, 16, 9]


@pytest.mark.parametrize("short_query_max", [0, 4, 16, 64])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_naive(short_query_max: int, hq: int, hkv: int) -> None:
    d, scale = 8, 8**-0.5
    q, k, v, k_cache, v_cache, meta, tables = make_batch(MIXED_Q, MIXED_S, hq, hkv, d)
    backend = TorchAttentionBackend(short_query_max=short_query_max)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    # the new tokens' K/V were written at their slots
    flat_k = k_cache.view(-1, hkv, d)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k)
    torch.testing.assert_close(v_cache.view(-1, hkv, d)[meta.slot_mapping], v)
    ref = naive_attention(q, k_cache, v_cache, MIXED_Q, MIXED_S, tables, scale)
    assert out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_all_decode_batch_and_metadata_reuse_across_layers() -> None:
    q_lens, s_lens = [1] * 7, [1, 2, 5, 9, 4, 17, 3]
    q, k, v, k_cache, v_cache, meta, tables = make_batch(q_lens, s_lens, 4, 2, 16, seed=3)
    backend = TorchAttentionBackend()
    out1 = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    ref = naive_attention(q, k_cache, v_cache, q_lens, s_lens, tables, 0.25)
    torch.testing.assert_close(out1, ref, atol=1e-5, rtol=1e-5)
    assert meta.derived, "the plan should be memoised on the metadata for the next layer"
    # a second "layer" with its own cache reuses the plan
    k_cache2, v_cache2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    k_cache2.copy_(torch.nan_to_num(k_cache, nan=0.0))
    v_cache2.copy_(torch.nan_to_num(v_cache, nan=0.0))
    out2 = backend.forward(q, k, v, k_cache2, v_cache2, meta, 0.25)
    torch.testing.assert_close(out2, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32() -> None:
    q, k, v, kc, vc, meta, tables = make_batch(MIXED_Q, MIXED_S, 4, 2, 16, dtype=torch.bfloat16)
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.25)
    assert out.dtype == torch.bfloat16
    ref = naive_attention(q.float(), kc.float(), vc.float(), MIXED_Q, MIXED_S, tables, 0.25)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_metadata_from_lists_slots() -> None:
    meta = AttentionMetadata.from_lists([2, 1], [6, 3], [[5, 2], [7]], block_size=4)
    # seq 0: positions 4, 5 -> block 2 offsets 0, 1; seq 1: position 2 -> block 7 offset 2
    assert meta.slot_mapping.tolist() == [8, 9, 30]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[5, 2], [7, 0]]
    assert meta.num_seqs == 2 and meta.num_tokens == 3
    with pytest.raises(ValueError, match="q_len"):
        AttentionMetadata.from_lists([4], [3], [[0]], block_size=4)
    with pytest.raises(ValueError, match="too narrow"):
        AttentionMetadata.from_lists([1], [9], [[0, 1]], block_size=4)


class _Paged256(AttentionBackend):
    name = "paged256"
    block_size_multiple = 256

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_check_block_size() -> None:
    TorchAttentionBackend.check_block_size(1)
    TorchAttentionBackend.check_block_size(16)
    for bad in (0, -4, 2.5, "16"):
        with pytest.raises(InvalidInputError, match="block_size must be a positive integer"):
            TorchAttentionBackend.check_block_size(bad)  # type: ignore[arg-type]
    _Paged256.check_block_size(512)
    with pytest.raises(InvalidInputError, match="block_size must be a positive multiple of 256"):
        _Paged256.check_block_size(16)


def test_select_backend() -> None:
    assert isinstance(select_backend("cpu"), TorchAttentionBackend)
    assert isinstance(select_backend(torch.device("cpu"), "torch"), TorchAttentionBackend)
    with pytest.raises(InvalidInputError, match="attention_backend 'flash' is not available"):
        select_backend("cpu", "flash")


def naive_tree_attention(q, k_cache, v_cache, query_lens, seq_lens, tables, scale, visible):
    """``visible[row]``: the key indices query row ``row`` sees."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    hq = q.shape[1]
    out = torch.empty_like(q)
    row = 0
    for q_len, s_len, table in zip(query_lens, seq_lens, tables, strict=True):
        keys = torch.stack([k_cache[table[p // bs], p % bs] for p in range(s_len)])
        vals = torch.stack([v_cache[table[p // bs], p % bs] for p in range(s_len)])
        for i in range(q_len):
            idx = torch.tensor(visible[row + i])
            for h in range(hq):
                kh = keys[idx, h // (hq // hkv)].double()
                vh = vals[idx, h // (hq // hkv)].double()
                w = torch.softmax(kh @ q[row + i, h].double() * scale, dim=0)
                out[row + i, h] = (w @ vh).to(q.dtype)
        row += q_len
    return out


def tree_batch(hq: int, hkv: int, d: int, seed: int = 0):
    """A ragged batch mixing a prompt, a decode, a chain, a prompt chunk and three trees: one
    over its new rows only (a verification), one whose tree starts before its new rows (a
    drafter's later depth) and one of 17 rows."""
    import random

    from specbatch.model.layers.attention import AttentionMetadata

    rng = random.Random(seed)
    q_lens = [20, 1, 4, 9, 7, 3, 17]
    s_lens = [20, 13, 30, 41, 23, 30, 50]
    starts = [-1, -1, -1, -1, 16, 24, 33]  # the 3-row tree's keys start 3 before its rows
    q, k, v, k_cache, v_cache, _, tables = random_paged_batch(
        q_lens, s_lens, BLOCK_SIZE, hq, hkv, d, seed
    )
    # the tree region's older keys (before the new rows) were written by earlier passes
    masks: list[int] = []
    visible: list[list[int]] = []
    for q_len, s_len, first in zip(q_lens, s_lens, starts, strict=True):
        ctx = s_len - q_len
        if first < 0:
            for i in range(q_len):
                masks.append(0)
                visible.append(list(range(ctx + i + 1)))
            continue
        # parents among the tree's keys: a random tree whose nodes are in key order
        size = s_len - first
        parent = [-1] + [rng.randrange(0, j) for j in range(1, size)]
        anc = []
        for j in range(size):
            bits, a = 0, j
            while a >= 0:
                bits |= 1 << a
                a = parent[a]
            anc.append(bits)
        for i in range(q_len):
            j = ctx - first + i
            masks.append(anc[j])
            visible.append(list(range(first)) + [first + b for b in range(size) if anc[j] >> b & 1])
    for b, (q_len, s_len, first) in enumerate(zip(q_lens, s_lens, starts, strict=True)):
        for p in range(max(first, 0), s_len - q_len):
            k_cache[tables[b][p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(hkv, d)
            v_cache[tables[b][p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(hkv, d)
    meta = AttentionMetadata.from_lists(
        q_lens, s_lens, tables, BLOCK_SIZE, tree_starts=starts, tree_masks=masks
    )
    return q, k, v, k_cache, v_cache, meta, tables, q_lens, s_lens, visible


@pytest.mark.parametrize("short_query_max", [0, 8, 64])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 4), (6, 1)])
def test_tree_masks_match_naive(short_query_max: int, hq: int, hkv: int) -> None:
    d, scale = 8, 8**-0.5
    q, k, v, k_cache, v_cache, meta, tables, q_lens, s_lens, visible = tree_batch(hq, hkv, d)
    out = TorchAttentionBackend(short_query_max=short_query_max).forward(
        q, k, v, k_cache, v_cache, meta, scale
    )
    ref = naive_tree_attention(q, k_cache, v_cache, q_lens, s_lens, tables, scale, visible)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_takes_trees_that_start_before_the_new_rows(dtype: torch.dtype) -> None:
    """The drafter's passes over a tree: earlier depths' nodes are keys in the cache, masked
    like the new rows. The CPU kernel against the torch reference, with every sequence's
    context written by each backend in a first pass."""
    from specbatch.kernels.cpu import cpu_kernels
    from specbatch.model.layers.cpu_attention import CpuAttentionBackend

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build here")
    hq, hkv, d, scale = 4, 2, 32, 32**-0.5
    *_, q_lens, s_lens, _visible = tree_batch(hq, hkv, d)
    q, k, v, _, _, meta, tables = random_paged_batch(q_lens, s_lens, BLOCK_SIZE, hq, hkv, d, 3)
    ctx = [s - n for s, n in zip(s_lens, q_lens, strict=True)]
    gen = torch.Generator().manual_seed(5)
    prefill = [torch.randn(sum(ctx), h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    has = [i for i, c in enumerate(ctx) if c]
    first = AttentionMetadata.from_lists(
        [ctx[i] for i in has], [ctx[i] for i in has], [tables[i] for i in has], BLOCK_SIZE
    )
    _, _, _, _, _, tree_meta, *_ = tree_batch(hq, hkv, d)
    outs = []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend(kernels)):
        shapes = backend.kv_cache_shapes(64, BLOCK_SIZE, hkv, d)
        k_cache = torch.zeros(shapes[0], dtype=dtype)
        v_cache = torch.zeros(shapes[1], dtype=dtype)
        backend.forward(*prefill, k_cache, v_cache, first, scale)
        meta.tree_starts, meta.tree_masks = tree_meta.tree_starts, tree_meta.tree_masks
        outs.append(backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), k_cache, v_cache,
                                    meta, scale).float())  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
