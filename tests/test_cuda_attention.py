"""The CUDA attention backends (flash-attn, xformers) run on the CPU: their input preparation and
layouts are checked by handing them CPU reference kernels written from each kernel's documented
contract, and comparing with TorchAttentionBackend (the oracle). Also: backend selection."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from specbatch.errors import InvalidInputError
from specbatch.model.layers import backend_choice
from specbatch.model.layers.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
)
from specbatch.model.layers.backend_choice import _auto_choice, select_backend
from specbatch.model.layers.flash_attn_backend import (
    FlashAttnBackend,
    FlashInputs,
    flash_inputs,
    prepare_flash_inputs,
)
from specbatch.model.layers.xformers_backend import (
    XFormersBackend,
    XFormersInputs,
    choose_route,
    prepare_xformers_inputs,
    xformers_inputs,
)
from tests.helpers import random_paged_batch

# ---- reference kernels (independent of TorchAttentionBackend) ---------------------------------


def _attend_one(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``[Sq, H, D]``, keys/vals ``[Sk, H, D]`` (heads already aligned) -> ``[Sq, H, D]``.

    Causal aligned bottom-right: row i sees keys 0 .. Sk - Sq + i; a row that sees no key is 0.
    Explicit float64 softmax."""
    sq, sk = q.shape[0], keys.shape[0]
    if sk == 0:
        return q.new_zeros(q.shape, dtype=torch.float64)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * scale
    visible = torch.arange(sk)[None, :] <= (sk - sq + torch.arange(sq))[:, None]  # [Sq, Sk]
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).clamp_min(-1e300)  # finite for all-masked rows
    weights = torch.exp(scores - row_max).masked_fill(~visible, 0.0)
    denom = weights.sum(-1, keepdim=True)
    weights = torch.where(denom > 0, weights / denom.clamp_min(1e-300), weights)
    return torch.einsum("hqk,khd->qhd", weights, vals.double())


def flash_varlen_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` with a paged cache, as its docstring defines it: ragged q by
    cu_seqlens_q; sequence b reads the first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` positions
    of its pages through the int32 block_table; query head h uses KV head h // (Hq / Hkv)."""
    assert causal
    for t in (cu_seqlens_q, cu_seqlens_k, block_table):
        assert t.dtype == torch.int32
    assert block_table.is_contiguous()
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    hq = q.shape[1]
    heads = torch.arange(hq) // (hq // hkv)
    cq, ck, tables = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), block_table.tolist()
    assert len(cq) == len(ck) == len(tables) + 1 and cq[-1] == q.shape[0]
    out = torch.empty_like(q)
    for b, table in enumerate(tables):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        assert 0 < sq <= max_seqlen_q and 0 <= sk <= max_seqlen_k
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(sk)], dtype=torch.long)
        keys = k_cache.reshape(-1, hkv, k_cache.shape[-1])[slots]  # [Sk, Hkv, D]
        vals = v_cache.reshape(-1, hkv, v_cache.shape[-1])[slots]
        o = _attend_one(q[cq[b] : cq[b + 1]], keys[:, heads], vals[:, heads], softmax_scale)
        out[cq[b] : cq[b + 1]] = o.to(q.dtype)
    return out


