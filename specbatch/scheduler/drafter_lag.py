"""How far a request's drafter may lag behind its target.

A drafter catches up on a request in the steps where it drafts for it, and on prompt chunks
with the target unless the policy last wanted no drafts, or the batch the prompt joins is more
than twice the one it last wanted drafts for (a burst, which will rather decode plainly). With
the prefix cache, while drafts are being made, a block is published once both caches hold it;
while none are, or once the drafter has fallen behind a published block, when the target holds
it, and it is marked as the drafter's as it catches up.
"""

from __future__ import annotations

import math

from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request


def is_prompt_chunk(req: Request, n: int) -> bool:
    """Whether scheduling ``n`` tokens of ``req`` is prefill rather than one decoding step."""
    return req.num_computed + n < req.num_tokens or n > 1


class DrafterLag:
    """``draft_input`` as the scheduler's ("tokens", "features" or "none")."""

    def __init__(self, kv: KVCacheManager, draft_input: str) -> None:
        self.kv = kv
        self.draft_input = draft_input
        self.idle = False  # the last policy call wanted no drafts at all
        self.drafting_batch = math.inf  # the requests of the last call that wanted drafts

    def wanted(self, drafts: bool, asked: int) -> None:
        """After a policy call about ``asked`` requests: whether it wanted any drafts."""
        self.idle = not drafts
        if drafts:
            self.drafting_batch = asked

    def draft_tokens(self, req: Request, n: int, end: int, drafts: bool, batch: int) -> list[int]:
        """What the drafter's KV cache catches up on this step, the target taking ``n`` tokens
        up to ``end``; ``drafts``: whether the request drafts this step; ``batch``: the
        requests running. A request whose drafter is off gets nothing."""
        prompt = is_prompt_chunk(req, n) and not self.idle and batch <= 2 * self.drafting_batch
        if (
            self.draft_input == "none"
            or req.drafter_off
            or not (drafts or prompt or self._owes_blocks(req, end))
        ):
            return []
        if self.draft_input == "features":  # the positions the target processed before
            return req.token_slice(req.num_draft_computed + 1, req.num_computed + 1)
        return req.token_slice(req.num_draft_computed, end)

    def _owes_blocks(self, req: Request, end: int) -> bool:
        """With the prefix cache, while drafts are being made: whether the drafter of a request
        not ``_detached`` lacks a full block the target holds (after this step, for a draft
        model; before it, for an EAGLE head, which reads a position's features a step after
        the target computes them)."""
        if not self.kv.caching or self.idle or self._detached(req):
            return False
        reach = req.num_computed if self.draft_input == "features" else end
        return req.num_draft_computed < reach // self.kv.block_size * self.kv.block_size

    def filled(self, req: Request) -> int:
        """Positions both the target's and the drafter's caches hold for ``req``."""
        if self.draft_input == "none":
            return req.num_computed
        return min(req.num_computed, req.num_draft_computed)

    def publishable(self, req: Request) -> tuple[int, int]:
        """The positions of ``req`` its published blocks may reach, and those of them its
        drafter's cache holds. While drafts are being made: what both caches hold, so that a
        request finding the blocks drafts from them at once. While none are, or once the
        drafter has fallen behind: what the target holds, so that the drafter need not follow."""
        drafted = req.num_computed if self.draft_input == "none" else req.num_draft_computed
        if self.idle or self._detached(req):
            return req.num_computed, drafted
        return self.filled(req), drafted

    def _detached(self, req: Request) -> bool:
        """Whether the request's drafter lacks a block it has published: published while no
        drafts were made, or found in the prefix cache held by the target alone."""
        rid = req.request_id
        return self.kv.num_drafted_blocks(rid) < self.kv.num_published(rid)
