"""Whether drafting pays, measured over stretches of steps (scheduler/drafting_trial.py): a
real ``DrafterLag`` driven as the scheduler drives it, steps whose seconds say what each
regime makes (output tokens a second while the drafter is awake and drafts, and while it
sleeps). No timing: every second here is made up."""

from __future__ import annotations

import pytest

from specbatch import SamplingParams
from specbatch.engine.async_engine import AsyncLLMEngine
from specbatch.engine.prometheus import ServerMetrics, parse_metrics
from specbatch.entrypoints.generate import speculation_summary
from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.scheduler.drafter_lag import DrafterLag
from specbatch.scheduler.drafting_trial import EPOCH, MARGIN, SETTLE, DraftingTrial, level
from tests.test_exactness import engine, pair  # noqa: F401


def requests(n: int) -> list[Request]:
    return [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=99), 256) for i in range(n)]


def drive(
    steps: int, drafting: float, plain: float, batch: int = 4, drafts: bool = True
) -> tuple[DraftingTrial, DrafterLag, float]:
    """``steps`` steps of ``batch`` requests making ``drafting`` tokens a second while the
    drafter is awake (drafting if ``drafts``) and ``plain`` while it sleeps; returns the trial,
    the lag and the share of the steps the drafter slept in the second half."""
    trial, lag, running = DraftingTrial(), DrafterLag(KVCacheManager(64, 16), "features"), []
    asleep_late = 0
    for i in range(steps):
        if i % 16 == 0:  # requests finish and others take their places
            running = requests(batch)
            for r in running:
                lag.admitted(r)
        lag.tick(len(running))
        rate = plain if lag.asleep else drafting
        asleep_late += lag.asleep and i >= steps // 2
        trial.step(lag, running, batch, 10, 10 / rate, drafted=drafts and not lag.asleep)
    return trial, lag, asleep_late / (steps - steps // 2)


def test_levels_double():
    assert [level(n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [0, 1, 1, 2, 2, 3, 3, 4]


def test_where_plain_decoding_makes_more_the_drafter_sleeps_and_is_tried_less_and_less():
    trial, _, asleep = drive(60 * EPOCH, drafting=900.0, plain=1000.0)
    assert asleep > 0.85
    lv = trial.levels[2]
    assert lv.plain and lv.interval >= 8


def test_where_drafting_makes_more_it_goes_on_and_is_tried_less_and_less():
    trial, _, asleep = drive(60 * EPOCH, drafting=1100.0, plain=1000.0)
    assert asleep < 0.15
    lv = trial.levels[2]
    assert not lv.plain and lv.interval >= 8


def test_drafting_ahead_within_the_margin_does_not_go_on():
    trial, _, asleep = drive(30 * EPOCH, drafting=1000.0 * (1 + MARGIN / 2), plain=1000.0)
    assert trial.levels[2].plain and asleep > 0.8


def test_drafting_ahead_by_more_than_the_margin_goes_on():
    trial, _, asleep = drive(30 * EPOCH, drafting=1000.0 * (1 + 2 * MARGIN), plain=1000.0)
    assert not trial.levels[2].plain and asleep < 0.2


def test_one_request_is_never_tried():
    trial, lag, asleep = drive(20 * EPOCH, drafting=500.0, plain=1000.0, batch=1)
    assert asleep == 0 and not trial.levels and not lag.asleep


def test_no_trial_while_the_controller_itself_drafts_nothing():
    trial, _, asleep = drive(20 * EPOCH, drafting=900.0, plain=1000.0, drafts=False)
    assert asleep == 0 and not trial.trial and not any(lv.plain for lv in trial.levels.values())


def test_a_trial_ends_when_the_batch_leaves_its_level():
    trial, lag = DraftingTrial(), DrafterLag(KVCacheManager(64, 16), "features")
    four = requests(4)
    for _ in range(SETTLE + EPOCH):  # a drafting stretch at 4 requests starts a trial
        trial.step(lag, four, 4, 10, 0.01, drafted=True)
    assert trial.trial and lag.asleep and all(r.drafter_off for r in four)
    eight = requests(8)
    trial.step(lag, eight, 8, 10, 0.01, drafted=False)
    assert not trial.trial and not lag.asleep


def test_back_at_a_level_where_plain_decoding_won_the_drafter_sleeps_at_once():
    trial, lag, _ = drive(8 * EPOCH, drafting=900.0, plain=1000.0)
    assert trial.levels[2].plain
    trial.step(lag, requests(8), 8, 10, 0.01, drafted=False)  # a larger batch: awake again
    assert not lag.asleep
    four = requests(4)
    trial.step(lag, four, 4, 10, 0.01, drafted=True)
    assert lag.asleep and trial.hold and all(r.drafter_off for r in four)


def test_generate_and_metrics_say_what_the_trials_measured(pair):  # noqa: F811
    """With auto, the engine's trial figures reach generate's closing line and ``/metrics``;
    a fixed draft length has no trial."""
    llm = engine(pair, "auto", max_draft_length=3)
    trial = llm.engine.trial
    lag = llm.engine.scheduler.lag
    four = requests(4)
    for i in range(SETTLE + EPOCH + SETTLE + EPOCH):  # a drafting stretch, then a plain one
        trial.step(lag, four, 4, 9 if i < SETTLE + EPOCH else 10, 0.01, drafted=not lag.asleep)
    assert llm.engine.metrics.summary()["measured"] == {"4-7": pytest.approx((900.0, 1000.0))}
    line = speculation_summary(llm.engine.metrics)
    assert "measured at batch 4-7: drafting made 0.90x plain decoding's tokens/s" in line
    page = parse_metrics(ServerMetrics(AsyncLLMEngine(llm.engine), "m").render())
    assert page['specbatch:spec_decode_measured_speedup{batch="4-7"}'] == pytest.approx(0.9)
    assert engine(pair, 3).engine.trial is None
