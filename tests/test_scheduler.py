"""The scheduler on its own (no torch): batching limits, lookahead, rollback, preemption.

A simulated worker stands in for the models: it emits a deterministic token stream per request and
accepts a random number of drafts, which is all the scheduler can observe of a real step.
"""

import random

from specbatch.draft_shape import DraftShape
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import FinishReason, Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.drafter_sleep import SLEEP_AFTER
from specbatch.scheduler.output import RequestStepResult, SchedulerOutput, StepResult
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.scheduler.speculation import FixedDraft
from specbatch.stop_checker import StopChecker


def make_scheduler(num_blocks=64, block_size=4, max_seqs=8, max_tokens=64, max_len=64, k=0):
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(
        SchedulerLimits(max_seqs, max_tokens, max_len),
        kv,
        StopChecker(None),
        policy=FixedDraft(k),
        speculative=k > 0,
    )
    return sched, kv


def request(rid, prompt_len, max_tokens, max_len=64, **kw):
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, **kw),
        max_model_len=max_len,
    )


def simulate(plan: SchedulerOutput, rng: random.Random) -> StepResult:
    """Emit position-derived tokens; accept a random prefix of the drafts."""
    out = StepResult()
    for sr in plan.requests:
        if sr.sample:
            a = rng.randint(0, sr.num_draft)
            base = sr.target_start + len(sr.target_token_ids)
            out.results[sr.request_id] = RequestStepResult(
                token_ids=[1000 + base + i for i in range(a + 1)],
                num_accepted=a,
                num_proposed=sr.num_draft,
            )
    return out


def check_invariants(sched: Scheduler, kv: KVCacheManager, plan: SchedulerOutput) -> None:
    used = 0
    for req in sched.running:
        table = kv.block_table(req.request_id)
        used += len(table)
    assert used == kv.num_used_blocks
    for sr in plan.requests:
        need = sr.target_start + len(sr.target_token_ids) + sr.num_draft
        assert len(sr.block_table) * kv.block_size >= need
        assert sr.draft_start <= sr.target_start or not sr.draft_token_ids


def run_to_completion(sched, kv, rng, abort_prob=0.0, max_steps=10_000):
    finished = {}
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < max_steps, "no progress"
        plan = sched.schedule()
        assert plan.requests, "deadlock: nothing scheduled"
        check_invariants(sched, kv, plan)
        assert plan.num_target_tokens <= sched.limits.max_num_batched_tokens
        assert len(plan.requests) <= sched.limits.max_num_seqs
        for req in sched.update(plan, simulate(plan, rng)):
            if req.is_finished:
                finished[req.request_id] = req
        if abort_prob and rng.random() < abort_prob and sched.running:
            victim = rng.choice(sched.running + list(sched.waiting))
            for req in sched.abort([victim.request_id]):
                finished[req.request_id] = req
    return finished


def test_limits_on_sequences_and_tokens_with_chunked_prefill():
    sched, _ = make_scheduler(max_seqs=2, max_tokens=10)
    for i in range(3):
        sched.add_request(request(f"r{i}", prompt_len=7, max_tokens=3))
    plan = sched.schedule()
    # r0 fully (7 tokens), r1 gets a 3-token chunk, r2 waits (token budget spent)
    assert [(r.request_id, len(r.target_token_ids), r.sample) for r in plan.requests] == [
        ("r0", 7, True),
        ("r1", 3, False),
    ]
    sched.update(plan, simulate(plan, random.Random(0)))
    plan = sched.schedule()
    assert [(r.request_id, len(r.target_token_ids)) for r in plan.requests] == [
        ("r0", 1),
        ("r1", 4),
    ]
    assert sched.num_waiting == 1  # max_num_seqs=2


def test_every_request_finishes_with_its_tokens_and_no_block_leaks():
    rng = random.Random(1)
    sched, kv = make_scheduler(num_blocks=40, k=3, max_tokens=32)
    for i in range(20):
        sched.add_request(request(f"r{i}", rng.randint(1, 20), rng.randint(1, 30)))
    finished = run_to_completion(sched, kv, rng)
    assert len(finished) == 20
    for req in finished.values():
        assert req.finish_reason is FinishReason.LENGTH
        assert len(req.output_token_ids) == req.sampling_params.max_tokens
        # tokens are a function of their position: rollback and recompute kept them consistent
        p = req.num_prompt_tokens
        assert req.output_token_ids == [1000 + p + i for i in range(len(req.output_token_ids))]
    assert kv.num_free_blocks == kv.num_blocks


