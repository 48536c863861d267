"""The adaptive draft-length policy (``num_speculative_tokens="auto"``).

Unit tests on synthetic step times and acceptance: the price table, the alpha estimates, the
choice, the probes and the KV limit; the policy learning inside a real scheduler driven by a
simulated worker (step times from a known cost model, drafts accepted with a known alpha);
then the engine-level wiring. The exactness tests with ``auto`` on are in test_exactness.py
(TP=1) and test_ray_tp.py (TP=2).
"""

from __future__ import annotations

import math
import random

import pytest

from specbatch import SamplingParams
from specbatch.engine.async_engine import AsyncLLMEngine
from specbatch.engine.prometheus import ServerMetrics, parse_metrics
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.scheduler.adaptive import PROBE_EVERY, AdaptiveDraftLength, sampling_class
from specbatch.scheduler.output import (
    RequestStepResult,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
)
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.scheduler.step_times import StepTimes, bucket
from specbatch.stop_checker import StopChecker
from specbatch.theory import expected_tokens_per_round
from tests.test_exactness import PROMPT, engine, pair  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=200)
HOT = SamplingParams(temperature=1.0, max_tokens=200)


def make_request(rid: str, prompt_len: int = 4, params: SamplingParams = GREEDY) -> Request:
    req = Request(rid, list(range(1, prompt_len + 1)), params, max_model_len=256)
    req.num_computed = req.num_draft_computed = prompt_len - 1  # decoding: one token to go
    return req


def price(pol: AdaptiveDraftLength, n: int, seconds: list[float], m: int | None = None) -> None:
    """Measure one step of ``n`` requests at each depth (``seconds[g]``), ``m`` of them
    drafting (all by default)."""
    for g, t in enumerate(seconds):
        pol.times.tick(n)
        pol.times.observe(n, (n if m is None else m) if g else 0, g, t)


def choices(pol: AdaptiveDraftLength, requests: list[Request], steps: int) -> list[list[int]]:
    return [pol.draft_lengths(requests) for _ in range(steps)]


# ---- prices -------------------------------------------------------------------------------------
def test_buckets_are_powers_of_two_on_a_log_scale():
    assert [bucket(n) for n in (1, 2, 3, 5, 6, 11, 12, 45, 46, 64)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        32,
        64,
        64,
    ]


def test_prices_keep_the_depths_contrasts_while_the_machine_drifts():
    """Depth 2 runs, 0, 1 and 3 are measured now and then, and the machine's speed moves by
    half: the level follows it, the depths' contrasts stay."""
    times = StepTimes()
    true = {0: 10.0, 1: 14.0, 2: 17.0, 3: 20.0}
    for i in range(600):
        g = {0: 1, 5: 0, 10: 3}.get(i % 16, 2) if i >= 4 else i
        speed = 1.5 + 0.5 * math.sin(i / 40)
        times.tick(8)
        times.observe(8, 8 if g else 0, g, true[g] * speed * 1e-3)
        if i > 100:  # the prices are the machine's now
            assert times.seconds(8, 2) == pytest.approx(true[2] * speed * 1e-3, rel=0.08)
    for g in (0, 1, 3):
        ratio = times.seconds(8, g) / times.seconds(8, 2)
        assert ratio == pytest.approx(true[g] / true[2], rel=0.03)


def test_a_new_bucket_borrows_the_nearest_contrasts_and_measures_its_level():
    times = StepTimes()
    for g, t in enumerate([10.0, 20.0, 30.0]):
        times.tick(4)
        times.observe(4, 4 if g else 0, g, t)
    times.tick(16)  # 4 is the nearest (and only) bucket measured
    assert times.seconds(16, 2) == pytest.approx(30.0)
    times.observe(16, 16, 1, 60.0)  # its first step: three times bucket 4's
    assert [times.seconds(16, g) for g in range(3)] == pytest.approx([30.0, 60.0, 90.0])
    assert times.seconds(4, 1) == pytest.approx(20.0)  # bucket 4 keeps its own


def test_a_plan_where_some_requests_draft_is_priced_from_their_own_batch_size():
    times = StepTimes()
    for n, seconds in ((8, [10.0, 30.0]), (2, [4.0, 6.0])):
        for g, t in enumerate(seconds):
            times.tick(n)
            times.observe(n, n if g else 0, g, t)
    assert times.price(8, 8, 1) == pytest.approx(30.0)
    assert times.price(8, 7, 1) == pytest.approx(30.0)  # 7 of 8 fill the bucket
    assert times.price(8, 2, 1) == pytest.approx(10.0 + 6.0 - 4.0)
    assert times.price(8, 4, 1) is None  # bucket 4 never measured
    times.observe(8, 2, 1, 99.0)  # such a step prices no depth
    assert times.price(8, 8, 1) == pytest.approx(30.0)


