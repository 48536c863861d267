"""The adaptive draft-length policy (``num_speculative_tokens="auto"``).

Unit tests on synthetic cost models and acceptance rates: the choice itself, the cost model's
fit, the acceptance estimate, the policy learning inside a real scheduler driven by a simulated
worker (step times from a known cost model, drafts accepted with a known alpha), the KV limits;
then the engine-level exactness test with ``auto`` on.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from specbatch import SamplingParams
from specbatch.engine.prometheus import ServerMetrics, parse_metrics
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.scheduler.acceptance import sampling_class
from specbatch.scheduler.adaptive import FAR_MARGIN, AdaptiveDraftLength
from specbatch.scheduler.output import (
    RequestStepResult,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
)
from specbatch.scheduler.pass_times import PassTimes, VerifyTimes, profile_token_counts
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.scheduler.speculation import StepShape
from specbatch.scheduler.step_cost import StepCostModel
from specbatch.stop_checker import StopChecker
from specbatch.theory import expected_tokens_per_round
from tests.helpers import exact_joint
from tests.test_exactness import PROMPT, N, assert_matches, engine, pair, sample_sequences  # noqa: F401


def linear_passes(fixed: float, per_token: float, max_tokens: int = 512) -> PassTimes:
    counts = profile_token_counts(max_tokens)
    return PassTimes(counts, [fixed + per_token * n for n in counts])


def linear_verify(fixed: float, per_token: float, max_seqs: int = 128) -> VerifyTimes:
    counts, depths = profile_token_counts(max_seqs), [0, 1, 2, 4, 8]
    rows = [[fixed + per_token * n * (d + 1) for n in counts] for d in depths]
    return VerifyTimes(counts, depths, rows)


def synthetic(target: tuple[float, float], draft: tuple[float, float]) -> StepCostModel:
    """A known cost model: each model's (fixed, per token) seconds for one forward."""
    return StepCostModel(linear_passes(*draft), linear_verify(*target))


def policy(k: int, target, draft, **kw) -> AdaptiveDraftLength:
    return AdaptiveDraftLength(k, synthetic(target, draft), **kw)


def shape(n: int) -> StepShape:
    return StepShape.decoding([None] * n)  # type: ignore[list-item]


# ---- the choice on a known cost model ----------------------------------------------------------
def test_expected_tokens_is_theorys_formula():
    assert expected_tokens_per_round(0.5, 0) == 1.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_round(1.0, 3) == 4.0


def test_picks_zero_when_drafts_cost_more_than_they_return():
    # a draft forward costs as much as a target one: even alpha 0.6 does not pay for it
    p = policy(4, (1.0, 0.0), (1.0, 0.0))
    assert p.choose([0.6] * 8, [4] * 8, shape(8)) == [0] * 8
    # verifying costs a lot per token (a compute-bound batch): drafts do not pay either
    p = policy(4, (0.1, 0.05), (0.001, 0.0))
    assert p.choose([0.5] * 32, [4] * 32, shape(32)) == [0] * 32


def test_grows_gamma_when_acceptance_is_high():
    # one request; a draft forward costs 10% of a target forward (THEORY's c = 0.1), verifying
    # extra tokens is free: T(gamma) = 1 + 0.1 gamma, THEORY's speedup model exactly
    p = policy(8, (1.0, 0.0), (0.1, 0.0))
    by_alpha = {a: p.choose([a], [8], shape(1))[0] for a in (0.05, 0.3, 0.6, 0.8, 0.95)}
    values = list(by_alpha.values())
    assert values == sorted(values) and values[0] == 0 and values[-1] >= 6, by_alpha
    for a, g in by_alpha.items():  # the one-request choice is THEORY's optimum of S(gamma)
        best = max(range(9), key=lambda k: expected_tokens_per_round(a, k) / (1 + 0.1 * k))
        assert g == best, (a, g, best)


def test_prices_the_catch_up_of_a_lagging_draft():
    # the draft has 50 unseen tokens to catch up on first: one draft is no longer worth it
    p = policy(4, (1.0, 0.0), (0.1, 0.01))
    assert p.choose([0.6], [4], shape(1), lags=[1]) != [0]
    assert p.choose([0.6], [4], shape(1), lags=[200]) == [0]


def test_mixed_batch_gives_each_request_its_own_gamma():
    p = policy(6, (1.0, 0.02), (0.05, 0.0))  # each verified draft token costs 2% of a step
    gammas = p.choose([0.95, 0.1, 0.7], [6, 6, 6], shape(3))
    assert gammas[0] > gammas[2] > gammas[1] == 0


def test_moves_one_position_per_replan_except_to_plain_or_to_a_well_measured_depth():
    # drafts are free: the best plan is the deepest, but from a plan 1 deep the next may be 2
    # deep at most, while depths 3-4 rest on no step at this batch size (at alpha 0.5 depth 4
    # returns 1.94 tokens a round against depth 2's 1.75: less than FAR_MARGIN more)
    p = policy(4, (1.0, 0.0), (0.0, 0.0))
    alphas, caps = [0.5] * 3, [4] * 3
    assert p.choose(alphas, caps, shape(3)) == [4] * 3
    assert p.choose(alphas, caps, shape(3), around=1) == [2] * 3
    assert p.choose(alphas, caps, shape(3), around=3) == [4] * 3
    for _ in range(p.well_measured + 1):  # depth 4 measured at this batch size, beside depth 1
        for g in (4, 1):
            p.cost.observe(3, 3 * g, 3, [g] * 3, 1.0)
    assert p.choose(alphas, caps, shape(3), around=1) == [4] * 3
    # drafts cost more than they return: plain decoding is open from any depth
    p = policy(4, (1.0, 0.0), (1.0, 0.0))
    assert p.choose([0.6] * 3, caps, shape(3), around=4) == [0] * 3


