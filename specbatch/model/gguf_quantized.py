"""Which GGUF matrices load as kept quantized blocks, and their blocks read from the file.

A matrix of a type the CPU kernels multiply (``kernels/quantized.py``: Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K) loads as its blocks where the model runs on those kernels in float32 or bfloat16;
every other tensor, and every tensor where the kernels do not run, is dequantized as it loads.
``SPECBATCH_GGUF_QUANTIZED=0`` dequantizes every matrix (the same weights as bfloat16 or
float32, for comparison). Llama's query and key rows are reordered as ``gguf_tensors`` reorders
the dequantized values: whole rows of blocks move.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from specbatch.kernels.quantized import KEPT_TYPES
from specbatch.model.gguf_tensors import GGUFTensor, unpermute_rows


def kept_types() -> tuple[int, ...]:
    """The ggml types kept quantized (none with ``SPECBATCH_GGUF_QUANTIZED=0``)."""
    setting = os.environ.get("SPECBATCH_GGUF_QUANTIZED", "1").strip().lower()
    return () if setting in ("0", "false", "no", "off") else tuple(KEPT_TYPES)


def keeps_quantized(weight: torch.Tensor) -> bool:
    """Whether a linear layer holding ``weight`` keeps a GGUF matrix quantized."""
    if not kept_types():
        return False
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    from specbatch.kernels.cpu import cpu_kernels

    return cpu_kernels() is not None


def quantized_blocks(loaded: Any) -> tuple[int, torch.Tensor] | None:
    """(ggml type, its rows of blocks uint8 ``[rows, bytes]``) of a GGUF matrix of a kept
    type; None for anything else."""
    if not isinstance(loaded, GGUFTensor) or loaded.offset or len(loaded.info.dims) != 2:
        return None
    kind = loaded.info.kind
    if kind not in kept_types():
        return None
    blocks = torch.from_numpy(loaded.reader.tensor_bytes(loaded.info).copy())
    if loaded.permute_heads is not None:
        blocks = unpermute_rows(blocks, loaded.permute_heads).contiguous()
    return kind, blocks
