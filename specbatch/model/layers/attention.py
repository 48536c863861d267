"""Attention over a paged KV cache: the metadata of one ragged forward, the backend interface and
the pure-torch reference backend (the CUDA ones and the choice between them live beside it).

Layout of one forward: B sequences, T new tokens in all, sequence after sequence. The new tokens
of a sequence are the LAST ``q_len`` of its ``seq_len`` positions, and query row ``i`` of it sees
keys ``0 .. seq_len - q_len + i`` (causal, aligned bottom-right). So one call covers prompts
(``q_len == seq_len``), prompt chunks, one-token decodes and ``gamma + 1``-token verification.
A draft tree replaces the causal rule for its sequence by a mask (``tree_starts``/``tree_masks``):
each node sees the keys before the tree and, inside it, its ancestors and itself.

A layer's cache is a pair ``(k_cache, v_cache)``, each ``[num_blocks, block_size, kv_heads, D]``;
token position ``p`` of a sequence lives in slot ``block_table[p // bs] * bs + p % bs``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specbatch.errors import InvalidInputError


@dataclass
class AttentionMetadata:
    """One ragged forward: B sequences, T new tokens in all, laid out sequence after sequence."""

    query_start_loc: torch.Tensor  # int64 [B+1]; new tokens of sequence b are rows qsl[b]:qsl[b+1]
    seq_lens: torch.Tensor  # int64 [B]; context length of b INCLUDING its new tokens
    block_tables: torch.Tensor  # int64 [B, max_blocks]; physical block ids (padding arbitrary)
    slot_mapping: torch.Tensor  # int64 [T]; slot = block_id * block_size + offset for token t
    query_lens_cpu: list[int]  # host copies, so backends need no device->host sync
    seq_lens_cpu: list[int]
    # Draft trees. Sequence b with ``tree_starts[b] >= 0`` sees every key before that index and,
    # of the keys ``tree_starts[b] .. seq_len - 1`` (at most 64 of them), only those whose bit
    # is set in its query row's ``tree_masks`` entry (bit j: key ``tree_starts[b] + j``). The
    # other sequences (-1) are causal. None: every sequence is causal.
    tree_starts: torch.Tensor | None = None  # int64 [B]
    tree_masks: torch.Tensor | None = None  # int64 [T]
    # Backends memoise per-forward index tensors here (the same metadata object is passed to
    # every layer of one forward). Build a new metadata object for each forward.
    derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def has_tree(self) -> bool:
        return self.tree_starts is not None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        tree_starts: list[int] | None = None,
        tree_masks: list[int] | None = None,
    ) -> AttentionMetadata:
        """Build the tensors from host lists (tests and simple runners; O(T) Python work);
        ``tree_masks`` as Python ints of up to 64 bits."""
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 1 <= q_len <= s_len:
                raise ValueError(
                    f"attention metadata: need 1 <= q_len <= seq_len, got {q_len}, {s_len}"
                )
            if len(table) * block_size < s_len:
                raise ValueError("attention metadata: block table too narrow for its sequence")
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            for p in range(s_len - q_len, s_len):
                slots.append(table[p // block_size] * block_size + p % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        meta = cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device).view(-1, width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
        if tree_starts is not None and tree_masks is not None:
            meta.tree_starts = torch.tensor(tree_starts, dtype=torch.int64, device=device)
            meta.tree_masks = torch.tensor(
                [as_int64(m) for m in tree_masks], dtype=torch.int64, device=device
            )
        meta.validate(block_size)
        return meta

    def validate(self, block_size: int) -> None:
        """Host-side consistency checks (no device sync); raises ValueError on a malformed batch."""
        b = len(self.seq_lens_cpu)
        if len(self.query_lens_cpu) != b or self.query_start_loc.shape != (b + 1,):
            raise ValueError(
                "attention metadata: query_start_loc / query_lens_cpu / seq_lens disagree"
            )
        if self.slot_mapping.shape != (sum(self.query_lens_cpu),):
            raise ValueError("attention metadata: slot_mapping must have one slot per new token")
        for q_len, s_len in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True):
            if not 1 <= q_len <= s_len:
                raise ValueError(
                    f"attention metadata: need 1 <= q_len <= seq_len, got {q_len}, {s_len}"
                )
        if b and self.block_tables.shape[1] * block_size < max(self.seq_lens_cpu):
            raise ValueError("attention metadata: block_tables too narrow for the longest sequence")


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends over the cache.

    Stateless across forwards: one instance may serve several models (target and draft).
    """

    name: ClassVar[str] = "abstract"
    #: The block size must be a positive multiple of this (flash-attn paged KV needs 256).
    block_size_multiple: ClassVar[int] = 1

    @classmethod
    def check_block_size(cls, block_size: int) -> None:
        """Raise InvalidInputError naming ``block_size`` and the rule when it does not fit."""
        m = cls.block_size_multiple
        if not isinstance(block_size, int) or block_size <= 0 or block_size % m != 0:
            rule = "a positive integer" if m == 1 else f"a positive multiple of {m}"
            raise InvalidInputError(
                f"block_size must be {rule} for the '{cls.name}' attention backend, "
                f"got {block_size!r}",
                "block_size",
            )

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's key and value caches: ``[num_blocks, block_size, kv_heads, D]``
        for both, unless the backend lays its cache out otherwise."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def slot_rows(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where slots' keys and values lie: indices into the key and the value cache seen as
        rows (``cache_rows``), the same for every layer of a model. For the ``[blocks,
        block_size, kv_heads, D]`` layout, a slot is a row."""
        return slots, slots

    @staticmethod
    def cache_rows(cache: torch.Tensor) -> torch.Tensor:
        """The cache as the rows ``slot_rows`` indexes."""
        return cache.view(-1, cache.shape[2], cache.shape[3])

    @abstractmethod
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
        """q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (already rotated) -> output ``[T, Hq, D]``."""


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the new tokens' K/V into their slots (caches must be contiguous)."""
    _, _, h, d = k_cache.shape
    k_cache.view(-1, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


# On CUDA: every SDPA kernel but cuDNN's (its graph fails with CUDNN_STATUS_INTERNAL_ERROR on a
# prefill's transposed bf16 views with grouped heads, seen on an H200 with torch 2.11).
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# scaled_dot_product_attention takes enable_gqa from torch 2.5 on; before, repeat the KV heads.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``[B, Hq, Lq, D]`` x ``[B, Hkv, Lk, D]`` attention; causal (top-left) when mask is None."""
    gqa = q.shape[1] != k.shape[1]
    if gqa and not _SDPA_HAS_GQA:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    extra = {"enable_gqa": True} if gqa else {}
    with sdpa_kernel(_CUDA_SDPA) if q.is_cuda else nullcontext():
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, **extra
        )


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean "may attend" mask -> 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