def test_jumps_to_an_unmeasured_depth_that_wins_by_more_than_its_price_may_err():
    # requests that accept nearly every draft (repetitive code) after a plan 2 deep: depth 4
    # returns 4.9 tokens a round against depth 3's 3.94, far more than FAR_MARGIN
    p = policy(4, (1.0, 0.0), (0.0, 0.0))
    assert p.choose([0.99] * 3, [4] * 3, shape(3), around=2) == [4] * 3
    expected = [expected_tokens_per_round(0.99, g) for g in (3, 4)]
    assert expected[1] > expected[0] * (1 + FAR_MARGIN)


def test_respects_the_cap():
    p = policy(4, (1.0, 0.0), (0.0, 0.0))  # drafts are free: take all that is allowed
    assert p.choose([0.9, 0.9, 0.9], [4, 2, 0], shape(3)) == [4, 2, 0]


def test_choice_is_deterministic():
    p = policy(5, (0.01, 0.0002), (0.001, 0.00003))
    alphas = [random.Random(i).random() for i in range(40)]
    assert p.choose(alphas, [5] * 40, shape(40)) == p.choose(alphas, [5] * 40, shape(40))


def plan_rate(
    p: AdaptiveDraftLength, alphas: list[float], lags: list[int], gammas: tuple[int, ...]
) -> float:
    """Expected tokens per second of one gamma vector, priced by the policy's own model."""
    deepest = max(p.max_draft_length, 1)
    sizes = np.array([[sum(g >= j for g in gammas) for j in range(2, deepest + 1)]], dtype=float)
    catch_up = sum(lag for lag, g in zip(lags, gammas) if g)
    n = len(gammas)
    t = p.cost.predict(n, catch_up, n, np.array([sum(gammas)]), sizes)[0]
    return sum(expected_tokens_per_round(a, g) for a, g in zip(alphas, gammas)) / t


def test_choice_is_the_best_plan_by_brute_force():
    # every gamma vector of 3 requests up to 3 drafts, priced by the same model
    rng = random.Random(5)
    for _ in range(20):
        target = (rng.uniform(0.5, 1.5), rng.uniform(0.0, 0.1))
        draft = (rng.uniform(0.01, 0.3), rng.uniform(0.0, 0.05))
        p = policy(3, target, draft)
        alphas = [rng.uniform(0.1, 0.95) for _ in range(3)]
        lags = [rng.randint(1, 3) for _ in range(3)]
        plans = list(itertools.product(range(4), repeat=3))
        best = max(plans, key=lambda gs: plan_rate(p, alphas, lags, gs))
        got = tuple(p.choose(alphas, [3, 3, 3], shape(3), lags))
        # the best plan, or a uniform one within the policy's margin of it
        floor = plan_rate(p, alphas, lags, best) / (1 + p.uniform_margin) * 0.99
        assert plan_rate(p, alphas, lags, got) >= floor, (got, best)
        if len(set(got)) > 1:
            assert plan_rate(p, alphas, lags, got) >= plan_rate(p, alphas, lags, best) * 0.99


# ---- estimates ---------------------------------------------------------------------------------
def test_pass_times_interpolate_and_continue_the_last_slope():
    times = PassTimes([1, 2, 4, 8], [1.0, 1.0, 2.0, 4.0])
    assert times(0) == 0.0
    assert float(times(3)) == pytest.approx(1.5)
    assert float(times(16)) == pytest.approx(8.0)  # past the last count: the last slope
    # a noisy profile is made non-decreasing by averaging, not by raising what follows
    noisy = PassTimes([1, 2, 3, 4, 5], [1.0, 3.0, 1.0, 1.2, 5.0])
    assert noisy.y.tolist() == pytest.approx([1.0, 5.2 / 3, 5.2 / 3, 5.2 / 3, 5.0])
    assert np.all(np.diff(noisy(np.arange(0, 20))) >= 0)


def test_verify_times_interpolate_in_tokens_per_sequence():
    # a verify token costs 1, a sequence 3 (its context reads): n (3 + u) for u tokens each
    counts, depths = [1, 2, 4, 8], [0, 1, 4]
    times = VerifyTimes(counts, depths, [[n * (3 + d + 1) for n in counts] for d in depths])
    assert float(times(4, 0)) == pytest.approx(16.0)  # 4 sequences of one token
    assert float(times(4, 8)) == pytest.approx(24.0)  # 2 drafts each: between depths 1 and 4
    assert float(times(4, 6)) == pytest.approx(22.0)  # 1.5 each
    assert float(times(2, 16)) == pytest.approx(24.0)  # 8 each: past the deepest, its slope
    assert float(times(6, 6)) == pytest.approx(30.0)  # between profiled counts


def test_a_step_that_ran_is_priced_as_the_plans_are():
    # the plain-Python pricing of an observed step matches the vectorised one of the plans,
    # also past the profiled counts and depths (extrapolated)
    rng = random.Random(0)
    counts = profile_token_counts(16)
    model = StepCostModel(
        PassTimes(counts, [0.002 + 0.0001 * n + 1e-4 * rng.random() for n in counts]),
        VerifyTimes(
            counts, [0, 1, 4], [[0.01 + 0.001 * n * (d + 2) for n in counts] for d in (0, 1, 4)]
        ),
        first_draft=PassTimes(counts, [0.003 + 0.0002 * n for n in counts]),
    )
    for _ in range(200):
        n = rng.randint(1, 40)
        gammas = [rng.choice([0, 0, 1, 2, 3, 8]) for _ in range(n)]
        catchup = sum(rng.randint(1, 3) for g in gammas if g) + rng.choice([0, 0, 100])
        target = n + rng.choice([0, 0, 64])
        depth = max(gammas)
        sizes = np.array([[sum(g >= j for g in gammas) for j in range(2, depth + 1)]])
        vector = model.profiled(n, catchup, target, np.array([sum(gammas)]), sizes)[0]
        assert model.profiled_step(n, catchup, target, gammas) == pytest.approx(vector)


