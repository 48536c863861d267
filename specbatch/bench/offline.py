"""Offline load test: a closed-loop workload over a grid of batch sizes and drafts (draft
lengths, draft trees, auto: ``drafts.py``).

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

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from specbatch.bench.auto_vs_fixed import auto_vs_fixed
from specbatch.bench.cell_run import CellRun, run_cell, run_side_by_side
from specbatch.bench.cells import CellResult, compare_with_plain, crossover, pool_runs
from specbatch.bench.drafts import Draft, auto_shape, order, tree_problem
from specbatch.bench.engines import build_engine, share_weights
from specbatch.bench.workload import (
    WORKLOADS,
    build_workload,
    shared_prefix,
    spread_output_lengths,
    with_shared_prefix,
)
from specbatch.bench.workload import mixed as mixed_workload
from specbatch.draft_shape import DraftShape
from specbatch.engine.data_parallel import DataParallelEngine
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import InvalidInputError
from specbatch.options import check_options, option, same_as
from specbatch.sampling_params import SamplingParams
from specbatch.speculative_config import SpeculativeConfig

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_DRAFT_LENGTHS = (0, 1, 2, 4, 8)
DEFAULT_INPUT_LEN = 64
DEFAULT_OUTPUT_LEN = 64
DEFAULT_OUTPUT_LEN_SPREAD = 0.5
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 8
INTERLEAVE = ("steps", "cells")


def rotated(drafts: list[Draft], r: int) -> list[Draft]:
    """Round ``r``'s order of the drafts: the grid's order started at its ``r``-th, so that
    over the rounds each runs early and late in a round alike (the machine's speed drifts
    within a round, and a draft always run last would carry that drift)."""
    i = r % len(drafts)
    return drafts[i:] + drafts[:i]


def default_num_requests(batch_size: int) -> int:
    """Requests measured per cell: four batches' worth, so that the engine runs full for most
    of the cell, and few enough that the default grid finishes in minutes on a CPU. A cell
    ends in a drain (nothing left to admit, the batch thinning as its last requests finish)
    that lasts about as long whatever the cell's size: with two batches' worth it was a
    large part of a small batch's cell, and a cell measured how the last requests
    finished as much as the batch size's throughput."""
    return max(4 * batch_size, 16)


