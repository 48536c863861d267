"""``auto`` at long contexts: a pass's cache reads priced per cached token (measured on the
model's own attention backend at start-up), apart from what its rows cost.

The controller's choice on synthetic prices (no timing: every second here is simulated), the
row prices learning a pass less its cache reads, and the measurement itself on the built-in
target through both attention backends.
"""

from __future__ import annotations

import pytest

from specbatch import LLM
from specbatch.draft_shape import DraftShape
from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.draft_controller import DraftController, ladder
from specbatch.scheduler.kv_prices import KvPrice, KvPrices
from specbatch.scheduler.output import ScheduledRequest, SchedulerOutput, StepResult
from specbatch.worker.kv_price import measure_kv_price
from tests.test_adaptive import GREEDY_CLASS, accepting

# a CPU: every row of a pass costs its arithmetic (drafting never pays at batch 16 on short
# contexts), a drafter pass (the target's own layers) as dear as the target's
ROW_S = 0.001
# reading a cached token costs 20 us for the first query row, 2 us for each further one; a draft
# pass reads at most 272 of them a request (self_sparse's sinks and window)
READS = KvPrices(KvPrice(2e-5, 2e-6), KvPrice(2e-5, 2e-6), 272)


def priced(kv: KvPrices | None) -> DraftController:
    ctl = DraftController(ladder(3, 1, 3), kv)
    for curve in (ctl.target, ctl.catch_up, ctl.depth):
        curve.observe(1, 1.0)  # a first call: left out
        for rows in (1, 2, 4, 8, 16, 32, 64, 128):
            curve.observe(rows, ROW_S * rows)
    return accepting(ctl, 0.8)


def decoding(n: int, context: int) -> list[Request]:
    reqs = []
    for i in range(n):
        req = Request(str(i), list(range(1, context + 1)), SamplingParams(temperature=0.0,
                      max_tokens=500), max_model_len=context + 600)  # fmt: skip
        req.num_computed = req.num_draft_computed = context - 1
        reqs.append(req)
    return reqs


def test_a_long_context_makes_verification_nearly_free_and_drafts_pay():
    """At 16 requests of 64 tokens a step's rows dominate: no drafts. At 8,000 tokens the cache
    reads dominate, verifying 4 rows reads each cache once, and a draft pass reads 272 keys a
    request: the controller drafts. Without the cache prices it cannot tell the two apart."""
    with_kv = priced(READS)
    assert all(s.nodes == 0 for s in with_kv.draft_shapes(decoding(16, 64)))
    assert all(s.nodes >= 2 for s in with_kv.draft_shapes(decoding(16, 8000)))
    blind = priced(None)
    assert all(s.nodes == 0 for s in blind.draft_shapes(decoding(16, 8000)))


def test_a_steps_price_adds_each_requests_cache_reads():
    ctl = priced(READS)
    cls, chain = GREEDY_CLASS, DraftShape.chain(3)
    counts, plan = {cls: 16}, {cls: chain}
    short = ctl.seconds(counts, plan, 0, {cls: 16.0}, None, {cls: 0.0})
    long = ctl.seconds(counts, plan, 0, {cls: 16.0}, None, {cls: 8000.0})
    target = 16 * READS.target.seconds(8000, 4)  # four rows share one read of each cache
    drafter = 16 * 3 * READS.draft.seconds(272, 1)  # three passes over the view
    assert long - short == pytest.approx(target + drafter, rel=1e-9)
    plain = ctl.seconds(counts, {cls: DraftShape()}, 0, None, None, {cls: 8000.0})
    bare = ctl.seconds(counts, {cls: DraftShape()}, 0, None, None, {cls: 0.0})
    assert plain - bare == pytest.approx(16 * READS.target.seconds(8000, 1), rel=1e-9)


def test_the_row_prices_learn_a_pass_less_its_cache_reads():
    """A target pass of 16 decoding requests at 800 tokens that took its rows' price plus its
    reads (nine tenths of it) leaves the row price where it was (it would otherwise read the
    cache's cost as the rows')."""
    ctl = priced(READS)
    before = ctl.target.seconds(16)
    plan = SchedulerOutput([ScheduledRequest(str(i), [5], 799, [], 0, 0, True, [0])
                            for i in range(16)])  # fmt: skip
    reads = 16 * READS.target.seconds(800, 1)
    for _ in range(20):
        result = StepResult(passes=[("target", 16, before + reads)])
        ctl.time_step(plan, result, before + reads, drafted=False)
    assert ctl.target.seconds(16) == pytest.approx(before, rel=0.02)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_the_engine_measures_its_prices_and_extra_rows_cost_less(backend):
    """The built-in pair under ``auto``: the controller holds the target's and the draft's
    prices, measured on the backend the models run: a cached token costs something, a further
    query row never less than nothing."""
    llm = LLM(attention_backend=backend, num_kv_blocks=256, max_model_len=256)
    worker = llm.engine.executor.worker
    kv = llm.engine.scheduler.policy.kv
    assert isinstance(kv, KvPrices) and kv.draft_view is None  # an EAGLE head's own cache
    for price in (kv.target, kv.draft):
        assert price is not None and price.read > 0 and price.row >= 0
    again = measure_kv_price(worker.target.model, worker.target.backend, 16)
    assert again is not None and again.seconds(1000, 4) >= again.seconds(1000, 1)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_self_sparse_drafts_at_the_targets_price_over_its_view():
    """The target's own layers draft: one measurement serves both, and a draft row reads the
    sinks and the window only."""
    spec = {"method": "self_sparse", "num_speculative_tokens": "auto", "window": 32, "sinks": 4}
    llm = LLM(speculative_config=spec, num_kv_blocks=256, max_model_len=256)
    kv = llm.engine.scheduler.policy.kv
    assert kv.target is not None and kv.draft is kv.target and kv.draft_view == 36
