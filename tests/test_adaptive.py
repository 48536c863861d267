"""The draft controller (``num_speculative_tokens="auto"``).

Unit tests on synthetic pass costs and acceptance: the row costs, the expected tokens, the
choice; the controller learning inside a real scheduler driven by a simulated worker whose
passes cost what a known cost model says and whose drafts are accepted with a known alpha;
then the engine-level wiring. No timing: every second here is simulated. The exactness tests
with ``auto`` on are in test_exactness.py (TP=1) and test_ray_tp.py (TP=2).
"""

from __future__ import annotations

import math
import random

import pytest

from specbatch import SamplingParams
from specbatch.draft_shape import DraftShape
from specbatch.engine.async_engine import AsyncLLMEngine
from specbatch.engine.calibration import MAX_STEPS, batch_sizes, calibrate
from specbatch.engine.prometheus import ServerMetrics, parse_metrics
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.scheduler import draft_controller
from specbatch.scheduler.draft_controller import (
    REUSE_STEPS,
    DraftController,
    chain_tokens,
    ladder,
    tree_bound,
)
from specbatch.scheduler.output import RequestStepResult, SchedulerOutput, StepResult
from specbatch.scheduler.row_costs import RowCosts, row_bucket
from specbatch.scheduler.scheduler import Scheduler, SchedulerLimits
from specbatch.stop_checker import StopChecker
from specbatch.theory import expected_tokens_per_round
from tests.test_exactness import PROMPT, engine, pair  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=200)
HOT = SamplingParams(temperature=1.0, max_tokens=200)


GREEDY_CLASS = (0.0, 1.0, 0, 0.0)


def make_request(rid: str, params: SamplingParams = GREEDY) -> Request:
    req = Request(rid, [1, 2, 3, 4], params, max_model_len=256)
    req.num_computed = req.num_draft_computed = 3  # decoding: one token to go
    return req


def accepting(ctl: DraftController, alpha: float, cls=GREEDY_CLASS) -> DraftController:
    """``ctl`` having seen the class accept ``alpha`` of 10,000 drafts."""
    ctl.tested[cls] = [alpha * 10_000, 10_000]
    ctl._standing = None
    return ctl


# a machine where rows are nearly free up to 16 and cost linearly beyond (a GPU or AMX), and a
# drafter pass costs a fifth of a target pass
def memory_bound(rows: int) -> float:
    return 0.002 + 0.0001 * max(0, rows - 16)


def cheap_drafter(rows: int) -> float:
    return 0.0004 + 0.00002 * rows


def priced(shapes: list[DraftShape], target=memory_bound, drafter=cheap_drafter):
    ctl = DraftController(shapes)
    ctl.target.observe(1, 1.0)  # a first call: left out
    for curve in (ctl.catch_up, ctl.depth):
        curve.observe(1, 1.0)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        ctl.target.observe(rows, target(rows))
        ctl.catch_up.observe(rows, drafter(rows))
        ctl.depth.observe(rows, drafter(rows))
    return ctl


# ---- row costs ----------------------------------------------------------------------------------
def test_row_buckets_and_unmeasured_rows():
    assert [row_bucket(r) for r in (1, 2, 4, 8)] == [0, 4, 8, 12]
    costs = RowCosts()
    costs.observe(1, 0.05)  # a first call: left out
    assert costs.seconds(4) is None
    costs.observe(1, 0.001)
    costs.observe(16, 0.004)
    assert costs.seconds(1) == pytest.approx(0.001, rel=1e-6)
    assert costs.seconds(4) == pytest.approx(0.002, rel=1e-6)  # on the log-log line
    assert costs.seconds(64) == pytest.approx(0.008, rel=1e-6)  # on the last two's slope
    assert costs.seconds(9) > costs.seconds(8)  # rows inside a bucket are not free
    costs = RowCosts()
    costs.observe(8, 0.1)
    costs.observe(8, 0.002)
    assert costs.seconds(2) == pytest.approx(0.0005, rel=0.05)  # proportional
    assert costs.seconds(32) == pytest.approx(0.002, rel=1e-6)  # one measured: flat, to be tried
    costs.observe(4, 0.003)  # fewer rows measured dearer: more rows never cost less
    assert costs.seconds(6) >= costs.seconds(4)


