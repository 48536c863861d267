"""How far a request's drafter may lag behind its target, and what follows from it.

A drafter catches up on a request in the steps where it drafts for it, and on prompt chunks
with the target unless the policy last wanted no drafts at all, or the batch the prompt joins
is more than twice the one the policy last wanted drafts for (a burst, which will rather decode
plainly): a request that drafts nothing lets it lag, at no draft work. With the prefix cache,
while drafts are being made, it lags only within a block, as a block is then published once the
drafter holds it too; while none are, or once it has fallen behind a published block, blocks are
published when the target holds them and marked as the drafter's as it catches up.

A drafter that keeps lagging costs something all the same: the policy prices every step, and an
EAGLE head keeps the target's features of every position it has yet to read. After
``SLEEP_AFTER`` policy calls in a row that wanted no drafts, the drafter sleeps: every running
request, and every request admitted while it sleeps, is ``drafter_off`` (it drafts nothing for
the rest of its run, and its drafter keeps nothing of it), so the policy is no longer asked and
the step is plain decoding. It wakes once the running requests are half as many as when it fell
asleep, or after ``WAKE_AFTER`` steps: requests admitted from then on have a drafter again and
the policy decides for them afresh. With one request running it stays awake (it would wake
only once none runs, and pricing one request's step costs little).
"""

from __future__ import annotations

import math

from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request

SLEEP_AFTER = 16  # policy calls in a row wanting no drafts before the drafter sleeps
WAKE_AFTER = 512  # steps it sleeps at most


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
        self.quiet = 0  # policy calls in a row that wanted none
        self.asleep_with: int | None = None  # running requests when it fell asleep
        self.slept = 0  # steps asleep
        self.wake_after = WAKE_AFTER  # steps it sleeps at most this time

    @property
    def asleep(self) -> bool:
        return self.asleep_with is not None

    def wanted(self, drafts: bool, asked: int, running: list[Request]) -> None:
        """After a policy call about ``asked`` requests: whether it wanted any drafts; sleeps
        after ``SLEEP_AFTER`` calls in a row that wanted none, turning the drafter of every
        running request off."""
        self.idle = not drafts
        if drafts:
            self.drafting_batch = asked
        self.quiet = 0 if drafts else self.quiet + 1
        if self.quiet < SLEEP_AFTER or self.draft_input == "none" or len(running) < 2:
            return
        self.sleep_for(WAKE_AFTER, running)

    def sleep_for(self, steps: int, running: list[Request]) -> None:
        """Sleeps now, for ``steps`` steps at most: every running request's drafter off."""
        self.asleep_with, self.slept, self.quiet, self.wake_after = len(running), 0, 0, steps
        for req in running:
            req.drafter_off = True

    def wake(self) -> None:
        """Requests admitted from now on have a drafter again."""
        self.asleep_with = None

    def tick(self, running: int) -> None:
        """Once a step, with the requests running: wakes when due."""
        if self.asleep_with is None:
            return
        self.slept += 1
        if running <= self.asleep_with // 2 or self.slept >= self.wake_after:
            self.wake()

    def admitted(self, req: Request) -> None:
        """A request admitted while the drafter sleeps has it off."""
        if self.asleep_with is not None:
            req.drafter_off = True

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