def true_step_seconds(n: int, gammas: list[int], truth_t, truth_d, rest) -> float:
    """A step of n decoding requests, each lagging the draft by one token, on linear models."""
    seconds = truth_t[0] + truth_t[1] * (n + sum(gammas)) + rest[0] + rest[1] * n
    if any(gammas):
        seconds += truth_d[0] + truth_d[1] * sum(g > 0 for g in gammas)
        for j in range(2, max(gammas) + 1):
            seconds += truth_d[0] + truth_d[1] * sum(g >= j for g in gammas)
    return seconds


def test_step_cost_corrects_the_profile_where_the_steps_run():
    rng = random.Random(0)
    truth_t, truth_d, rest = (0.010, 0.0002), (0.002, 0.00005), (0.001, 0.00003)
    # a profile off by -30% (target) and +30% (draft), as on a machine busier or idler at
    # start-up than later, and blind to the per-sequence work outside the forwards
    model = synthetic((0.007, 0.00014), (0.0026, 0.000065))

    def predicted(n: int, g: int) -> float:
        sizes = np.array([[n] * (g - 1)], dtype=float) if g > 1 else np.zeros((1, 0))
        return float(model.predict(n, n if g else 0, n, np.array([n * g]), sizes)[0])

    seen = [(n, g) for n in (1, 8, 32) for g in range(5)]
    for _ in range(40):
        for n, g in seen:
            seconds = true_step_seconds(n, [g] * n, truth_t, truth_d, rest)
            model.observe(n, n if g else 0, n, [g] * n, seconds * (1 + rng.gauss(0, 0.03)))
    for n, g in seen:  # measured (batch, depth) pairs: within the noise
        want = true_step_seconds(n, [g] * n, truth_t, truth_d, rest)
        assert predicted(n, g) == pytest.approx(want, rel=0.06), (n, g)
        # what the choice rests on, a depth's cost against another's at the same batch size,
        # within half the noise of one step (the level, from the last few steps, cancels)
        want_1 = true_step_seconds(n, [1] * n, truth_t, truth_d, rest)
        assert predicted(n, g) / predicted(n, 1) == pytest.approx(want / want_1, rel=0.015)
        # every step but a batch size's first, which had no other depth to be compared with
        assert model.steps_seen(n, g) == (39 if g == 0 else 40)
    # a batch size never run borrows the correction of all steps, so it is nearer than the
    # profile alone
    want = true_step_seconds(16, [1] * 16, truth_t, truth_d, rest)
    profile_only = float(model.profiled(16, 16, 16, np.array([16]), np.zeros((1, 0)))[0])
    assert abs(predicted(16, 1) - want) < abs(profile_only - want)
    assert model.steps_seen(16, 1) == 0


def test_step_cost_carries_a_slowdown_to_depths_it_does_not_run():
    # the profile is right; every depth runs for a while, then the machine slows down by 40%
    # and only depth 2 runs: the predictions of the other depths follow the slowdown
    truth_t, truth_d = (0.010, 0.0002), (0.002, 0.00005)
    model = synthetic(truth_t, truth_d)
    n = 8

    def step(g: int, slow: float) -> None:
        seconds = true_step_seconds(n, [g] * n, truth_t, truth_d, (0.0, 0.0)) * slow
        model.observe(n, n if g else 0, n, [g] * n, seconds)

    for _ in range(20):
        for g in range(6):
            step(g, 1.0)
    for _ in range(100):
        step(2, 1.4)
    for g in range(6):
        sizes = np.array([[n] * (g - 1)], dtype=float) if g > 1 else np.zeros((1, 0))
        got = float(model.predict(n, n if g else 0, n, np.array([n * g]), sizes)[0])
        want = true_step_seconds(n, [g] * n, truth_t, truth_d, (0.0, 0.0)) * 1.4
        assert got == pytest.approx(want, rel=0.06), g


def test_step_cost_learns_a_depth_it_runs_in_streaks():
    # the policy keeps a plan for several steps: here depths 1 and 4 in turns of 32 steps at
    # batch 4, the profile right; batch 8's steps had depth 4 15% cheaper than the profile
    # says, which batch 4 takes as its prior. Within a few turns batch 4 learns its own
    # contrast, instead of being held near the prior by steps that compare depth 4 with
    # itself (as a level of the last few steps, whatever their depth, did: 4.7% off here,
    # against 2.1%)
    truth_t, truth_d = (0.010, 0.0002), (0.002, 0.00005)
    rng = random.Random(1)
    model = synthetic(truth_t, truth_d)
    model._shift_entry(model.batch_bucket(8), 1)[:] = [0.0, 100.0]
    model._shift_entry(model.batch_bucket(8), 4)[:] = [math.log(0.85), 100.0]
    n = 4

    def ratio() -> float:
        times = []
        for g in (1, 4):
            sizes = np.array([[n] * (g - 1)], dtype=float) if g > 1 else np.zeros((1, 0))
            times.append(float(model.predict(n, n, n, np.array([n * g]), sizes)[0]))
        return times[1] / times[0]

    def true_seconds(g: int) -> float:
        return true_step_seconds(n, [g] * n, truth_t, truth_d, (0.0, 0.0))

    want = true_seconds(4) / true_seconds(1)
    assert ratio() < 0.9 * want
    for turn in range(12):
        g = (1, 4)[turn % 2]
        for _ in range(32):
            model.observe(n, n, n, [g] * n, true_seconds(g) * math.exp(rng.gauss(0, 0.05)))
    assert ratio() == pytest.approx(want, rel=0.025)


