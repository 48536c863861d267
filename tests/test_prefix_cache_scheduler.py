"""The scheduler with the prefix cache (no torch): what a request takes from the cache, what it
recomputes, what it copies, and what it publishes. Every run goes through the shadow worker
(tests/kv_shadow.py), which checks the contents of every slot each step reads and writes."""

import random

import pytest

from specbatch.draft_shape import DraftShape
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.drafter_lag import DrafterLag
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.scheduler.speculation import FixedDraft
from specbatch.stop_checker import StopChecker
from tests.kv_shadow import ShadowWorker, all_blocks_back
from tests.test_scheduler_stress import random_mix

BS = 4


def make(num_blocks=64, k=0, draft_input="none", max_seqs=8, budget=256, seed=0, policy=None):
    """A scheduler with the prefix cache, its KV manager, and a shadow worker (speculating
    when ``k`` > 0 or a policy is given)."""
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    sched = Scheduler(
        SchedulerLimits(max_seqs, budget, 128),
        kv,
        StopChecker(None),
        policy=policy or FixedDraft(k),
        speculative=k > 0 or policy is not None,
        draft_input=draft_input,
    )
    return sched, kv, ShadowWorker(sched, random.Random(seed))


def req(rid, prompt, max_tokens=6, **kw):
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(rid, list(prompt), params, max_model_len=128)


def first_plan(sched, worker, rid):
    """Step until ``rid`` is scheduled; returns the plan and its entry for ``rid``."""
    while True:
        plan = sched.schedule()
        entry = next((r for r in plan.requests if r.request_id == rid), None)
        sched.update(plan, worker.step(plan))
        if entry is not None:
            return plan, entry


P = list(range(1, 11))  # 10 tokens: two full blocks of 4 and a part


def test_a_request_starts_on_the_cached_blocks_of_its_prompt():
    sched, kv, w = make()
    sched.add_request(req("a", P))
    w.run()
    sched.add_request(req("b", [*P[:8], 50, 51, 52]))
    plan, b = first_plan(sched, w, "b")
    assert b.target_start == 8 and b.target_token_ids == [50, 51, 52]
    assert (plan.prefix_cache_queries, plan.prefix_cache_hits) == (11, 8)
    assert not plan.block_copies
    w.run()
    assert all_blocks_back(kv) and kv.num_cached_blocks >= 4


def test_a_wholly_cached_prompt_recomputes_its_last_token_in_a_copy():
    sched, kv, w = make()
    sched.add_request(req("a", P[:8]))
    w.run()
    cached = kv.cached_run(kv.block_keys("x", lambda i, j: P[i:j], 2))[0]
    assert len(cached) == 2
    sched.add_request(req("b", P[:8]))
    plan, b = first_plan(sched, w, "b")
    assert b.target_start == 7 and plan.block_copies == [(cached[1], b.block_table[1])]
    assert b.block_table[0] == cached[0] and b.block_table[1] != cached[1]
    w.run()
    assert all_blocks_back(kv)


@pytest.mark.parametrize("next_token, start, copies", [(9, 8, 0), (77, 7, 1)])
def test_an_eagle_head_recomputes_a_boundary_read_with_another_token(next_token, start, copies):
    """The head's K/V at a block's last position read the token after the block: a request
    with another token there starts one position earlier, in a copy of that block."""
    sched, kv, w = make(k=2, draft_input="features")
    sched.add_request(req("a", P, max_tokens=8))
    w.run()
    sched.add_request(req("b", [*P[:8], next_token, 60, 61]))
    plan, b = first_plan(sched, w, "b")
    assert (b.target_start, b.draft_start, len(plan.block_copies)) == (start, start, copies)
    w.run()
    assert all_blocks_back(kv)


def test_cached_blocks_count_as_free_for_admission():
    sched, kv, w = make(num_blocks=8)
    for i in range(4):  # every block ends up idle in the cache
        sched.add_request(req(f"r{i}", [100 * i + t for t in range(20)], max_tokens=4))
        w.run()
    assert kv.num_cached_blocks > 0 and all_blocks_back(kv)
    sched.add_request(req("big", list(range(500, 529)), max_tokens=3))  # needs all 8
    finished = w.run()
    assert len(finished["big"].output_token_ids) == 3
    assert kv.pool.num_evictions > 0


