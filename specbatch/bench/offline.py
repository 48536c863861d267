"""Offline load test: a closed-loop workload over a grid of batch sizes and draft lengths.

*Batch size* B is the number of requests running concurrently: B requests are added, and each
time one finishes a new one takes its place, until ``num_requests`` have finished (the engine is
kept full at B, which is what a server under load sees). Every request has the same prompt
length and generates exactly its output length (``ignore_eos``): ``output_len`` on average,
spread uniformly by ``output_len_spread`` (``spread_output_lengths``; 0: all the same).

Engines: one per draft length (plain for 0, ``auto`` up to the grid's largest length), all up
for the whole run and sharing the checkpoints' weights (``share_weights``). The cells of one
batch size run in rounds, one cell of each draft length a round, so speedups compare figures
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
* ``c``: the draft/target cost ratio at this batch size, the draft's time per draft pass in the
  speculative cell (draft time / (steps x k)) over the target's time per step in the plain cell
  at the same B (so it needs the k = 0 cell in the grid);
* predicted speedup ``S = (1 - a^(g+1)) / ((1 - a)(g c + 1))`` with g the mean draft length
  actually proposed, next to the measured speedup (output tokens/s over that of the plain cell
  at the same B). THEORY's model assumes a verify pass costs what a plain step does; the gap
  between the two grows with B, where the verify pass becomes compute-bound: ``verify_ratio``
  (the target's time per speculative step over its time per plain step) shows by how much, and
  ``predicted_speedup_with_verify`` = E / (g c + verify_ratio) puts it back into the formula.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specbatch.bench.auto_vs_fixed import auto_vs_fixed
from specbatch.bench.cell_run import CellRun, run_cell, run_side_by_side
from specbatch.bench.cells import (
    AUTO,
    CellResult,
    compare_with_plain,
    crossover,
    pool_runs,
)
from specbatch.bench.workload import (
    WORKLOADS,
    build_workload,
    mixed,
    shared_prefix,
    spread_output_lengths,
    with_shared_prefix,
)
from specbatch.config import DEFAULT_MAX_DRAFT_LENGTH, EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import InvalidInputError
from specbatch.sampling_params import SamplingParams

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_DRAFT_LENGTHS = (0, 1, 2, 4, 8)
DEFAULT_INPUT_LEN = 64
DEFAULT_OUTPUT_LEN = 64
DEFAULT_OUTPUT_LEN_SPREAD = 0.5
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 8
INTERLEAVE = ("steps", "cells")


def draft_length_arg(value: str) -> int:
    """``--draft-lengths``: an integer, or ``auto`` (as ``AUTO``)."""
    if value == "auto":
        return AUTO
    try:
        return int(value)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def rotated(lengths: list[int], r: int) -> list[int]:
    """Round ``r``'s order of the draft lengths: the grid's order started at its ``r``-th, so
    that over the rounds each length runs early and late in a round alike (the machine's
    speed drifts within a round, and a length always run last would carry that drift)."""
    i = r % len(lengths)
    return lengths[i:] + lengths[:i]


def draft_length_order(k: int) -> float:
    """Sort key: fixed draft lengths ascending, then the auto row."""
    return math.inf if k == AUTO else k


def draft_length_label(k: int) -> str:
    return "auto" if k == AUTO else str(k)


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
    draft_lengths: list[int] = field(default_factory=lambda: list(DEFAULT_DRAFT_LENGTHS))
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    # each prompt's output length uniform in output_len * [1 - spread, 1 + spread]
    output_len_spread: float = DEFAULT_OUTPUT_LEN_SPREAD
    num_requests: int | None = None  # per cell; None: default_num_requests(B)
    prompts_file: str | None = None
    temperature: float = 0.0
    repeats: int = 1  # runs of each cell, in rounds; the cell is reported over all of them
    # None: every request at ``temperature``; a float: the mixed workload (bench/workload.py),
    # easy greedy requests in turn with hard ones sampled at this temperature
    mixed_hard_temperature: float | None = None
    seed: int = 0
    # "steps": a round's cells side by side, a step at a time (cell_run.py); "cells": one
    # after another, each engine alone on the machine
    interleave: str = "steps"
    # the drafter as speculative_config (its num_speculative_tokens comes from the grid);
    # None: ``draft_model``, or the built-in target's own drafter (its EAGLE head)
    speculative_config: dict[str, Any] | None = None
    workload: str = "heldout"  # "heldout" stdlib windows, or "grounded" (bench/workload.py)
    shared_prefix_len: int = 0  # tokens every prompt starts with, before its input_len own
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # more EngineArgs fields

    def check(self) -> None:
        def bad(name: str, why: str) -> InvalidInputError:
            return InvalidInputError(f"{name} {why}")

        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise bad("batch_sizes", "must be integers >= 1")
        if not self.draft_lengths or any(k < 0 and k != AUTO for k in self.draft_lengths):
            raise bad("draft_lengths", "must be integers >= 0 (or auto)")
        if self.input_len < 1 or self.output_len < 2:
            raise bad("input_len", "must be >= 1 (and output_len >= 2)")
        if not 0 <= self.output_len_spread < 1:
            raise bad("output_len_spread", f"must be in [0, 1), got {self.output_len_spread}")
        if self.shared_prefix_len < 0:
            raise bad("shared_prefix_len", f"must be >= 0, got {self.shared_prefix_len}")
        if self.num_requests is not None and self.num_requests < 1:
            raise bad("num_requests", "must be >= 1")
        if self.repeats < 1:
            raise bad("repeats", "must be >= 1")
        if self.interleave not in INTERLEAVE:
            choices = ", ".join(INTERLEAVE)
            raise bad("interleave", f"must be one of {choices}, got {self.interleave!r}")
        if self.workload not in WORKLOADS:
            raise bad("workload", f"must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        drafter = self.draft_model is not None or self.speculative_config is not None
        if self.max_draft_length > 0 and self.model is not None and not drafter:
            raise bad(
                "draft_lengths", "above 0 need a drafter (--draft-model or --speculative-config)"
            )

    @property
    def max_draft_length(self) -> int:
        """The speculative engine's draft length: the largest k, else the auto row's default."""
        fixed = max(self.draft_lengths)
        return fixed if fixed > 0 or AUTO not in self.draft_lengths else DEFAULT_MAX_DRAFT_LENGTH

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


def _engine(cfg: BenchConfig, k: int, max_seqs: int) -> LLMEngine:
    """The engine of draft length ``k``: plain for 0, ``auto`` up to the grid's largest."""
    model_len = (
        cfg.shared_prefix_len + cfg.input_len + cfg.max_output_len + cfg.max_draft_length + 2
    )
    kwargs: dict[str, Any] = {"max_model_len": model_len, **cfg.engine_kwargs}
    kwargs["max_num_seqs"] = max(max_seqs, int(kwargs.get("max_num_seqs") or 0))
    draft_length: int | str = "auto" if k == AUTO else k
    if cfg.speculative_config is not None and k != 0:
        spec = dict(cfg.speculative_config, num_speculative_tokens=draft_length)
        spec["max_draft_length"] = cfg.max_draft_length
        kwargs["speculative_config"] = spec
    else:
        kwargs["draft_model"] = cfg.draft_model if k != 0 else None
        kwargs["num_speculative_tokens"] = draft_length
        kwargs["max_draft_length"] = cfg.max_draft_length
    args = EngineArgs(model=cfg.model, seed=cfg.seed, **kwargs)
    return LLMEngine.from_engine_args(args)


