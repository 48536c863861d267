"""Running the offline bench's cells: one alone, or several side by side a step at a time.

This machine's speed drifts by +-10% over seconds with no other process of its own running
(the same greedy cell, identical work, took 9.3 to 11.4 s of CPU time in ten runs: a shared
host's caches and memory). Cells of several draft lengths run one after another each see a
spell of their own, and their ratios carry that drift. Run side by side, they take turns on
the machine one engine step at a time, the engine with the least machine time so far going
next: every engine is then at the same point of its own timeline at any moment, and a slow
spell falls on all of them alike.

Each cell's figures are in its own time (``OwnClock``): the machine time its engine had, its
steps and its requests' submissions, with the other engines' turns left out. Throughput is
tokens over that time; a request's latencies are read on the same clock.
"""

from __future__ import annotations

import bisect
import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from specbatch.bench.cells import CellResult, latency_figures, spec_figures
from specbatch.bench.drafts import Draft
from specbatch.bench.workload import Workload
from specbatch.engine.llm_engine import LLMEngine
from specbatch.engine.metrics import EngineMetrics
from specbatch.errors import InvalidInputError
from specbatch.outputs import RequestMetrics
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import SchedulerOutput, StepResult


@dataclass
class PassCounts(EngineMetrics):
    """The engine's counters, and the rows of the target's passes and the number of the
    drafter's passes (``StepResult.passes``)."""

    target_rows: int = 0
    draft_passes: int = 0

    def on_step(self, plan: SchedulerOutput, result: StepResult, step_time: float) -> None:
        super().on_step(plan, result, step_time)
        for model, rows, _ in result.passes:
            if model == "target":
                self.target_rows += rows
            else:
                self.draft_passes += 1


def engine_draft(engine: LLMEngine) -> Draft:
    """What an engine drafts: ``auto``, or its fixed shape (``DraftShape()``: nothing)."""
    return "auto" if engine.config.adaptive_speculation else engine.config.draft_shape


class OwnClock:
    """The machine time one engine has had: the sum of its turns. ``own(t)`` reads a
    ``time.monotonic()`` stamp taken during one of its turns on this clock."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._starts: list[float] = []  # each turn's start, wall clock
        self._turns: list[tuple[float, float]] = []  # (wall end, own time at its start)

    @contextmanager
    def turn(self) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            end = time.monotonic()
            self._starts.append(start)
            self._turns.append((end, self.seconds))
            self.seconds += end - start

    def own(self, t: float) -> float:
        i = bisect.bisect_right(self._starts, t) - 1
        if i < 0:
            return 0.0
        end, before = self._turns[i]
        return before + min(t, end) - self._starts[i]

    def metrics(self, m: RequestMetrics) -> RequestMetrics:
        """A request's metrics with its times on this clock."""

        def own(t: float | None) -> float | None:
            return None if t is None else self.own(t)

        return replace(
            m,
            arrival_time=self.own(m.arrival_time),
            first_scheduled_time=own(m.first_scheduled_time),
            first_token_time=own(m.first_token_time),
            last_token_time=own(m.last_token_time),
            finished_time=own(m.finished_time),
        )


