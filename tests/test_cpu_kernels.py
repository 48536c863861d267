"""specbatch's CPU kernels against the pure-torch reference: the matrix multiply, the layer ops,
and attention over the paged cache on ragged batches of prompts, chunks, decodes and
verifications, in float32 and bfloat16. Every test fails if a kernel drops or mixes up a row,
a position, a head or a KV slot."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specbatch.kernels.build import cpu_flags, load_module
from specbatch.kernels.cpu import CpuKernels, cpu_kernels
from specbatch.model.layers.attention import AttentionMetadata, TorchAttentionBackend
from specbatch.model.layers.cpu_attention import CpuAttentionBackend
from specbatch.model.layers.norm import RMSNorm
from specbatch.model.layers.rotary import RotaryEmbedding
from specbatch.model.loader import load_model
from tests.helpers import random_paged_batch

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels do not build here")
DTYPES = [torch.float32, torch.bfloat16]


def kernels() -> CpuKernels:
    assert KERNELS is not None
    return KERNELS


@functools.cache
def avx2_kernels() -> CpuKernels:
    return CpuKernels(load_module(avx2_only=True))


@pytest.fixture(
    params=[
        "native",
        pytest.param(
            "avx2",
            marks=pytest.mark.skipif(
                "avx512f" not in cpu_flags(), reason="the native build is the AVX2 build here"
            ),
        ),
    ]
)
def kern(request: pytest.FixtureRequest) -> CpuKernels:
    """The op-level tests run on this CPU's build and, where it has AVX-512, on the AVX2 build
    too (the same sources with 16-lane vectors as register pairs)."""
    return kernels() if request.param == "native" else avx2_kernels()


# --- matrix multiply ------------------------------------------------------------------------


# bfloat16 multiplies run on AMX tiles where the CPU has them (K a multiple of 32), else on
# AVX-512 BF16 dot products or, without them, as FMA pairs; each path is tested where it exists.
LINEAR_PATHS = [
    (torch.float32, False),
    (torch.bfloat16, False),
    pytest.param(
        torch.bfloat16, True,
        marks=pytest.mark.skipif(
            KERNELS is None or not KERNELS.amx_available, reason="no AMX on this CPU"
        ),
    ),
]  # fmt: skip


@pytest.fixture
def amx_path(request: pytest.FixtureRequest, kern: CpuKernels):
    """Sets the bfloat16 path for one test (the parametrised ``amx``) and restores it."""
    amx = request.getfixturevalue("amx")
    if amx and not kern.amx_available:
        pytest.skip("no AMX in this build")
    before = kern.amx
    yield kern.use_amx(amx)
    kern.use_amx(before)


@pytest.mark.parametrize(("dtype", "amx"), LINEAR_PATHS)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 704, 256),
        (2, 300, 33),
        (3, 17, 7),
        (3, 200, 64),
        (6, 100, 33),
        (70, 48, 64),
        (20, 100, 96),
        (17, 4096, 256),
        (9, 50, 260),
        (24, 70, 301),
    ],
)
def test_linear_matches_torch(
    dtype: torch.dtype, amx: bool, amx_path: bool, m: int, n: int, k: int, kern: CpuKernels
) -> None:
    assert amx_path == amx
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    packed = kern.pack_linear(w)
    ref = F.linear(x.float(), w.float(), b.float())
    got = kern.linear(x, packed, b, out_dtype=torch.float32)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, ref, atol=1e-4 * k**0.5, rtol=1e-5)
    rounded = kern.linear(x, packed, b)
    assert rounded.dtype == dtype
    torch.testing.assert_close(rounded, got.to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize(("dtype", "amx"), LINEAR_PATHS)
@pytest.mark.parametrize(
    ("n", "k", "bias"), [(72, 96, True), (72, 100, True), (72, 301, True), (4096, 256, False)]
)
def test_linear_row_does_not_depend_on_the_batch(
    dtype: torch.dtype, amx: bool, amx_path: bool, n: int, k: int, bias: bool, kern: CpuKernels
) -> None:
    """A row's output has the same bits whatever the number of rows in the call and the row's
    place among them (up to four rows one tile, then tall tiles, one or several; K in one block
    or several): in the input dtype and as float32 (the LM head's logits, where a rounding to
    bfloat16 would hide a difference)."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(37, k, generator=gen).to(dtype)
    packed = kern.pack_linear(torch.randn(n, k, generator=gen).to(dtype))
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    for out in (None, torch.float32):
        whole = kern.linear(x, packed, b, out_dtype=out)
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 37):
            for start in sorted({0, (37 - rows) // 2, 37 - rows}):
                part = kern.linear(x[start : start + rows], packed, b, out_dtype=out)
                assert torch.equal(part, whole[start : start + rows]), (
                    f"{rows} rows from row {start} ({out or dtype} out) differ from the same rows "
                    "in a batch of 37"
                )


# --- layer ops --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, kern: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(200, 1e-5, dtype=dtype, device="cpu")
    norm.weight.data.copy_(torch.randn(200, generator=gen))
    x = torch.randn(9, 200, generator=gen).to(dtype)
    residual = torch.randn(9, 200, generator=gen).to(dtype)
    ref_out, ref_res = norm.add_and_norm(x, residual.clone())
    ref_plain = norm(x)
    norm.use_cpu_kernels(kern)
    res = residual.clone()
    out, res_out = norm.add_and_norm(x, res)
    assert res_out is res  # the sum is written into the residual in place
    tol = 0 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(norm(x), ref_plain, atol=tol, rtol=tol)
    heads = x.view(9, 5, 40)[:, :, :]
    head_norm = RMSNorm(40, 1e-6, dtype=dtype, device="cpu")
    head_norm.weight.data.copy_(torch.randn(40, generator=gen))
    ref_heads = head_norm.norm_heads_(heads.clone())
    head_norm.use_cpu_kernels(kern)
    got_heads = heads.clone()
    head_norm.norm_heads_(got_heads)
    torch.testing.assert_close(got_heads, ref_heads, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_heads(dtype: torch.dtype, kern: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(2)
    d, hq, hkv = 32, 4, 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    rope = RotaryEmbedding(d, inv_freq, max_positions=300)
    qkv = torch.randn(11, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 300, (11,), generator=gen)
    q, k = qkv[:, : hq * d].view(11, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(11, hkv, d)
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    untouched = qkv[:, (hq + hkv) * d :].clone()
    rope.use_cpu_kernels(kern)
    got_q, got_k = rope(positions, q, k)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # torch rounds each product in bfloat16
    torch.testing.assert_close(got_q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, ref_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (hq + hkv) * d :], untouched), "v was written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype, kern: CpuKernels) -> None:
    x = (torch.randn(7, 2 * 90, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    ref = F.silu(x[:, :90]) * x[:, 90:]
    tol = 0 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(kern.silu_and_mul(x), ref, atol=tol, rtol=tol)


# --- attention --------------------------------------------------------------------------

# (query_lens, seq_lens): whole prompts, a prompt chunk on cached context, one-token decodes,
# gamma + 1 verifications, and a long prompt spanning many blocks, in one ragged batch.
RAGGED = ([7, 1, 3, 20, 1, 5, 40, 2], [7, 1, 30, 45, 64, 5, 40, 9])


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "hq", "hkv", "d"),
    [(4, 4, 2, 16), (16, 4, 2, 64), (32, 6, 2, 32), (16, 8, 1, 128), (16, 3, 3, 64), (5, 4, 2, 32)],
)
def test_attention_matches_reference(
    dtype: torch.dtype, block_size: int, hq: int, hkv: int, d: int, kern: CpuKernels
) -> None:
    q, k, v, k_cache, v_cache, meta, _ = random_paged_batch(
        *RAGGED, block_size, hq, hkv, d, seed=block_size + d, dtype=dtype
    )
    backend = CpuAttentionBackend(kern)
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
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert not got.isnan().any(), "an unwritten (NaN) slot was read"
    for b in range(meta.num_seqs):
        rows = slice(int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1]))
        torch.testing.assert_close(
            got[rows], ref[rows], atol=tol, rtol=tol, msg=lambda m, b=b: f"sequence {b}: {m}"
        )
    # the new keys and values landed in their slots of the CPU layout, and nothing else moved
    ref_kc, ref_vc = to_cpu_layout(k_cache, v_cache)
    torch.testing.assert_close(kc, ref_kc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, ref_vc, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_over_a_large_cache_matches_reference(threads: int, kern: CpuKernels) -> None:
    """A call that reads more keys and values than a core's L2 prefetches each work item's
    during the one before, a thread running consecutive items: every item still runs once,
    with its own outputs."""
    query_lens = [1, 3, 1, 5] * 6  # decodes and verifications
    seq_lens = [300 + 7 * i for i in range(24)]  # 7.5 MB of float32 keys and values
    q, k, v, k_cache, v_cache, meta, _ = random_paged_batch(
        query_lens, seq_lens, 16, 4, 2, 64, seed=11
    )
    kc, vc = to_cpu_layout(k_cache, v_cache)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = CpuAttentionBackend(kern).forward(q, k, v, kc, vc, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    ref = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_attention_reads_each_sequence_own_slots(kern: CpuKernels) -> None:
    """Changing one cached key changes exactly the outputs of the sequence holding it, from the
    first query row that sees its position."""
    q, k, v, k_cache, v_cache, meta, tables = random_paged_batch(*RAGGED, 16, 4, 2, 64, seed=5)
    backend = CpuAttentionBackend(kern)
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


# --- whole model ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_with_kernels_matches_pure_torch(
    make_checkpoint, dtype: torch.dtype, arch: str
) -> None:
    from tests.test_model import SCHEDULE, random_tokens, run_schedule

    path: Path = make_checkpoint(arch)
    fast = load_model(path, dtype, "cpu")
    slow = load_model(path, dtype, "cpu", attention_backend=TorchAttentionBackend(),
                      use_cpu_kernels=False)  # fmt: skip
    assert isinstance(fast.attention_backend, CpuAttentionBackend)
    assert fast.model.layers[0].mlp.down_proj.packed is not None or dtype == torch.bfloat16
    lengths = [sum(step[b] for step in SCHEDULE) for b in range(len(SCHEDULE[0]))]
    tokens = random_tokens(lengths, fast.vocab_size, seed=random.Random(arch).randrange(99))
    got = run_schedule(fast, tokens, SCHEDULE)
    ref = run_schedule(slow, tokens, SCHEDULE)
    tol = 0.1 if dtype == torch.bfloat16 else 1e-4
    for o, r in zip(got, ref, strict=True):
        torch.testing.assert_close(o, r, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_flat_forward_is_the_module_path_bit_for_bit(
    make_checkpoint, dtype: torch.dtype, arch: str
) -> None:
    """The decoder stack as flat kernel calls (CpuDecoderPlan) gives the module path's hidden
    states, residual streams and K/V, bit for bit, over prompts, chunks and decodes."""
    model = load_model(make_checkpoint(arch, num_layers=3), dtype, "cpu")
    plan = model.model.cpu_plan
    assert plan is not None
    lens, ctx, bs = [7, 1, 3, 12, 1], [0, 20, 9, 0, 33], 4
    tables, used = [], 0
    for n in (-(-(q + c) // bs) for q, c in zip(lens, ctx, strict=True)):
        tables.append(list(range(used, used + n)))
        used += n
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(lens, ctx, strict=True)])
    for p in model.parameters():  # re-pointed after the plan was built, as share_weights does
        p.data = p.data.clone()
    results = []
    for use_plan in (True, False):
        model.model.cpu_plan = plan if use_plan else None
        caches = model.allocate_kv_caches(used, bs)
        for k, v in caches:  # earlier context: the same random K/V for both paths
            k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(2)))
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(3)))
        meta = AttentionMetadata.from_lists(lens, [q + c for q, c in zip(lens, ctx)], tables, bs)
        hidden, streams = model.model(ids, positions, caches, meta, streams=(0, 2, 3))
        results.append((hidden, streams, [t for kv in caches for t in kv]))
    (h1, s1, c1), (h2, s2, c2) = results
    assert torch.equal(h1, h2)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(c1, c2, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_row_does_not_depend_on_the_batch_or_the_chunking(
    dtype: torch.dtype, kern: CpuKernels
) -> None:
    """A sequence's outputs are bit-identical alone and inside the ragged batch, and when its
    new tokens come in two chunks instead of one."""
    from specbatch.model.layers.attention import AttentionMetadata

    q, k, v, k_cache, v_cache, meta, tables = random_paged_batch(
        *RAGGED, 16, 6, 2, 64, seed=9, dtype=dtype
    )
    backend = CpuAttentionBackend(kern)
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


def test_dtype_auto_on_a_cpu() -> None:
    """float32 weights stay float32; 16-bit weights run in bfloat16 on the kernels."""
    from types import SimpleNamespace

    from specbatch.model.checkpoint import resolve_dtype

    assert resolve_dtype("auto", SimpleNamespace(dtype="float32"), "cpu") == torch.float32
    want = torch.bfloat16
    assert resolve_dtype("auto", SimpleNamespace(dtype="bfloat16"), "cpu") == want
    assert resolve_dtype("auto", SimpleNamespace(torch_dtype="float16"), "cpu") == want
    assert resolve_dtype("float32", SimpleNamespace(dtype="bfloat16"), "cpu") == torch.float32
