"""Room for ``auto``'s drafts in the free KV blocks: the policy never plans more draft slots
than the free blocks hold (it never preempts to make room for drafts). ``kv=None``: no limit."""

from __future__ import annotations

from specbatch.kv_cache.kv_cache_manager import KVCacheManager, blocks_for
from specbatch.request import Request


def binding(kv: KVCacheManager | None, num_requests: int, max_draft_length: int) -> bool:
    """Whether free KV blocks may cap some request's drafts: not while every request could
    take ``max_draft_length`` more slots (at most that many blocks' worth, plus one for a block
    boundary) from the free ones."""
    if kv is None:
        return False
    per_request = blocks_for(max_draft_length, kv.block_size) + 1
    return kv.num_free_blocks < num_requests * per_request


def draft_caps(
    kv: KVCacheManager | None, requests: list[Request], max_draft_length: int
) -> list[int]:
    """Per-request gamma caps: ``max_draft_length``, and what the free blocks would hold for
    that request alone."""
    caps = [max_draft_length] * len(requests)
    if kv is None:
        return caps
    for i, req in enumerate(requests):
        if kv.has_table(req.request_id):
            fits = kv.max_slots_within_free(req.request_id) - req.num_computed - 1
            caps[i] = max(0, min(caps[i], fits))
    return caps


def fit_free_blocks(
    kv: KVCacheManager | None, requests: list[Request], gammas: list[int]
) -> list[int]:
    """Shrink the plan, last requests first, so that its new blocks fit in the free ones."""
    if kv is None:
        return gammas
    free = kv.num_free_blocks
    out = []
    for req, g in zip(requests, gammas):
        while g > 0:
            if kv.blocks_needed(req.request_id, req.num_computed + 1 + g) <= free:
                break
            g -= 1
        if g:
            free -= kv.blocks_needed(req.request_id, req.num_computed + 1 + g)
        out.append(g)
    return out