def test_preemption_under_a_tiny_pool_never_deadlocks_or_leaks():
    rng = random.Random(2)
    # 16 blocks of 4 = 64 slots: exactly one max-length request fits
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_len=64, k=4, max_tokens=64)
    for i in range(10):
        sched.add_request(request(f"r{i}", rng.randint(5, 30), 40))
    finished = run_to_completion(sched, kv, rng)
    assert len(finished) == 10
    assert sched.num_preemptions > 0
    for req in finished.values():
        assert len(req.output_token_ids) == min(40, 64 - req.num_prompt_tokens)
    assert kv.num_free_blocks == kv.num_blocks


def test_aborts_at_random_times_return_every_block():
    rng = random.Random(3)
    sched, kv = make_scheduler(num_blocks=24, k=2)
    for i in range(30):
        sched.add_request(request(f"r{i}", rng.randint(1, 12), rng.randint(1, 20)))
    finished = run_to_completion(sched, kv, rng, abort_prob=0.2)
    assert len(finished) == 30
    assert any(r.finish_reason is FinishReason.ABORT for r in finished.values())
    assert kv.num_free_blocks == kv.num_blocks


def test_rollback_moves_counters_and_truncates_the_table():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, k=6)
    sched.add_request(request("a", prompt_len=7, max_tokens=50))
    plan = sched.schedule()
    sched.update(plan, StepResult({"a": RequestStepResult([100], 0, 0)}))  # prefill: 8 tokens
    plan = sched.schedule()
    (sr,) = plan.requests
    assert sr.num_draft == 6 and sr.target_token_ids == [100] and sr.target_start == 7
    assert sr.draft_token_ids == [100]  # the draft read the prompt alongside the target
    assert len(sr.block_table) == 4  # slots 0..14: 8 known tokens + 6 drafts + 1
    sched.update(plan, StepResult({"a": RequestStepResult([101, 102, 103], 2, 6)}))
    req = sched.requests["a"]
    assert req.num_computed == 10 and req.num_tokens == 11
    assert req.num_draft_computed == 10  # the draft saw d1, d2 (accepted), not d3..
    assert len(kv.block_table("a")) == 3
    # all accepted: the draft lags the target by one
    plan = sched.schedule()
    (sr,) = plan.requests
    assert sr.draft_token_ids == [103]
    sched.update(plan, StepResult({"a": RequestStepResult(list(range(7)), 6, 6)}))
    assert req.num_computed == 17 and req.num_draft_computed == 16
    plan = sched.schedule()
    assert plan.requests[0].draft_token_ids == [5, 6]


def test_the_draft_skips_prompts_while_the_policy_wants_no_drafts():
    """Prompt chunks go through the draft as through the target, except after a step in which
    the policy wanted no drafts at all: then the draft catches up on a request when it drafts."""
    sched, _ = make_scheduler(num_blocks=64, block_size=4, k=2)
    sched.add_request(request("a", prompt_len=5, max_tokens=30))
    plan = sched.schedule()
    assert plan.requests[0].draft_token_ids == [1, 2, 3, 4, 5]  # a prefill: the draft reads it
    sched.update(plan, StepResult({"a": RequestStepResult([100], 0, 0)}))
    sched.policy = FixedDraft(0)
    plan = sched.schedule()  # a decodes, drafting nothing
    sched.update(plan, StepResult({"a": RequestStepResult([101], 0, 0)}))
    sched.add_request(request("b", prompt_len=3, max_tokens=30))
    plan = sched.schedule()
    by_id = {r.request_id: r for r in plan.requests}
    assert by_id["a"].draft_token_ids == [] and by_id["b"].draft_token_ids == []
    sched.update(plan, StepResult({r: RequestStepResult([7], 0, 0) for r in "ab"}))
    sched.policy = FixedDraft(2)
    plan = sched.schedule()  # both draft: the draft catches up on all it has not seen
    by_id = {r.request_id: r for r in plan.requests}
    assert by_id["a"].draft_token_ids == [100, 101, 7] and by_id["b"].draft_token_ids == [
        1,
        2,
        3,
        7,
    ]
    assert by_id["a"].num_draft == by_id["b"].num_draft == 2


def test_draft_length_shrinks_before_any_preemption():
    for num_blocks, gamma_b in ((6, 0), (7, 4)):
        sched, kv = make_scheduler(num_blocks=num_blocks, block_size=4, max_len=24, k=8)
        for rid in "ab":
            sched.add_request(request(rid, prompt_len=7, max_tokens=10, max_len=24))
        plan = sched.schedule()  # both prefill: 2 blocks each
        sched.update(plan, StepResult({r: RequestStepResult([1], 0, 0) for r in "ab"}))
        plan = sched.schedule()
        by_id = {r.request_id: r for r in plan.requests}
        assert plan.num_preempted == 0 and set(by_id) == {"a", "b"}
        assert by_id["a"].num_draft == 8  # 8 known tokens + 8 drafts: 4 blocks
        assert by_id["b"].num_draft == gamma_b  # what the remaining blocks allow
        assert kv.num_free_blocks == 0 or gamma_b == 0


