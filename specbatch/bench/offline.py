"""Offline load test: a closed-loop workload over a grid of batch sizes and draft lengths.

*Batch size* B is the number of requests running concurrently: B requests are added, and each
time one finishes a new one takes its place, until ``num_requests`` have finished (the engine is
kept full at B, which is what a server under load sees). Every request has the same prompt
length and generates exactly ``output_len`` tokens (``ignore_eos``).

Engines: one plain engine (the target alone) runs the draft length 0 cells, and one speculative
engine built with the largest draft length runs every k > 0 cell, its scheduler's policy set to
``FixedDraftLength(k)`` before the cell. Both stay up for the whole run, and the cells of one
batch size run back to back (k = 0 first), so speedups compare figures taken side by side.
Before each cell a warm-up of ``min(B, 4)`` short requests runs, then the engine's counters are
reset, so warm-up is excluded from every figure.

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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specbatch.bench.workload import Workload, build_workload, mixed
from specbatch.config import DEFAULT_MAX_DRAFT_LENGTH, EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.engine.metrics import EngineMetrics
from specbatch.errors import InvalidInputError
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.speculation import FixedDraftLength
from specbatch.stats import percentile
from specbatch.theory import predicted_speedup

AUTO = -1  # the draft length of the ``auto`` row: num_speculative_tokens="auto"
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_DRAFT_LENGTHS = (0, 1, 2, 4, 8)
DEFAULT_INPUT_LEN = 64
DEFAULT_OUTPUT_LEN = 64
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 8


def draft_length_arg(value: str) -> int:
    """``--draft-lengths``: an integer, or ``auto`` (as ``AUTO``)."""
    if value == "auto":
        return AUTO
    try:
        return int(value)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def draft_length_order(k: int) -> float:
    """Sort key: fixed draft lengths ascending, then the auto row."""
    return math.inf if k == AUTO else k


def draft_length_label(k: int) -> str:
    return "auto" if k == AUTO else str(k)


def default_num_requests(batch_size: int) -> int:
    """Requests measured per cell: enough for the engine to stay full a while, few enough that
    the default grid finishes in minutes on a CPU."""
    return max(2 * batch_size, 8)


# ---- one cell ------------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class CellResult:
    """The figures of one (batch size, draft length) cell. Times in seconds."""

    batch_size: int
    draft_length: int
    num_requests: int
    input_len: int
    output_len: int
    wall_s: float
    output_tokens: int  # summed over the finished requests' outputs
    engine_generated_tokens: int  # the engine's own count over the same steps
    steps: int
    output_tok_s: float
    tpot_mean: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_mean: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    step_s: float  # mean engine step time
    target_s_per_step: float
    draft_s_per_step: float
    spec_rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    acceptance_rate: float | None = None  # accepted / proposed
    alpha: float | None = None  # THEORY's alpha: accepted / (accepted + rejections)
    mean_draft_length: float | None = None
    mean_tokens_per_round: float | None = None
    predicted_tokens_per_round: float | None = None
    cost_ratio: float | None = None  # c, filled in against the plain cell
    verify_ratio: float | None = None  # target time per step over the plain cell's
    measured_speedup: float | None = None
    predicted_speedup: float | None = None
    # THEORY's formula with the measured verify cost in place of 1: E / (g c + verify_ratio)
    predicted_speedup_with_verify: float | None = None
    runs_tok_s: list[float] = field(default_factory=list)  # every repeat's tok/s (--repeats)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    """Keep ``batch_size`` requests running until ``num_requests`` have finished."""
    if batch_size < 1 or num_requests < 1:
        raise InvalidInputError("batch sizes and request counts must be >= 1")
    engine.metrics = EngineMetrics()
    submitted = 0
    finished: list[Any] = []
    live: set[str] = set()

    def submit() -> None:
        nonlocal submitted
        i = first_prompt + submitted
        rid = engine.add_request(workload.prompt(i), workload.params(i, params))
        live.add(rid)
        submitted += 1

    start = time.perf_counter()
    try:
        for _ in range(min(batch_size, num_requests)):
            submit()
        while live:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.discard(out.request_id)
                    finished.append(out)
                    if on_finished is not None:
                        on_finished()
                    if submitted < num_requests:
                        submit()
    except BaseException:
        engine.abort_request(list(live))
        raise
    wall = time.perf_counter() - start
    m = engine.metrics
    s = m.spec
    tpots = [t for o in finished if (t := o.metrics.time_per_output_token) is not None]
    ttfts = [t for o in finished if (t := o.metrics.time_to_first_token) is not None]
    e2es = [t for o in finished if (t := o.metrics.e2e_latency) is not None]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    steps = max(m.num_steps, 1)
    return CellResult(
        batch_size=batch_size,
        draft_length=engine.scheduler.policy.max_draft_length if engine.config.speculative else 0,
        num_requests=len(finished),
        input_len=workload.input_len,
        output_len=workload.output_len,
        wall_s=wall,
        output_tokens=out_tokens,
        engine_generated_tokens=m.num_generated_tokens,
        steps=m.num_steps,
        output_tok_s=out_tokens / wall if wall > 0 else 0.0,
        tpot_mean=_mean(tpots),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        ttft_mean=_mean(ttfts),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        e2e_mean=_mean(e2es),
        e2e_p50=percentile(e2es, 50),
        e2e_p99=percentile(e2es, 99),
        step_s=m.step_time_total / steps,
        target_s_per_step=m.target_time_total / steps,
        draft_s_per_step=m.draft_time_total / steps,
        spec_rounds=s.rounds,
        draft_tokens_proposed=s.proposed,
        draft_tokens_accepted=s.accepted,
        acceptance_rate=s.acceptance_rate,
        alpha=s.alpha,
        mean_draft_length=s.mean_draft_length,
        mean_tokens_per_round=s.mean_tokens_per_round,
        predicted_tokens_per_round=s.predicted_tokens_per_round(),
    )


def median_cell(runs: list[CellResult]) -> CellResult:
    """The run of median throughput (the lower one of an even count), with every run's
    throughput in ``runs_tok_s``."""
    ordered = sorted(runs, key=lambda c: c.output_tok_s)
    cell = ordered[(len(ordered) - 1) // 2]
    cell.runs_tok_s = [c.output_tok_s for c in runs]
    return cell


def compare_with_plain(cells: list[CellResult]) -> None:
    """Fill in c, measured and predicted speedup of every speculative cell whose batch size has
    a plain (draft length 0) cell."""
    plain = {c.batch_size: c for c in cells if c.draft_length == 0}
    for c in cells:
        p = plain.get(c.batch_size)
        if p is None:
            continue
        if p.output_tok_s > 0:
            c.measured_speedup = c.output_tok_s / p.output_tok_s
        if c.draft_length == 0:
            c.predicted_speedup = 1.0
            continue
        if p.target_s_per_step > 0 and c.draft_length > 0:
            c.cost_ratio = c.draft_s_per_step / c.draft_length / p.target_s_per_step
            c.verify_ratio = c.target_s_per_step / p.target_s_per_step
        if c.alpha is not None and c.cost_ratio is not None and c.mean_draft_length is not None:
            c.predicted_speedup = predicted_speedup(c.alpha, c.mean_draft_length, c.cost_ratio)
            if c.verify_ratio is not None:
                c.predicted_speedup_with_verify = predicted_speedup(
                    c.alpha, c.mean_draft_length, c.cost_ratio, c.verify_ratio
                )


def _first_below_one(speedups: dict[int, float]) -> int | None:
    """The smallest batch size from which on every speedup is below 1 (None: never)."""
    sizes = sorted(speedups)
    for i, b in enumerate(sizes):
        if all(speedups[x] < 1.0 for x in sizes[i:]):
            return b
    return None


def crossover(cells: Sequence[CellResult]) -> dict[str, Any]:
    """Where speculation stops paying: for each batch size the best measured speculative
    speedup, the smallest batch size from which on it stays below 1 (None: never in the grid),
    and the same per draft length."""
    best: dict[int, float] = {}
    by_k: dict[int, dict[int, float]] = {}
    for c in cells:
        if c.draft_length > 0 and c.measured_speedup is not None:
            best[c.batch_size] = max(best.get(c.batch_size, 0.0), c.measured_speedup)
            by_k.setdefault(c.draft_length, {})[c.batch_size] = c.measured_speedup
    return {
        "best_speedup_by_batch_size": {str(b): best[b] for b in sorted(best)},
        "crossover": _first_below_one(best),
        "crossover_by_draft_length": {str(k): _first_below_one(v) for k, v in sorted(by_k.items())},
    }


# ---- the grid ------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    model: str | None = None  # None: the built-in pair
    draft_model: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_BATCH_SIZES))
    draft_lengths: list[int] = field(default_factory=lambda: list(DEFAULT_DRAFT_LENGTHS))
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    num_requests: int | None = None  # per cell; None: default_num_requests(B)
    prompts_file: str | None = None
    temperature: float = 0.0
    repeats: int = 1  # runs of each cell, interleaved; the median one is reported
    # None: every request at ``temperature``; a float: the mixed workload (bench/workload.py),
    # easy greedy requests in turn with hard ones sampled at this temperature
    mixed_hard_temperature: float | None = None
    seed: int = 0
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
        if self.num_requests is not None and self.num_requests < 1:
            raise bad("num_requests", "must be >= 1")
        if self.repeats < 1:
            raise bad("repeats", "must be >= 1")
        if self.max_draft_length > 0 and self.model is not None and self.draft_model is None:
            raise bad("draft_lengths", "above 0 need a draft model (--draft-model)")

    @property
    def max_draft_length(self) -> int:
        """The speculative engine's draft length: the largest k, else the auto row's default."""
        fixed = max(self.draft_lengths)
        return fixed if fixed > 0 or AUTO not in self.draft_lengths else DEFAULT_MAX_DRAFT_LENGTH

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
    model_len = cfg.input_len + cfg.output_len + cfg.max_draft_length + 2
    kwargs: dict[str, Any] = {"max_model_len": model_len, **cfg.engine_kwargs}
    kwargs["max_num_seqs"] = max(max_seqs, int(kwargs.get("max_num_seqs") or 0))
    args = EngineArgs(
        model=cfg.model,
        draft_model=cfg.draft_model if k > 0 else None,
        num_speculative_tokens=k,
        seed=cfg.seed,
        **kwargs,
    )
    return LLMEngine.from_engine_args(args)


def run_bench(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    """Run every cell of the grid: batch sizes x draft lengths."""
    cfg.check()
    t0 = time.perf_counter()
    sizes = sorted(set(cfg.batch_sizes))
    lengths = sorted(set(cfg.draft_lengths), key=draft_length_order)
    spec_lengths = [k for k in lengths if k != 0]
    k_max = cfg.max_draft_length
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=cfg.temperature, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    total = sum(cfg.requests_for(b) for b in sizes) * len(lengths) * cfg.repeats
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True)
    cells: list[CellResult] = []
    source = ""
    # Both engines stay up, and the cells of one batch size run back to back, so that each
    # speedup is a ratio of figures taken minutes apart at most, under the same machine load.
    engines: dict[int, LLMEngine] = {}
    try:
        if 0 in lengths:
            engines[0] = _engine(cfg, 0, max(sizes))
        if spec_lengths:
            engines[k_max] = _engine(cfg, k_max, max(sizes))
        # the auto row's policy lives as long as its engine, as in a server: it calibrates in
        # its first cell's warm-up and keeps learning from every later auto cell
        auto = engines[k_max].adaptive_policy(k_max) if AUTO in lengths else None
        workload = build_workload(
            next(iter(engines.values())),
            input_len=cfg.input_len,
            output_len=cfg.output_len,
            num_prompts=max(64, max(sizes)),
            prompts_file=cfg.prompts_file,
            seed=cfg.seed,
        )
        if cfg.mixed_hard_temperature is not None:
            tokenizer = next(iter(engines.values())).tokenizer
            workload = mixed(workload, tokenizer, cfg.mixed_hard_temperature)
        source = workload.source
        for b in sizes:
            runs: dict[int, list[CellResult]] = {k: [] for k in lengths}
            for _ in range(cfg.repeats):  # rounds over the draft lengths, interleaved
                for k in lengths:
                    engine = engines[0 if k == 0 else k_max]
                    if k != 0:
                        engine.scheduler.policy = auto if k == AUTO else FixedDraftLength(k)
                    if bar is not None:
                        bar.set_description(f"bench B={b} k={'auto' if k == AUTO else k}")
                    run_cell(engine, workload, b, min(b, WARMUP_REQUESTS), warm)
                    cell = run_cell(
                        engine,
                        workload,
                        b,
                        cfg.requests_for(b),
                        params,
                        on_finished=bar.update if bar is not None else None,
                        first_prompt=WARMUP_REQUESTS,
                    )
                    cell.draft_length = k
                    runs[k].append(cell)
            cells.extend(median_cell(runs[k]) for k in lengths)
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
        | ({"auto_profile_s": auto.profile_seconds} if auto is not None else {}),
        machine=machine_facts(),
        wall_s=time.perf_counter() - t0,
    )
