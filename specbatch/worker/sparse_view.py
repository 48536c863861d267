"""A sparse view of a paged KV cache: each sequence of a forward attends only to the blocks that
hold its first ``sinks`` keys and its last ``window`` keys (StreamingLLM's "attention sinks" and
recent window), read from the same cache through a shorter block table.

Nothing is copied: the view is new attention metadata whose block table lists the sink blocks
and then the window's blocks, with the sequence lengths and tree starts shifted by the blocks
left out. Positions (so RoPE) and the slots the forward writes are the real ones; every backend
runs the view as an ordinary forward. Both ends are widened to whole blocks: the view holds the
first ``ceil(sinks / block_size)`` blocks, and the window's first key is moved back to the start
of its block (a draft tree's keys always stay in the window).
"""

from __future__ import annotations

import torch

from specbatch.model.layers.attention import AttentionMetadata


def sparse_view(
    meta: AttentionMetadata, sinks: int, window: int, block_size: int
) -> AttentionMetadata:
    """``meta`` seen through sinks and a window (``meta`` itself where nothing is left out)."""
    sink_blocks = -(-sinks // block_size)
    lens = meta.seq_lens_cpu
    first = [n - window for n in lens]  # each sequence's first window key
    if meta.tree_starts is not None:
        first = [min(f, t) if t >= 0 else f for f, t in zip(first, meta.tree_starts.tolist())]
    window_block = [max(sink_blocks, f // block_size) for f in first]
    shift = [(w - sink_blocks) * block_size for w in window_block]
    if not any(shift):
        return meta
    device = meta.block_tables.device
    tables = meta.block_tables
    width = max(-(-n // block_size) - w for n, w in zip(lens, window_block)) + sink_blocks
    col = torch.arange(width, device=device)[None, :]
    start = torch.tensor(window_block, dtype=torch.int64, device=device)[:, None]
    src = torch.where(col < sink_blocks, col, col - sink_blocks + start)
    shift_t = torch.tensor(shift, dtype=torch.int64, device=device)
    seq_lens = [n - s for n, s in zip(lens, shift)]
    view = AttentionMetadata(
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens - shift_t,
        block_tables=tables.gather(1, src.clamp(max=tables.shape[1] - 1)),
        slot_mapping=meta.slot_mapping,
        query_lens_cpu=meta.query_lens_cpu,
        seq_lens_cpu=seq_lens,
    )
    if meta.tree_starts is not None:
        starts = meta.tree_starts
        view.tree_starts = torch.where(starts >= 0, starts - shift_t, starts)
        view.tree_masks = meta.tree_masks
    return view
