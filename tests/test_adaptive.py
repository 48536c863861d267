"""The adaptive draft-length policy (``num_speculative_tokens="auto"``).

Unit tests on synthetic cost models and acceptance rates: the choice itself, the cost model's
fit, the acceptance estimate, the policy learning inside a real scheduler driven by a simulated
worker (step times from a known cost model, drafts accepted with a known alpha), the KV limits;
then the engine-level exactness test with ``auto`` on.
"""

from __future__ import annotations

import random

import pytest

from specbatch import SamplingParams
from specbatch.engine.prometheus import ServerMetrics, parse_metrics
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.scheduler.adaptive import (
    AdaptiveDraftLength,
    StepCostModel,
    step_features,
)
from specbatch.scheduler.output import RequestStepResult, SchedulerOutput, StepResult
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.stop_checker import StopChecker
from specbatch.theory import expected_tokens_per_round
from tests.helpers import exact_joint
from tests.test_exactness import PROMPT, N, assert_matches, engine, pair, sample_sequences  # noqa: F401


def synthetic(theta: tuple[float, float, float, float]) -> StepCostModel:
    """A known cost model: (fixed, per target token, per draft pass, per draft token) seconds,
    as the model's (fixed, per sequence, per prompt token, per pass, per draft token)."""
    fixed, per_target, per_pass, per_draft = theta
    model = StepCostModel()
    model.theta = [fixed, per_target, per_target, per_pass, per_draft + per_target]
    return model


def policy(k: int, theta, **kw) -> AdaptiveDraftLength:
    return AdaptiveDraftLength(k, cost_model=synthetic(theta), **kw)


# ---- the choice on a known cost model ----------------------------------------------------------
def test_expected_tokens_is_theorys_formula():
    assert expected_tokens_per_round(0.5, 0) == 1.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_round(1.0, 3) == 4.0


def test_picks_zero_when_drafts_cost_more_than_they_return():
    # a draft pass costs as much as a whole step: even alpha 0.6 does not pay for it
    p = policy(4, (1.0, 0.0, 1.0, 0.0))
    assert p.choose([0.6] * 8, [4] * 8) == [0] * 8
    # verifying costs a lot per token (a compute-bound batch): drafts do not pay either
    p = policy(4, (0.1, 0.05, 0.0, 0.0))
    assert p.choose([0.5] * 32, [4] * 32) == [0] * 32


def test_grows_gamma_when_acceptance_is_high():
    theta = (1.0, 0.0, 0.1, 0.0)  # a draft pass costs 10% of a step (THEORY's c = 0.1)
    p = policy(8, theta)
    by_alpha = {a: p.choose([a], [8])[0] for a in (0.05, 0.3, 0.6, 0.8, 0.95)}
    values = list(by_alpha.values())
    assert values == sorted(values) and values[0] == 0 and values[-1] >= 6, by_alpha
    # the one-request choice is THEORY's optimum of S(gamma)
    for a, g in by_alpha.items():
        best = max(range(9), key=lambda k: expected_tokens_per_round(a, k) / (1 + 0.1 * k))
        assert g == best, (a, g, best)


def test_mixed_batch_gives_each_request_its_own_gamma():
    p = policy(6, (1.0, 0.02, 0.05, 0.02))  # each verified draft token costs 4% of a step
    gammas = p.choose([0.95, 0.1, 0.7], [6, 6, 6])
    assert gammas[0] > gammas[2] > gammas[1] == 0


def test_respects_the_cap():
    p = policy(4, (1.0, 0.0, 0.0, 0.0))  # drafts are free: take all that is allowed
    assert p.choose([0.9, 0.9, 0.9], [4, 2, 0]) == [4, 2, 0]


def test_choice_is_deterministic():
    p = policy(5, (1.0, 0.002, 0.08, 0.003))
    alphas = [random.Random(i).random() for i in range(40)]
    assert p.choose(alphas, [5] * 40) == p.choose(alphas, [5] * 40)


# ---- estimates ---------------------------------------------------------------------------------
def test_cost_model_fit_recovers_a_linear_step_time():
    rng = random.Random(0)
    truth = (0.004, 0.0003, 0.0002, 0.0015, 0.00005)
    model = StepCostModel(decay=1.0)

    def point() -> list[float]:
        n, passes, prefill = rng.randint(1, 64), rng.randint(0, 4), rng.choice((0, 0, 32))
        gammas = [rng.randint(0, passes) for _ in range(n)]
        return step_features(n + (prefill > 0), prefill, gammas)

    def time_of(x: list[float]) -> float:
        return sum(a * b for a, b in zip(truth, x))

    for _ in range(400):
        x = point()
        model.observe(x, time_of(x) * (1 + rng.gauss(0, 0.01)))
    for got, want in zip(model.theta, truth):
        assert got == pytest.approx(want, rel=0.15, abs=2e-5)
    for _ in range(20):
        x = point()
        assert model.predict(*x[1:]) == pytest.approx(time_of(x), rel=0.03)