def test_a_first_pass_at_new_rows_costs_no_more_than_more_rows():
    """A first pass at a new row count may be slow for reasons of its own (a request's first
    drafting step sets up its drafter); it is priced at most as a larger measured row count."""
    costs = RowCosts()
    costs.observe(1, 0.05)  # a first call: left out
    for _ in range(3):
        costs.observe(1, 0.001)
        costs.observe(8, 0.002)
    costs.observe(4, 0.01)
    assert costs.seconds(4) == pytest.approx(0.002, rel=1e-6) == costs.seconds(8)


def test_row_costs_follow_the_machine_and_keep_their_contrasts():
    """A machine that slows while one row count runs prices every row count slower."""
    costs = RowCosts()
    for _ in range(50):
        costs.observe(1, 0.001)
        costs.observe(32, 0.003)
    for _ in range(200):  # the machine slows by half; only one-row passes run
        costs.observe(1, 0.0015)
    assert costs.seconds(1) == pytest.approx(0.0015, rel=0.05)
    assert costs.seconds(32) / costs.seconds(1) == pytest.approx(3.0, rel=0.05)


# ---- expectations -------------------------------------------------------------------------------
def test_chain_tokens_is_theorys_formula():
    for a, k in ((0.5, 3), (0.8, 1), (0.0, 4)):
        assert chain_tokens(a, k) == pytest.approx(expected_tokens_per_round(a, k))
    tree = DraftShape(4, 4, 16)
    assert tree_bound(0.6, tree) > chain_tokens(0.6, 4)  # more children per level, more tokens


def test_drafts_are_priced_as_cut_by_max_tokens():
    """A request two tokens from its max_tokens has room for one draft, which is all a deeper
    chain would bring it: both are priced alike (tokens and seconds); with room, not."""
    ctl = accepting(priced(ladder(4, 1, 4)), 0.7)
    one, four = DraftShape.chain(1), DraftShape.chain(4)
    estimates = {}
    for max_tokens in (2, 200):
        step = ctl.read([make_request("a", SamplingParams(temperature=0.0, max_tokens=max_tokens))])
        estimates[max_tokens] = [ctl._estimate(step, {GREEDY_CLASS: s}) for s in (one, four)]
    assert estimates[2][1] == pytest.approx(estimates[2][0])
    assert estimates[200][1][0] > estimates[200][0][0] + 0.5  # tokens
    assert estimates[200][1][1] > estimates[200][0][1]  # seconds


def test_an_acceptance_read_from_few_tests_is_priced_optimistically():
    """A rate read from 32 tests that came out low is given the benefit of its doubt
    (``OPTIMISM`` standard errors): drafts stay on, and their tests go on; the same rate read
    from 10,000 tests stops them, and so would the 32 tests read at face value."""

    def shape(tests: int, optimism: float) -> DraftShape:
        ctl = priced(ladder(4, 1, 4), target=lambda r: 0.002 + 0.0005 * r)
        ctl.tested[GREEDY_CLASS] = [0.35 * tests, tests]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(draft_controller, "OPTIMISM", optimism)
            return ctl.draft_shapes([make_request("a")])[0]

    assert shape(32, draft_controller.OPTIMISM).nodes
    assert not shape(10_000, draft_controller.OPTIMISM).nodes
    assert not shape(32, 0.0).nodes


