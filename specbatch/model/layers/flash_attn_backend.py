"""The flash-attn 2 backend: one ``flash_attn_varlen_func`` call over the paged cache per layer.

flash-attn's paged varlen path takes a ragged batch in which every sequence has its own query
length and its own key length, reads K/V through an int32 block table, and applies the causal
mask aligned bottom-right (query row ``i`` of a sequence with ``Sq`` queries and ``Sk`` keys sees
keys ``0 .. Sk - Sq + i``). That is exactly the layout of ``AttentionMetadata``, so one call covers
prompts, prompt chunks, one-token decodes and ``gamma + 1``-token verification together. The
kernel never writes the cache: the new K/V are scattered into their slots first.

Upstream constraints (flash-attn 2.8.x): CUDA, fp16/bf16, the page (block) size a multiple of
256, query heads a multiple of KV heads. The package is optional (``pip install -e ".[gpu]"``)
and imported only when a ``FlashAttnBackend`` is built without an explicit ``kernel``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specbatch.model.layers.attention import AttentionBackend, AttentionMetadata, write_kv

#: ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
#: softmax_scale=..., causal=..., block_table=...) -> out [T, Hq, D]``
FlashKernel = Callable[..., torch.Tensor]

_DERIVED_KEY = "flash-attn"


@dataclass(frozen=True, eq=False)
class FlashInputs:
    """The per-forward arguments of ``flash_attn_varlen_func`` besides q and the caches."""

    cu_seqlens_q: torch.Tensor  # int32 [B+1]; sequence b's queries are rows [b]:[b+1] of q
    cu_seqlens_k: torch.Tensor  # int32 [B+1]; running sum of the context lengths (new tokens too)
    block_table: torch.Tensor  # int32 [B, max_blocks], contiguous; padding entries are ignored
    max_seqlen_q: int
    max_seqlen_k: int


def prepare_flash_inputs(meta: AttentionMetadata) -> FlashInputs:
    """Build the kernel's index tensors from the metadata: device ops and host lists only, so
    no device->host sync."""
    device = meta.seq_lens.device
    cu_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=device)
    if meta.num_seqs:
        cu_k[1:] = torch.cumsum(meta.seq_lens, 0)
    return FlashInputs(
        cu_seqlens_q=meta.query_start_loc.to(torch.int32),
        cu_seqlens_k=cu_k,
        block_table=meta.block_tables.to(torch.int32).contiguous(),
        max_seqlen_q=max(meta.query_lens_cpu, default=0),
        max_seqlen_k=max(meta.seq_lens_cpu, default=0),
    )


def flash_inputs(meta: AttentionMetadata) -> FlashInputs:
    """``prepare_flash_inputs`` memoised on the metadata (built once, reused by every layer)."""
    inputs = meta.derived.get(_DERIVED_KEY)
    if inputs is None:
        inputs = prepare_flash_inputs(meta)
        meta.derived[_DERIVED_KEY] = inputs
    return inputs


def load_flash_kernel() -> FlashKernel:
    """The real ``flash_attn.flash_attn_varlen_func`` (raises ImportError when not installed)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


class FlashAttnBackend(AttentionBackend):
    """Paged varlen attention with flash-attn 2 (CUDA, fp16/bf16, block_size a multiple of 256).

    ``kernel`` defaults to ``flash_attn.flash_attn_varlen_func``; tests pass a CPU function that
    implements the same contract.
    """

    name = "flash-attn"
    block_size_multiple = 256

    def __init__(self, kernel: FlashKernel | None = None) -> None:
        self.kernel = kernel if kernel is not None else load_flash_kernel()

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
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        fi = flash_inputs(meta)
        return self.kernel(
            q,
            k_cache,
            v_cache,
            fi.cu_seqlens_q,
            fi.cu_seqlens_k,
            fi.max_seqlen_q,
            fi.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=fi.block_table,
        )