def test_a_preempted_request_resumes_from_its_released_blocks():
    sched, kv, w = make(num_blocks=12, k=3, draft_input="tokens", max_seqs=4)
    for i in range(4):
        sched.add_request(req(f"r{i}", [7 * i + t for t in range(1, 13)], max_tokens=20))
    seen: dict[str, int] = {}
    resumed_at = []  # where each request starts again after a preemption
    while sched.has_unfinished():
        plan = sched.schedule()
        for sr in plan.requests:
            r = sched.requests[sr.request_id]
            if r.num_preemptions > seen.get(sr.request_id, 0):
                seen[sr.request_id] = r.num_preemptions
                resumed_at.append(sr.target_start)
        sched.update(plan, w.step(plan))
    assert sched.num_preemptions > 0 and any(resumed_at), resumed_at
    assert all_blocks_back(kv)


@pytest.mark.parametrize("draft_input", ["none", "tokens", "features"])
def test_n_completions_share_their_prompt_through_the_cache(draft_input):
    sched, kv, w = make(k=2 if draft_input != "none" else 0, draft_input=draft_input)
    sched.add_request(req("g", P))
    for j in (1, 2, 3):
        sched.add_request(req(f"g#{j}", P), fork_of="g")
    owners = 0
    starts = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        for sr in plan.requests:
            starts.setdefault(sr.request_id, sr.target_start)
        owners = max(owners, max(kv.pool.ref_count(b) for b in range(kv.num_blocks)))
        sched.update(plan, w.step(plan))
    assert owners == 4 and starts == {"g": 0, "g#1": 8, "g#2": 8, "g#3": 8}
    assert all_blocks_back(kv)


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    sched, _kv, w = make()
    sched.add_request(req("a", P))
    w.run()
    sched.add_request(req("b", P, prompt_logprobs=1))
    plan, b = first_plan(sched, w, "b")
    assert b.target_start == 0 and plan.prefix_cache_queries == 0


def test_an_aborted_request_leaves_its_blocks_in_the_cache():
    sched, kv, w = make()
    sched.add_request(req("a", P, max_tokens=50))
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, w.step(plan))
    sched.abort(["a"])
    assert all_blocks_back(kv) and kv.num_cached_blocks >= 2
    sched.add_request(req("b", P))
    assert first_plan(sched, w, "b")[1].target_start == 8


def test_a_hit_on_a_block_whose_neighbours_were_rolled_back():
    """A request drafting 3 tokens a round (most rejected) publishes the blocks of its verified
    tokens while its later blocks take drafts and roll back; a request whose prompt is the first
    one's prompt and output hits those blocks and finds only verified tokens in them."""
    sched, _kv, w = make(k=3, draft_input="tokens")
    sched.add_request(req("a", P, max_tokens=30))
    a = w.run()["a"]
    assert a.spec.rejections > 3
    tokens = P + a.output_token_ids
    sched.add_request(req("b", [*tokens[:35], 9, 9]))
    _plan, b = first_plan(sched, w, "b")
    assert b.target_start == 32  # 8 full blocks, 6 of them the first request's output
    w.run()


