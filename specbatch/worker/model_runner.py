"""One model on one rank: its paged KV cache, and ragged forward passes over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.model.checkpoint import ModelConfig
from specbatch.model.layers.attention import AttentionBackend, AttentionMetadata
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
    new token sitting at position ``starts[b]``. Built from the host lists in plain Python (a
    step's few hundred tokens cost less so than as a dozen small tensor ops)."""
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    for q, start, table in zip(query_lens, starts, block_tables, strict=True):
        end = start + q
        positions.extend(range(start, end))
        slots.extend(
            table[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        qsl.append(qsl[-1] + q)
        seq_lens.append(end)
    width = max(map(len, block_tables), default=1) or 1
    table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int64).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
        block_tables=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )
    return ForwardInputs(input_ids, torch.tensor(positions, dtype=torch.int64).to(device), meta)


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
        from specbatch.model.gemma import needs_torch_attention
        from specbatch.model.llama import head_dim_of

        self.backend = select_backend(
            device,
            attention_backend,
            dtype=model_config.dtype,
            block_size=block_size,
            head_dim=head_dim_of(model_config.hf_config),
            torch_only=needs_torch_attention(model_config.hf_config),
        )
        self.model = load_model(
            model_config, model_config.dtype, device, tp, attention_backend=self.backend
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_cache_bytes_per_token() * block_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.backend.check_block_size(block_size)
        self.kv_caches = self.model.allocate_kv_caches(num_blocks, block_size, self.device)
        self.block_size = block_size

    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots ``src`` into slots ``dst`` in every layer."""
        move_slots(self.backend, self.kv_caches, src, dst, self.device)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy on write: the K/V of whole blocks ``src`` into blocks ``dst`` in every layer."""
        copy_blocks(self.kv_caches, src, dst, self.device)

    @torch.inference_mode()
    def forward(self, inputs: ForwardInputs, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """Run the model; return float32 logits of the rows ``logits_rows`` (of the T tokens)."""
        return self.forward_features(inputs, logits_rows, None)[0]

    @torch.inference_mode()
    def forward_features(
        self,
        inputs: ForwardInputs,
        logits_rows: torch.Tensor | None,
        streams: tuple[int, ...] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of ``logits_rows`` and the features of all T rows a drafter reads: None
        (``streams`` None), the final hidden states (``()``), or the residual streams entering
        the layers ``streams``, concatenated."""
        hidden, kept = self.model.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, streams or ()
        )
        features = None
        if streams is not None:
            features = torch.cat(kept, dim=-1) if streams else hidden
        if logits_rows is None:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32), features
        return self.model.compute_logits(hidden.index_select(0, logits_rows)), features


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    src: list[int],
    dst: list[int],
    device: torch.device,
) -> None:
    """Copy blocks ``src`` into blocks ``dst`` in every layer's cache: every backend's caches
    are indexed by block first, whatever their layout within a block (all sources are read
    before any copy is written)."""
    if not kv_caches or not src:
        return
    s = torch.tensor(src, dtype=torch.int64, device=device)
    d = torch.tensor(dst, dtype=torch.int64, device=device)
    for caches in kv_caches:
        for cache in caches:
            cache.index_copy_(0, d, cache.index_select(0, s))


def move_slots(
    backend: AttentionBackend,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    src: list[int],
    dst: list[int],
    device: torch.device,
) -> None:
    """Copy the K/V of slots ``src`` into slots ``dst`` in every layer's cache (all sources
    are read before any destination is written)."""
    if not kv_caches or not src:
        return
    s = torch.tensor(src, dtype=torch.int64, device=device)
    d = torch.tensor(dst, dtype=torch.int64, device=device)
    k0, v0 = kv_caches[0]
    (k_src, v_src), (k_dst, v_dst) = backend.slot_rows(k0, v0, s), backend.slot_rows(k0, v0, d)
    for k_cache, v_cache in kv_caches:
        for cache, a, b in ((k_cache, k_src, k_dst), (v_cache, v_src, v_dst)):
            rows = backend.cache_rows(cache)
            rows.index_copy_(0, b, rows.index_select(0, a))