def test_never_drafts_past_max_tokens_or_max_model_len():
    sched, _ = make_scheduler(num_blocks=64, k=8, max_len=20)
    sched.add_request(request("a", prompt_len=5, max_tokens=4, max_len=20))
    sched.add_request(request("b", prompt_len=15, max_tokens=100, max_len=20))
    plan = sched.schedule()
    sched.update(
        plan, StepResult({r.request_id: RequestStepResult([7], 0, 0) for r in plan.requests})
    )
    plan = sched.schedule()
    by_id = {r.request_id: r for r in plan.requests}
    assert by_id["a"].num_draft == 2  # 1 emitted, 3 left: 2 drafts + 1 bonus
    assert by_id["b"].num_draft == 3  # 16 of 20 tokens known: 3 drafts + 1 bonus fill it
    results = {"a": RequestStepResult([1, 2, 3], 2, 2), "b": RequestStepResult([1, 2, 3, 4], 3, 3)}
    sched.update(plan, StepResult(results))
    assert not sched.has_unfinished()


def test_stop_token_inside_an_accepted_run_ends_the_request_there():
    sched, kv = make_scheduler(k=4)
    sched.add_request(request("a", prompt_len=3, max_tokens=20, stop_token_ids=[42]))
    plan = sched.schedule()
    sched.update(plan, StepResult({"a": RequestStepResult([5], 0, 0)}))
    plan = sched.schedule()
    (req,) = sched.update(plan, StepResult({"a": RequestStepResult([6, 42, 8, 9], 3, 4)}))
    assert req.output_token_ids == [5, 6, 42]
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == 42
    assert kv.num_free_blocks == kv.num_blocks


def test_speculation_statistics_count_only_tested_drafts():
    from specbatch.request import SpecStats

    s = SpecStats()
    s.record(4, 1)  # draft 0 accepted, draft 1 rejected, drafts 2-3 never tested
    s.record(4, 4)  # all accepted
    s.record(2, 0)
    assert (s.rounds, s.proposed, s.accepted, s.rejections, s.emitted) == (3, 10, 5, 2, 8)
    assert s.acceptance_rate == 0.5
    assert s.alpha == 5 / 7
    assert s.reached_by_position == [3, 2, 1, 1]
    assert s.acceptance_by_position == [2 / 3, 1 / 2, 1.0, 1.0]
    a, g = 5 / 7, 10 / 3
    assert abs(s.predicted_tokens_per_round() - (1 - a ** (g + 1)) / (1 - a)) < 1e-12


def test_a_preempted_request_starts_again_from_position_zero():
    """Recompute preemption: when re-admitted, the target reads the request from position 0,
    and so does its drafter (a draft model reads tokens 0.. with the target; an EAGLE head,
    whose position t reads token t + 1 and the target's feature at t, reads tokens 1.. one step
    after the target), in every mode of draft input."""
    for draft_input in ("tokens", "features", "none"):
        kv = KVCacheManager(8, 4)  # 32 slots: two requests of 12 tokens cannot both grow
        sched = Scheduler(
            SchedulerLimits(4, 64, 32),
            kv,
            StopChecker(None),
            policy=FixedDraft(2),
            speculative=True,
            draft_input=draft_input,
        )
        for rid in "ab":
            sched.add_request(request(rid, prompt_len=10, max_tokens=20, max_len=32))
        rng = random.Random(0)
        again: list = []  # the preempted request's first two steps after re-admission
        for _ in range(200):
            plan = sched.schedule()
            if plan.num_preempted:
                victim = sched.waiting[0]
                assert victim.num_computed == victim.num_draft_computed == 0
            for sr in plan.requests:
                if sched.requests[sr.request_id].num_preemptions and len(again) < 2:
                    again.append(sr)
            sched.update(plan, simulate(plan, rng))
            if len(again) == 2:
                break
        assert len(again) == 2, draft_input
        first, second = again
        tokens = first.target_token_ids
        assert first.target_start == 0 and tokens[:10] == list(range(1, 11))
        if draft_input == "tokens":
            assert first.draft_start == 0 and first.draft_token_ids == tokens
        elif draft_input == "features":
            assert first.draft_token_ids == []
            assert second.draft_start == 0
            assert second.draft_token_ids[: len(tokens) - 1] == tokens[1:]
        else:
            assert first.draft_token_ids == second.draft_token_ids == []


class DraftsWhenFew:
    """A policy that wants a chain of 2 for fewer than 4 requests, none for more."""

    shape = DraftShape.chain(2)

    def __init__(self) -> None:
        self.calls = 0

    def draft_shapes(self, requests, prompt_rows=0, plain=0):
        self.calls += 1
        return [self.shape if len(requests) < 4 else DraftShape()] * len(requests)

    def observe(self, plan, result, seconds):
        pass