@dataclass
class _ShortGroup:
    """Index tensors that batch every short-query sequence into one padded SDPA call."""

    q_index: torch.Tensor  # [Bs, max_q] rows of q (padding rows repeat a valid row)
    out_index: torch.Tensor  # [Bs * max_q] destination rows; padding rows go to the trash row T
    kv_slots: torch.Tensor  # [Bs, max_k] cache slots (padding keys repeat the sequence's slot 0)
    mask: torch.Tensor  # [Bs, 1, max_q, max_k] bool, True = may attend
    additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as 0 / -inf in ``dtype``: CPU SDPA runs about twice as fast with it."""
        m = self.additive.get(dtype)
        if m is None:
            m = additive_mask(self.mask, dtype)
            self.additive[dtype] = m
        return m


@dataclass
class _LongSeq:
    start: int
    end: int
    q_len: int
    seq_len: int
    kv_slots: torch.Tensor | None  # [seq_len]; None when the whole sequence is new (a prompt)
    mask: torch.Tensor | None = None  # [q_len, seq_len] bool of a tree; None: causal


@dataclass
class _Plan:
    short: _ShortGroup | None
    long: list[_LongSeq]


class TorchAttentionBackend(AttentionBackend):
    """Pure-torch reference backend (any device; the oracle in tests).

    Every sequence whose query is short (decode, verification: ``q_len <= short_query_max``) goes
    through one padded ``scaled_dot_product_attention`` call, its keys gathered from the paged
    cache with one index op; only long queries (prefills) are handled one sequence at a time.
    Index tensors and masks are built once per forward and reused by every layer.
    """

    name = "torch"

    def __init__(self, short_query_max: int = 16) -> None:
        self.short_query_max = short_query_max

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
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        k_flat = k_cache.view(-1, hkv, d)
        v_flat = v_cache.view(-1, hkv, d)
        plan = self._plan(meta, k_cache.shape[1], t)
        out = q.new_empty(t + 1, hq, d)  # the last row collects padding rows
        if plan.short is not None:
            g = plan.short
            bsz, max_q = g.q_index.shape
            max_k = g.kv_slots.shape[1]
            slots = g.kv_slots.view(-1)
            o = sdpa(
                q.index_select(0, g.q_index.view(-1)).view(bsz, max_q, hq, d).transpose(1, 2),
                k_flat.index_select(0, slots).view(bsz, max_k, hkv, d).transpose(1, 2),
                v_flat.index_select(0, slots).view(bsz, max_k, hkv, d).transpose(1, 2),
                g.additive_mask(q.dtype),
                scale,
            )
            out.index_copy_(0, g.out_index, o.transpose(1, 2).reshape(-1, hq, d))
        for s in plan.long:
            if s.kv_slots is None:
                ks, vs = k[s.start : s.end], v[s.start : s.end]
            else:
                ks = k_flat.index_select(0, s.kv_slots)
                vs = v_flat.index_select(0, s.kv_slots)
            mask = None
            if s.mask is not None:
                mask = additive_mask(s.mask, q.dtype)
            elif s.q_len != s.seq_len:
                mask = torch.ones(s.q_len, s.seq_len, dtype=torch.bool, device=q.device)
                mask = additive_mask(mask.tril(diagonal=s.seq_len - s.q_len), q.dtype)
            o = sdpa(
                q[s.start : s.end].transpose(0, 1).unsqueeze(0),
                ks.to(q.dtype).transpose(0, 1).unsqueeze(0),
                vs.to(q.dtype).transpose(0, 1).unsqueeze(0),
                mask,
                scale,
            )
            out[s.start : s.end] = o[0].transpose(0, 1)
        return out[:t]

    def _plan(self, meta: AttentionMetadata, block_size: int, num_tokens: int) -> _Plan:
        key = ("torch", block_size, self.short_query_max)
        plan = meta.derived.get(key)
        if plan is None:
            plan = self._build_plan(meta, block_size, num_tokens)
            meta.derived[key] = plan
        return plan

    def _build_plan(self, meta: AttentionMetadata, bs: int, t: int) -> _Plan:
        q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
        short = [i for i, n in enumerate(q_lens) if n <= self.short_query_max]
        device = meta.query_start_loc.device
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        long: list[_LongSeq] = []
        for i, (q_len, s_len) in enumerate(zip(q_lens, s_lens, strict=True)):
            if q_len <= self.short_query_max:
                continue
            slots = None
            if q_len != s_len:
                pos = torch.arange(s_len, device=device)
                slots = meta.block_tables[i, pos // bs] * bs + pos % bs
            tree = None
            if meta.tree_starts is not None and meta.tree_masks is not None:
                first = meta.tree_starts[i : i + 1]
                bits = meta.tree_masks[starts[i] : starts[i + 1]].unsqueeze(0)
                keys = torch.arange(s_len, device=device).unsqueeze(0)
                tree = tree_visibility(first, bits, keys, keys < s_len)[0]
                tree = torch.where(first >= 0, tree, _causal(q_len, s_len, device))
            long.append(_LongSeq(starts[i], starts[i + 1], q_len, s_len, slots, tree))
        if not short:
            return _Plan(None, long)

        qsl, seq_lens, tables = meta.query_start_loc[:-1], meta.seq_lens, meta.block_tables
        qlen = meta.query_start_loc[1:] - qsl
        if len(short) != len(q_lens):
            idx = torch.tensor(short, dtype=torch.int64, device=device)
            qsl, qlen, seq_lens, tables = qsl[idx], qlen[idx], seq_lens[idx], tables[idx]
        max_q = max(q_lens[i] for i in short)
        max_k = max(s_lens[i] for i in short)
        ar_q = torch.arange(max_q, device=device)
        ar_k = torch.arange(max_k, device=device)
        rows = qsl[:, None] + ar_q[None, :]
        q_valid = ar_q[None, :] < qlen[:, None]
        slots = tables[:, ar_k // bs] * bs + ar_k % bs
        k_valid = ar_k[None, :] < seq_lens[:, None]
        # Padding keys point at the sequence's first slot (always written), so no uninitialised
        # cache memory (possibly NaN) enters the matmuls, even with zero weight.
        slots = torch.where(k_valid, slots, slots[:, :1])
        last_visible = (seq_lens - qlen)[:, None] + ar_q[None, :]  # [Bs, max_q]
        mask = (ar_k[None, None, :] <= last_visible[:, :, None]) & k_valid[:, None, :]
        if meta.tree_starts is not None and meta.tree_masks is not None:
            first = meta.tree_starts
            if len(short) != len(q_lens):
                first = first[idx]
            bits = torch.where(q_valid, meta.tree_masks[rows.clamp(max=t - 1)], 0)
            tree = tree_visibility(first, bits, ar_k.expand(len(short), -1), k_valid)
            mask = torch.where((first >= 0)[:, None, None], tree, mask)
        group = _ShortGroup(
            q_index=torch.where(q_valid, rows, qsl[:, None]),
            out_index=torch.where(q_valid, rows, t).reshape(-1),
            kv_slots=slots,
            mask=mask.unsqueeze(1),
        )
        return _Plan(group, long)


def as_int64(bits: int) -> int:
    """A mask of up to 64 bits as the signed 64-bit integer with the same bits."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _causal(q_len: int, s_len: int, device: torch.device) -> torch.Tensor:
    mask = torch.ones(q_len, s_len, dtype=torch.bool, device=device)
    return mask.tril(diagonal=s_len - q_len)


def tree_visibility(
    first: torch.Tensor, bits: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Which keys each query row of a tree sees: bool [B, Q, K] for ``first`` [B] (the first
    key of each tree), ``bits`` [B, Q] (each row's mask over the tree's keys), ``keys`` [B, K]
    (key indices) and ``valid`` [B, K]."""
    offset = keys - first[:, None]
    shift = offset.clamp(0, 63)[:, None, :]
    inside = ((bits[:, :, None] >> shift) & 1).bool()
    return torch.where((offset < 0)[:, None, :], True, inside) & valid[:, None, :]
