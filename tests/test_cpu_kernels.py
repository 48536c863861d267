"""specbatch's CPU kernels against the pure-torch reference: the matrix multiply, the layer ops
and whole models on the kernels, in float32 and bfloat16 (attention: test_cpu_attention.py).
Every test fails if a kernel drops or mixes up a row, a position or a head."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specbatch.kernels.cpu import CpuKernels, cpu_kernels
from specbatch.model.layers.attention import AttentionMetadata, TorchAttentionBackend
from specbatch.model.layers.cpu_attention import CpuAttentionBackend
from specbatch.model.layers.norm import RMSNorm
from specbatch.model.layers.rotary import RotaryEmbedding
from specbatch.model.loader import load_model
from specbatch.worker.rejection_sampler import rejection_sample, rejection_sample_reference
from specbatch.worker.sampler import sample_reference

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels do not build here")
DTYPES = [torch.float32, torch.bfloat16]


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


def test_sampling_is_the_torch_reference_token_for_token(kern: CpuKernels) -> None:
    """The same token as ``sample_reference`` for every row: sparse rows (zero-mass tokens at
    the ends), u = 0 and u just below 1, unnormalised rows, vocabularies from 2 to 50,000; a
    row holding NaN stays inside the vocabulary."""
    g = torch.Generator().manual_seed(0)
    for trial in range(240):
        n, v = 1 + trial % 9, (2, 7, 4096, 50_000)[trial % 4]
        p = torch.softmax(torch.randn(n, v, generator=g) * (1 + trial % 5), dim=-1)
        if trial % 3 == 0:
            p[p < p.median()] = 0.0
        if trial % 4 == 1:
            p = p * 3.7  # unnormalised
        u = torch.rand(n, generator=g)
        u[0] = 0.0 if trial % 2 else 1.0 - 2**-24
        assert torch.equal(kern.sample_rows(p, u), sample_reference(p, u)), trial
    p = torch.softmax(torch.randn(3, 100, generator=g), dim=-1)
    p[1, 5] = float("nan")
    token = kern.sample_rows(p, torch.rand(3, generator=g))
    assert ((token >= 0) & (token < 100)).all()


def test_rejection_rule_is_the_torch_reference_token_for_token(kern: CpuKernels) -> None:
    """The same accepted counts and tokens as ``rejection_sample_reference``: drafts the draft
    favours (mostly accepted) and ones it does not, ragged chains, point masses (no q), rows
    where p equals q (no residual mass), NaN in padding and in a residual."""
    g = torch.Generator().manual_seed(1)
    accepted = rejected = 0
    for trial in range(300):
        b, gamma, v = 1 + trial % 5, trial % 4, (3, 50, 4096)[trial % 3]
        p = torch.softmax(torch.randn(b, gamma + 1, v, generator=g) * 2, dim=-1)
        noise = torch.randn(b, gamma, v, generator=g) * (0.2 if trial % 2 else 3.0)
        q = torch.softmax(torch.log(p[:, :gamma]) + noise, dim=-1)
        if trial % 7 == 0 and gamma:
            q[0, 0] = p[0, 0]  # no residual mass at the first draft
        ids = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, gamma) if gamma else (
            torch.zeros(b, 0, dtype=torch.int64))  # fmt: skip
        counts = torch.randint(0, gamma + 1, (b,), generator=g)
        for r in range(b):  # padding past a request's drafts may hold anything
            p[r, counts[r] + 1 :] = float("nan")
            q[r, counts[r] :] = float("nan")
        if trial % 11 == 0 and gamma:
            q[0, 0, 1] = float("nan")  # a NaN residual falls back to p
        au, fu = torch.rand(b, gamma, generator=g), torch.rand(b, generator=g)
        for qq in (q, None) if trial % 3 else (q,):
            got = rejection_sample(ids, counts, qq, p, au, fu)
            ref = rejection_sample_reference(ids, counts, qq, p, au, fu)
            assert torch.equal(got.num_accepted, ref.num_accepted), trial
            assert torch.equal(got.token_ids, ref.token_ids), trial
            accepted += int(got.num_accepted.sum())
            rejected += int((got.num_accepted < counts).sum())
    assert accepted > 100 and rejected > 100  # both paths were taken


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
    states, residual streams and K/V, bit for bit, over prompts, chunks and decodes, and reads
    weights re-pointed after it was built once refreshed."""
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
        p.data = p.data.clone() * 1.5  # other values: a plan still reading the old ones fails
    plan.refresh()
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


def test_dtype_auto_on_a_cpu() -> None:
    """float32 weights stay float32; 16-bit weights run in bfloat16 on the kernels."""
    from types import SimpleNamespace

    from specbatch.model.checkpoint import resolve_dtype

    assert resolve_dtype("auto", SimpleNamespace(dtype="float32"), "cpu") == torch.float32
    want = torch.bfloat16
    assert resolve_dtype("auto", SimpleNamespace(dtype="bfloat16"), "cpu") == want
    assert resolve_dtype("auto", SimpleNamespace(torch_dtype="float16"), "cpu") == want
    assert resolve_dtype("float32", SimpleNamespace(dtype="bfloat16"), "cpu") == torch.float32