def test_another_batch_size_prices_a_depth_only_where_this_one_has_measured_none():
    # batch 8 ran depth 4 once, a step held up to twice its time. At batch 2, which has run
    # no depth, depth 4 leans on that step as one step against prior_weight (2) at 0: off by
    # a third of a doubling, not all of it
    truth_t, truth_d = (0.010, 0.0002), (0.002, 0.00005)
    model = synthetic(truth_t, truth_d)
    model._shift_entry(model.batch_bucket(8), 4)[:] = [math.log(2.0), 1.0]
    assert model._shift(model.batch_bucket(2), 4) == pytest.approx(math.log(2.0) / 3)
    # batch 4 has run depths 1-3, 10% and 20% above the profile: depth 4 is priced from
    # those (flat past the deepest), whatever batch 8 found, even on many steps
    model._shift_entry(model.batch_bucket(8), 4)[:] = [math.log(0.5), 100.0]
    for g, ratio in ((1, 1.1), (2, 1.1), (3, 1.2)):
        model._shift_entry(model.batch_bucket(4), g)[:] = [math.log(ratio), 50.0]
    assert model._shift(model.batch_bucket(4), 4) == pytest.approx(math.log(1.2))
    assert model._shift(model.batch_bucket(4), 0) == pytest.approx(math.log(1.1))


def test_profile_token_counts_cover_the_range():
    counts = profile_token_counts(1280)
    assert counts[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12] and counts[-1] == 1280
    assert counts == sorted(set(counts)) and len(counts) < 40
    assert profile_token_counts(5) == [1, 2, 3, 4, 5]


def test_alpha_estimate_starts_at_the_engine_rate_and_moves_to_the_requests():
    p = policy(4, (1.0, 0.0), (0.1, 0.0), prior_alpha=0.5, prior_strength=8)
    req = make_request("r", 4, 10)
    assert p.estimates.alpha_of(req) == pytest.approx(0.5)
    for _ in range(50):
        req.spec.record(4, 4)  # the request's drafts are always accepted
    assert p.estimates.alpha_of(req) > 0.95
    other = make_request("s", 4, 10)
    for _ in range(30):
        other.spec.record(4, 0)
    assert p.estimates.alpha_of(other) < 0.15


def observe_rounds(pol: AdaptiveDraftLength, req: Request, rounds: list[tuple[int, int]]) -> None:
    """Feed the policy finished rounds of ``req``: (drafts, accepted) each."""
    pol.draft_lengths([req])  # the policy learns the request's sampling class
    for num_draft, accepted in rounds:
        sr = ScheduledRequest(req.request_id, [1], 8, [1], 8, num_draft, True, [0])
        result = StepResult(
            {req.request_id: RequestStepResult([1] * (accepted + 1), accepted, num_draft)}
        )
        pol.observe(SchedulerOutput(requests=[sr]), result, 0.01)


def test_a_new_request_starts_at_its_sampling_class_rate():
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0, prior_strength=8)
    greedy = make_request("g", 4, 200)
    greedy.sampling_params = SamplingParams(temperature=0.0, max_tokens=200)
    hot = make_request("h", 4, 200)
    hot.sampling_params = SamplingParams(temperature=1.0, max_tokens=200)
    observe_rounds(p, greedy, [(4, 4)] * 60)  # greedy requests accept every draft
    observe_rounds(p, hot, [(4, 0), (4, 1)] * 60)  # sampled ones: alpha 1/3
    assert p.estimates.engine_alpha == pytest.approx(300 / 420)  # the mix's
    new_greedy = make_request("g2", 4, 200)
    new_greedy.sampling_params = SamplingParams(temperature=0.0, max_tokens=200)
    new_hot = make_request("h2", 4, 200)
    new_hot.sampling_params = SamplingParams(temperature=1.0, max_tokens=200)
    p.draft_lengths([new_greedy, new_hot])
    assert p.estimates.alpha_of(new_greedy) > 0.9
    assert p.estimates.alpha_of(new_hot) == pytest.approx(1 / 3, abs=0.05)
    est = p.estimates  # no position effect in either class: factors stay near 1
    assert est.position_factors(sampling_class(greedy.sampling_params)) == pytest.approx(
        [1.0] * 4, abs=0.05
    )


def finish(pol: AdaptiveDraftLength, req: Request) -> None:
    pol.observe(SchedulerOutput(finished_request_ids=[req.request_id]), StepResult(), 0.01)


def test_prior_strength_is_strong_when_requests_accept_alike_and_weak_when_they_differ():
    alike = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0)
    differ = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0)
    for i in range(16):
        req = make_request(f"r{i}", 4, 200)
        observe_rounds(alike, req, [(1, 1), (1, 0)] * 20)  # every request: alpha 1/2
        finish(alike, req)
        req = make_request(f"s{i}", 4, 200)  # half the requests accept 9 drafts in 10, half 1
        observe_rounds(differ, req, [(1, 1)] * 36 + [(1, 0)] * 4 if i % 2 else [(1, 0)] * 36)
        finish(differ, req)
    for p in (alike, differ):
        assert p.estimates.prior_strength == 8.0  # the default until learned
        p.estimates.learn_prior_strength()
    assert alike.estimates.prior_strength == 200.0  # the class rate says it all
    assert differ.estimates.prior_strength == 2.0  # a request's own rounds count at once


