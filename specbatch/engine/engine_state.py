"""What ``/metrics`` and the data-parallel router read from an engine: its counters and gauges at
one moment, from one ``LLMEngine`` or summed over data-parallel replicas."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specbatch.engine.metrics import EngineMetrics
from specbatch.request import SpecStats

if TYPE_CHECKING:
    from specbatch.engine.llm_engine import LLMEngine


@dataclass
class EngineState:
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    running: int = 0  # requests with a completion in the batch (n > 1 counted once)
    waiting: int = 0  # requests not yet in the batch
    completions_running: int = 0
    completions_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    draft_nodes: int | None = None  # with num_speculative_tokens=auto: the largest draft
    # a data-parallel replica's count of the states it published up to this one (0 elsewhere):
    # replies may arrive out of order, and a state only replaces one of a smaller count
    snapshot: int = 0

    @classmethod
    def of(cls, engine: LLMEngine, copy_metrics: bool = False) -> EngineState:
        """The engine's state now. ``copy_metrics``: a copy of its counters (taken on the
        engine's own thread), not the live object."""
        running, waiting = engine.num_requests()
        n_run, n_all = len(engine.scheduler.running), len(engine.scheduler.requests)
        metrics = copy.deepcopy(engine.metrics) if copy_metrics else engine.metrics
        auto = engine.config.speculative_config.auto
        policy = engine.scheduler.policy
        nodes = policy.shape.nodes if auto else None
        return cls(
            metrics=metrics,
            running=running,
            waiting=waiting,
            completions_running=n_run,
            completions_waiting=n_all - n_run,
            kv_blocks_total=engine.num_kv_blocks,
            kv_blocks_used=engine.num_kv_blocks - engine.num_free_kv_blocks,
            draft_nodes=nodes,
        )


def merge_metrics(parts: Iterable[EngineMetrics]) -> EngineMetrics:
    """The counters of several engines added up, as the first one's class (a subclass's own
    counters included); every field is a number, a ``SpecStats``, a ``Counter`` or a dict of
    figures each engine measured (any one's taken)."""
    parts = list(parts)
    total = type(parts[0])() if parts else EngineMetrics()
    for m in parts:
        for f in dataclasses.fields(total):
            mine, theirs = getattr(total, f.name), getattr(m, f.name)
            if isinstance(mine, SpecStats):
                mine.merge(theirs)
            elif isinstance(mine, dict):  # a Counter adds up; another dict takes any one's
                mine.update(theirs)
            else:
                setattr(total, f.name, mine + theirs)
    return total


def merge_states(states: Iterable[EngineState]) -> EngineState:
    """Several engines' states as one: counts and blocks summed."""
    states = list(states)
    nodes = [s.draft_nodes for s in states if s.draft_nodes is not None]
    return EngineState(
        metrics=merge_metrics(s.metrics for s in states),
        running=sum(s.running for s in states),
        waiting=sum(s.waiting for s in states),
        completions_running=sum(s.completions_running for s in states),
        completions_waiting=sum(s.completions_waiting for s in states),
        kv_blocks_total=sum(s.kv_blocks_total for s in states),
        kv_blocks_used=sum(s.kv_blocks_used for s in states),
        draft_nodes=max(nodes) if nodes else None,
    )