PLANTS = {
    # blocks published as soon as the last emitted token is known, before the target has
    # written its K/V: that slot still holds a rejected draft's (or nothing)
    "the bonus slot": (
        "tokens",
        "filled",
        lambda self, r: min(r.num_computed + 1, self.kv.num_slots(r.request_id)),
    ),
    # blocks published as held by an EAGLE head when only the target holds them
    "the target only": ("features", "publishable", lambda self, r: (r.num_computed,) * 2),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_publication_bugs_are_caught(monkeypatch, plant):
    """Caught by the shadow's checks or the rollback guard (``truncate``) in most mixes."""
    draft_input, method, planted = PLANTS[plant]
    caught = 0
    for seed in range(20):
        rng = random.Random(seed)
        sched, _, _ = random_mix(rng, draft_input, seed, caching=True)
        with monkeypatch.context() as m:
            m.setattr(DrafterLag, method, planted)
            try:
                ShadowWorker(sched, rng).run()
            except (AssertionError, RuntimeError):
                caught += 1
    assert caught >= 3, caught


@pytest.mark.parametrize(("draft_input", "k", "start"), [("none", 0, 12), ("features", 2, 11)])
def test_a_request_waits_for_the_blocks_another_is_computing(draft_input, k, start):
    """Two prompts on one uncached prefix arrive together: the second lets an unrelated
    request go first and waits until the first has published the prefix (one step more with
    an EAGLE head, which catches up a step after the target), then starts on it."""
    sched, kv, w = make(k=k, draft_input=draft_input)
    shared = list(range(1, 13))  # three full blocks
    for rid, prompt in (("a", [*shared, 50]), ("b", [*shared, 60]), ("c", [70, 71])):
        sched.add_request(req(rid, prompt))
    steps = 0
    while True:
        plan = sched.schedule()
        steps += 1
        b = next((r for r in plan.requests if r.request_id == "b"), None)
        if steps == 1:
            assert [r.request_id for r in plan.requests] == ["a", "c"]
        sched.update(plan, w.step(plan))
        if b is not None:
            break
    assert b.target_start == start and steps == (2 if draft_input == "none" else 3)
    w.run()
    assert all_blocks_back(kv)


@pytest.mark.parametrize(
    ("draft_input", "start", "steps"), [("tokens", 12, 2), ("features", 11, 3)]
)
def test_a_drafter_that_lags_still_lets_every_block_be_published(draft_input, start, steps):
    """A policy that never drafts lets the drafter lag (as ``auto`` does); with the prefix
    cache it still catches up on every full block, so that the block can be published: a
    request that arrives beside the first waits one step at most (an EAGLE head's, which then
    recomputes the last shared position, read with another token), and one that arrives after
    it finds the prompt and the first request's output cached."""
    sched, kv, w = make(draft_input=draft_input, policy=FixedDraft(0))  # drafting nothing
    shared = list(range(1, 13))  # three full blocks
    sched.add_request(req("a", [*shared, 50], max_tokens=12))
    sched.add_request(req("b", [*shared, 60]))
    plan, b = first_plan(sched, w, "b")
    assert b.target_start == start and plan.prefix_cache_hits == start
    assert len(sched.requests["a"].output_token_ids) == steps  # b ran in step `steps`
    finished = w.run()
    out = finished["a"].output_token_ids
    sched.add_request(req("c", [*shared, 50, *out[:8], 99]))
    plan, c = first_plan(sched, w, "c")
    assert c.target_start == 20 and plan.prefix_cache_hits == 20
    w.run()
    assert all_blocks_back(kv)


class Switch(FixedDraft):
    """Drafts a chain of 2 for every decoding request while ``on``, nothing otherwise."""

    def __init__(self) -> None:
        super().__init__(2)
        self.on = False

    def draft_shapes(
        self, requests: list[Request], prompt_rows: int = 0, plain: int = 0
    ) -> list[DraftShape]:
        return [self.shape if self.on else DraftShape()] * len(requests)


@pytest.mark.parametrize("draft_input", ["tokens", "features"])
def test_an_idle_drafter_does_no_work_and_the_cache_still_fills(draft_input):
    """While no drafts are made, blocks are published as the target computes them and the
    drafter catches up on nothing; a request finding them takes them all. Once drafts resume,
    a draft model catches up on what it lacks; an EAGLE head, which would need the target's
    features of the cached positions, drafts nothing for that request."""
    policy = Switch()
    sched, kv, w = make(policy=policy, draft_input=draft_input)
    sched.add_request(req("a", P, max_tokens=14))
    first_plan(sched, w, "a")  # its prompt: the drafter follows until the policy says no
    caught_up = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        caught_up += sum(len(sr.draft_token_ids) for sr in plan.requests)
        sched.update(plan, w.step(plan))
    assert caught_up == 0 and kv.num_cached_blocks == 5  # 23 tokens: 5 full blocks
    policy.on = True
    tokens = [*P, *[1000 + p for p in range(10, 23)]]  # the shadow's outputs
    sched.add_request(req("b", [*tokens[:20], 7, 7], max_tokens=8))
    _, b = first_plan(sched, w, "b")
    if draft_input == "tokens":  # the prompt's two blocks were drafted with the target's
        assert (b.target_start, b.draft_start) == (20, 8)
    else:  # the head reads a step late, when no drafts were wanted; the last cached block
        # was published with another token after it, which the head's last slot read
        assert (b.target_start, b.draft_start) == (19, 0)
    drafted = []
    while sched.has_unfinished():
        plan = sched.schedule()
        drafted += [sr.num_draft for sr in plan.requests]
        sched.update(plan, w.step(plan))
    assert (sum(drafted) > 0) == (draft_input == "tokens"), drafted
    assert all_blocks_back(kv)