def greedy_requests(n: int, prefix: str) -> list[Request]:
    reqs = [make_request(f"{prefix}{i}", 4, 400) for i in range(n)]
    for r in reqs:
        r.sampling_params = SamplingParams(temperature=0.0, max_tokens=400)
    return reqs


def test_position_factors_do_not_count_easy_requests_twice():
    # one class, two kinds of request, no position effect: easy ones accept every draft, hard
    # ones none. Deep positions are reached by easy requests only, where the class's rate is
    # 1 against a class alpha of 0.8 (1.25); against each round's own alpha, about 1.
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0)
    for i, r in enumerate(greedy_requests(20, "r")):
        observe_rounds(p, r, [(4, 4) if i % 2 else (4, 0)] * 20)
    key = sampling_class(SamplingParams(temperature=0.0))
    accepted, tested = p.estimates.class_counts[key]
    assert accepted / tested == pytest.approx(0.8)
    assert p.estimates.position_factors(key)[1:] == pytest.approx([1.0] * 3, abs=0.08)


def test_position_factors_find_a_position_effect():
    # every request: half its rounds reject the first draft, the others accept all four. Its
    # alpha is 0.8; the first draft is accepted half the time (0.5 / 0.8), later ones always
    # once reached (1 / 0.8)
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0)
    for r in greedy_requests(10, "r"):
        observe_rounds(p, r, [(4, 0), (4, 4)] * 20)
    factors = p.estimates.position_factors(sampling_class(SamplingParams(temperature=0.0)))
    assert factors[0] == pytest.approx(0.5 / 0.8, abs=0.06)
    assert factors[1:] == pytest.approx([1 / 0.8] * 3, abs=0.06)


def count_choices(p: AdaptiveDraftLength) -> list[int]:
    """A list that grows by one at every call of ``p.choose`` (a replan)."""
    calls: list[int] = []
    choose = p.choose
    p.choose = lambda *a, **kw: calls.append(1) or choose(*a, **kw)  # type: ignore[method-assign]
    return calls


def test_an_unchanged_batch_keeps_its_plan_between_replans():
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0, explore_every=1000)
    calls = count_choices(p)
    reqs = [make_request("a", 4, 50), make_request("b", 4, 50)]
    for _ in range(2 * p.replan_every):
        p.draft_lengths(reqs)
    assert len(calls) == 2
    p.draft_lengths(reqs[:1])  # another batch size: a new plan at once
    assert len(calls) == 3


def test_a_uniform_plan_stands_for_another_batch_of_the_same_size_between_replans():
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0, explore_every=1000)
    calls = count_choices(p)
    batch = [make_request("a", 4, 50), make_request("b", 4, 50)]
    for _ in range(p.replan_every):  # past a new batch size's first steps (they explore)
        p.draft_lengths(batch)
    calls.clear()
    first = p.draft_lengths(batch)  # a replan
    assert len(set(first)) == 1  # a uniform plan
    for i in range(p.replan_every - 1):  # a request replaced at every step
        batch = [batch[1], make_request(f"new{i}", 4, 50)]
        assert p.draft_lengths(batch) == first
    assert len(calls) == 1
    p.draft_lengths(batch)  # the replan
    assert len(calls) == 2


def test_a_uniform_plan_does_not_stand_for_a_request_of_another_sampling_class():
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0, explore_every=1000)
    calls = count_choices(p)
    batch = [make_request("a", 4, 50)]
    for _ in range(p.replan_every + 1):  # past the first steps, and a replan
        p.draft_lengths(batch)
    calls.clear()
    p.draft_lengths([make_request("b", 4, 50)])  # a request sampled alike: the plan stands
    assert not calls
    greedy = make_request("c", 4, 50)
    greedy.sampling_params = SamplingParams(temperature=0.0, max_tokens=50)
    p.draft_lengths([greedy])
    assert len(calls) == 1


def test_one_request_gets_the_depth_for_its_alpha_at_every_step_between_replans():
    # a draft pass costs a fifth of a target one: the best depth grows with alpha
    p = policy(8, (0.01, 0.0), (0.002, 0.0), calibration_rounds=0, explore_every=1000)
    p.well_measured = 0  # every depth's price trusted: this test is about when it is read
    calls = count_choices(p)
    easy = make_request("easy", 4, 500)
    for _ in range(p.replan_every):  # past a new batch size's first steps
        p.draft_lengths([easy])
    calls.clear()
    start = p.draft_lengths([easy])[0]  # at the prior's alpha (0.7), no drafts seen yet
    easy.spec.accepted, easy.spec.rejections = 200, 1
    deep = p.draft_lengths([easy])[0]
    easy.spec.accepted, easy.spec.rejections = 200, 200
    shallow = p.draft_lengths([easy])[0]
    assert shallow < start < deep == 8
    assert len(calls) == 1  # one replan priced the depths; the alphas chose among them
    # a new request does not inherit the depth chosen for the one before it
    easy.spec.accepted, easy.spec.rejections = 200, 1
    assert p.draft_lengths([easy]) == [8]
    assert p.draft_lengths([make_request("next", 4, 500)]) == [start]
    assert len(calls) == 1
    # and the prices are remade at the periodic replan
    for _ in range(p.replan_every):
        p.draft_lengths([easy])
    assert len(calls) == 2