def share_weights(engines: Sequence[LLMEngine]) -> None:
    """Point every in-process engine's target (and draft) at the first one's tensors: they are
    the same checkpoint, and side by side (cell_run.py) each engine's step would otherwise
    begin by reading its own copy back into the caches that the other engines' steps evicted,
    which one engine running alone never does. Engines whose workers live elsewhere (Ray)
    keep their own."""
    first: dict[str, torch.nn.Module] = {}
    for engine in engines:
        worker = getattr(engine.executor, "worker", None)
        if worker is None:
            continue
        for role in ("target", "draft"):
            runner = getattr(worker, role)
            if runner is None:
                continue
            source = first.setdefault(role, runner.model)
            if source is runner.model:
                continue
            mine = dict(runner.model.named_parameters())
            for name, tensor in source.named_parameters():
                mine[name].data = tensor.data
            modules = dict(runner.model.named_modules())
            for name, module in source.named_modules():  # the CPU kernels' packed weights
                packed = getattr(module, "packed", None)
                own = getattr(modules[name], "packed", None)
                if packed is not None and own is not None:
                    own.panels.data = packed.panels.data


def run_bench(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    """Run every cell of the grid: batch sizes x draft lengths."""
    cfg.check()
    t0 = time.perf_counter()
    sizes = sorted(set(cfg.batch_sizes))
    lengths = sorted(set(cfg.draft_lengths), key=draft_length_order)
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=cfg.temperature, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    total = sum(cfg.requests_for(b) for b in sizes) * len(lengths) * cfg.repeats
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True)
    cells: list[CellResult] = []
    source = ""
    # One engine per draft length, all up for the whole run, so that the cells of a round can
    # run side by side. The auto row's policy lives as long as its engine, as in a server: it
    # learns in its first cells and keeps learning from every later auto cell.
    engines: dict[int, LLMEngine] = {}
    try:
        for k in lengths:
            engines[k] = _engine(cfg, k, max(sizes))
        share_weights(list(engines.values()))
        workload = build_workload(
            engines[lengths[0]],
            input_len=cfg.input_len,
            output_len=cfg.output_len,
            # every repeat of a cell runs prompts of its own (see the module's docstring)
            num_prompts=max(64, WARMUP_REQUESTS + cfg.repeats * max(map(cfg.requests_for, sizes))),
            prompts_file=cfg.prompts_file,
            seed=cfg.seed,
            grounded=cfg.workload == "grounded",
        )
        if cfg.mixed_hard_temperature is not None:
            workload = mixed(workload, engines[lengths[0]].tokenizer, cfg.mixed_hard_temperature)
        prefix = shared_prefix(engines[lengths[0]], cfg.shared_prefix_len, cfg.seed)
        workload = with_shared_prefix(workload, prefix)
        workload = spread_output_lengths(workload, cfg.output_len_spread, cfg.seed)
        source = workload.source
        on_finished = bar.update if bar is not None else None
        for b in sizes:
            runs: dict[int, list[CellResult]] = {k: [] for k in lengths}
            n = cfg.requests_for(b)
            for r in range(cfg.repeats):  # rounds over the draft lengths, interleaved
                order = rotated(lengths, r)
                if bar is not None:
                    bar.set_description(f"bench B={b} round {r + 1}/{cfg.repeats}")
                first = WARMUP_REQUESTS + r * n
                if cfg.interleave == "steps":
                    for k in order:
                        run_cell(engines[k], workload, b, min(b, WARMUP_REQUESTS), warm)
                    cell_runs = [
                        CellRun(
                            engines[k],
                            workload,
                            b,
                            n,
                            params,
                            first_prompt=first,
                            on_finished=on_finished,
                        )
                        for k in order
                    ]
                    results = run_side_by_side(cell_runs)
                else:
                    results = []
                    for k in order:
                        run_cell(engines[k], workload, b, min(b, WARMUP_REQUESTS), warm)
                        results.append(
                            run_cell(
                                engines[k],
                                workload,
                                b,
                                n,
                                params,
                                first_prompt=first,
                                on_finished=on_finished,
                            )
                        )
                for k, cell in zip(order, results):
                    cell.draft_length = k
                    runs[k].append(cell)
            cells.extend(pool_runs(runs[k]) for k in lengths)
    finally:
        for engine in engines.values():
            engine.shutdown()
        if bar is not None:
            bar.close()
    cells.sort(key=lambda c: (c.batch_size, draft_length_order(c.draft_length)))
    compare_with_plain(cells)
    config = asdict(cfg)
    config["num_requests_per_cell"] = {str(b): cfg.requests_for(b) for b in sizes}
    config["warmup"] = f"{WARMUP_REQUESTS} requests of {WARMUP_TOKENS} tokens before each cell"
    return BenchResult(
        config=config,
        workload_source=source,
        cells=cells,
        summary=crossover(cells)
        | ({"auto_vs_fixed": auto_vs_fixed(cells)} if AUTO in engines else {}),
        machine=machine_facts(),
        wall_s=time.perf_counter() - t0,
    )