def test_a_trees_measured_yield_replaces_its_bound():
    tree = DraftShape(3, 2, 6)
    ctl = DraftController(ladder(3, 2, 6))
    cls = (0.0, 1.0, 0, 0.0)
    before = ctl.tokens(cls, 0.7, tree)
    ctl.yields[cls, tree] = [1.2 * 1000, 1000]  # it yielded 1.2 tokens a round
    after = ctl.tokens(cls, 0.7, tree)
    assert after == pytest.approx(1.2, abs=0.02) and after < before


# ---- the choice ---------------------------------------------------------------------------------
def test_drafts_at_batch_one_and_stops_where_rows_cost_more_than_they_return():
    """The issue's test: with step costs that make drafting lose at large batches, the
    controller drafts at batch 1 and stops drafting there."""
    ctl = accepting(priced(ladder(4, 1, 4)), 0.7)
    for n in (1, 256):
        reqs = [make_request(str(i)) for i in range(n)]
        shapes = ctl.draft_shapes(reqs)
        if n == 1:
            assert shapes[0].nodes >= 2  # rows are free: draft deep
        else:
            assert all(s.nodes == 0 for s in shapes)


def test_a_draft_is_made_only_where_it_keeps_the_rate():
    """With a 2 ms target pass at any rows, a 0.3 ms drafter pass and alpha 0.7, chains of 1-4
    drafts make 1.7, 2.19, 2.53 and 2.77 tokens in 2.3, 2.6, 2.9 and 3.2 ms: 0.74, 0.84, 0.87
    and 0.87 - 0.007 tokens a ms. The fourth draft's tokens come faster (0.8 a ms) than
    decoding without drafts makes them (0.5) but slower than the three-draft chain's: the
    chain stops at three, where the tokens a second are most."""

    def flat(rows: int) -> float:
        return 0.002

    ctl = accepting(priced(ladder(4, 1, 4), target=flat, drafter=lambda rows: 0.0003), 0.7)
    shape = ctl.draft_shapes([make_request("a")])[0]
    assert shape == DraftShape.chain(3)
    cls, counts = GREEDY_CLASS, {GREEDY_CLASS: 1}
    alpha = ctl.priced_rate(cls)
    made = {}
    for k in range(5):
        plan = {cls: DraftShape.chain(k)}
        made[k] = ctl.tokens(cls, alpha, plan[cls]) / ctl.seconds(counts, plan, 0, {cls: 1.0})
    assert max(made, key=made.get) == 3 and made[4] > made[0]


def test_a_prompt_carrying_step_is_priced_at_its_margin():
    """Drafts beside a prompt pay when the rows they add cost less than decoding their tokens
    in steps of their own would: on a machine where every row costs the same, never."""

    def compute_bound(rows: int) -> float:
        return 0.0002 * rows

    def memory_bound(rows: int) -> float:
        return 0.002 + 0.00005 * max(0, rows - 8)

    reqs = [make_request(str(i)) for i in range(4)]
    ctl = priced(ladder(4, 1, 4), target=compute_bound)
    assert all(s.nodes == 0 for s in ctl.draft_shapes(reqs, prompt_rows=2000))
    ctl = priced(ladder(4, 1, 4), target=memory_bound)
    assert all(s.nodes for s in ctl.draft_shapes(reqs, prompt_rows=0))
    # beside a prompt the rows are dear, but so would be the steps the drafts save
    assert all(s.nodes for s in ctl.draft_shapes(reqs, prompt_rows=2000))


def test_a_request_drafting_beside_plain_ones_is_priced_by_the_whole_step():
    """Requests decoding without a drafter (those of a drafter that slept) each bring a token
    for their row whatever the plan: where a row costs a fifth of a step's fixed part, one
    request drafts alone, but not beside seven decoding plainly, whose tokens its rows slow."""

    def fixed_and_rows(rows: int) -> float:
        return 0.002 + 0.0005 * rows

    ctl = accepting(priced(ladder(4, 1, 4), target=fixed_and_rows), 0.7)
    req = [make_request("a")]
    assert ctl.draft_shapes(req)[0].nodes
    ctl._standing = None
    assert ctl.draft_shapes(req, plain=7)[0].nodes == 0