def test_one_requests_per_step_choice_agrees_with_the_replans():
    # OneRequestPrices.best re-decides in plain Python what choose decides in NumPy: at the
    # alpha and last depth of a replan, both pick the same depth
    p = policy(8, (0.01, 0.0), (0.003, 0.0))
    for alpha in np.linspace(0.05, 0.99, 40):
        for last in (0, 1, 3, 8):
            p._depth = last
            chosen = p.choose([float(alpha)], [8], shape(1), around=last)
            best = p._prices.best(float(alpha), 8, last, p.switch_margin)
            assert [best] == chosen, (alpha, last)


def test_replans_less_often_where_a_replan_is_dear_against_a_step():
    def replans(step_seconds: float) -> int:
        p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0, explore_every=1000)
        calls = count_choices(p)
        batch = [make_request(f"{i}", 4, 500) for i in range(2)]
        for _ in range(16 * p.replan_every):
            gammas = p.draft_lengths(batch)
            srs = [
                ScheduledRequest(r.request_id, [1], 8, [1], 8, g, True, [0])
                for r, g in zip(batch, gammas)
            ]
            results = {r.request_id: RequestStepResult([1], 0, g) for r, g in zip(batch, gammas)}
            p.observe(SchedulerOutput(requests=srs), StepResult(results), step_seconds)
        return len(calls)

    assert replans(10.0) == 16  # a replan is nothing against a step: every replan_every steps
    assert replans(1e-6) <= 5  # 4x as far apart at most, after the first interval


def test_a_batch_size_keeps_its_plan_while_the_batch_goes_thinner_and_back():
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0, explore_every=1000)
    calls = count_choices(p)
    four = [make_request(str(i), 4, 50) for i in range(4)]
    for batch in (four, four[:3]):  # past both batch sizes' first steps
        for _ in range(p.replan_every):
            p.draft_lengths(batch)
    calls.clear()
    for _ in range(3):  # a request finishes, and the next one takes its place
        p.draft_lengths(four[:3])
        p.draft_lengths(four)
    assert len(calls) == 2  # each batch size's periodic replan, none for coming back
    for _ in range(2 * p.replan_every):  # a plan stands for twice replan_every steps at most
        p.draft_lengths(four)
    calls.clear()
    p.draft_lengths(four[:3])
    assert len(calls) == 1


# ---- inside the scheduler, against a simulated worker -----------------------------------------
def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_model_len=256,
    )


def simulated_seconds(
    plan: SchedulerOutput, target: tuple[float, float], draft: tuple[float, float]
) -> float:
    """The time of the forwards worker.py would run for ``plan``, on linear (fixed, per token)
    models, plus 0.5 ms of scheduling."""
    seconds = 0.0005
    catch_up = sum(len(sr.draft_token_ids) for sr in plan.requests)
    if catch_up:
        seconds += draft[0] + draft[1] * catch_up
    gammas = [sr.num_draft for sr in plan.requests]
    for j in range(2, max(gammas, default=0) + 1):
        seconds += draft[0] + draft[1] * sum(g >= j for g in gammas)
    return seconds + target[0] + target[1] * plan.num_target_tokens