def xformers_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    inputs: XFormersInputs,
    scale: float,
    split_k: bool,
) -> torch.Tensor:
    """``memory_efficient_attention_forward`` with the paged bottom-right causal bias built from
    ``inputs``: query ``[1, T, H, D]`` / ``[1, T, G, Hg, D]``, key and value the pool
    ``[1, N, ...]`` with the same head axes; sequence b's logical key p lives at pool row
    ``block_tables[b, p // page] * page + p % page``; causal from the bottom right."""
    assert query.shape[0] == key.shape[0] == 1 and query.ndim == key.ndim in (4, 5)
    assert query.shape[2:-1] == key.shape[2:-1] == value.shape[2:-1]
    assert inputs.block_tables.dtype == torch.int32
    page = inputs.page_size
    assert key.shape[1] % page == 0
    assert inputs.kv_padding == inputs.block_tables.shape[1] * page
    assert all(n <= inputs.kv_padding for n in inputs.kv_seqlen)
    assert sum(inputs.q_seqlen) == query.shape[1]
    if split_k:  # what xformers' Triton split-K operator accepts with a causal bias
        assert len(set(inputs.q_seqlen)) == 1 and inputs.q_seqlen[0] <= 16 and page % 64 == 0
    d = query.shape[-1]
    q = query[0].reshape(query.shape[1], -1, d)
    k = key[0].reshape(key.shape[1], -1, d)
    v = value[0].reshape(value.shape[1], -1, d)
    out = torch.empty_like(q)
    start = 0
    for table, sq, sk in zip(inputs.block_tables.tolist(), inputs.q_seqlen, inputs.kv_seqlen):
        rows = torch.tensor(
            [table[p // page] * page + p % page for p in range(sk)], dtype=torch.long
        )
        o = _attend_one(q[start : start + sq], k[rows], v[rows], scale)
        out[start : start + sq] = o.to(q.dtype)
        start += sq
    return out.reshape(query.shape)


class Spy:
    """Wraps a kernel, recording every call's positional arguments past the tensors."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self.calls: list[tuple] = []

    def __call__(self, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        self.calls.append(args[3:])
        return self.fn(*args, **kwargs)


# ---- batches ----------------------------------------------------------------------------------


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    hq: int,
    hkv: int,
    d: int,
    seed: int = 0,
) -> tuple:
    """``random_paged_batch`` without its tables."""
    return random_paged_batch(query_lens, seq_lens, block_size, hq, hkv, d, seed)[:6]


def random_mix(seed: int, block_size: int) -> tuple[list[int], list[int]]:
    """A prompt, a prompt chunk on top of context, two one-token decodes and two gamma+1-token
    verifications, in random order, lengths crossing block boundaries."""
    rng = random.Random(seed)
    kinds: list[tuple[int, int]] = []
    n = rng.randint(1, 2 * block_size)
    kinds.append((n, n))  # prompt
    ctx = rng.randint(1, 2 * block_size)
    chunk = rng.randint(17, block_size)
    kinds.append((chunk, ctx + chunk))  # prompt chunk
    for _ in range(2):
        kinds.append((1, rng.randint(1, 3 * block_size)))  # decode
    for _ in range(2):
        g1 = rng.randint(2, 6)
        kinds.append((g1, rng.randint(0, 2 * block_size) + g1))  # verification
    rng.shuffle(kinds)
    return [a for a, _ in kinds], [b for _, b in kinds]


def uniform(seed: int, q_len: int, n: int, block_size: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [q_len] * n, [q_len + rng.randint(0, 3 * block_size) for _ in range(n)]


def run_pair(backend, lens, block_size, hq, hkv, d, seed):  # type: ignore[no-untyped-def]
    """Output of ``backend`` and of the torch oracle on copies of the same batch and caches."""
    q, k, v, kc, vc, meta = make_batch(*lens, block_size, hq, hkv, d, seed)
    kc2, vc2 = kc.clone(), vc.clone()
    meta2 = AttentionMetadata.from_lists(
        meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables.tolist(), block_size
    )
    ref = TorchAttentionBackend().forward(q, k, v, kc2, vc2, meta2, d**-0.5)
    out = backend.forward(q, k, v, kc, vc, meta, d**-0.5)
    # the backend wrote the new tokens' K/V into their slots, like the oracle
    torch.testing.assert_close(kc.view(-1, hkv, d)[meta.slot_mapping], k)
    torch.testing.assert_close(vc.view(-1, hkv, d)[meta.slot_mapping], v)
    return out, ref, meta


HEADS = [(4, 2), (6, 2), (4, 4), (3, 1)]

# ---- flash-attn ------------------------------------------------------------------------------

FIXED_Q = [300, 200, 1, 1, 5, 5]  # prompt, chunk on 350 tokens, decodes, verifications
FIXED_S = [300, 550, 257, 1, 512, 40]


@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_flash_matches_torch(hq: int, hkv: int, seed: int | None) -> None:
    lens = (FIXED_Q, FIXED_S) if seed is None else random_mix(seed, 256)
    spy = Spy(flash_varlen_reference)
    out, ref, meta = run_pair(FlashAttnBackend(kernel=spy), lens, 256, hq, hkv, 8, seed or 0)
    assert len(spy.calls) == 1, "one kernel call per forward"
    assert isinstance(meta.derived["flash-attn"], FlashInputs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_flash_inputs_hand_checked() -> None:
    meta = AttentionMetadata.from_lists([2, 1, 3], [6, 3, 3], [[5, 2], [7], [1]], block_size=4)
    fi = prepare_flash_inputs(meta)
    for t in (fi.cu_seqlens_q, fi.cu_seqlens_k, fi.block_table):
        assert t.dtype == torch.int32
    assert fi.cu_seqlens_q.tolist() == [0, 2, 3, 6]
    assert fi.cu_seqlens_k.tolist() == [0, 6, 9, 12]
    assert fi.block_table.tolist() == [[5, 2], [7, 0], [1, 0]]
    assert fi.block_table.is_contiguous()
    assert (fi.max_seqlen_q, fi.max_seqlen_k) == (3, 6)
    assert flash_inputs(meta) is flash_inputs(meta), "memoised for the next layer"


def test_flash_reference_catches_corrupted_inputs() -> None:
    """The comparison above can fail: an off-by-one context length or a wrong block table,
    handed to the reference kernel, gives an output far from the oracle's."""
    q, k, v, kc, vc, meta = make_batch(FIXED_Q, FIXED_S, 256, 4, 2, 8)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.3)
    good = prepare_flash_inputs(meta)
    b = meta.num_seqs

    def run(fi: FlashInputs) -> torch.Tensor:
        return flash_varlen_reference(
            q,
            kc,
            vc,
            fi.cu_seqlens_q,
            fi.cu_seqlens_k,
            fi.max_seqlen_q,
            fi.max_seqlen_k,
            softmax_scale=0.3,
            causal=True,
            block_table=fi.block_table,
        )

    torch.testing.assert_close(run(good), ref, atol=1e-5, rtol=1e-5)
    one_short = good.cu_seqlens_k - torch.arange(b + 1, dtype=torch.int32)
    swapped = good.block_table.roll(1, dims=0).contiguous()
    for bad in (
        replace(good, cu_seqlens_k=one_short),  # every context one token short
        replace(good, cu_seqlens_k=good.cu_seqlens_q),  # query lengths taken for context lengths
        replace(good, block_table=swapped),  # each sequence reading another one's pages
    ):
        assert not torch.allclose(run(bad), ref, atol=1e-3, rtol=1e-3)


# ---- xformers --------------------------------------------------------------------------------


@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("seed", [None, 3])
def test_xformers_mixed_batch_at_256(hq: int, hkv: int, seed: int | None) -> None:
    lens = (FIXED_Q, FIXED_S) if seed is None else random_mix(seed, 256)
    spy = Spy(xformers_reference)
    out, ref, _ = run_pair(XFormersBackend(kernel=spy), lens, 256, hq, hkv, 16, seed or 0)
    assert [c[-1] for c in spy.calls] == [False], "xformers' dispatcher chooses at 256"
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("q_len", [1, 5, 16])
def test_xformers_uniform_batch_at_64_uses_split_k(hq: int, hkv: int, q_len: int) -> None:
    spy = Spy(xformers_reference)
    lens = uniform(q_len, q_len, 5, 64)
    out, ref, _ = run_pair(XFormersBackend(kernel=spy), lens, 64, hq, hkv, 16, q_len)
    assert [c[-1] for c in spy.calls] == [True]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [random_mix(4, 64), uniform(0, 17, 3, 64)])
