"""Draft-tree attention masks, and a pure-torch attention over the paged cache that honours them
(the reference the CPU kernel is tested against).

A tree mask is int64 ``[T]``, one entry per new token (query row) of a ragged forward: bit ``j``
of row ``t``'s entry is set where ``t`` sees new token ``j`` of its own sequence (its ancestors in
the draft tree, and itself). Every row sees its sequence's whole context. Masks cover sequences
of at most ``TREE_ROWS`` new tokens; the rows of longer ones (prompts, chunks) are causal and
their entries are ignored. Without a mask every row is causal: row ``i`` sees new tokens
``0 .. i``.
"""

from __future__ import annotations

import torch

from specbatch.model.layers.attention import AttentionMetadata

TREE_ROWS = 64


def tree_bits(parents: list[int]) -> list[int]:
    """The mask entries of one sequence's new tokens from each token's parent among them (-1: a
    root, which sees the context and itself); parents come before their children."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree: token {i}'s parent must be -1 or an earlier token, got {p}")
        bits.append((bits[p] if p >= 0 else 0) | 1 << i)
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # as int64


def causal_tree_mask(query_lens: list[int]) -> torch.Tensor:
    """The mask that sees what causal attention sees (a chain: row ``i`` sees ``0 .. i``)."""
    return torch.tensor(
        [b for n in query_lens for b in (tree_bits(list(range(-1, n - 1))) if n <= TREE_ROWS
                                         else [0] * n)],
        dtype=torch.int64,
    )  # fmt: skip


def check_tree_mask(tree_mask: torch.Tensor, query_lens: list[int]) -> None:
    """ValueError unless every covered row sees itself and no token past its sequence's."""
    if tree_mask.dtype != torch.int64 or tree_mask.shape != (sum(query_lens),):
        raise ValueError(
            f"tree_mask must be int64 [{sum(query_lens)}], got {tree_mask.dtype} "
            f"{tuple(tree_mask.shape)}"
        )
    row = 0
    for n in query_lens:
        if n <= TREE_ROWS:
            for i, b in enumerate(tree_mask[row : row + n].tolist()):
                b &= (1 << 64) - 1
                if not b >> i & 1 or b >> n:
                    raise ValueError(f"tree_mask: row {row + i} must see itself and only the "
                                     f"{n} new tokens of its sequence, got {b:#x}")  # fmt: skip
        row += n


def visible(
    query_lens: list[int], seq_lens: list[int], tree_mask: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Per sequence, a bool ``[q_len, seq_len]``: the positions each of its new rows sees."""
    out, row = [], 0
    for q_len, s_len in zip(query_lens, seq_lens, strict=True):
        ctx = s_len - q_len
        see = torch.ones(q_len, s_len, dtype=torch.bool).tril(diagonal=ctx)
        if tree_mask is not None and q_len <= TREE_ROWS:
            bits = tree_mask[row : row + q_len, None] >> torch.arange(q_len)[None, :]
            see[:, ctx:] = (bits & 1).bool()
        out.append(see)
        row += q_len
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, Hq, D]`` over caches ``[blocks, block_size, Hkv, D]`` (their keys and values
    already written), a sequence at a time, the softmax in float64."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    sees = visible(meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask)
    starts = meta.query_start_loc.tolist()
    for b, see in enumerate(sees):
        s_len = see.shape[1]
        pos = torch.arange(s_len)
        slots = meta.block_tables[b, pos // bs] * bs + pos % bs
        keys = k_cache.view(-1, hkv, k_cache.shape[3])[slots].double().repeat_interleave(group, 1)
        vals = v_cache.view(-1, hkv, v_cache.shape[3])[slots].double().repeat_interleave(group, 1)
        qs = q[starts[b] : starts[b + 1]].double()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        weights = scores.masked_fill(~see, float("-inf")).softmax(dim=-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", weights, vals).to(q.dtype)
    return out
