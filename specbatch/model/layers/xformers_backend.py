"""The xformers backend: ``memory_efficient_attention_forward`` over the paged cache, with the
paged, bottom-right causal, block-diagonal bias
``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask``.

Layout handed to xformers (0.0.3x): queries ``[1, T, H, D]`` (``[1, T, G, Hg, D]`` with grouped
heads, G = KV heads, Hg = query heads per KV head), the whole pool as keys and values
``[1, num_blocks * block_size, Hkv, D]`` (``[1, N, G, Hg, D]`` with the Hg axis a stride-0 view),
and the bias built from the per-sequence query lengths, context lengths, int32 block tables and
page size. Sequence b's query row ``i`` sees its keys ``0 .. kv_seqlen[b] - q_seqlen[b] + i``.

Which xformers operator can run a paged bias, as its sources (0.0.3x) say:

* its flash-attn 2 / FlashAttention-3 operators take ragged query lengths, and flash-attn 2 needs
  pages that are a multiple of 256;
* its Triton split-K operator (``triton_splitk.FwOp``) takes pages that are a multiple of 64 but,
  with a causal bias, only batches in which every sequence has the SAME query length, at most 16
  (decode steps, verification steps), and head dims in {16, 32, 64, 128, 256, 512}.

So, per forward: with a page size that is a multiple of 256 xformers' own dispatcher picks the
operator; with a page size that is a multiple of 64 only, a batch that meets the split-K rules is
sent to the split-K operator explicitly, and any other batch (one holding a prompt, or mixed query
lengths) is computed by specbatch's torch reference backend on the same cache instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from specbatch.model.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    write_kv,
)

#: Page sizes xformers' flash-attn 2 path accepts are multiples of this.
FLASH_PAGE_MULTIPLE = 256
#: xformers' Triton split-K kernel reads the pages in blocks of 64 keys.
SPLIT_K_PAGE_MULTIPLE = 64
#: Longest query (equal for every sequence) split-K accepts with a causal bias.
SPLIT_K_MAX_QUERY_LEN = 16
SPLIT_K_HEAD_DIMS = frozenset({16, 32, 64, 128, 256, 512})

Route = Literal["dispatch", "split-k", "torch"]

#: ``kernel(query, key, value, inputs, scale, split_k) -> out`` shaped like ``query``: query
#: ``[1, T, H, D]`` or ``[1, T, G, Hg, D]``; key and value the pool as ``[1, N, Hkv, D]`` or
#: ``[1, N, G, Hg, D]``; ``split_k`` asks for xformers' Triton split-K operator.
XFormersKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "XFormersInputs", float, bool], torch.Tensor
]


@dataclass(frozen=True, eq=False)
class XFormersInputs:
    """What the paged bias is built from, for one forward."""

    q_seqlen: tuple[int, ...]  # new tokens per sequence
    kv_seqlen: tuple[int, ...]  # context length per sequence, new tokens included
    block_tables: torch.Tensor  # int32 [B, max_pages], contiguous; padding entries unused
    page_size: int
    kv_padding: int  # max_pages * page_size: the per-sequence key space the bias addresses
    # Per-forward objects a kernel builds once and reuses across layers (xformers' bias).
    kernel_cache: dict[str, Any] = field(default_factory=dict, repr=False)


def prepare_xformers_inputs(meta: AttentionMetadata, page_size: int) -> XFormersInputs:
    """Build the bias inputs from the metadata (host lists and one device cast, no sync)."""
    tables = meta.block_tables.to(torch.int32).contiguous()
    return XFormersInputs(
        q_seqlen=tuple(meta.query_lens_cpu),
        kv_seqlen=tuple(meta.seq_lens_cpu),
        block_tables=tables,
        page_size=page_size,
        kv_padding=tables.shape[1] * page_size,
    )


def xformers_inputs(meta: AttentionMetadata, page_size: int) -> XFormersInputs:
    """``prepare_xformers_inputs`` memoised on the metadata (reused by every layer)."""
    key = ("xformers", page_size)
    inputs = meta.derived.get(key)
    if inputs is None:
        inputs = prepare_xformers_inputs(meta, page_size)
        meta.derived[key] = inputs
    return inputs


def choose_route(inputs: XFormersInputs, head_dim: int) -> Route:
    """Which path runs this forward (see the module docstring)."""
    if inputs.page_size % FLASH_PAGE_MULTIPLE == 0:
        return "dispatch"
    lens = set(inputs.q_seqlen)
    if (
        inputs.page_size % SPLIT_K_PAGE_MULTIPLE == 0
        and len(lens) == 1
        and max(lens) <= SPLIT_K_MAX_QUERY_LEN
        and head_dim in SPLIT_K_HEAD_DIMS
    ):
        return "split-k"
    return "torch"


def xformers_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    inputs: XFormersInputs,
    scale: float,
    split_k: bool,
) -> torch.Tensor:
    """The real kernel: build (once per forward) the paged bias, then call xformers."""
    from xformers.ops import fmha
    from xformers.ops.fmha.attn_bias import (
        BlockDiagonalCausalWithOffsetPaddedKeysMask,
        PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
    )

    bias = inputs.kernel_cache.get("bias")
    if bias is None:
        bias = BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=list(inputs.q_seqlen),
            kv_padding=inputs.kv_padding,
            kv_seqlen=list(inputs.kv_seqlen),
            device=query.device,
        ).make_paged(
            block_tables=inputs.block_tables,
            page_size=inputs.page_size,
            paged_type=PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
        )
        inputs.kernel_cache["bias"] = bias
    op = None
    if split_k:
        from xformers.ops.fmha import triton_splitk

        op = triton_splitk.FwOp
    return fmha.memory_efficient_attention_forward(
        query, key, value, attn_bias=bias, scale=scale, op=op
    )


def load_xformers_kernel() -> XFormersKernel:
    """``xformers_kernel``, once ``xformers.ops.fmha`` imports (raises ImportError otherwise)."""
    import xformers.ops.fmha  # noqa: F401

    return xformers_kernel


class XFormersBackend(AttentionBackend):
    """Paged attention with xformers (CUDA, fp16/bf16, block_size a multiple of 64).

    Block sizes that are multiples of 256 let xformers run any ragged batch; smaller multiples of
    64 run only uniform batches of short queries (<= 16) on xformers' split-K operator and leave
    the rest to the torch reference backend (see the module docstring). ``kernel`` defaults to
    ``xformers_kernel``; tests pass a CPU function that implements the same contract.
    """

    name = "xformers"
    block_size_multiple = SPLIT_K_PAGE_MULTIPLE

    def __init__(self, kernel: XFormersKernel | None = None) -> None:
        self.kernel = kernel if kernel is not None else load_xformers_kernel()
        self.fallback = TorchAttentionBackend()

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
        num_blocks, page_size, hkv, d = k_cache.shape
        t, hq, _ = q.shape
        inputs = xformers_inputs(meta, page_size)
        route = choose_route(inputs, d)
        if route == "torch":
            return self.fallback.forward(q, k, v, k_cache, v_cache, meta, scale)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        n = num_blocks * page_size
        group = hq // hkv
        if group == 1:
            query = q.reshape(1, t, hq, d)
            key = k_cache.view(1, n, hkv, d)
            value = v_cache.view(1, n, hkv, d)
        else:
            query = q.reshape(1, t, hkv, group, d)
            key = k_cache.view(1, n, hkv, 1, d).expand(1, n, hkv, group, d)
            value = v_cache.view(1, n, hkv, 1, d).expand(1, n, hkv, group, d)
        out = self.kernel(query, key, value, inputs, scale, route == "split-k")
        return out.reshape(t, hq, d)