class NoDrafts(DraftsWhenFew):
    """A policy that never wants drafts."""

    def draft_shapes(self, requests, prompt_rows=0, plain=0):
        self.calls += 1
        return [DraftShape()] * len(requests)


def step(sched: Scheduler, rng: random.Random) -> SchedulerOutput:
    plan = sched.schedule()
    sched.update(plan, simulate(plan, rng))
    return plan


def test_a_drafter_wanted_for_nothing_sleeps_and_wakes_when_the_batch_halves():
    """After SLEEP_AFTER policy calls wanting no drafts, every running request and every one
    admitted while asleep has its drafter off and the policy is no longer asked; once half the
    requests are gone the drafter wakes, and a request admitted then drafts again."""
    rng = random.Random(0)
    sched, kv = make_scheduler(num_blocks=512, block_size=4, max_seqs=16, max_len=512, k=2)
    policy = sched.policy = DraftsWhenFew()
    for i in range(8):
        sched.add_request(request(f"r{i}", prompt_len=3, max_tokens=300, max_len=512))
    step(sched, rng)  # the prompts
    for _ in range(SLEEP_AFTER - 1):
        step(sched, rng)
        assert not any(r.drafter_off for r in sched.running)
    plan = step(sched, rng)
    assert policy.calls == SLEEP_AFTER
    assert all(r.drafter_off for r in sched.running)
    sched.add_request(request("late", prompt_len=3, max_tokens=300, max_len=512))
    plan = step(sched, rng)
    plan = step(sched, rng)
    assert all(sr.drafter_off and not sr.num_draft for sr in plan.requests)
    assert len(plan.requests) == 9 and policy.calls == SLEEP_AFTER  # not asked while asleep
    sched.abort(["late", *(f"r{i}" for i in range(4))])  # 4 left of the 8 it slept with
    sched.add_request(request("new", prompt_len=3, max_tokens=300, max_len=512))
    step(sched, rng)  # wakes; admits "new", whose drafter is on
    plan = step(sched, rng)
    by_id = {sr.request_id: sr for sr in plan.requests}
    assert not by_id["new"].drafter_off and by_id["new"].num_draft == 2
    assert all(by_id[f"r{i}"].drafter_off and not by_id[f"r{i}"].num_draft for i in range(4, 8))
    assert policy.calls == SLEEP_AFTER + 1  # asked about "new" alone
    run_to_completion(sched, kv, rng)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_drafter_with_one_request_running_stays_awake():
    """Asleep with one request it would wake only once none runs: wanted for nothing while one
    runs, it stays awake, and the policy is asked every step."""
    rng = random.Random(0)
    sched, kv = make_scheduler(num_blocks=512, block_size=4, max_seqs=16, max_len=512, k=2)
    policy = sched.policy = NoDrafts()
    sched.add_request(request("one", prompt_len=3, max_tokens=300, max_len=512))
    for _ in range(2 * SLEEP_AFTER):
        step(sched, rng)
    assert not sched.sleep.asleep and not sched.running[0].drafter_off
    assert policy.calls == 2 * SLEEP_AFTER - 1  # every decoding step
    run_to_completion(sched, kv, rng)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_burst_joining_a_drafting_batch_keeps_its_prompts_from_the_drafter():
    """The drafter reads a prompt with the target while the batch it joins is at most twice
    the one the policy last wanted drafts for; a burst beyond that lags, to be caught up on
    only if its requests draft."""
    rng = random.Random(0)
    sched, kv = make_scheduler(num_blocks=512, block_size=4, max_seqs=16, max_len=512, k=2)
    sched.policy = DraftsWhenFew()
    sched.add_request(request("a", prompt_len=3, max_tokens=300, max_len=512))
    step(sched, rng)
    step(sched, rng)  # "a" decodes and drafts: the policy wanted drafts for one request
    sched.add_request(request("b", prompt_len=3, max_tokens=300, max_len=512))
    plan = step(sched, rng)
    by_id = {sr.request_id: sr for sr in plan.requests}
    assert by_id["b"].draft_token_ids == [1, 2, 3]  # two running: read with the target
    for i in range(8):
        sched.add_request(request(f"burst{i}", prompt_len=3, max_tokens=300, max_len=512))
    plan = step(sched, rng)
    prompts = [sr for sr in plan.requests if sr.request_id.startswith("burst")]
    assert len(prompts) == 8 and all(sr.draft_token_ids == [] for sr in prompts)
    run_to_completion(sched, kv, rng)
    assert kv.num_free_blocks == kv.num_blocks