def test_drafts_that_pay_only_beside_prompts_are_not_made():
    """Where rows cost in proportion up to 64 and next to nothing beyond, drafts beside 2,000
    prompt rows cost nearly nothing at the step's margin, but the drafter's catch-up they start
    pays only if the requests go on drafting in steps without prompts, where they lose."""

    def steep_then_flat(rows: int) -> float:
        return 0.0002 * min(rows, 64) + 0.000001 * max(0, rows - 64)

    reqs = [make_request(str(i)) for i in range(32)]
    ctl = accepting(priced(ladder(4, 1, 4), target=steep_then_flat), 0.6)
    assert all(s.nodes == 0 for s in ctl.draft_shapes(reqs, prompt_rows=0))
    assert all(s.nodes == 0 for s in ctl.draft_shapes(reqs, prompt_rows=2000))


def test_draft_rows_inside_a_measured_bucket_are_not_free():
    """Beside 2,016 prompt rows, 32 requests' four drafts each add 128 rows, which fall in the
    bucket of the rows without them: on a machine where every row costs the same they still
    cost their share, and nobody drafts."""
    ctl = DraftController(ladder(4, 1, 4))
    for rows in [1, *sorted({round(2 ** (b / 4)) for b in range(49)})]:  # every bucket to 4096
        ctl.target.observe(rows, 0.0002 * rows)
        ctl.catch_up.observe(rows, 0.00002 * rows)
        ctl.depth.observe(rows, 0.00002 * rows)
    accepting(ctl, 0.7)
    reqs = [make_request(str(i)) for i in range(32)]
    assert row_bucket(2016 + 32) == row_bucket(2016 + 32 * 5)
    assert all(s.nodes == 0 for s in ctl.draft_shapes(reqs, prompt_rows=2016))


def test_deeper_drafts_for_higher_acceptance_and_trees_where_rows_are_free():
    ctl = priced(ladder(4, 4, 16))
    low = accepting(ctl, 0.2).draft_shapes([make_request("a")])[0]
    high = accepting(ctl, 0.95).draft_shapes([make_request("b")])[0]
    assert high.depth > low.depth
    assert not accepting(ctl, 0.5).draft_shapes([make_request("c")])[0].is_chain


def test_each_sampling_class_gets_its_own_shape():
    ctl = priced(ladder(4, 1, 4), target=lambda r: 0.002 + 0.00005 * r)
    ctl.tested[GREEDY_CLASS] = [9500, 10000]  # greedy requests accept almost all
    ctl.tested[(1.0, 1.0, 0, 0.0)] = [500, 10000]  # hot ones almost none
    reqs = [make_request(str(i), GREEDY if i % 2 else HOT) for i in range(32)]
    shapes = ctl.draft_shapes(reqs)
    greedy = {s for r, s in zip(reqs, shapes) if r.sampling_params.greedy}
    hot = {s for r, s in zip(reqs, shapes) if not r.sampling_params.greedy}
    assert len(greedy) == len(hot) == 1
    assert greedy.pop().depth > hot.pop().depth


