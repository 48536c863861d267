"""Vocabulary-parallel token embedding and LM head.

The vocabulary rows are split across ranks in contiguous ranges of ``ceil(vocab / tp)`` rows; the
last range is zero-padded when the vocabulary does not divide evenly, and the padding never leaks
out (ids there are never looked up, and gathered logits are cut back to ``vocab_size``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.kernels.cpu import CpuKernels, PackedLinear
from specbatch.kernels.quantized import QuantizedLinear, QuantizedRows
from specbatch.model.layers.weights import Loaded, check_shape, copy_into, new_param, take


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids in its vocabulary range (others give zeros); then an all-reduce."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = min(tp.rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = new_param((self.rows_per_rank, hidden_size), dtype, device)
        if self.vocab_end - self.vocab_start < self.rows_per_rank:
            with torch.no_grad():
                self.weight[self.vocab_end - self.vocab_start :].zero_()
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        check_shape(loaded, (self.vocab_size, self.hidden_size))
        n = self.vocab_end - self.vocab_start
        copy_into(param.data.narrow(0, 0, n), take(loaded, 0, self.vocab_start, n))
        if getattr(param, "lm_head", False):  # an LM head's: kept as GGUF blocks too, if it can
            from specbatch.model.gguf_quantized import keeps_quantized, quantized_blocks

            got = quantized_blocks(loaded) if keeps_quantized(param) else None
            if got is not None:
                kind, blocks = got
                rows = blocks[self.vocab_start : self.vocab_end]
                pad = self.rows_per_rank - n  # the padding rows multiply to 0
                rows = F.pad(rows, (0, 0, 0, pad)) if pad else rows.contiguous()
                param.gguf_blocks = (kind, rows, self.hidden_size)  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = torch.where(outside, 0, input_ids - self.vocab_start)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Local logits over this rank's vocabulary range, then an all-gather along the vocabulary.

    With tied embeddings, pass the embedding's parameter as ``tied_weight``: both layers then use
    one tensor and the checkpoint's ``lm_head.weight`` (if any) is not needed.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
        tied_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp=tp, dtype=dtype, device=device)
        self.tied = tied_weight is not None
        if tied_weight is not None:
            self.weight = tied_weight
        self.weight.lm_head = True  # type: ignore[attr-defined]  # (the loader keeps GGUF blocks)
        self.kernels: CpuKernels | None = None
        self.packed: PackedLinear | None = None
        self.quant: QuantizedLinear | None = None

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        """Multiply through the kernels' packed copy, or the GGUF blocks kept as the weight
        loaded; an untied weight is then released."""
        kept = getattr(self.weight, "gguf_blocks", None)
        if kept is not None:
            del self.weight.gguf_blocks
            kind, blocks, k = kept
            self.kernels = kernels
            self.quant = QuantizedLinear([QuantizedRows.from_blocks(kind, blocks, k)], k)
        elif kernels.supports_linear(self.weight.dtype) and self.weight.device.type == "cpu":
            self.kernels, self.packed = kernels, kernels.pack_linear(self.weight)
        else:
            return
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab_size]``, full vocabulary on every rank."""
        if self.quant is not None and self.kernels is not None:
            logits = self.kernels.linear_quant(hidden, self.quant, out_dtype=torch.float32)
        elif self.packed is not None and self.kernels is not None:
            logits = self.kernels.linear(hidden, self.packed, out_dtype=torch.float32)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits.float()
