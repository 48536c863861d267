"""Attention over the torch backend's paged cache with what the backends do not do: logit
soft-capping (``softcap * tanh(scores / softcap)`` before the softmax, Gemma 2) and a sliding
window (a query at position ``p`` sees only the keys at ``p - window + 1 .. p``, Gemma 2 and 3's
local layers), each row's window exact.

Like the self-drafter's sparse view (``worker/sparse_view.py``), a windowed sequence reads only
the keys its rows can see: each item gathers the keys from its first row's window start to its
last row, through the block table, then masks per row. The rest of the layout is the torch
backend's: the cache is ``[blocks, block_size, kv_heads, D]``, one ragged forward covers
prompts, chunks, decodes, verification rows and draft trees, and a tree row sees the keys before
its tree and its own ancestors.

Positions are read off the metadata, in its own key coordinates (so a view of the cache
windows as the cache does): key ``j`` before a tree sits at position ``j``, a causal row at its
own key's, and a tree row one past its tree's first key for each tree key it sees beyond the
first (its path from the tree's top: verification's root and its descendants, or a drafter's
beam under a root just before the tree). A tree's own keys are windowed by their index, at or
past their position: exact while a tree is shallower than the window (a real model's window is
hundreds of keys or more, a tree at most 64 deep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.model.layers.attention import (
    AttentionMetadata,
    additive_mask,
    sdpa,
    tree_visibility,
    write_kv,
)

SHORT_ROWS = 16  # sequences with at most this many rows share one padded call
CHUNK_ROWS = 256  # longer ones run in chunks of this many rows each


@dataclass
class _Group:
    """Items (stretches of one sequence's rows) padded into one call."""

    q_index: torch.Tensor  # [G, L] rows of q (padding rows repeat a valid one)
    out_index: torch.Tensor  # [G * L] destination rows; padding rows go to the trash row T
    slots: torch.Tensor  # [G, K] cache slots of the keys each item reads
    mask: torch.Tensor  # [G, L, K] bool, True = may attend


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (rotated) -> ``[T, Hq, D]``; writes k and v
    into their slots first. Scores are ``q . k * scale``, soft-capped where ``softcap`` is set,
    then softmax in float32, as transformers' eager attention computes them."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    k_rows, v_rows = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    key = ("window", k_cache.shape[1], window)
    groups = meta.derived.get(key)
    if groups is None:
        groups = _groups(meta, k_cache.shape[1], window)
        meta.derived[key] = groups
    out = q.new_empty(t + 1, hq, d)  # the last row collects padding rows
    for g in groups:
        n, rows = g.q_index.shape
        keys = g.slots.shape[1]
        slots = g.slots.view(-1)
        qg = q.index_select(0, g.q_index.view(-1)).view(n, rows, hq, d).transpose(1, 2)
        kg = k_rows.index_select(0, slots).view(n, keys, hkv, d).transpose(1, 2).to(q.dtype)
        vg = v_rows.index_select(0, slots).view(n, keys, hkv, d).transpose(1, 2).to(q.dtype)
        if softcap is None:
            o = sdpa(qg, kg, vg, additive_mask(g.mask.unsqueeze(1), q.dtype), scale)
        else:
            o = _capped(qg, kg, vg, g.mask, scale, softcap)
        out.index_copy_(0, g.out_index, o.transpose(1, 2).reshape(-1, hq, d))
    return out[:t]


def _capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """q ``[G, Hq, L, D]`` over k, v ``[G, Hkv, K, D]`` with soft-capped scores; the query
    heads that share a key/value head are grouped, as ``repeat_kv`` pairs them."""
    n, hq, rows, d = q.shape
    hkv = k.shape[1]
    qg = q.view(n, hkv, hq // hkv, rows, d)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None, None], torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(2)).view(n, hq, rows, d)


def _groups(meta: AttentionMetadata, bs: int, window: int | None) -> list[_Group]:
    """Every sequence's rows as items: the short sequences in one group, each chunk of a long
    one in a group of its own."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    trees = meta.tree_starts.tolist() if meta.tree_starts is not None else [-1] * len(q_lens)
    seen: list[int] | None = None  # the tree keys each row sees
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    short: list[tuple[int, int, int, int, int]] = []
    groups: list[list[tuple[int, int, int, int, int]]] = []
    for b, (q_len, s_len) in enumerate(zip(q_lens, s_lens, strict=True)):
        tree = trees[b]
        if tree >= 0 and window is not None and seen is None:
            assert meta.tree_masks is not None
            seen = [bin(m & (1 << 64) - 1).count("1") for m in meta.tree_masks.tolist()]
        for r0 in range(0, q_len, CHUNK_ROWS if q_len > SHORT_ROWS else q_len):
            r1 = min(r0 + CHUNK_ROWS, q_len)
            hi = s_len if tree >= 0 else s_len - q_len + r1
            lo = 0
            if window is not None:
                first = s_len - q_len + r0  # the first row's position (a causal row)
                if tree >= 0:
                    assert seen is not None
                    first = tree + min(seen[starts[b] + r0 : starts[b] + r1]) - 1
                lo = max(0, min(first - window + 1, tree if tree >= 0 else first))
            item = (b, r0, r1, lo, hi)
            if q_len <= SHORT_ROWS:
                short.append(item)
            else:
                groups.append([item])
    if short:
        groups.insert(0, short)
    num_tokens = starts[-1]
    return [_group(meta, items, bs, window, num_tokens) for items in groups]


def _group(
    meta: AttentionMetadata,
    items: list[tuple[int, int, int, int, int]],
    bs: int,
    window: int | None,
    num_tokens: int,
) -> _Group:
    device = meta.query_start_loc.device

    def col(i: int) -> torch.Tensor:
        return torch.tensor([it[i] for it in items], dtype=torch.int64, device=device)

    b, r0, r1, lo, hi = (col(i) for i in range(5))
    rows = max(it[2] - it[1] for it in items)
    keys = max(it[4] - it[3] for it in items)
    q_len = meta.query_start_loc[b + 1] - meta.query_start_loc[b]
    own0 = meta.seq_lens[b] - q_len  # the key index of each sequence's first row
    ar_q = torch.arange(rows, device=device)
    ar_k = torch.arange(keys, device=device)
    row = r0[:, None] + ar_q[None, :]  # [G, L] row within its sequence
    q_valid = row < r1[:, None]
    q_index = meta.query_start_loc[b][:, None] + row
    q_safe = torch.where(q_valid, q_index, meta.query_start_loc[b][:, None] + r0[:, None])
    key = lo[:, None] + ar_k[None, :]  # [G, K] key index
    k_valid = key < hi[:, None]
    tables = meta.block_tables.index_select(0, b)
    block = (key // bs).clamp(max=tables.shape[1] - 1)
    slots = tables.gather(1, block) * bs + key % bs
    slots = torch.where(k_valid, slots, slots[:, :1])  # padding reads a written key, unseen
    own = own0[:, None] + row  # [G, L] each row's own key index
    mask = key[:, None, :] <= own[:, :, None]
    at = own  # each row's position in the metadata's key coordinates
    if meta.tree_starts is not None and meta.tree_masks is not None:
        first = meta.tree_starts.index_select(0, b)
        bits = torch.where(q_valid, meta.tree_masks[q_safe], 0)
        tree = tree_visibility(first, bits, key, k_valid)
        is_tree = first >= 0
        mask = torch.where(is_tree[:, None, None], tree, mask)
        if window is not None:
            seen = ((bits[:, :, None] >> torch.arange(64, device=device)) & 1).sum(-1)
            at = torch.where(is_tree[:, None], first[:, None] + seen - 1, own)
    if window is not None:
        mask &= key[:, None, :] > (at - window)[:, :, None]
    mask &= k_valid[:, None, :]
    mask |= ~q_valid[:, :, None] & (ar_k == 0)[None, None, :]  # padding rows see one key
    return _Group(
        q_index=q_safe,
        out_index=torch.where(q_valid, q_index, num_tokens).reshape(-1),
        slots=slots,
        mask=mask,
    )