def test_a_choice_stands_for_the_same_requests_and_no_longer():
    """The same requests, prompt rows and acceptance as the last choice read reuse it, for at
    most ``REUSE_STEPS`` steps; a change in any of them is priced at once."""
    ctl = priced(ladder(4, 1, 4))
    accepting(ctl, 0.7)
    one = [make_request("a")]
    drafts = ctl.draft_shapes(one)[0]
    assert drafts.nodes
    many = [make_request(str(i)) for i in range(256)]
    assert all(s.nodes == 0 for s in ctl.draft_shapes(many))  # a new batch: priced
    assert ctl.draft_shapes(one)[0] == drafts
    ctl.tested[GREEDY_CLASS] = [200, 10_000]  # the class's acceptance moved: priced at once
    assert ctl.draft_shapes(one)[0].nodes < drafts.nodes
    ctl.tested[GREEDY_CLASS] = [7_000, 10_000]
    ctl.draft_shapes(one)
    ctl.rest_plain = RowCosts()  # what the choice priced changes: drafts now cost a step each
    ctl.rest_drafting.observe(1, 1.0)
    ctl.rest_drafting.observe(1, 1.0)
    seen = [ctl.draft_shapes(one)[0] for _ in range(REUSE_STEPS)]
    assert seen[: REUSE_STEPS - 1] == [drafts] * (REUSE_STEPS - 1)
    assert seen[-1].nodes == 0


def test_the_same_requests_on_a_standing_choice_are_not_priced_again(monkeypatch):
    """The very same requests, step after step: the standing choice is handed out again without
    reading the step (once in ``REUSE_STEPS`` it is priced anew)."""
    ctl = accepting(priced(ladder(4, 1, 4)), 0.7)
    read = []
    monkeypatch.setattr(ctl, "_rooms", lambda rs: read.append(1) or {4: len(rs)})
    one = [make_request("a")]
    seen = [ctl.draft_shapes(one)[0] for _ in range(4 * REUSE_STEPS)]
    assert len(set(seen)) == 1 and seen[0].nodes
    assert len(read) == 4


def test_no_drafts_before_anything_was_measured():
    ctl = DraftController(ladder(4, 1, 4))
    assert ctl.draft_shapes([make_request("a")]) == [DraftShape()]


# ---- inside a scheduler, against a simulated worker ---------------------------------------------
def simulate(
    plan: SchedulerOutput, rng: random.Random, alpha: float, target, drafter
) -> StepResult:
    """A step of a simulated worker: each draft accepted with probability ``alpha``, each pass
    costing what ``target`` and ``drafter`` say for its rows."""
    result = StepResult()
    rows = 0
    for sr in plan.requests:
        rows += len(sr.target_token_ids) + sr.num_draft
        if sr.sample:
            a = 0
            while a < sr.shape.depth and rng.random() < alpha:
                a += 1
            base = sr.target_start + len(sr.target_token_ids)
            result.results[sr.request_id] = RequestStepResult(
                [100 + base + i for i in range(a + 1)], a, sr.num_draft
            )
    depth = max((sr.shape.depth for sr in plan.requests), default=0)
    beams = [sum(sr.shape.topk for sr in plan.requests if sr.shape.depth > d)
             for d in range(1, depth)]  # fmt: skip
    result.passes = [("target", rows, target(rows))]
    result.passes += [("draft", b, drafter(b)) for b in beams]
    return result


def run(alpha: float, target, drafter, *, num_requests: int = 16, num_blocks: int = 1000,
        max_tokens: int = 60, shapes=None) -> list[list[DraftShape]]:  # fmt: skip
    """A closed loop of ``num_requests`` requests: each draft accepted with probability
    ``alpha``; each step's passes cost what ``target`` and ``drafter`` say for their rows.
    Returns the shapes granted at each step where every request decoded."""
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks, 4)
    ctl = DraftController(shapes or ladder(4, 1, 4))
    sched = Scheduler(
        SchedulerLimits(num_requests, 4096, 256), kv, StopChecker(None), ctl, speculative=True
    )
    for i in range(num_requests):
        sched.add_request(
            Request(str(i), list(range(1, 9)), SamplingParams(max_tokens=max_tokens), 256)
        )
    history = []
    while sched.has_unfinished():
        plan: SchedulerOutput = sched.schedule()
        result = simulate(plan, rng, alpha, target, drafter)
        sched.update(plan, result)
        ctl.observe(plan, result, sum(p[2] for p in result.passes) + 0.0002)
        if all(len(sr.target_token_ids) == 1 for sr in plan.requests):
            history.append([sr.shape for sr in plan.requests])
    assert sched.num_preemptions == 0
    return history