def test_xformers_other_batches_at_64_fall_back_to_torch(lens: tuple) -> None:
    spy = Spy(xformers_reference)
    out, ref, _ = run_pair(XFormersBackend(kernel=spy), lens, 64, 4, 2, 16, 0)
    assert spy.calls == [], "split-K cannot take these; the torch backend computes them"
    torch.testing.assert_close(out, ref)


def test_xformers_inputs_hand_checked() -> None:
    meta = AttentionMetadata.from_lists([2, 1, 3], [6, 3, 3], [[5, 2], [7], [1]], block_size=4)
    xi = prepare_xformers_inputs(meta, 4)
    assert xi.q_seqlen == (2, 1, 3) and xi.kv_seqlen == (6, 3, 3)
    assert xi.block_tables.dtype == torch.int32 and xi.block_tables.is_contiguous()
    assert xi.block_tables.tolist() == [[5, 2], [7, 0], [1, 0]]
    assert (xi.page_size, xi.kv_padding) == (4, 8)
    assert xformers_inputs(meta, 4) is xformers_inputs(meta, 4)


def test_xformers_route() -> None:
    def route(q_lens: list[int], page: int, d: int = 64) -> str:
        meta = AttentionMetadata.from_lists(q_lens, [20] * len(q_lens), [[0]] * len(q_lens), 64)
        return choose_route(prepare_xformers_inputs(meta, page), d)

    assert route([20, 1, 5], 256) == "dispatch"
    assert route([1, 1, 1], 64) == "split-k"
    assert route([16, 16], 128) == "split-k"
    assert route([17, 17], 64) == "torch"
    assert route([1, 5], 64) == "torch"
    assert route([4, 4], 64, d=8) == "torch"  # split-K head dims: 16 .. 512, powers of two