# ---- acceptance ---------------------------------------------------------------------------------
def observe_rounds(pol: AdaptiveDraftLength, req: Request, rounds: list[tuple[int, int]]) -> None:
    """Feed the policy finished rounds of ``req``: (drafts, accepted) each."""
    pol.draft_lengths([req])  # the policy learns the request's sampling class
    for num_draft, accepted in rounds:
        sr = ScheduledRequest(req.request_id, [1], 8, [1], 8, num_draft, True, [0])
        result = StepResult(
            {req.request_id: RequestStepResult([1] * (accepted + 1), accepted, num_draft)}
        )
        pol.observe(SchedulerOutput(requests=[sr]), result, 0.01)
        req.spec.record(num_draft, accepted)
    pol.times = StepTimes()  # these steps teach acceptance only


def test_expected_tokens_is_theorys_formula():
    assert expected_tokens_per_round(0.5, 0) == 1.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_round(1.0, 3) == 4.0


def test_a_new_request_starts_at_its_class_rate_and_moves_to_its_own():
    pol = AdaptiveDraftLength(4)
    observe_rounds(pol, make_request("g"), [(4, 4)] * 100)  # greedy requests accept all
    observe_rounds(pol, make_request("h", params=HOT), [(4, 0), (4, 1)] * 400)  # alpha 1/3
    greedy, hot = make_request("g2"), make_request("h2", params=HOT)
    pol.draft_lengths([greedy, hot])
    alphas, rates = pol.rates([greedy, hot])
    assert alphas == rates
    assert alphas[0] > 0.95 and alphas[1] == pytest.approx(1 / 3, abs=0.03)
    observe_rounds(pol, hot, [(4, 4)] * 40)  # this sampled request accepts every draft
    alphas, rates = pol.rates([greedy, hot])
    assert alphas[1] > 0.9 and rates[1] < 0.8
    assert sampling_class(greedy) != sampling_class(hot)


# ---- the choice ---------------------------------------------------------------------------------
def test_the_first_steps_run_each_depth_once_then_choose():
    pol = AdaptiveDraftLength(4)
    reqs = [make_request("a"), make_request("b")]
    seen = []
    for g, t in enumerate([10.0, 12.0, 14.0, 16.0, 18.0]):
        seen.append(pol.draft_lengths(reqs))
        pol.times.observe(2, 2 if g else 0, g, t)
    assert seen == [[g, g] for g in range(5)]
    assert pol.draft_lengths(reqs) == [2, 2]  # alpha 0.6: the most tokens per second


def test_picks_no_drafts_when_they_cost_more_than_they_return():
    pol = AdaptiveDraftLength(4)
    price(pol, 4, [10.0, 19.0, 28.0, 37.0, 46.0])  # a draft pass: 90% of a plain step
    reqs = [make_request(str(i)) for i in range(4)]
    assert choices(pol, reqs, PROBE_EVERY - 1) == [[0] * 4] * (PROBE_EVERY - 1)


def test_drafts_deeper_when_acceptance_is_higher():
    def depth(accepted: int) -> int:
        pol = AdaptiveDraftLength(8)
        observe_rounds(pol, make_request("x"), [(8, accepted)] * 100)
        price(pol, 1, [10.0 + 2.5 * g for g in range(9)])
        return pol.draft_lengths([make_request("y")])[0]

    depths = [depth(a) for a in (0, 1, 3, 8)]
    assert depths == sorted(depths) and depths[0] == 0 and depths[-1] == 8


def test_favours_the_high_alpha_requests_in_a_mixed_batch():
    pol = AdaptiveDraftLength(4)
    observe_rounds(pol, make_request("g"), [(4, 4), (4, 3)] * 60)  # greedy: alpha ~0.9
    observe_rounds(pol, make_request("h", params=HOT), [(4, 0)] * 60)  # sampled: ~0.05
    # a draft position costs each request as much as plain decoding: worth it for greedy ones
    price(pol, 4, [14.0 + 4.0 * g for g in range(5)])
    price(pol, 8, [18.0 + 8.0 * g for g in range(5)])
    batch = [make_request(str(i), params=GREEDY if i % 2 else HOT) for i in range(8)]
    gammas = pol.draft_lengths(batch)
    assert all(g > 0 for g in gammas[1::2]) and not any(gammas[0::2])


