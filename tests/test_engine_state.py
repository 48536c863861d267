"""Data-parallel replicas' counters and gauges summed into one (``engine_state.py``): every
counter of ``EngineMetrics`` and of a subclass counting more, and auto's pooled estimate."""

from __future__ import annotations

import dataclasses
from collections import Counter

from specbatch.bench.cell_run import PassCounts
from specbatch.engine.engine_state import EngineState, merge_metrics, merge_states
from specbatch.engine.metrics import EngineMetrics
from specbatch.request import SpecStats


def counters(seed: int) -> PassCounts:
    m = PassCounts()
    for i, f in enumerate(dataclasses.fields(m)):
        if f.type in ("int", "float"):
            setattr(m, f.name, seed * 10 + i)
    m.spec = SpecStats(rounds=seed, proposed=3 * seed, accepted=seed, rejections=1, emitted=2)
    m.draft_length_counts = Counter({0: seed, 3: 1})
    return m


def test_every_counter_is_summed_in_the_first_ones_class() -> None:
    a, b = counters(1), counters(2)
    total = merge_metrics([a, b])
    assert type(total) is PassCounts
    for f in dataclasses.fields(total):
        if f.type in ("int", "float"):
            assert getattr(total, f.name) == getattr(a, f.name) + getattr(b, f.name), f.name
    assert (total.spec.rounds, total.spec.proposed, total.spec.rejections) == (3, 9, 2)
    assert total.draft_length_counts == Counter({0: 3, 3: 2})
    assert (a.spec.rounds, a.draft_length_counts) == (1, Counter({0: 1, 3: 1}))  # untouched
    assert merge_metrics([]) == EngineMetrics()


def test_states_add_up() -> None:
    one = EngineState(running=2, waiting=1, kv_blocks_total=10, kv_blocks_used=4, draft_nodes=3)
    two = EngineState(running=1, kv_blocks_total=10, kv_blocks_used=1, draft_nodes=5)
    plain = EngineState(running=4, kv_blocks_total=8)
    total = merge_states([one, two, plain])
    assert (total.running, total.waiting, total.kv_blocks_total, total.kv_blocks_used) == (
        7,
        1,
        28,
        5,
    )
    assert total.draft_nodes == 5 and merge_states([plain]).draft_nodes is None


def test_a_replica_state_older_than_the_one_held_is_not_taken() -> None:
    """Replies may arrive out of order: a poll's reply read after a fresher ``stats`` one (the
    request it counted since aborted) must not bring its state back."""
    from specbatch.engine.data_parallel import DataParallelEngine

    dp = DataParallelEngine.__new__(DataParallelEngine)  # the bookkeeping alone, no replicas
    dp._states = [EngineState(snapshot=5)]
    dp._take_state(0, EngineState(running=1, kv_blocks_used=10, snapshot=4))
    assert (dp._states[0].running, dp._states[0].kv_blocks_used) == (0, 0)
    dp._take_state(0, EngineState(running=2, kv_blocks_used=3, snapshot=6))
    assert (dp._states[0].running, dp._states[0].kv_blocks_used) == (2, 3)