def test_xformers_reference_catches_wrong_table() -> None:
    lens = uniform(7, 4, 4, 64)
    q, k, v, kc, vc, meta = make_batch(*lens, 64, 4, 2, 16, seed=7)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, 0.25)
    good = prepare_xformers_inputs(meta, 64)
    n = kc.shape[0] * 64
    query, key, value = q.reshape(1, -1, 2, 2, 16), kc.view(1, n, 2, 1, 16), vc.view(1, n, 2, 1, 16)
    key, value = key.expand(1, n, 2, 2, 16), value.expand(1, n, 2, 2, 16)

    def run(xi: XFormersInputs) -> torch.Tensor:
        return xformers_reference(query, key, value, xi, 0.25, True).reshape(q.shape)

    torch.testing.assert_close(run(good), ref, atol=1e-5, rtol=1e-5)
    bad_table = replace(good, block_tables=good.block_tables.roll(1, dims=0).contiguous())
    bad_lens = replace(good, kv_seqlen=tuple(s - 1 for s in good.kv_seqlen))
    for bad in (bad_table, bad_lens):
        assert not torch.allclose(run(bad), ref, atol=1e-3, rtol=1e-3)


# ---- block sizes and selection --------------------------------------------------------------


def test_check_block_size() -> None:
    FlashAttnBackend.check_block_size(256)
    FlashAttnBackend.check_block_size(512)
    with pytest.raises(InvalidInputError, match=r"block_size must be .*multiple of 256.*flash"):
        FlashAttnBackend.check_block_size(16)
    XFormersBackend.check_block_size(64)
    XFormersBackend.check_block_size(192)
    with pytest.raises(InvalidInputError, match=r"block_size must be .*multiple of 64.*xformers"):
        XFormersBackend.check_block_size(16)


@pytest.mark.parametrize("name", ["flash-attn", "xformers"])
def test_select_cuda_backend_on_cpu_names_the_field(name: str) -> None:
    with pytest.raises(InvalidInputError, match=f"attention_backend '{name}' needs a CUDA device"):
        select_backend("cpu", name)
    with pytest.raises(InvalidInputError, match=f"attention_backend '{name}' needs a CUDA device"):
        select_backend("cpu", name, dtype=torch.bfloat16, block_size=256)