# ---- the grid ------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    model: str | None = None  # None: the built-in pair
    draft_model: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_BATCH_SIZES))
    # chains of k drafts (0: plain decoding), or "auto"
    draft_lengths: list[int | Literal["auto"]] = field(
        default_factory=lambda: list(DEFAULT_DRAFT_LENGTHS)
    )
    trees: list[DraftShape] = field(default_factory=list)  # draft trees, cells beside them
    # fmt: off
    tree_children: str = same_as(SpeculativeConfig, "tree_children", flag=True)
    input_len: int = option(DEFAULT_INPUT_LEN, "prompt tokens per request", ge=1, metavar="N")
    shared_prefix_len: int = option(0, "every prompt starts with the same N tokens (a window "
        "of the held-out text), then its own --input-len tokens: the workload the prefix cache "
        "serves", ge=0, metavar="N")
    output_len: int = option(DEFAULT_OUTPUT_LEN, "output tokens per request, on average", ge=2,
        metavar="N")
    output_len_spread: float = option(DEFAULT_OUTPUT_LEN_SPREAD, "each prompt's output length "
        "uniform in --output-len x [1 - S, 1 + S], the same for every cell; 0: all exactly "
        "--output-len", ge=0, lt=1, metavar="S")
    num_requests: int | None = option(None, "requests measured per cell (default: max(4 B, "
        "16))", type=int, ge=1, metavar="N")
    prompts: str | None = option(None, "prompts file (.txt or .jsonl), each cut or repeated to "
        "--input-len tokens (default: the built-in pair's held-out stdlib text; random ids "
        "without a tokenizer)", type=Path, metavar="FILE")
    temperature: float = same_as(SamplingParams, "temperature", 0.0, help="sampling "
        "temperature, 0 = greedy")
    repeats: int = option(1, "run every cell N times, the cells of a batch size in interleaved "
        "rounds, and report each cell over all its runs: tokens/s as the output tokens over "
        "the time, both summed", ge=1, metavar="N")
    interleave: str = option("steps", "steps: a round's cells side by side, in turns of one "
        "engine step, each timed on its own clock (cell_run.py); cells: one after another, "
        "each alone on the machine (with --data-parallel-size above 1 always cells: replicas "
        "step on their own)", choices=INTERLEAVE)
    mixed: float | None = option(None, "the mixed workload (bench/workload.py): easy requests "
        "(repetitive code, greedy) in turn with hard ones (the prompts sampled at temperature "
        "T); --temperature is then unused", type=float, metavar="T")
    workload: str = option("heldout", "heldout: windows of the built-in pair's held-out stdlib "
        "files; grounded: each a held-out function followed by its first lines again, so "
        "outputs copy spans of the prompt (what n-gram drafting is for; give --input-len 256 "
        "or so)", choices=WORKLOADS)
    # fmt: on
    seed: int = 0
    # the drafter as speculative_config (its num_speculative_tokens comes from the grid);
    # None: ``draft_model``, or the built-in target's own drafter (its EAGLE head)
    speculative_config: dict[str, Any] | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # more EngineArgs fields

    def check(self) -> None:
        def bad(name: str, why: str) -> InvalidInputError:
            return InvalidInputError(f"{name} {why}", name)

        check_options(BenchConfig, self)
        if self.mixed is not None:  # checked as the temperature it becomes
            try:
                SamplingParams(temperature=self.mixed)
            except InvalidInputError as e:
                raise InvalidInputError(f"mixed: {e}", "mixed") from None
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise bad("batch_sizes", "must be integers >= 1")
        if not self.draft_lengths and not self.trees:
            raise bad("draft_lengths", "and trees are both empty: give at least one cell")
        for k in self.draft_lengths:
            if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
                raise bad("draft_lengths", f"must be integers >= 0 (or auto), got {k!r}")
        for tree in self.trees:
            problem = tree_problem(tree) if isinstance(tree, DraftShape) else None
            if not isinstance(tree, DraftShape) or problem is not None:
                raise bad("trees", problem or f"must be DraftShapes, got {tree!r}")
        drafter = self.draft_model is not None or self.speculative_config is not None
        if self.lookahead > 0 and self.model is not None and not drafter:
            raise bad(
                "draft_lengths",
                "above 0, auto and trees need a drafter (--draft-model or --speculative-config)",
            )

    @property
    def drafts(self) -> list[Draft]:
        """The grid's cells at each batch size, in order: plain and chains, trees, auto."""
        cells: set[Draft] = {k if k == "auto" else DraftShape.chain(k) for k in self.draft_lengths}
        return sorted(cells | set(self.trees), key=order)

    @property
    def auto_shape(self) -> DraftShape:
        """The auto cell's largest drafts (``drafts.auto_shape``)."""
        return auto_shape(self.drafts, SpeculativeConfig.max_draft_length)

    @property
    def lookahead(self) -> int:
        """Slots past a request's last token that any cell's drafts may take."""
        shapes = [d for d in self.drafts if isinstance(d, DraftShape)]
        if "auto" in self.drafts:
            shapes.append(self.auto_shape)
        return max(s.lookahead for s in shapes)

    @property
    def max_output_len(self) -> int:
        return math.ceil(self.output_len * (1 + self.output_len_spread))

    def requests_for(self, batch_size: int) -> int:
        return self.num_requests or default_num_requests(batch_size)


@dataclass
class BenchResult:
    config: dict[str, Any]
    workload_source: str
    cells: list[CellResult]
    summary: dict[str, Any]
    machine: dict[str, Any]
    wall_s: float


def machine_facts() -> dict[str, Any]:
    import os
    import platform

    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


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
        workload = build_workload(
            engines[drafts[0]],
            input_len=cfg.input_len,
            output_len=cfg.output_len,
            # every repeat of a cell runs prompts of its own (see the module's docstring)
            num_prompts=max(64, WARMUP_REQUESTS + cfg.repeats * max(map(cfg.requests_for, sizes))),
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
