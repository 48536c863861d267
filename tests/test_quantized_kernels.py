"""The CPU kernels' products with GGUF weights kept quantized (csrc/gemm_qpanel.c) against
dequantize-then-matmul in float64, on random blocks, odd shapes and 1-37 rows, in the native
and the AVX2 build; a row's output the same bits whatever the rows beside it."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from specbatch.kernels.build import cpu_flags, load_module
from specbatch.kernels.cpu import CpuKernels, cpu_kernels
from specbatch.kernels.quantized import KEPT_TYPES, QuantizedLinear, QuantizedRows

gguf = pytest.importorskip("gguf")

# where each type's float16 scales sit in its block
HALVES = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
ROWS = (1, 2, 3, 4, 5, 8, 9, 17, 37)


@functools.cache
def build(name: str) -> CpuKernels:
    if name == "avx2":
        return CpuKernels(load_module(avx2_only=True))
    k = cpu_kernels()
    assert k is not None
    return k


BUILDS = [
    "native",
    pytest.param(
        "avx2",
        marks=pytest.mark.skipif(
            "avx512f" not in cpu_flags(), reason="the native build is the AVX2 one"
        ),
    ),
]


def random_blocks(kind: int, rows: int, k: int, seed: int) -> np.ndarray:
    """Random quants, and scales (and minimums) of either sign, ``[rows, bytes]``."""
    _, block, block_bytes = KEPT_TYPES[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows, k // block, block_bytes), dtype=np.uint8)
    for at in HALVES[kind]:
        h = (rng.standard_normal((rows, k // block)) * 0.05).astype(np.float16)
        b[:, :, at : at + 2] = h.view(np.uint8).reshape(rows, k // block, 2)
    return b.reshape(rows, -1)


def dequantized(kind: int, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(kind)))


def weight(kind: int, n: int, k: int, seed: int = 0) -> tuple[QuantizedLinear, torch.Tensor]:
    blocks = random_blocks(kind, n, k, seed)
    rows = QuantizedRows.from_blocks(kind, torch.from_numpy(blocks), k)
    return QuantizedLinear([rows], k), dequantized(kind, blocks).double()


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float) -> None:
    """|got - x w^T| within rtol of |x| |w|^T, elementwise."""
    want = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    err = (got.double() - want).abs()
    assert (err <= rtol * scale + 1e-30).all(), float((err / scale).max())


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("kind", list(KEPT_TYPES), ids=lambda k: KEPT_TYPES[k][0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_equals_dequantize_then_matmul(name: str, kind: int, dtype: torch.dtype) -> None:
    kernels = build(name)
    block = KEPT_TYPES[kind][1]
    for n, k in ((37, 3 * block), (53, block), (16, 2 * block)):
        q, w = weight(kind, n, k, seed=n)
        bias = torch.randn(n).to(dtype)
        for m in ROWS:
            x = torch.randn(m, k).to(dtype)
            y = kernels.linear_quant(x, q, bias, out_dtype=torch.float32)
            # the quants exact in bfloat16, each block's sums scaled in float32
            assert_close(y - bias.float(), x, w, 1e-5)


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("kind", list(KEPT_TYPES), ids=lambda k: KEPT_TYPES[k][0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_batch(
    name: str, kind: int, dtype: torch.dtype
) -> None:
    kernels = build(name)
    k = 2 * KEPT_TYPES[kind][1]
    q, _ = weight(kind, 45, k)
    x = torch.randn(37, k).to(dtype)
    alone = torch.cat([kernels.linear_quant(x[i : i + 1], q) for i in range(37)])
    for m in range(1, 38):
        rows = kernels.linear_quant(x[:m], q)
        assert torch.equal(rows, alone[:m]), m
        assert torch.equal(kernels.linear_quant(x[37 - m :], q), alone[37 - m :]), m


@pytest.mark.parametrize("name", BUILDS)
def test_segments_of_several_types_fill_their_own_columns(name: str) -> None:
    kernels = build(name)
    k = 256
    parts = [(3, 40), (14, 24), (8, 17), (12, 16)]
    segments, ws = [], []
    for i, (kind, n) in enumerate(parts):
        blocks = random_blocks(kind, n, k, seed=i)
        segments.append(QuantizedRows.from_blocks(kind, torch.from_numpy(blocks), k))
        ws.append(dequantized(kind, blocks).double())
    q = QuantizedLinear(segments, k)
    assert q.out_features == sum(n for _, n in parts)
    x = torch.randn(6, k)
    assert_close(kernels.linear_quant(x, q), x, torch.cat(ws), 1e-5)


def test_rows_of_a_type_the_kernels_do_not_run_are_refused() -> None:
    with pytest.raises(KeyError):
        QuantizedRows.from_blocks(6, torch.zeros(1, 22, dtype=torch.uint8), 32)  # Q5_0
    with pytest.raises(ValueError, match="whole blocks"):
        QuantizedRows.from_blocks(3, torch.zeros(1, 30, dtype=torch.uint8), 48)