def test_learns_to_draft_when_rows_are_free_and_acceptance_high():
    history = run(0.9, memory_bound, cheap_drafter, num_requests=2, max_tokens=200)
    late = [s.depth for step in history[10:] for s in step]
    assert late and sum(d >= 3 for d in late) > 0.8 * len(late)


def test_learns_not_to_draft_when_rows_cost_and_drafts_fail():
    def costly(rows: int) -> float:
        return 0.001 * rows

    history = run(0.2, costly, lambda r: 0.0005 * r)
    late = history[10:]
    drafting = [step for step in late if any(s.nodes for s in step)]
    assert late and len(drafting) <= 0.1 * len(late)  # the probes only


def test_start_up_timing_keeps_a_fresh_engine_from_drafting_where_drafts_lose():
    """Calibrated on a simulated worker whose rows cost arithmetic, a fresh controller drafts
    for one request and not for 64 at once (untimed, its drafter's passes would be priced at
    nothing); it learns no acceptance from the throwaway requests, and the KV pool is whole."""

    def target(rows: int) -> float:
        return 0.001 + 0.0001 * rows

    def drafter(rows: int) -> float:
        return 0.0002 + 0.00005 * rows

    rng = random.Random(0)
    kv = KVCacheManager(4096, 4)
    ctl = DraftController(ladder(4, 1, 4))
    ctl.target.observe(1, 1.0)  # a first call: left out
    ctl.target.observe(64, target(64))  # the target alone timed: drafts look free
    assert ctl.draft_shapes([make_request(str(i)) for i in range(64)])[0].nodes
    ctl = DraftController(ladder(4, 1, 4))
    forgotten = []

    def execute(plan: SchedulerOutput) -> StepResult:
        forgotten.extend(plan.finished_request_ids)
        return simulate(plan, rng, 0.3, target, drafter)

    def new_scheduler(policy) -> Scheduler:
        limits = SchedulerLimits(256, 4096, 256)
        return Scheduler(limits, kv, StopChecker(None), policy, speculative=True)

    calibrate(ctl, new_scheduler, execute, vocab_size=100, max_model_len=256, max_num_seqs=256)
    assert not ctl.tested
    assert kv.num_free_blocks == kv.num_blocks
    assert len(set(forgotten)) == 2 + sum(batch_sizes(256))  # the workers forget every one
    accepting(ctl, 0.7)
    assert ctl.draft_shapes([make_request("one")])[0].nodes
    assert not any(s.nodes for s in ctl.draft_shapes([make_request(str(i)) for i in range(64)]))


def test_start_up_timing_ends_where_nothing_is_drafted():
    """A drafter that finds nothing to draft (an n-gram lookup in random tokens) does not keep
    the start-up timing running until its requests reach max_model_len."""
    rng = random.Random(0)
    kv = KVCacheManager(4096, 4)
    steps = []

    def execute(plan: SchedulerOutput) -> StepResult:
        steps.append(plan)
        result = simulate(plan, rng, 0.0, memory_bound, cheap_drafter)
        for r in result.results.values():
            r.num_proposed = r.num_accepted = 0
        return result

    def new_scheduler(policy) -> Scheduler:
        return Scheduler(SchedulerLimits(64, 4096, 4096), kv, StopChecker(None), policy, True)

    ctl = DraftController(ladder(4, 1, 4))
    calibrate(ctl, new_scheduler, execute, vocab_size=100, max_model_len=4096, max_num_seqs=64)
    assert len(steps) <= (2 + len(batch_sizes(64))) * MAX_STEPS + 1
    assert kv.num_free_blocks == kv.num_blocks


def test_drafts_within_the_free_blocks_without_preempting():
    history = run(0.9, memory_bound, cheap_drafter, num_blocks=200, max_tokens=40)
    assert history  # run() checks that nothing was preempted


