"""The scheduler's side of the prefix cache, request by request: where a waiting request starts
(the cached blocks it takes, the block it copies before rewriting a slot of it, or whether it
waits for a block another request is computing), and which blocks of a running request are
published. Plain Python; the blocks themselves are kv_cache's."""

from __future__ import annotations

from collections.abc import Callable

from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request

Copy = tuple[int, int]  # (a cached block, the request's own copy of it)


class PrefixSharing:
    """``draft_input`` as the scheduler's: with "features" (an EAGLE head) a block's last slot
    in the head's cache read the token after the block, which each block is published with."""

    def __init__(self, kv: KVCacheManager, draft_input: str) -> None:
        self.kv = kv
        self.draft_input = draft_input
        self.copies: list[Copy] = []  # this step's, for the workers
        self.queries = self.hits = 0  # this step's, in tokens
        self._computing: dict[bytes, Request] = {}  # an unpublished block's key -> its writer
        self._registered: dict[str, list[bytes]] = {}  # request id -> its keys there

    @staticmethod
    def queries_cache(req: Request) -> bool:
        """Whether a request may start on cached blocks: not one that asks for its prompt's
        logprobs, which only computing the prompt gives."""
        return req.sampling_params.prompt_logprobs is None

    def _after(self, req: Request) -> Callable[[int], int | None] | None:
        """Block index -> the request's token after that block (None: not known yet)."""
        if self.draft_input != "features":
            return None
        bs, n = self.kv.block_size, req.num_tokens

        def after(i: int) -> int | None:
            p = (i + 1) * bs
            return req.token_slice(p, p + 1)[0] if p < n else None

        return after

    def start(self, req: Request) -> tuple[int, Copy | None] | None:
        """Start a waiting request's table on the longest run of cached blocks of its tokens;
        returns the slots taken and the block to copy, if any; None: it should wait, as the
        next block it needs is being computed by a running request that publishes it soon.

        The request resumes at the end of the run, less what it must compute itself: the last
        prompt token (its logits), or for a resumed request the last two tokens (it decodes
        its last token as it did before, drafts and all); and, with an EAGLE head, the last
        token of a run whose last block was published with another token after it (the head's
        K/V there read that token): the target recomputes its feature, which the head then
        reads with the request's own next token. The block holding the first position it
        computes is copied first when it is cached."""
        req.drafter_off = False
        if not self.queries_cache(req):
            return 0, None
        kv, bs, n = self.kv, self.kv.block_size, req.num_tokens
        keys = kv.block_keys(req.request_id, req.token_slice, n // bs)
        blocks, exact = kv.cached_run(keys, self._after(req))
        if exact and len(blocks) < len(keys) and self._in_flight(keys[len(blocks)]):
            return None
        limit = n - 2 if req.output_token_ids else n - 1
        resume = max(0, min(len(blocks) * bs - (not exact), limit))
        kept = blocks[: -(-resume // bs)]
        if not kept:
            return 0, None
        kv.take_cached(req.request_id, kept)
        copy = None
        if resume % bs:
            copy = kv.copy_on_write(req.request_id, len(kept) - 1)
            if copy is None:
                kv.free(req.request_id)
                return 0, None
        req.num_computed = resume
        req.num_draft_computed = min(resume, kv.num_drafted(kept) * bs)
        # an EAGLE head reads the target's features of every position, which the request's
        # target never computes for cached blocks: past a block only the target holds, it
        # cannot catch up, and the request drafts nothing (a draft model reads tokens)
        req.drafter_off = self.draft_input == "features" and req.num_draft_computed < resume
        return resume, copy

    def _in_flight(self, key: bytes) -> bool:
        """Whether a running request is computing the block of this key: it publishes it once
        its target holds it, and while drafts are being made once its drafter does too (an
        EAGLE head a step after the target)."""
        return key in self._computing

    def admitted(self, req: Request, copy: Copy | None) -> None:
        """A request started: count its hits (first admissions only), note its copy, and
        register the full blocks it is about to compute."""
        if copy is not None:
            self.copies.append(copy)
        if self.queries_cache(req) and not req.num_preemptions:
            req.num_cached_tokens = req.num_computed
            self.queries += req.num_tokens
            self.hits += req.num_computed
        bs = self.kv.block_size
        keys = self.kv.block_keys(req.request_id, req.token_slice, req.num_tokens // bs)
        mine = self._registered.setdefault(req.request_id, [])
        for key in keys[req.num_computed // bs :]:
            if self._computing.setdefault(key, req) is req:
                mine.append(key)

    def publish(self, req: Request, filled: int, drafted: int) -> None:
        """Publish the request's full blocks below ``filled`` (verified positions the target's
        cache holds), marked as held by the drafter's cache below ``drafted``."""
        bs, rid = self.kv.block_size, req.request_id
        known = req.num_tokens - (self.draft_input == "features")  # see ``after``
        full = min(filled, known) // bs
        done = self.kv.num_published(rid)
        drafted_blocks = min(drafted, known) // bs
        if full <= done and drafted_blocks <= self.kv.num_drafted_blocks(rid):
            return
        keys = self.kv.block_keys(rid, req.token_slice, full)
        after = None
        if self.draft_input == "features":  # known: the head read it at the block's end

            def after(i: int) -> int:
                return req.token_slice((i + 1) * bs, (i + 1) * bs + 1)[0]

        self.kv.publish(rid, keys, after, drafted_blocks)
        for key in keys[done:]:
            if self._computing.get(key) is req:
                del self._computing[key]

    def release(self, req: Request) -> None:
        """The request stopped computing (preempted, finished, aborted)."""
        for key in self._registered.pop(req.request_id, ()):
            if self._computing.get(key) is req:
                del self._computing[key]

    def take_step(self) -> tuple[list[Copy], int, int]:
        """This step's copies, queries and hits; the next step starts from none."""
        out = (self.copies, self.queries, self.hits)
        self.copies, self.queries, self.hits = [], 0, 0
        return out
