"""Offline load test: a closed-loop workload over a grid of batch sizes and drafts (draft
lengths, draft trees, auto: ``drafts.py``), set in ``bench_config.py``.

*Batch size* B is the number of requests running concurrently: B requests are added, and each
time one finishes a new one takes its place, until ``num_requests`` have finished (the engine is
kept full at B, which is what a server under load sees). Every request has the same prompt
length and generates exactly its output length (``ignore_eos``): ``output_len`` on average,
spread uniformly by ``output_len_spread`` (``spread_output_lengths``; 0: all the same).

Engines: one per draft (plain for 0, ``auto`` up to the grid's deepest draft and, when it has
trees, with trees in its ladder), all up for the whole run and sharing the checkpoints' weights
(engines.py). The cells of one batch size run in rounds, one cell of each draft a round, so
speedups compare figures
taken side by side: by default (``interleave="steps"``) a round's cells run together, taking
turns on the machine one engine step at a time, each figure in its engine's own time
(cell_run.py), so that the machine's drift between and within cells falls on every draft
length alike; with ``interleave="cells"`` they run one after another, each alone on the
machine, in an order rotated from round to round (``rotated``).
Before each cell a warm-up of ``min(B, 4)`` short requests runs, then the engine's counters are
reset, so warm-up is excluded from every figure. Each repeat of a cell (``repeats``) runs the
next ``num_requests`` prompts, the same for every draft length: greedy decoding replays a
prompt's output exactly, so repeats over the same few prompts would average the machine's noise
but not the prompts', and at small batch sizes a cell holds only eight.

Per cell, next to the measured figures, THEORY.md's prediction from measured values:

* ``alpha``: the engine's per-draft acceptance probability, accepted / (accepted + rejections);
  for a tree, the chance that its walk passes a level (a round ends at a rejection, or at a
  leaf without one);
* ``c``: the draft/target cost ratio at this batch size, the draft's time per draft pass in the
  speculative cell (draft time / (steps x passes), passes being k for a chain, the depth for a
  tree, what auto's steps ran) over the target's time per step in the plain cell at the same B
  (so it needs the k = 0 cell in the grid);
* predicted speedup ``S = (1 - a^(g+1)) / ((1 - a)(g c + 1))`` with g the mean draft length
  actually proposed (a tree: its depth, alpha then being the chance its walk passes a level),
  next to the measured speedup (output tokens/s over that of the plain cell at the same B);
  none for auto, whose shapes vary. THEORY's model assumes a verify pass costs what a plain
  step does; the gap
  between the two grows with B, where the verify pass becomes compute-bound: ``verify_ratio``
  (the target's time per speculative step over its time per plain step) shows by how much, and
  ``predicted_speedup_with_verify`` = E / (g c + verify_ratio) puts it back into the formula;
  ``target_rows_per_step`` (prompts, decodes and every verified draft) says what that pass
  carried.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from specbatch.bench.agentic_workload import agentic_workload
from specbatch.bench.auto_vs_fixed import auto_vs_fixed
from specbatch.bench.bench_config import BenchConfig
from specbatch.bench.cell_run import CellRun, run_cell, run_side_by_side
from specbatch.bench.cells import CellResult, compare_with_plain, crossover, pool_runs
from specbatch.bench.drafts import Draft, order
from specbatch.bench.engines import build_engine, share_weights
from specbatch.bench.machine import machine_facts
from specbatch.bench.workload import (
    build_workload,
    shared_prefix,
    spread_output_lengths,
    with_shared_prefix,
)
from specbatch.bench.workload import mixed as mixed_workload
from specbatch.engine.data_parallel import DataParallelEngine
from specbatch.engine.llm_engine import LLMEngine
from specbatch.sampling_params import SamplingParams

WARMUP_REQUESTS = 4
WARMUP_TOKENS = 8


def rotated(drafts: list[Draft], r: int) -> list[Draft]:
    """Round ``r``'s order of the drafts: the grid's order started at its ``r``-th, so that
    over the rounds each runs early and late in a round alike (the machine's speed drifts
    within a round, and a draft always run last would carry that drift)."""
    i = r % len(drafts)
    return drafts[i:] + drafts[:i]


@dataclass
class BenchResult:
    config: dict[str, Any]
    workload_source: str
    cells: list[CellResult]
    summary: dict[str, Any]
    machine: dict[str, Any]
    wall_s: float


def run_bench(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    """Run every cell of the grid: batch sizes x drafts."""
    cfg.check()
    t0 = time.perf_counter()
    sizes = sorted(set(cfg.batch_sizes))
    drafts = cfg.drafts
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=cfg.temperature, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    total = sum(cfg.requests_for(b) for b in sizes) * len(drafts) * cfg.repeats
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True)
    cells: list[CellResult] = []
    source = ""
    # data-parallel replicas step on their own, so cells cannot take turns: one after another
    data_parallel = int(cfg.engine_kwargs.get("data_parallel_size") or 1) > 1
    # One engine per draft, all up for the whole run, so that the cells of a round can run side
    # by side. The auto cell's controller lives as long as its engine, as in a server: it
    # learns in its first cells and keeps learning from every later auto cell.
    engines: dict[Draft, LLMEngine | DataParallelEngine] = {}
    try:
        for d in drafts:
            engines[d] = build_engine(cfg, d, max(sizes))
        share_weights(list(engines.values()))
        # every repeat of a cell runs prompts of its own (see the module's docstring)
        num_prompts = max(64, WARMUP_REQUESTS + cfg.repeats * max(map(cfg.requests_for, sizes)))
        if cfg.workload == "agentic":
            workload = agentic_workload(engines[drafts[0]].tokenizer, cfg.input_len,
                                        cfg.output_len, num_prompts, cfg.seed)  # fmt: skip
        else:
            workload = build_workload(
                engines[drafts[0]],
                input_len=cfg.input_len,
                output_len=cfg.output_len,
                num_prompts=num_prompts,
                prompts_file=cfg.prompts,
                seed=cfg.seed,
                grounded=cfg.workload == "grounded",
            )
        if cfg.mixed is not None:
            workload = mixed_workload(workload, engines[drafts[0]].tokenizer, cfg.mixed)
        prefix = shared_prefix(engines[drafts[0]], cfg.shared_prefix_len, cfg.seed)
        workload = with_shared_prefix(workload, prefix)
        workload = spread_output_lengths(workload, cfg.output_len_spread, cfg.seed)
        source = workload.source
        on_finished = bar.update if bar is not None else None
        for b in sizes:
            runs: dict[Draft, list[CellResult]] = {d: [] for d in drafts}
            n = cfg.requests_for(b)
            for r in range(cfg.repeats):  # rounds over the drafts, interleaved
                round_order = rotated(drafts, r)
                if bar is not None:
                    bar.set_description(f"bench B={b} round {r + 1}/{cfg.repeats}")
                first = WARMUP_REQUESTS + r * n
                if cfg.interleave == "steps" and not data_parallel:
                    for d in round_order:
                        run_cell(engines[d], workload, b, min(b, WARMUP_REQUESTS), warm)
                    cell_runs = [
                        CellRun(
                            engines[d],
                            workload,
                            b,
                            n,
                            params,
                            first_prompt=first,
                            on_finished=on_finished,
                        )
                        for d in round_order
                    ]
                    results = run_side_by_side(cell_runs)
                else:
                    results = []
                    for d in round_order:
                        run_cell(engines[d], workload, b, min(b, WARMUP_REQUESTS), warm)
                        results.append(
                            run_cell(
                                engines[d],
                                workload,
                                b,
                                n,
                                params,
                                first_prompt=first,
                                on_finished=on_finished,
                            )
                        )
                for d, cell in zip(round_order, results, strict=True):
                    runs[d].append(cell)
            cells.extend(pool_runs(runs[d]) for d in drafts)
    finally:
        for engine in engines.values():
            engine.shutdown()
        if bar is not None:
            bar.close()
    cells.sort(key=lambda c: (c.batch_size, order(c.draft)))
    compare_with_plain(cells)
    config = asdict(cfg)
    config["trees"] = [str(t) for t in cfg.trees]
    config["auto_shape"] = str(cfg.auto_shape) if "auto" in drafts else None
    config["num_requests_per_cell"] = {str(b): cfg.requests_for(b) for b in sizes}
    config["warmup"] = f"{WARMUP_REQUESTS} requests of {WARMUP_TOKENS} tokens before each cell"
    return BenchResult(
        config=config,
        workload_source=source,
        cells=cells,
        summary=crossover(cells)
        | ({"auto_vs_fixed": auto_vs_fixed(cells)} if "auto" in engines else {}),
        machine=machine_facts(),
        wall_s=time.perf_counter() - t0,
    )
