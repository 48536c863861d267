"""The bench's cells run side by side (bench/cell_run.py): each on its own clock, in fair turns,
with the outputs of a cell run alone, and no KV block left behind when one of them fails; each
cell's engine drafts what the cell asks for (bench/engines.py), its passes counted."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from specbatch.bench import cell_run
from specbatch.bench.bench_config import BenchConfig
from specbatch.bench.cell_run import CellRun, OwnClock, PassCounts, run_cell, run_side_by_side
from specbatch.bench.engines import build_engine, share_weights
from specbatch.bench.workload import Workload
from specbatch.draft_shape import DraftShape
from specbatch.engine.llm_engine import LLMEngine
from specbatch.outputs import RequestMetrics
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.draft_controller import DraftController
from specbatch.scheduler.output import (
    RequestStepResult,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_own_clock_counts_only_its_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(cell_run, "time", fake)
    clock = OwnClock()
    with clock.turn():
        fake.now += 2.0  # a turn of 2 s: 100 .. 102
    fake.now += 50.0  # other engines' turns
    with clock.turn():
        fake.now += 1.0
        stamp = fake.now  # 1 s into its second turn: own time 3 s
        fake.now += 3.0  # 152 .. 156
    fake.now += 7.0
    assert clock.seconds == pytest.approx(6.0)
    assert clock.own(101.0) == pytest.approx(1.0)
    assert clock.own(stamp) == pytest.approx(3.0)
    assert clock.own(130.0) == pytest.approx(2.0)  # between turns: the end of the last one
    assert clock.own(99.0) == 0.0
    m = RequestMetrics(100.5, 101.0, 101.5, 153.0, 156.0, 4, 5, 0)
    own = clock.metrics(m)
    assert (own.arrival_time, own.first_token_time, own.finished_time) == (0.5, 1.5, 6.0)
    assert own.time_per_output_token == pytest.approx((3.0 - 1.5) / 4)
    assert own.e2e_latency == pytest.approx(5.5)


@pytest.fixture(scope="module")
def engines(make_checkpoint: Callable[..., Path]) -> dict[int, LLMEngine]:
    cfg = BenchConfig(
        model=str(make_checkpoint("llama", num_layers=2, seed=0)),
        draft_model=str(make_checkpoint("llama", num_layers=1, seed=1)),
        draft_lengths=[0, 2],
        input_len=6,
        output_len=GREEDY.max_tokens or 0,
        output_len_spread=0.0,
        engine_kwargs={"device": "cpu"},
    )
    built = {k: build_engine(cfg, DraftShape.chain(k), 4) for k in (0, 2)}
    yield built
    for e in built.values():
        e.shutdown()


def _workload(n: int) -> Workload:
    prompts = [[(7 * i + j) % 200 + 3 for j in range(6)] for i in range(n)]
    return Workload(prompts, input_len=6, output_len=7, source="test")


def _outputs(run: CellRun) -> dict[tuple[int, ...], list[int]]:
    return {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in run.finished}


def test_side_by_side_gives_each_cell_its_own_time_in_fair_turns(
    engines: dict[int, LLMEngine],
) -> None:
    workload = _workload(10)
    alone = {}
    for k, e in engines.items():
        run = CellRun(e, workload, 3, 10, GREEDY)
        run_side_by_side([run])
        alone[k] = _outputs(run)

    def pointers(e: LLMEngine) -> list[int]:
        model = e.executor.worker.target.model
        packed = [m.packed.panels for m in model.modules() if getattr(m, "packed", None)]
        return [t.data_ptr() for t in (*model.parameters(), *packed)]

    assert pointers(engines[0])[0] != pointers(engines[2])[0]  # each engine loaded its own
    share_weights(list(engines.values()))
    assert pointers(engines[2]) == pointers(engines[0])

    start = cell_run.time.monotonic()  # the runs' first turns submit their first requests
    runs = [CellRun(e, workload, 3, 10, GREEDY) for e in engines.values()]
    gaps: list[float] = []  # after every turn: how far apart the live cells' clocks are
    longest = 0.0
    for run in runs:
        advance = run.advance

        def timed(advance: Callable[[], None] = advance) -> None:
            nonlocal longest
            before = {id(r): r.clock.seconds for r in runs}
            advance()
            longest = max(longest, max(r.clock.seconds - before[id(r)] for r in runs))
            live = [r.clock.seconds for r in runs if not r.done]
            if len(live) == 2:
                gaps.append(max(live) - min(live))

        run.advance = timed  # type: ignore[method-assign]
    results = run_side_by_side(runs)
    elapsed = cell_run.time.monotonic() - start

    for k, run in zip(engines, runs, strict=True):
        assert _outputs(run) == alone[k]  # the same greedy tokens as alone, shared weights
    # the least-timed cell goes next: while both run, their clocks stay a turn apart at most
    assert gaps and max(gaps) <= longest + 1e-9
    # each cell's time is its own turns: together no more than the run took
    assert sum(r.wall_s for r in results) <= elapsed
    for r, run in zip(results, runs, strict=True):
        assert r.wall_s == run.clock.seconds > 0
        assert r.output_tok_s == pytest.approx(r.output_tokens / r.wall_s)
        assert r.num_requests == 10 and r.output_tokens == 10 * 7
        lat = r.latencies
        assert r.ttft_mean == pytest.approx(statistics.fmean(lat["ttft"]))
        assert r.e2e_mean == pytest.approx(statistics.fmean(lat["e2e"]))
        for ttft, tpot, e2e in zip(lat["ttft"], lat["tpot"], lat["e2e"], strict=True):
            # on the cell's clock: the first token, six gaps of tpot, the end, within the cell
            assert ttft > 0 and ttft + 6 * tpot <= e2e * (1 + 1e-12) and e2e <= r.wall_s
        assert run.full_batch is not None
        assert r.full_batch_tok_s == run.full_batch[1] / run.full_batch[0]
    for e in engines.values():
        assert e.num_free_kv_blocks == e.num_kv_blocks


def test_a_failing_cell_aborts_every_cell_and_frees_their_blocks(
    engines: dict[int, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = _workload(8)
    failing = engines[2]
    step = failing.step
    calls = 0

    def breaks_on_the_fourth_step() -> list:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("worker lost")
        return step()

    monkeypatch.setattr(failing, "step", breaks_on_the_fourth_step)
    runs = [CellRun(e, workload, 4, 8, GREEDY) for e in engines.values()]
    with pytest.raises(RuntimeError, match="worker lost"):
        run_side_by_side(runs)
    for e in engines.values():
        assert not e.has_unfinished_requests()
        assert e.num_free_kv_blocks == e.num_kv_blocks
    monkeypatch.undo()
    assert run_cell(failing, workload, 2, 2, GREEDY).num_requests == 2  # usable again


def test_bench_rejects_an_unknown_interleave() -> None:
    from specbatch.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="interleave must be one of steps, cells"):
        BenchConfig(interleave="rounds").check()


def test_each_cell_engine_drafts_what_its_cell_asks(make_checkpoint: Callable[..., Path]) -> None:
    cfg = BenchConfig(
        model=str(make_checkpoint("llama", num_layers=2, seed=0)),
        draft_model=str(make_checkpoint("llama", num_layers=1, seed=1)),
        draft_lengths=[0, 3, "auto"],
        trees=[DraftShape(2, 2, 5)],
        tree_children="top",
        input_len=6,
        output_len=7,
        engine_kwargs={"device": "cpu", "attention_backend": "torch"},
    )
    assert cfg.auto_shape == DraftShape(3, 2, 5)
    built = {str(d): build_engine(cfg, d, 2) for d in cfg.drafts}
    try:
        assert list(built) == ["0", "3", "2x2/5", "auto"]
        assert not built["0"].config.speculative_config.speculative
        assert built["3"].config.speculative_config.shape == DraftShape.chain(3)
        tree = built["2x2/5"].config
        assert tree.speculative_config.shape == DraftShape(2, 2, 5)
        assert tree.speculative_config.tree_children == "top"
        auto = built["auto"]
        assert auto.config.speculative_config.auto
        assert isinstance(auto.scheduler.policy, DraftController)
        # auto's ladder holds trees of the grid's children per node, up to its deepest cell
        trees = [s for s in auto.scheduler.policy.shapes if not s.is_chain]
        assert trees and {s.topk for s in trees} == {2}
        assert max(s.depth for s in auto.scheduler.policy.shapes) == 3
        for d, e in zip(cfg.drafts, built.values(), strict=True):
            assert cell_run.engine_draft(e) == d
        run = run_cell(built["2x2/5"], _workload(4), 2, 4, GREEDY)
        assert run.draft == DraftShape(2, 2, 5) and run.spec_rounds > 0
        assert run.mean_draft_length is not None and run.mean_draft_length > 2  # a tree's nodes
    finally:
        for e in built.values():
            e.shutdown()


def test_pass_counts_count_rows_passes_and_a_tree_round_ending_at_a_leaf() -> None:
    tree = DraftShape(2, 2, 5)
    sr = ScheduledRequest("r", [7], 10, [7], 10, 5, True, [0], draft_shape=tree)
    plan = SchedulerOutput(requests=[sr])
    # the walk passed both levels and ended at a leaf: 2 accepted of 5 nodes, no rejection
    done = RequestStepResult([1, 2, 3], num_accepted=2, num_proposed=5, rejected=False)
    passes = [("draft", 1, 0.1), ("draft", 2, 0.1), ("target", 6, 0.3)]
    counts = PassCounts()
    counts.on_step(plan, StepResult({"r": done}, passes=passes), 0.5)
    assert (counts.target_rows, counts.draft_passes) == (6, 2)
    assert counts.spec.rejections == 0 and counts.spec.alpha == 1.0
    stopped = RequestStepResult([4], num_accepted=0, num_proposed=5, rejected=True)
    counts.on_step(plan, StepResult({"r": stopped}, passes=passes), 0.5)
    assert counts.spec.alpha == pytest.approx(2 / 3) and counts.target_rows == 12