# ---- engine level -------------------------------------------------------------------------------
def test_engine_args_accept_auto(pair):  # noqa: F811
    llm = engine(pair, "auto", max_draft_length=3)
    assert llm.engine.config.speculative_config.auto
    policy = llm.engine.scheduler.policy
    assert isinstance(policy, DraftController) and policy.shape.depth == 3
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
    assert out[0].metrics.draft_lengths  # the per-request metrics: drafts of each round
    assert policy.target.level is not None and math.isfinite(policy.target.level)
    m = llm.engine.metrics
    assert m.summary()["generated_tokens"] == 20  # the start-up timing's requests not counted
    assert page["specbatch:spec_decode_drafting_share"] == m.drafting_steps / m.decoding_steps
    fixed = engine(pair, 2)
    page = parse_metrics(ServerMetrics(AsyncLLMEngine(fixed.engine), "m").render())
    assert "specbatch:spec_decode_draft_length_count" not in page


def test_the_start_up_timing_leaves_nothing_behind(pair):  # noqa: F811
    """The engine times auto's passes on throwaway requests before the first one arrives; then
    no request, KV block, cached block, worker state, acceptance or metric remains of them."""
    llm = engine(pair, "auto", max_draft_length=3, enable_prefix_caching=True)
    eng = llm.engine
    policy = eng.scheduler.policy
    for curve in (policy.target, policy.catch_up, policy.depth, policy.rest_plain):
        assert curve.level is not None
    assert len(policy.target.offsets) >= len(batch_sizes(256))
    assert not policy.tested
    assert eng.num_free_kv_blocks == eng.num_kv_blocks and eng.kv_cache.num_cached_blocks == 0
    assert not eng.executor.worker._states and not eng.scheduler.requests
    assert eng.metrics.summary()["steps"] == 0


def test_bench_has_an_auto_row(make_checkpoint, tmp_path):
    from specbatch.bench.bench_config import BenchConfig
    from specbatch.bench.offline import run_bench
    from specbatch.bench.report import format_report, format_table
    from specbatch.entrypoints.cli import build_parser

    target = make_checkpoint("llama", num_layers=2, seed=0)
    draft = make_checkpoint("llama", num_layers=1, seed=1)
    ns = build_parser().parse_args(["bench", "--draft-lengths", "0", "2", "auto"])
    assert ns.draft_lengths == [0, 2, "auto"]
    cfg = BenchConfig(
        model=str(target),
        draft_model=str(draft),
        batch_sizes=[1, 4],
        draft_lengths=[0, 2, "auto"],
        input_len=8,
        output_len=12,
        num_requests=4,
        temperature=1.0,
        engine_kwargs={"device": "cpu"},
    )
    result = run_bench(cfg, progress=False)
    assert [(c.batch_size, str(c.draft)) for c in result.cells] == [
        (b, k) for b in (1, 4) for k in ("0", "2", "auto")
    ]
    for c in result.cells:
        assert c.output_tokens == 4 * 12 == c.engine_generated_tokens
        if c.draft == "auto":
            assert c.measured_speedup is not None and c.measured_speedup > 0
            assert c.mean_draft_length is None or c.mean_draft_length <= 2
    against = result.summary["auto_vs_fixed"]
    assert sorted(against) == ["1", "4"]
    assert all(r["best_fixed"] in ("0", "2") for r in against.values())
    assert all(len(r["round_tok_ratios"]) == 1 for r in against.values())
    assert "auto against the best fixed cell" in format_report(result)
    table = format_table(result.cells)
    assert sum(line.split()[1] == "auto" for line in table.splitlines()[2:]) == 2


def test_cli_flags_take_auto(capsys):
    from specbatch.entrypoints.cli import build_parser
    from specbatch.entrypoints.flags import engine_args_from

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
    assert not cfg.speculative_config.auto and cfg.speculative_config.depth == 2
