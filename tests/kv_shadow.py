"""A torch-free stand-in for the workers that records what every KV slot holds.

Each slot of the target's and the drafter's caches holds, instead of K/V, the tokens whose K/V it
would be: position p of a sequence holds ``tokens[:p + 1]`` in the target's and a draft model's
cache, and ``tokens[:p + 2]`` in an EAGLE head's (head position p reads token p + 1). The worker
emits position-derived tokens (``1000 + position``), proposes drafts that are right up to a
random point and wrong after it, and checks on every step what a real step relies on:
- every slot a model reads holds the K/V of the request's own tokens (a cached block holding a
  draft, a stale slot or another prompt's K/V fails here);
- no step writes into a block that is published or has another owner, except a drafter
  catching up on a published block only the target's cache held when it took it (what it
  writes there is what any other writer does);
- an EAGLE head catches up only on positions whose target features earlier passes kept;
- every published block of a table is published under the key of that request's tokens.
"""

from __future__ import annotations

import random

from specbatch.kv_cache.block_keys import block_key
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.scheduler.output import RequestStepResult, SchedulerOutput, StepResult
from specbatch.scheduler.scheduler import Scheduler

Content = tuple[int, ...]
GARBAGE: Content = (-1,)  # a draft drafted from the head's own features


class ShadowWorker:
    def __init__(self, sched: Scheduler, rng: random.Random) -> None:
        self.sched, self.kv, self.rng = sched, sched.kv, rng
        self.bs = sched.kv.block_size
        self.target: dict[int, Content] = {}
        self.drafter: dict[int, Content] = {}
        self.features: dict[str, tuple[int, list[Content]]] = {}  # EAGLE's kept features
        self.reads = 0

    def _slot(self, table: list[int], p: int) -> int:
        return table[p // self.bs] * self.bs + p % self.bs

    def _write(
        self, cache: dict[int, Content], table: list[int], p: int, c: Content, fill: bool = False
    ) -> None:
        block = table[p // self.bs]
        pool = self.kv.pool
        if fill and pool.key_of(block) is not None:  # a drafter catching up on its own tokens
            if pool.is_drafted(block):  # another request's drafter filled it first
                assert cache.get(self._slot(table, p)) == c, f"position {p} changed in {block}"
            cache[self._slot(table, p)] = c
            return
        assert pool.key_of(block) is None, f"a step writes position {p} into published {block}"
        assert pool.ref_count(block) == 1, f"a step writes position {p} into shared {block}"
        cache[self._slot(table, p)] = c

    def _check(self, cache: dict[int, Content], table: list[int], n: int, tokens, extra: int):
        for p in range(n):
            got = cache.get(self._slot(table, p))
            assert got == tuple(tokens[: p + 1 + extra]), f"position {p} holds {got}"
            self.reads += 1

    def _check_keys(self, table: list[int], published: int, tokens: list[int]) -> None:
        key = self.kv.salt
        for i in range(published):
            key = block_key(key, tokens[i * self.bs : (i + 1) * self.bs])
            assert self.kv.pool.key_of(table[i]) in (key, None), f"block {i} has another key"

    def step(self, plan: SchedulerOutput) -> StepResult:
        for cache in (self.target, self.drafter):  # gathered first, as the worker does
            moved = [
                (dst * self.bs + i, cache.get(src * self.bs + i))
                for src, dst in plan.block_copies
                for i in range(self.bs)
            ]
            for slot, c in moved:
                if c is None:
                    cache.pop(slot, None)
                else:
                    cache[slot] = c
        out = StepResult()
        mode = self.sched.draft_input
        for sr in plan.requests:
            req = self.sched.requests[sr.request_id]
            tokens = req.token_slice(0, req.num_tokens)
            table = sr.block_table
            self._check_keys(table, self.kv.num_published(sr.request_id), tokens)
            base = sr.target_start + len(sr.target_token_ids)
            assert tokens[sr.target_start : base] == sr.target_token_ids
            # the drafts: right up to a random point, then wrong (a tree: its walk accepts a
            # path of that many nodes, whichever they are)
            shape = sr.shape
            a = self.rng.randint(0, shape.depth) if sr.sample else 0
            drafts = [1000 + base + j if j < a else -5 for j in range(sr.num_draft)]
            # the drafter catches up, then drafts
            if mode != "none" and (sr.draft_token_ids or sr.num_draft):
                assert sr.draft_token_ids or not sr.num_draft, "drafts without a root"
                extra = 1 if mode == "features" else 0
                self._check(self.drafter, table, sr.draft_start, tokens, extra)
                for i, t in enumerate(sr.draft_token_ids):
                    p = sr.draft_start + i
                    if mode == "features":
                        start, kept = self.features[sr.request_id]
                        assert start <= p < start + len(kept), f"no feature kept for {p}"
                        assert t == tokens[p + 1] and kept[p - start] == tuple(tokens[: p + 1])
                        self._write(self.drafter, table, p, tuple(tokens[: p + 2]), True)
                    else:
                        self._write(self.drafter, table, p, tuple(tokens[: p + 1]), True)
                if not shape.is_chain:  # one slot per expanded node of depths 1 .. D - 1
                    for j in range(shape.topk * (shape.depth - 1)):
                        self._write(self.drafter, table, base + j, GARBAGE)
                for j in range(max(sr.num_draft - 1, 0) if shape.is_chain else 0):
                    c = GARBAGE if mode == "features" else tuple(tokens[:base] + drafts[: j + 1])
                    self._write(self.drafter, table, base + j, c)
            # the target's pass over its tokens and the drafts
            self._check(self.target, table, sr.target_start, tokens, 0)
            kept = []
            for i in range(len(sr.target_token_ids)):
                c = tuple(tokens[: sr.target_start + i + 1])
                self._write(self.target, table, sr.target_start + i, c)
                kept.append(c)
            for j in range(sr.num_draft):
                c = tuple(tokens[:base] + drafts[: j + 1]) if shape.is_chain else GARBAGE
                self._write(self.target, table, base + j, c)
            for j in range(a if not shape.is_chain else 0):  # the accepted path, compacted
                self._write(self.target, table, base + j, tuple(tokens[:base] + drafts[: j + 1]))
            if sr.sample:
                kept.extend(tuple(tokens[:base] + drafts[: j + 1]) for j in range(a))
                out.results[sr.request_id] = RequestStepResult(
                    [1000 + base + i for i in range(a + 1)], a, sr.num_draft
                )
            self._keep_features(sr, kept)
        return out

    def _keep_features(self, sr, rows: list[Content]) -> None:
        """As the EAGLE proposer: features kept from the positions the head has not read yet
        (it lags while its request drafts nothing), the new pass's rows after them."""
        start, kept = self.features.get(sr.request_id, (sr.target_start, []))
        if start + len(kept) != sr.target_start:  # new, or recomputed from the start
            start, kept = sr.target_start, []
        read = max(0, sr.draft_start + len(sr.draft_token_ids) - start)
        self.features[sr.request_id] = (start + read, kept[read:] + rows)

    def run(self, max_steps: int = 20_000) -> dict:
        """Step until every request finished; returns the requests that finished."""
        sched, finished = self.sched, {}
        for _ in range(max_steps):
            if not sched.has_unfinished():
                return finished
            plan = sched.schedule()
            assert plan.requests, "nothing scheduled while requests wait"
            for req in sched.update(plan, self.step(plan)):
                if req.is_finished:
                    finished[req.request_id] = req
        raise AssertionError("no progress")


def all_blocks_back(kv: KVCacheManager) -> bool:
    """Every block is free or idle in the prefix cache."""
    return kv.num_free_blocks == kv.num_blocks
