"""The data-parallel router: each request to the replica with the fewest outstanding tokens,
counting what was sent to a replica since its last report (no Ray here)."""

from __future__ import annotations

import pytest

from specbatch.engine.dp_replica import ReplicaRequest, token_budget
from specbatch.engine.dp_router import Router
from specbatch.sampling_params import SamplingParams


def test_a_new_request_goes_to_the_least_loaded_replica() -> None:
    router = Router(3)
    router.update(0, applied_seq=4, outstanding_tokens=900)
    router.update(1, applied_seq=2, outstanding_tokens=300)
    router.update(2, applied_seq=7, outstanding_tokens=500)
    assert router.choose() == 1
    router.sent(1, seq=3, tokens=250)  # not yet reported by replica 1: 550 now
    assert router.load(1) == 550
    assert router.choose() == 2
    router.sent(2, seq=8, tokens=100)
    assert router.choose() == 1  # 550 < 600
    # replica 1's next report includes message 3 (and its own progress): no double count
    router.update(1, applied_seq=3, outstanding_tokens=200)
    assert router.load(1) == 200 and router.choose() == 1
    assert router.choose(among=[0, 2]) == 2


def test_a_burst_spreads_before_any_report_and_ties_go_low() -> None:
    router = Router(2)
    picks = []
    for seq in range(1, 7):
        i = router.choose()
        picks.append(i)
        router.sent(i, seq, tokens=100)
    assert picks == [0, 1, 0, 1, 0, 1]


def test_a_report_older_than_one_seen_is_ignored() -> None:
    router = Router(2)
    router.sent(0, 1, 40)
    router.sent(0, 2, 40)
    router.update(0, applied_seq=2, outstanding_tokens=50)
    router.update(0, applied_seq=1, outstanding_tokens=999)  # arrived late
    assert router.load(0) == 50


def test_a_removed_replica_gets_nothing() -> None:
    router = Router(2)
    router.update(0, applied_seq=0, outstanding_tokens=0)
    router.update(1, applied_seq=0, outstanding_tokens=10_000)
    router.remove(0)
    assert router.choose() == 1
    router.remove(1)
    with pytest.raises(LookupError):
        router.choose()


def test_token_budget_counts_the_prompt_and_every_completion() -> None:
    def req(n_prompt: int, **kw: object) -> ReplicaRequest:
        return ReplicaRequest("r", None, list(range(n_prompt)), SamplingParams(**kw))

    assert token_budget(req(10, max_tokens=20), max_model_len=100) == 30
    assert token_budget(req(10, max_tokens=20, n=3), max_model_len=100) == 70
    assert token_budget(req(90, max_tokens=20), max_model_len=100) == 100  # the context caps it
    assert token_budget(req(10, max_tokens=None), max_model_len=100) == 100
