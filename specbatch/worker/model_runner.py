"""One model on one rank: its paged KV cache, and ragged forward passes over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.config import ModelConfig
from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.model.layers.attention import AttentionMetadata
from specbatch.model.layers.backend_choice import select_backend
from specbatch.model.loader import load_model


@dataclass
class ForwardInputs:
    """Flattened inputs of one ragged forward: B sequences, T tokens."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata


def build_inputs(
    input_ids: torch.Tensor,
    query_lens: list[int],
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> ForwardInputs:
    """Positions, slot mapping and attention metadata for sequences whose new tokens are
    ``input_ids`` (already laid out sequence after sequence, on ``device``), sequence b's first
    new token sitting at position ``starts[b]``. Only host lists are read: no device sync."""
    seq_lens = [s + q for s, q in zip(starts, query_lens)]
    b = len(query_lens)
    width = max((len(t) for t in block_tables), default=1) or 1
    table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    qsl = torch.zeros(b + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=qsl[1:])
    seq_index = torch.repeat_interleave(torch.arange(b), q_lens)
    total = int(qsl[-1])
    positions = torch.arange(total) - qsl[seq_index] + torch.tensor(starts)[seq_index]
    slots = table[seq_index, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
        block_tables=table.to(device),
        slot_mapping=slots.to(device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
    return ForwardInputs(input_ids, positions.to(device), meta)


class ModelRunner:
    """Loads one model (its shard on this rank) and runs it over its own paged cache."""

    def __init__(
        self,
        model_config: ModelConfig,
        device: torch.device,
        tp: TensorParallelGroup = SINGLE,
        attention_backend: str = "auto",
        block_size: int | None = None,
    ) -> None:
        """``block_size`` (the engine's) lets "auto" skip a CUDA backend whose block-size rule it
        breaks, and an explicitly named backend reject it early; None: "auto" keeps torch."""
        self.config = model_config
        self.device = device
        from specbatch.model.llama import head_dim_of

        self.backend = select_backend(
            device,
            attention_backend,
            dtype=model_config.dtype,
            block_size=block_size,
            head_dim=head_dim_of(model_config.hf_config),
        )
        self.model = load_model(
            model_config.path, model_config.dtype, device, tp, attention_backend=self.backend
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_cache_bytes_per_token() * block_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.backend.check_block_size(block_size)
        self.kv_caches = self.model.allocate_kv_caches(num_blocks, block_size, self.device)
        self.block_size = block_size

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Run the model; return float32 logits of the rows ``logits_rows`` (of the T tokens)."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if logits_rows is None:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, logits_rows))