def run(
    alpha: float,
    target: tuple[float, float],
    draft: tuple[float, float],
    *,
    num_requests: int = 16,
    num_blocks: int = 512,
    max_tokens: int = 60,
    k: int = 4,
    seed: int = 0,
) -> tuple[AdaptiveDraftLength, Scheduler, list[list[int]]]:
    """Drive a scheduler with the policy against a simulated worker: each draft is accepted with
    probability ``alpha``, each forward takes the linear models' time. The policy starts from a
    profile that is off (every forward 10 ms) and must learn the real costs. Returns the granted
    gammas of the decoding steps, step by step."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, 4)
    pol = AdaptiveDraftLength(k, synthetic((0.01, 0.0), (0.01, 0.0)), kv)
    sched = Scheduler(
        SchedulerLimits(num_requests, 4096, 256), kv, StopChecker(None), pol, speculative=True
    )
    for i in range(num_requests):
        sched.add_request(make_request(str(i), 8, max_tokens))
    history: list[list[int]] = []
    while sched.has_unfinished():
        plan: SchedulerOutput = sched.schedule()
        result = StepResult()
        for sr in plan.requests:
            if sr.sample:
                a = 0
                while a < sr.num_draft and rng.random() < alpha:
                    a += 1
                base = sr.target_start + len(sr.target_token_ids)
                toks = [100 + base + i for i in range(a + 1)]
                result.results[sr.request_id] = RequestStepResult(toks, a, sr.num_draft)
        gammas = [sr.num_draft for sr in plan.requests if sr.sample]
        seconds = simulated_seconds(plan, target, draft)
        sched.update(plan, result)
        pol.observe(plan, result, seconds)
        if all(len(sr.target_token_ids) == 1 for sr in plan.requests):
            history.append(gammas)
    assert sched.num_preemptions == 0
    return pol, sched, history


def test_learns_to_stop_drafting_when_drafts_do_not_pay():
    # a draft forward costs 80% of a target one and acceptance is low
    pol, _, history = run(0.3, (0.01, 0.0001), (0.008, 0.0001))
    late = history[pol.calibration_steps + 10 :]
    drafting = [step for step in late if any(step)]
    assert late and len(drafting) <= 0.25 * len(late)  # exploration only
    assert all(max(step) == 1 for step in drafting)  # one position deeper than the choice


def test_learns_to_draft_long_when_acceptance_is_high():
    # cheap drafts (a forward is 5% of a target one) and alpha 0.9: the full draft length pays
    pol, _, history = run(0.9, (0.01, 0.00002), (0.0005, 0.00001), max_tokens=240, num_blocks=1200)
    late = [g for step in history[pol.calibration_steps + 2 :] for g in step]
    assert late and sum(g == 4 for g in late) > 0.8 * len(late)
    assert pol.estimates.engine_alpha == pytest.approx(0.9, abs=0.05)
    assert set(pol.draft_length_counts) == set(range(5))  # the calibration sweep was granted


def test_never_plans_more_drafts_than_the_free_blocks_hold():
    # 16 requests of 8 prompt + 40 output tokens need 12 blocks each: 200 blocks leave little room
    pol, sched, history = run(0.9, (0.01, 0.0), (0.0, 0.0), num_blocks=200, max_tokens=40)
    assert sched.num_preemptions == 0  # (checked in run as well)
    assert any(sum(step) < 4 * len(step) for step in history)  # some drafts were cut for room

    kv = KVCacheManager(4, 4)
    pol = AdaptiveDraftLength(4, synthetic((1.0, 0.0), (0.0, 0.0)), kv, calibration_rounds=0)
    reqs = [make_request(str(i), 6, 50) for i in range(2)]
    for r in reqs:
        assert kv.allocate(r.request_id, 7)  # 2 blocks each, 1 free slot each, 0 free blocks
        r.num_computed = 6
    assert pol.draft_lengths(reqs) == [1, 1]


def test_explores_one_position_beside_its_choice():
    # drafts do not pay: the choice is 0, and every explore_every-th step drafts 1 somewhere
    pol = policy(4, (1.0, 0.0), (10.0, 0.0), calibration_rounds=0, explore_every=5)
    reqs = [make_request("a", 4, 50), make_request("b", 4, 50)]
    chosen = [pol.draft_lengths(reqs) for _ in range(20)]
    # a new batch size: every other step at first; from no drafts, one request in 16 drafts
    # (at least one), the one the draft lags least
    assert chosen[1:8:2] == [[1, 0]] * 4
    assert chosen[10:] == ([[0, 0]] * 4 + [[1, 0]]) * 2
    reqs[1].num_draft_computed = reqs[1].num_tokens  # b's draft is up to date, a's is not
    pol._steps_by_batch.clear()
    assert [pol.draft_lengths(reqs) for _ in range(2)] == [[0, 0], [0, 1]]
    # free drafts: the choice is the most allowed, and exploring goes one shallower
    pol = policy(4, (1.0, 0.0), (0.0, 0.0), calibration_rounds=0, explore_every=2)
    assert [pol.draft_lengths(reqs) for _ in range(2)] == [[4, 4], [3, 3]]


def test_explores_four_times_less_once_the_depths_beside_are_well_measured():
    pol = policy(4, (1.0, 0.0), (10.0, 0.0), calibration_rounds=0, explore_every=5)
    reqs = [make_request("a", 4, 50), make_request("b", 4, 50)]
    for _ in range(8):  # past a new batch size's first steps
        pol.draft_lengths(reqs)
    explored = [pol.draft_lengths(reqs) != [0, 0] for _ in range(40)]
    assert sum(explored) == 8  # every 5th step: depth 1 is measured by no step
    for _ in range(pol.well_measured + 1):  # depth-1 steps in turn with depth-0 ones, as profiled
        for g, seconds in ((1, 11.0), (0, 1.0)):
            pol.cost.observe(
                num_seqs=2,
                catchup_tokens=2 * g,
                target_tokens=2,
                gammas=[g, g],
                step_seconds=seconds,
            )
    explored = [pol.draft_lengths(reqs) != [0, 0] for _ in range(40)]
    assert sum(explored) == 2  # every 20th


def test_explores_plain_decoding_beside_a_deeper_plan_while_it_is_plausible():
    # a draft pass costs a quarter of a target one and alpha is 0.7 (the prior): the choice is
    # 2, and a step without drafts is priced at 1 / 1.46 of it, close enough to be measured
    pol = policy(4, (1.0, 0.0), (0.25, 0.0), calibration_rounds=0, explore_every=4)
    reqs = [make_request("a", 4, 50), make_request("b", 4, 50)]
    first = [pol.draft_lengths(reqs) for _ in range(8)]
    assert first[0::2] == [[2, 2]] * 4
    assert first[1::2] == [[1, 1]] * 4  # a new batch size: one position beside only
    later = [pol.draft_lengths(reqs) for _ in range(8)]
    assert later == ([[2, 2]] * 3 + [[0, 0]]) * 2  # no step without drafts measured yet
    # cheap drafts: the choice is 4, plain decoding is priced at a third of it, never explored
    pol = policy(4, (1.0, 0.0), (0.01, 0.0), calibration_rounds=0, explore_every=4)
    steps = [pol.draft_lengths(reqs) for _ in range(40)]
    assert {tuple(s) for s in steps} == {(4, 4), (3, 3)}


# ---- engine level -------------------------------------------------------------------------------
def test_engine_args_accept_auto(pair):  # noqa: F811
    llm = engine(pair, "auto", max_draft_length=3)
    assert llm.engine.config.adaptive_speculation
    assert llm.engine.scheduler.policy.max_draft_length == 3
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=20), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 20
    counts = llm.engine.scheduler.policy.draft_length_counts
    assert sum(counts.values()) > 0
    page = parse_metrics(ServerMetrics().render(llm.engine, healthy=True))
    assert page["specbatch_spec_decode_draft_length_count"] == sum(counts.values())
    assert page['specbatch_spec_decode_draft_length_bucket{le="0"}'] == counts[0]
    assert out[0].metrics.draft_lengths  # the per-request metrics: gamma of each round


def test_profile_times_every_pass_through_the_step_code(pair):  # noqa: F811
    llm = engine(pair, 2)
    worker = llm.engine.executor.worker
    free = llm.engine.num_free_kv_blocks
    seq_counts, depths, draft_counts = [1, 2, 4], [0, 1, 2], [1, 2, 8, 16]
    profile = worker.profile_passes(seq_counts, 12, depths, draft_counts)
    assert len(profile["draft_first"]) == len(draft_counts)
    assert len(profile["draft_further"]) == len(seq_counts)
    assert [len(row) for row in profile["target"]] == [len(seq_counts)] * len(depths)
    times = [*profile["draft_first"], *profile["draft_further"]]
    times += [t for row in profile["target"] for t in row]
    assert all(0 < t < 10 for t in times)
    assert not worker._states  # the dummy requests are forgotten
    assert llm.engine.num_free_kv_blocks == free == llm.engine.num_kv_blocks
    # and the engine runs as before
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=6), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    # dummy sequences with blocks of their own at spread positions: more of them than the
    # pool holds share its blocks round the pool
    small = engine(pair, 2, num_kv_blocks=6, max_model_len=24)
    profile = small.engine.executor.worker.profile_passes([1, 8], 12, [0, 2], [1, 8])
    assert all(t > 0 for row in profile["target"] for t in row)
    assert small.engine.num_free_kv_blocks == small.engine.num_kv_blocks


def test_joint_of_first_three_tokens_is_the_targets_with_auto(pair):  # noqa: F811
    llm = engine(pair, "auto", seed=21, max_draft_length=4)
    pol = llm.engine.scheduler.policy
    assert isinstance(pol, AdaptiveDraftLength)
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * N
    samples = sample_sequences(llm, params)
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0
    print("auto draft lengths granted:", dict(sorted(pol.draft_length_counts.items())))
    assert len(pol.draft_length_counts) >= 3  # several gammas were exercised, 0 included
    assert_matches(samples, exact_joint(pair[0], PROMPT, 3, 1.0))


def test_bench_has_an_auto_row(make_checkpoint, tmp_path):
    from specbatch.bench.offline import AUTO, BenchConfig, run_bench
    from specbatch.bench.report import format_report, format_table
    from specbatch.entrypoints.cli import build_parser

    target = make_checkpoint("llama", num_layers=2, seed=0)
    draft = make_checkpoint("llama", num_layers=1, seed=1)
    ns = build_parser().parse_args(["bench", "--draft-lengths", "0", "2", "auto"])
    assert ns.draft_lengths == [0, 2, AUTO]
    cfg = BenchConfig(
        model=str(target),
        draft_model=str(draft),
        batch_sizes=[1, 4],
        draft_lengths=[0, 2, AUTO],
        input_len=8,
        output_len=12,
        num_requests=4,
        temperature=1.0,
        engine_kwargs={"device": "cpu"},
    )
    result = run_bench(cfg, progress=False)
    assert [(c.batch_size, c.draft_length) for c in result.cells] == [
        (b, k) for b in (1, 4) for k in (0, 2, AUTO)
    ]
    for c in result.cells:
        assert c.output_tokens == 4 * 12 == c.engine_generated_tokens
        if c.draft_length == AUTO:
            assert c.measured_speedup is not None and c.measured_speedup > 0
            assert c.mean_draft_length is None or c.mean_draft_length <= 2
    assert result.summary["auto_profile_s"] > 0  # the start-up profile, timed
    against = result.summary["auto_vs_fixed"]
    assert sorted(against) == ["1", "4"]
    assert all(r["best_fixed"] in (0, 2) for r in against.values())
    assert all(len(r["round_tok_ratios"]) == 1 for r in against.values())
    assert "auto against the best fixed draft length" in format_report(result)
    table = format_table(result.cells)
    assert sum(line.split()[1] == "auto" for line in table.splitlines()[2:]) == 2


def test_cli_flags_take_auto(capsys):
    from specbatch.entrypoints.cli import build_parser
    from specbatch.entrypoints.engine_flags import engine_args_from

    argv = ["generate", "--prompts", "p.txt", "--output", "o.jsonl"]
    ns = build_parser().parse_args([*argv, "--num-speculative-tokens", "auto"])
    ns_max = build_parser().parse_args(
        [*argv, "--num-speculative-tokens", "auto", "--max-draft-length", "6"]
    )
    assert engine_args_from(ns).num_speculative_tokens == "auto"
    assert engine_args_from(ns).max_draft_length == 4
    assert engine_args_from(ns_max).max_draft_length == 6
    assert (
        build_parser().parse_args([*argv, "--num-speculative-tokens", "2"]).num_speculative_tokens
        == 2
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--num-speculative-tokens", "many"])
    assert "integer or 'auto'" in capsys.readouterr().err


def test_engine_args_reject_bad_auto_settings(pair):  # noqa: F811
    from specbatch.config import EngineArgs
    from specbatch.errors import InvalidInputError

    target, draft = map(str, pair)
    with pytest.raises(InvalidInputError, match="num_speculative_tokens must be an integer"):
        EngineArgs(target, draft, num_speculative_tokens="sometimes").create_engine_config()
    with pytest.raises(InvalidInputError, match="max_draft_length must be an integer >= 1"):
        EngineArgs(
            target, draft, num_speculative_tokens="auto", max_draft_length=0
        ).create_engine_config()
    cfg = EngineArgs(target, draft, num_speculative_tokens=2, max_num_seqs=4).create_engine_config()
    assert not cfg.adaptive_speculation and cfg.num_speculative_tokens == 2
