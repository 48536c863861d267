"""The scheduler searched for stalls: random mixes of prompts (some sharing prefixes), ``n > 1``
groups, chunked prefill, speculation and preemption on small pools, with the prefix cache on and
off, for many seeds (no torch).

Every mix must finish with every request's tokens, never leave a step with nothing scheduled
while requests wait, and give every block back (to the free list or the prefix cache). The
shadow worker (tests/kv_shadow.py) checks every slot each step reads and writes.
"""

import random

import pytest

from specbatch.draft_shape import DraftShape
from specbatch.kv_cache.kv_cache_manager import KVCacheManager, blocks_for
from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.scheduler.speculation import FixedDraft
from specbatch.stop_checker import StopChecker
from tests.kv_shadow import ShadowWorker


class Sometimes(FixedDraft):
    """Drafts ``shape`` for most decoding requests, none for the others, and in some steps
    none at all: a drafter lags behind the requests that draft nothing, as under ``auto``."""

    def __init__(self, shape: DraftShape, rng: random.Random) -> None:
        super().__init__(shape)
        self.rng = rng

    def draft_shapes(
        self, requests: list[Request], prompt_rows: int = 0, plain: int = 0
    ) -> list[DraftShape]:
        if self.rng.random() < 0.3:
            return [DraftShape()] * len(requests)
        return [self.shape if self.rng.random() < 0.7 else DraftShape() for _ in requests]


def random_mix(rng: random.Random, draft_input: str, seed: int, caching: bool = False):
    block_size = rng.choice([1, 2, 4, 16])
    max_len = rng.choice([32, 64, 128])
    k = rng.choice([0, 1, 3]) if draft_input != "none" else rng.choice([0, 2])
    shape = rng.choice([DraftShape.chain(k), DraftShape(2, 2, 3), DraftShape(3, 2, 5)])
    shape = shape if k else DraftShape()
    ahead = shape.lookahead
    # the pool holds at least one request of max_model_len (the engine checks that at start)
    num_blocks = blocks_for(max_len + ahead + 1, block_size) + rng.randint(0, 12)
    budget = rng.choice([ahead + 1, 8, 32, 256])
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    policy = Sometimes(shape, rng) if rng.random() < 0.5 else FixedDraft(shape)
    sched = Scheduler(
        SchedulerLimits(rng.choice([1, 2, 4, 16]), max(budget, ahead + 1), max_len),
        kv,
        StopChecker(None),
        policy=policy,
        speculative=k > 0,
        draft_input=draft_input,
        batch_invariant=rng.random() < 0.2,
    )
    expected: dict[str, int] = {}
    prefixes = [[rng.randrange(1, 50) for _ in range(max_len)] for _ in range(3)]
    for i in range(rng.randint(5, 30)):
        prompt_len = rng.randint(1, max_len - 1)
        max_tokens = rng.randint(1, 40)
        n = rng.choice([1, 1, 2, 3, 4])
        shared = rng.choice([0, 0, rng.randint(1, prompt_len)])  # tokens from a common prefix
        prompt = rng.choice(prefixes)[:shared]
        prompt += [rng.randrange(1, 50) for _ in range(prompt_len - shared)]
        rid = f"s{seed}r{i}"
        for j in range(n):
            member = Request(
                request_id=f"{rid}#{j}" if j else rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens),
                max_model_len=max_len,
            )
            sched.add_request(member, fork_of=rid if j else None)
            expected[member.request_id] = min(max_tokens, max_len - prompt_len)
    return sched, kv, expected


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("draft_input", ["tokens", "features", "none"])
def test_random_mixes_with_forks_and_preemption_always_finish(draft_input, caching):
    preemptions = forks = hits = holes = 0
    for seed in range(150):
        rng = random.Random(seed)
        sched, kv, expected = random_mix(rng, draft_input, seed, caching)
        forks += sum("#" in rid for rid in expected)
        finished: dict[str, Request] = {}
        worker = ShadowWorker(sched, rng)
        steps = 0
        while sched.has_unfinished():
            steps += 1
            assert steps < 20_000, f"seed {seed}: no progress"
            plan = sched.schedule()
            assert plan.requests, f"seed {seed}: nothing scheduled while requests wait"
            hits += plan.prefix_cache_hits
            holes += sum(r.drafter_off for r in sched.running)
            for req in sched.update(plan, worker.step(plan)):
                if req.is_finished:
                    finished[req.request_id] = req
            if rng.random() < 0.02 and sched.running:  # an abort now and then
                victim = rng.choice(sched.running)
                expected.pop(victim.request_id)
                for req in sched.abort([victim.request_id]):
                    finished.pop(req.request_id, None)
        assert kv.num_free_blocks == kv.num_blocks, f"seed {seed}: leaked blocks"
        assert {r: len(finished[r].output_token_ids) for r in expected} == expected
        preemptions += sched.num_preemptions
    assert preemptions > 100 and forks > 500  # the search did reach the paths it is for
    assert (hits > 5000) == caching
    # an EAGLE head that finds blocks only the target holds drafts nothing for that request
    assert (holes > 0) == (caching and draft_input == "features"), holes