def drive(
    pol: AdaptiveDraftLength,
    requests: list[Request],
    seconds: list[float],
    steps: int,
    unmeasured: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[int]:
    """Plan and observe ``steps`` steps taking ``seconds[g]`` at depth ``g``; the steps whose
    index is in ``unmeasured`` carry a prompt chunk. A request that did not draft in the step
    before makes its draft catch up on 5 tokens. Returns the deepest draft of each step."""
    depths, drafted = [], {r.request_id for r in requests}
    for i in range(steps):
        gammas = pol.draft_lengths(requests)
        plan = SchedulerOutput(
            requests=[
                ScheduledRequest(
                    r.request_id,
                    [1],
                    8,
                    [1] * (1 if r.request_id in drafted else 5) if g else [],
                    8,
                    g,
                    True,
                    [0],
                )
                for r, g in zip(requests, gammas)
            ]
        )
        if i in unmeasured:
            plan.requests.append(ScheduledRequest("new", [1] * 8, 0, [], 0, 0, True, [0]))
        drafted = {sr.request_id for sr in plan.requests if sr.num_draft}
        result = StepResult(
            {sr.request_id: RequestStepResult([1], 0, sr.num_draft) for sr in plan.requests}
        )
        pol.observe(plan, result, seconds[max(gammas)])
        pol.tested.clear()  # acceptance stays at the prior: only the prices matter here
        depths.append(max(gammas))
    return depths


def test_probes_a_plan_beside_the_choice():
    pol = AdaptiveDraftLength(4)
    times = [10.0, 13.0, 14.0, 18.0, 25.0]  # alpha 0.6: depth 2 is the best
    price(pol, 2, times)
    reqs = [make_request("a"), make_request("b")]
    steps = drive(pol, reqs, times, 4 * PROBE_EVERY)
    probes = {i: g for i, g in enumerate(steps) if g != 2}
    assert sorted(probes) == [PROBE_EVERY * k - 1 for k in range(1, 5)]
    assert set(probes.values()) == {1, 3}  # one deeper, one shallower, in turn
    # a probe whose step measured nothing runs again, once
    steps = drive(pol, reqs, times, 2 * PROBE_EVERY - 1, unmeasured={PROBE_EVERY - 1, PROBE_EVERY})
    assert [i for i, g in enumerate(steps) if g != 2] == [PROBE_EVERY - 1, PROBE_EVERY]


def test_probes_from_no_drafts_only_a_borrowed_price():
    pol = AdaptiveDraftLength(4)
    times = [10.0, 30.0, 40.0, 50.0, 60.0]  # drafts do not pay
    price(pol, 2, times)
    reqs = [make_request("a"), make_request("b")]
    assert not any(drive(pol, reqs, times, 4 * PROBE_EVERY))  # the draft lags both: no probe
    # at a new bucket, prices borrowed: depth 1 once the draft caught up (the second step)
    four = [make_request(str(i)) for i in range(4)]
    steps = drive(pol, four, times, 4 * PROBE_EVERY)
    assert [i for i, g in enumerate(steps) if g] == [PROBE_EVERY - 1, PROBE_EVERY]
    assert pol.times.measured(4, 1) == 1


def test_never_plans_past_the_free_kv_blocks():
    kv = KVCacheManager(5, 4)
    pol = AdaptiveDraftLength(4, kv)
    price(pol, 2, [10.0, 10.5, 11.0, 11.5, 12.0])  # drafts nearly free: the most that fits
    reqs = [make_request("a", 6), make_request("b", 7)]
    for r in reqs:
        assert kv.allocate(r.request_id, 8)  # 2 blocks each, slot 8 is the next block's
    assert kv.num_free_blocks == 1
    gammas = pol.draft_lengths(reqs)
    need = sum(kv.blocks_needed(r.request_id, r.num_computed + 1 + g) for r, g in zip(reqs, gammas))
    assert need <= kv.num_free_blocks
    assert gammas == [2, 2]  # 3 each would take a block each
    assert kv.allocate("c", 4)
    assert pol.draft_lengths(reqs) == [1, 1]  # no free block: what the tables hold


# ---- inside a scheduler, against a simulated worker ---------------------------------------------
def run(
    alpha: float,
    draft_pass: float,
    *,
    verify_token: float = 0.0,
    num_blocks: int = 1000,
    num_requests: int = 16,
    max_tokens: int = 60,
    k: int = 4,
) -> tuple[Scheduler, list[list[int]]]:
    """A closed loop of ``num_requests`` requests: each draft accepted with probability
    ``alpha``, a step taking 10 ms plus ``draft_pass`` seconds per draft position plus
    ``verify_token`` per draft verified. Returns the scheduler and the gammas the policy asked
    for at each step in which every request decoded, checking that they fit the free blocks."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks, 4)
    pol = AdaptiveDraftLength(k, kv)
    sched = Scheduler(
        SchedulerLimits(num_requests, 4096, 256), kv, StopChecker(None), pol, speculative=True
    )
    for i in range(num_requests):
        sched.add_request(
            Request(str(i), list(range(1, 9)), SamplingParams(max_tokens=max_tokens), 256)
        )
    asked: list[list[int]] = []
    plan_lengths = pol.draft_lengths

    def watched(requests: list[Request]) -> list[int]:
        gammas = plan_lengths(requests)
        need = sum(
            kv.blocks_needed(r.request_id, r.num_computed + 1 + g) for r, g in zip(requests, gammas)
        )
        assert need <= kv.num_free_blocks
        asked.append(gammas)
        return gammas

    pol.draft_lengths = watched  # type: ignore[method-assign]
    history = []
    while sched.has_unfinished():
        asked.clear()
        plan = sched.schedule()
        result = StepResult()
        for sr in plan.requests:
            if sr.sample:
                a = 0
                while a < sr.num_draft and rng.random() < alpha:
                    a += 1
                base = sr.target_start + len(sr.target_token_ids)
                result.results[sr.request_id] = RequestStepResult(
                    [100 + base + i for i in range(a + 1)], a, sr.num_draft
                )
        drafts = [sr.num_draft for sr in plan.requests]
        seconds = 0.01 + draft_pass * max(drafts) + verify_token * sum(drafts)
        sched.update(plan, result)
        pol.observe(plan, result, seconds)
        if asked and all(len(sr.target_token_ids) == 1 for sr in plan.requests):
            history.append(asked[0])
    assert sched.num_preemptions == 0
    return sched, history


def test_learns_to_stop_drafting_when_drafts_do_not_pay():
    _, history = run(0.3, 0.008)  # a draft pass costs 80% of a step, a third accepted
    late = history[10:]
    drafting = [step for step in late if any(step)]
    assert late and len(drafting) <= 0.2 * len(late)  # the probes only
    assert all(max(step) == 1 for step in drafting)


def test_learns_to_draft_long_when_acceptance_is_high():
    _, history = run(0.95, 0.0005, max_tokens=200)
    late = [g for step in history[10:] for g in step]
    assert late and sum(g == 4 for g in late) > 0.8 * len(late)


def test_drafts_within_the_free_blocks_without_preempting():
    # 16 requests of 8 prompt + 40 output tokens take 12 blocks each: 200 blocks leave little
    _, history = run(0.9, 0.0, num_blocks=200, max_tokens=40)
    assert any(sum(step) < 4 * len(step) for step in history)  # drafts cut for room


# ---- engine level -------------------------------------------------------------------------------
def test_engine_args_accept_auto(pair):  # noqa: F811
    llm = engine(pair, "auto", max_draft_length=3)
    assert llm.engine.config.adaptive_speculation
    assert isinstance(llm.engine.scheduler.policy, AdaptiveDraftLength)
    assert llm.engine.scheduler.policy.max_draft_length == 3
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 20
    counts = llm.engine.metrics.draft_length_counts
    assert sum(counts.values()) > 0 and max(counts) <= 3
    page = parse_metrics(ServerMetrics(AsyncLLMEngine(llm.engine), "m").render())
    assert page["specbatch:spec_decode_draft_length_count"] == sum(counts.values())
    assert page['specbatch:spec_decode_draft_length_bucket{le="0"}'] == counts[0]
    assert out[0].metrics.draft_lengths  # the per-request metrics: gamma of each round
    fixed = engine(pair, 2)
    page = parse_metrics(ServerMetrics(AsyncLLMEngine(fixed.engine), "m").render())
    assert "specbatch:spec_decode_draft_length_count" not in page


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