class CellRun:
    """One cell in progress: ``batch_size`` requests kept running, each finished one replaced
    by the next prompt, until ``num_requests`` have finished. ``advance`` runs one engine step
    (and the submissions it frees room for) as a turn on the cell's clock."""

    def __init__(
        self,
        engine: LLMEngine,
        workload: Workload,
        batch_size: int,
        num_requests: int,
        params: SamplingParams,
        *,
        on_finished: Callable[[], None] | None = None,
        first_prompt: int = 0,
    ) -> None:
        if batch_size < 1 or num_requests < 1:
            raise InvalidInputError("batch sizes and request counts must be >= 1")
        self.engine = engine
        self.workload = workload
        self.batch_size = batch_size
        self.num_requests = num_requests
        self.params = params
        self.on_finished = on_finished
        self.first_prompt = first_prompt
        self.clock = OwnClock()
        self.submitted = 0
        self.finished: list[Any] = []
        self.live: set[str] = set()
        # (own seconds, tokens generated) when the last request came in
        self.full_batch: tuple[float, int] | None = None
        engine.metrics = PassCounts()
        with self.clock.turn():
            for _ in range(min(batch_size, num_requests)):
                self._submit()

    @property
    def done(self) -> bool:
        return not self.live

    def _submit(self) -> None:
        i = self.first_prompt + self.submitted
        rid = self.engine.add_request(self.workload.prompt(i), self.workload.params(i, self.params))
        self.live.add(rid)
        self.submitted += 1

    def advance(self) -> None:
        with self.clock.turn():
            for out in self.engine.step():
                if not (out.finished and out.request_id in self.live):
                    continue
                self.live.discard(out.request_id)
                self.finished.append(out)
                if self.on_finished is not None:
                    self.on_finished()
                if self.submitted < self.num_requests:
                    self._submit()
                    if self.submitted == self.num_requests:
                        self.full_batch = (
                            self.clock.own(time.monotonic()),
                            self.engine.metrics.num_generated_tokens,
                        )

    def abort(self) -> None:
        self.engine.abort_request(list(self.live))
        self.live.clear()

    def result(self) -> CellResult:
        wall = self.clock.seconds
        m = self.engine.metrics
        assert isinstance(m, PassCounts)
        s = m.spec
        timed = [self.clock.metrics(o.metrics) for o in self.finished]
        latencies = {
            "tpot": [t for r in timed if (t := r.time_per_output_token) is not None],
            "ttft": [t for r in timed if (t := r.time_to_first_token) is not None],
            "e2e": [t for r in timed if (t := r.e2e_latency) is not None],
        }
        out_tokens = sum(len(o.outputs[0].token_ids) for o in self.finished)
        steps = max(m.num_steps, 1)
        full = self.full_batch
        draft = engine_draft(self.engine)
        return CellResult(
            batch_size=self.batch_size,
            draft=draft,
            num_requests=len(self.finished),
            input_len=self.workload.input_len,
            output_len=self.workload.output_len,
            wall_s=wall,
            output_tokens=out_tokens,
            engine_generated_tokens=m.num_generated_tokens,
            steps=m.num_steps,
            output_tok_s=out_tokens / wall if wall > 0 else 0.0,
            full_batch_tok_s=full[1] / full[0] if full and full[0] else None,
            **latency_figures(latencies),  # type: ignore[arg-type]
            latencies=latencies,
            step_s=m.step_time_total / steps,
            target_s_per_step=m.target_time_total / steps,
            draft_s_per_step=m.draft_time_total / steps,
            target_rows_per_step=m.target_rows / steps,
            draft_passes_per_step=m.draft_passes / steps,
            **spec_figures(s, draft),
            spec=copy.deepcopy(s),
        )


def run_side_by_side(runs: Sequence[CellRun]) -> list[CellResult]:
    """Step the cells in turns until all are done, the one with the least machine time so far
    next (ties: the earlier in ``runs``). On an error every cell's requests are aborted."""
    try:
        live = [r for r in runs if not r.done]
        while live:
            min(live, key=lambda r: r.clock.seconds).advance()
            live = [r for r in live if not r.done]
    except BaseException:
        for r in runs:
            r.abort()
        raise
    return [r.result() for r in runs]


def run_cell(
    engine: LLMEngine,
    workload: Workload,
    batch_size: int,
    num_requests: int,
    params: SamplingParams,
    *,
    on_finished: Callable[[], None] | None = None,
    first_prompt: int = 0,
) -> CellResult:
    """One cell alone: ``batch_size`` requests kept running until ``num_requests`` finished."""
    run = CellRun(
        engine,
        workload,
        batch_size,
        num_requests,
        params,
        on_finished=on_finished,
        first_prompt=first_prompt,
    )
    return run_side_by_side([run])[0]
