"""What a model's attention costs per cached token it reads, measured on this machine.

A decode step at long contexts reads far more KV cache than weights (THEORY.md, "Long contexts"):
its price grows with every request's context, not with its rows. The draft policy prices that
part of a pass from two rates read here, at start-up, off the model's own attention backend on
a synthetic paged cache of its shapes (every layer, so that the keys stream from memory as in a
real pass): the seconds per cached token for a request's first query row, and the further
seconds per cached token for each more row (verifying k drafts sends k + 1 rows that share one
read of the keys).
"""

from __future__ import annotations

import time

import torch

from specbatch.model.layers.attention import AttentionMetadata
from specbatch.scheduler.kv_prices import KvPrice

CACHE_BYTES = 96 << 20  # the synthetic cache: several times a core's share of the last cache
SEQUENCES = 4
ROWS = 4  # the query rows a sequence sends in the second measurement
REPEATS = 3  # the least of these is kept (another process may interrupt one)


def measure_kv_price(model: torch.nn.Module, backend, block_size: int) -> KvPrice | None:
    """``model``'s attention price per cached token on ``backend`` (None: a model without
    paged attention layers)."""
    names = ("num_heads_local", "num_kv_heads_local", "head_dim")
    shapes = [getattr(model, a, None) for a in names]
    if any(s is None for s in shapes) or not hasattr(model, "allocate_kv_caches"):
        return None
    heads, kv_heads, head_dim = (int(s) for s in shapes)
    device = next(model.parameters()).device
    per_token = model.kv_cache_bytes_per_token()
    context = max(256, min(4096, CACHE_BYTES // (SEQUENCES * per_token)))
    context = -(-context // block_size) * block_size
    per_seq = context // block_size
    caches = model.allocate_kv_caches(SEQUENCES * per_seq, block_size, device)
    dtype = caches[0][0].dtype
    gen = torch.Generator().manual_seed(0)
    for k_cache, v_cache in caches:
        k_cache.fill_(0.01)
        v_cache.fill_(0.02)
    # each sequence's blocks in a run, as the engine's pool hands a fresh engine's prompts them
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(SEQUENCES)]

    def seconds(rows: int) -> float:
        meta = AttentionMetadata.from_lists(
            [rows] * SEQUENCES, [context] * SEQUENCES, tables, block_size, device
        )
        q = torch.randn(SEQUENCES * rows, heads, head_dim, generator=gen).to(device, dtype)
        kv = torch.randn(SEQUENCES * rows, kv_heads, head_dim, generator=gen).to(device, dtype)
        best = float("inf")
        for _ in range(REPEATS + 1):  # the first call warms the path up
            start = time.perf_counter()
            for k_cache, v_cache in caches:
                backend.forward(q, kv, kv, k_cache, v_cache, meta, head_dim**-0.5)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return best

    one, more = seconds(1), seconds(ROWS)
    tokens = SEQUENCES * context
    return KvPrice(read=one / tokens, row=max(more - one, 0.0) / ((ROWS - 1) * tokens))