def test_select_explicit_cuda_backend_checks() -> None:
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    with pytest.raises(InvalidInputError, match=r"block_size must be .*multiple of 256"):
        select_backend(cuda, "flash-attn", dtype=torch.bfloat16, block_size=16)
    with pytest.raises(InvalidInputError, match=r"block_size must be .*multiple of 64"):
        select_backend(cuda, "xformers", dtype=torch.float16, block_size=16)
    with pytest.raises(InvalidInputError, match="needs dtype float16 or bfloat16, got float32"):
        select_backend(cuda, "flash-attn", dtype=torch.float32, block_size=256)


@pytest.mark.parametrize("name", ["flash-attn", "xformers"])
def test_select_missing_package(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(backend_choice, "_import_error", lambda pkg: f"ModuleNotFoundError: {pkg}")
    with pytest.raises(InvalidInputError, match=f"attention_backend '{name}' needs the") as e:
        select_backend("cuda", name, dtype=torch.bfloat16, block_size=256)
    assert 'pip install -e ".[gpu]"' in str(e.value)
    assert "--no-build-isolation" in str(e.value)


def test_select_torch_and_auto_on_cpu() -> None:
    assert isinstance(select_backend("cpu"), TorchAttentionBackend)
    assert isinstance(select_backend("cpu", "torch"), TorchAttentionBackend)
    auto = select_backend("cpu", "auto", dtype=torch.bfloat16, block_size=256)
    assert isinstance(auto, TorchAttentionBackend)  # head_dim unknown: the reference
    with pytest.raises(
        InvalidInputError, match="available: auto, torch, cpu, flash-attn, xformers"
    ):
        select_backend("cpu", "flash")


def test_select_cpu_kernel_backend() -> None:
    from specbatch.kernels.cpu import cpu_kernels
    from specbatch.model.layers.cpu_attention import CpuAttentionBackend

    if cpu_kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    auto = select_backend("cpu", "auto", dtype=torch.float32, head_dim=64)
    assert isinstance(auto, CpuAttentionBackend)
    assert isinstance(select_backend("cpu", "cpu", dtype=torch.bfloat16, head_dim=128),
                      CpuAttentionBackend)  # fmt: skip
    # a head_dim the kernel does not take: auto falls back, naming it is an error
    assert isinstance(select_backend("cpu", "auto", dtype=torch.float32, head_dim=40),
                      TorchAttentionBackend)  # fmt: skip
    with pytest.raises(InvalidInputError, match=r"attention_backend 'cpu' cannot run.*head_dim 40"):
        select_backend("cpu", "cpu", dtype=torch.float32, head_dim=40)
    with pytest.raises(InvalidInputError, match="attention_backend 'cpu' runs on a CPU device"):
        select_backend("cuda", "cpu", dtype=torch.float32, head_dim=64)


BOTH = {"flash_attn", "xformers.ops"}


@pytest.mark.parametrize(
    ("is_cuda", "dtype", "block_size", "importable", "expected"),
    [
        (False, torch.bfloat16, 256, BOTH, "torch"),  # CPU: always torch
        (True, torch.bfloat16, 16, BOTH, "torch"),  # the default block size breaks both rules
        (True, torch.float16, 32, BOTH, "torch"),
        (True, torch.float32, 256, BOTH, "torch"),  # fp32: neither kernel
        (True, None, 256, BOTH, "torch"),
        (True, torch.bfloat16, None, BOTH, "torch"),  # block size unknown
        (True, torch.bfloat16, 256, BOTH, "flash-attn"),
        (True, torch.float16, 512, BOTH, "flash-attn"),
        (True, torch.bfloat16, 64, BOTH, "xformers"),  # 64 breaks flash-attn's rule only
        (True, torch.bfloat16, 256, {"xformers.ops"}, "xformers"),
        (True, torch.bfloat16, 128, {"flash_attn"}, "torch"),
        (True, torch.bfloat16, 256, set(), "torch"),
    ],
)
def test_auto_choice(
    is_cuda: bool,
    dtype: torch.dtype | None,
    block_size: int | None,
    importable: set[str],
    expected: str,
) -> None:
    assert _auto_choice(is_cuda, dtype, block_size, importable) == expected