def test_alpha_estimate_starts_at_the_engine_rate_and_moves_to_the_requests():
    p = policy(4, (1.0, 0.0, 0.1, 0.0), prior_alpha=0.5, prior_strength=8)
    req = make_request("r", 4, 10)
    assert p.alpha_of(req) == pytest.approx(0.5)
    for _ in range(50):
        req.spec.record(4, 4)  # the request's drafts are always accepted
    assert p.alpha_of(req) > 0.95
    other = make_request("s", 4, 10)
    for _ in range(30):
        other.spec.record(4, 0)
    assert p.alpha_of(other) < 0.15


# ---- inside the scheduler, against a simulated worker -----------------------------------------
def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_model_len=256,
    )


def run(
    alpha: float,
    truth: tuple[float, float, float, float],
    *,
    num_requests: int = 16,
    num_blocks: int = 512,
    max_tokens: int = 60,
    k: int = 4,
    seed: int = 0,
) -> tuple[AdaptiveDraftLength, Scheduler, list[list[int]]]:
    """Drive a scheduler with the policy; each draft is accepted with probability ``alpha`` and
    each step 'takes' the synthetic ``truth`` cost model's time. Returns the granted gammas of the
    decoding requests, step by step."""
    rng = random.Random(seed)
    cost = synthetic(truth)
    kv = KVCacheManager(num_blocks, 4)
    pol = AdaptiveDraftLength(k, kv)
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
                result.results[sr.request_id] = RequestStepResult(toks, a)
        gammas = [sr.num_draft for sr in plan.requests if sr.sample]
        prompt = sum(len(sr.target_token_ids) - sr.sample for sr in plan.requests)
        seconds = cost.predict(*step_features(len(plan.requests), prompt, gammas)[1:])
        sched.update(plan, result)
        pol.observe(plan, result, seconds)
        if all(len(sr.target_token_ids) == 1 for sr in plan.requests):
            history.append(gammas)
    assert sched.num_preemptions == 0
    return pol, sched, history


def test_learns_to_stop_drafting_when_drafts_do_not_pay():
    # a draft pass costs 80% of a step and acceptance is low
    pol, _, history = run(0.3, (0.01, 0.0001, 0.008, 0.0001))
    late = history[pol.calibration_steps + 2 :]
    assert late and all(g == 0 for step in late for g in step)


def test_learns_to_draft_long_when_acceptance_is_high():
    # cheap drafts (a pass is 5% of a step) and alpha 0.9: the full draft length pays
    pol, _, history = run(0.9, (0.01, 0.00002, 0.0005, 0.00001))
    late = [g for step in history[pol.calibration_steps + 2 :] for g in step]
    assert late and sum(g == 4 for g in late) > 0.8 * len(late)
    assert pol.engine_alpha == pytest.approx(0.9, abs=0.05)
    assert set(pol.draft_length_counts) == set(range(5))  # the calibration sweep was granted


def test_never_plans_more_drafts_than_the_free_blocks_hold():
    # 16 requests of 8 prompt + 40 output tokens need 12 blocks each: 200 blocks leave little room
    pol, sched, history = run(0.9, (0.01, 0.0, 0.0, 0.0), num_blocks=200, max_tokens=40)
    assert sched.num_preemptions == 0  # (checked in run as well)
    assert any(sum(step) < 4 * len(step) for step in history)  # some drafts were cut for room

    kv = KVCacheManager(4, 4)
    pol = AdaptiveDraftLength(4, kv, synthetic((1.0, 0.0, 0.0, 0.0)), calibration_rounds=0)
    reqs = [make_request(str(i), 6, 50) for i in range(2)]
    for r in reqs:
        assert kv.allocate(r.request_id, 7)  # 2 blocks each, 1 free slot each, 0 free blocks
        r.num_computed = 6
    assert pol.draft_lengths(reqs) == [1, 1]


def test_explores_after_a_long_run_without_drafts():
    pol = policy(4, (1.0, 0.0, 10.0, 0.0), calibration_rounds=0, explore_every=5)
    reqs = [make_request("a", 4, 50)]
    chosen = [pol.draft_lengths(reqs)[0] for _ in range(12)]
    assert chosen == [0] * 5 + [1] + [0] * 5 + [1]


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
    from specbatch.bench.report import format_table
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
