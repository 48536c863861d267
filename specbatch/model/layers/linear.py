"""Tensor-parallel linear layers (Megatron style), sharded while the weights load.

- ``ColumnParallelLinear``: the output features are split across ranks; each rank returns its own
  slice (no communication). ``MergedColumnParallelLinear`` fuses several such projections that
  share an input (gate and up), ``QKVParallelLinear`` fuses q, k and v with heads split per rank.
- ``RowParallelLinear``: the input features are split; each rank computes a partial product and
  the results are summed with an all-reduce. The bias is added once, after the reduction.

Weights are stored like ``nn.Linear``: ``[out_features_local, in_features_local]``. On a CPU
with specbatch's kernels, ``use_cpu_kernels`` repacks a loaded weight into the kernels' panels
(the original is released) and the layer multiplies through them. A GGUF matrix of a type the
kernels multiply quantized (``model/gguf_quantized.py``) is kept as its blocks instead: each
rank keeps its rows (or, row-parallel, its columns where they are whole blocks), and
``use_cpu_kernels`` multiplies through them where every part of the layer was kept so; else
the kept parts are dequantized into the weight then.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import CpuKernels, PackedLinear
from specbatch.kernels.quantized import KEPT_TYPES, QuantizedLinear, QuantizedRows
from specbatch.model.layers.weights import (
    Loaded,
    check_shape,
    copy_into,
    new_param,
    read_all,
    set_weight_loader,
    take,
)

logger = logging.getLogger(__name__)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise InvalidInputError(
            f"{what}={numerator} must be divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator


class PackableLinear(nn.Module):
    """The matrix multiply shared by the parallel linear layers: ``F.linear`` on the stored
    weight, or the CPU kernels' packed copy of it once ``use_cpu_kernels`` was called."""

    weight: nn.Parameter
    kernels: CpuKernels | None = None
    packed: PackedLinear | None = None
    quant: QuantizedLinear | None = None
    # parts kept as GGUF blocks too, by shard: (ggml type, blocks [rows, bytes], in features)
    _kept: dict[int, tuple[int, torch.Tensor, int]] | None = None
    num_shards = 1

    def keep_blocks(
        self, shard: int, loaded: Loaded, rows: tuple[int, int] | None, cols: tuple[int, int] | None
    ) -> None:
        """Keep this rank's part of a GGUF matrix (``rows``, ``cols``: start and length, None
        for all) as its blocks as well, if it is of a kept type and the kernels can run it (the
        weight holds its values until ``use_cpu_kernels``)."""
        from specbatch.model.gguf_quantized import keeps_quantized, quantized_blocks

        if not keeps_quantized(self.weight):
            return
        got = quantized_blocks(loaded)
        if got is None:
            return
        kind, blocks = got
        _, block, block_bytes = KEPT_TYPES[kind]
        k = blocks.shape[1] // block_bytes * block
        if rows is not None:
            blocks = blocks[rows[0] : rows[0] + rows[1]]
        if cols is not None:
            if cols[0] % block or cols[1] % block:
                logger.info(
                    "a %s matrix loads dequantized: this rank's columns %d..%d split its "
                    "%d-value blocks",
                    KEPT_TYPES[kind][0],
                    cols[0],
                    cols[0] + cols[1],
                    block,
                )
                return
            b0, nb = cols[0] // block, cols[1] // block
            blocks, k = blocks[:, b0 * block_bytes : (b0 + nb) * block_bytes], cols[1]
        if self._kept is None:
            self._kept = {}
        self._kept[shard] = (kind, blocks.contiguous(), k)

    def _use_kept(self, kernels: CpuKernels) -> bool:
        """Multiply through the kept blocks where every part was kept (True)."""
        kept, self._kept = self._kept, None
        if not kept or len(kept) < self.num_shards:
            return False
        segments: list[QuantizedRows] = []
        run: list[tuple[int, torch.Tensor, int]] = []
        for shard in sorted(kept):  # adjacent parts of one type as one segment
            if run and kept[shard][0] != run[0][0]:
                segments.append(_segment(run))
                run = []
            run.append(kept[shard])
        segments.append(_segment(run))
        self.quant = QuantizedLinear(segments, segments[0].in_features)
        self.kernels = kernels
        self.weight.data = self.weight.data.new_empty(0)
        return True

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Repack the loaded weight for the kernels (or multiply through its kept GGUF blocks)
        and release the original."""
        if self._use_kept(kernels):
            return
        if not kernels.supports_linear(self.weight.dtype) or self.weight.device.type != "cpu":
            return
        self.kernels, self.packed = kernels, kernels.pack_linear(self.weight)
        self.weight.data = self.weight.data.new_empty(0)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernels is not None:
            if self.quant is not None:
                return self.kernels.linear_quant(x, self.quant, bias)
            if self.packed is not None:
                return self.kernels.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


def _segment(parts: list[tuple[int, torch.Tensor, int]]) -> QuantizedRows:
    kind, _, k = parts[0]
    return QuantizedRows.from_blocks(kind, torch.cat([p[1] for p in parts]), k)


class ColumnParallelLinear(PackableLinear):
    """``y_local = x @ W_local^T + b_local``, with ``W`` split along its output dimension.

    ``output_sizes`` is one size, or several for a fused layer (each part split on its own).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: int | Sequence[int],
        *,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
        shard_names: Sequence[object] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.local_sizes = [divide(n, tp.size, "output_size") for n in self.output_sizes]
        self.local_offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        self.shard_names = list(shard_names) if shard_names is not None else None
        self.weight = new_param((sum(self.local_sizes), input_size), dtype, device)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias: nn.Parameter | None = new_param((sum(self.local_sizes),), dtype, device)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def _shard_index(self, shard_id: object) -> int:
        if self.shard_names is None:
            if shard_id is None and len(self.output_sizes) == 1:
                return 0
            if isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes):
                return shard_id
        elif shard_id in self.shard_names:
            return self.shard_names.index(shard_id)
        raise ValueError(f"unknown shard id {shard_id!r} for {type(self).__name__}")

    def _local_rows(self, shard: int) -> tuple[int, int, int]:
        """(start row in the full shard, number of rows, start row in the local parameter)."""
        n = self.local_sizes[shard]
        return self.tp.rank * n, n, self.local_offsets[shard]

    @property
    def num_shards(self) -> int:  # type: ignore[override]
        return len(self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        shard = self._shard_index(shard_id)
        src_start, n, dst_start = self._local_rows(shard)
        full_rows = self.output_sizes[shard]
        expected = (full_rows,) if param.dim() == 1 else (full_rows, self.input_size)
        check_shape(loaded, expected)
        copy_into(param.data.narrow(0, dst_start, n), take(loaded, 0, src_start, n))
        if param.dim() == 2:
            self.keep_blocks(shard, loaded, (src_start, n), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (e.g. gate and up).

    Shard ids are the integer positions in ``output_sizes``; each part is split across ranks on
    its own, so rank ``r`` holds ``[gate_r; up_r]``.
    """


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard ids ``"q"``, ``"k"``, ``"v"``.

    Query heads and key/value heads are split across ranks separately (both counts must be
    divisible by the tensor-parallel size), so rank ``r`` holds whole heads:
    ``[q heads of r; kv heads of r (k); kv heads of r (v)]``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_heads_local = divide(num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads_local = divide(num_kv_heads, tp.size, "num_key_value_heads")
        self.head_dim = head_dim
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=bias,
            tp=tp,
            dtype=dtype,
            device=device,
            shard_names=["q", "k", "v"],
        )

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, local_out]`` -> q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (views)."""
        q, k, v = qkv.split(self.local_sizes, dim=-1)
        t = qkv.shape[0]
        return (
            q.view(t, self.num_heads_local, self.head_dim),
            k.view(t, self.num_kv_heads_local, self.head_dim),
            v.view(t, self.num_kv_heads_local, self.head_dim),
        )


class RowParallelLinear(PackableLinear):
    """``y = all_reduce(x_local @ W_local^T) + b``, with ``W`` split along its input dimension.

    ``x_local`` is this rank's slice of the input features, as produced by a column-parallel
    layer. The bias is replicated and added after the reduction, so it is counted once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_local = divide(input_size, tp.size, "input_size")
        self.weight = new_param((output_size, self.input_size_local), dtype, device)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias: nn.Parameter | None = new_param((output_size,), dtype, device)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if param.dim() == 1:  # bias: replicated
            check_shape(loaded, (self.output_size,))
            copy_into(param.data, read_all(loaded))
            return
        check_shape(loaded, (self.output_size, self.input_size))
        n = self.input_size_local
        copy_into(param.data, take(loaded, 1, self.tp.rank * n, n))
        self.keep_blocks(0, loaded, None, (self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        if self.bias is not None:
            y = y + self.bias
        return y
