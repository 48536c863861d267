"""One cell of the offline bench (a batch size and a draft length): its figures, and how the
cells compare with plain decoding (speedups, THEORY.md's prediction, the crossover batch size).
Running a cell is ``cell_run.py``; the grid around them is ``offline.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specbatch.request import SpecStats
from specbatch.stats import percentile
from specbatch.theory import predicted_speedup

AUTO = -1  # the draft length of an ``auto`` cell: num_speculative_tokens="auto"


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
    # every repeat's own mean TPOT, in the same order (``tpot_mean`` pools all their requests)
    runs_tpot_mean: list[float | None] = field(default_factory=list)
    # tok/s while the engine held all B requests: from the cell's start to the admission of its
    # last request, before the batch drains (None when every request fit in the first batch).
    # With equal lengths, k = 0 finishes a whole batch in one step while staggered speculative
    # requests drain over many thinning steps, which a server under load never does. Over
    # repeats: the median of the runs' figures.
    full_batch_tok_s: float | None = None
    runs_full_batch_tok_s: list[float] = field(default_factory=list)
    # every finished request's seconds per latency ("tpot", "ttft", "e2e"); not written out
    latencies: dict[str, list[float]] = field(default_factory=dict, repr=False)
    # the speculation counters the figures above come from; not written out
    spec: SpecStats = field(default_factory=SpecStats, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["latencies"], d["spec"]
        return d


LATENCIES = ("tpot", "ttft", "e2e")


def latency_figures(latencies: dict[str, list[float]]) -> dict[str, float | None]:
    """Mean, p50 and p99 of each latency: ``tpot_mean``, ``tpot_p50``, ... ``e2e_p99``."""
    figures: dict[str, float | None] = {}
    for name in LATENCIES:
        xs = latencies.get(name, [])
        figures |= {
            f"{name}_mean": _mean(xs),
            f"{name}_p50": percentile(xs, 50),
            f"{name}_p99": percentile(xs, 99),
        }
    return figures


def spec_figures(s: SpecStats) -> dict[str, Any]:
    """A cell's speculation figures from its counters (every one None without drafts)."""
    return {
        "spec_rounds": s.rounds,
        "draft_tokens_proposed": s.proposed,
        "draft_tokens_accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "alpha": s.alpha,
        "mean_draft_length": s.mean_draft_length,
        "mean_tokens_per_round": s.mean_tokens_per_round,
        "predicted_tokens_per_round": s.predicted_tokens_per_round(),
    }


def pool_runs(runs: list[CellResult]) -> CellResult:
    """One cell over all its runs (``--repeats``): requests, tokens, time, steps and
    speculation counters summed, so that its tok/s is the output tokens over the time, both
    summed; its latencies are over every run's requests. Each run's tok/s and mean TPOT are
    kept in ``runs_tok_s`` and ``runs_tpot_mean``; ``full_batch_tok_s`` is the median of the
    runs' own.

    Not the run of median throughput: run side by side, the cells of a round share the
    machine's speed, and two rounds do not; the median runs of two draft lengths may be
    different rounds, and their ratio carries the drift between rounds back in (in session
    11's grid, auto's median run over k = 1's at batch 8 came out below four of the five
    rounds' own ratios). Summed, every round weighs in by its time for both alike."""
    first = runs[0]
    steps = sum(c.steps for c in runs)
    spec = SpecStats()
    for c in runs:
        spec.merge(c.spec)
    wall = sum(c.wall_s for c in runs)
    tokens = sum(c.output_tokens for c in runs)
    latencies = {n: [x for c in runs for x in c.latencies.get(n, [])] for n in LATENCIES}
    full = sorted(c.full_batch_tok_s for c in runs if c.full_batch_tok_s is not None)

    def per_step(name: str) -> float:
        return sum(getattr(c, name) * c.steps for c in runs) / max(steps, 1)

    return CellResult(
        batch_size=first.batch_size,
        draft_length=first.draft_length,
        num_requests=sum(c.num_requests for c in runs),
        input_len=first.input_len,
        output_len=first.output_len,
        wall_s=wall,
        output_tokens=tokens,
        engine_generated_tokens=sum(c.engine_generated_tokens for c in runs),
        steps=steps,
        output_tok_s=tokens / wall if wall > 0 else 0.0,
        **latency_figures(latencies),  # type: ignore[arg-type]
        step_s=per_step("step_s"),
        target_s_per_step=per_step("target_s_per_step"),
        draft_s_per_step=per_step("draft_s_per_step"),
        **spec_figures(spec),
        runs_tok_s=[c.output_tok_s for c in runs],
        runs_tpot_mean=[c.tpot_mean for c in runs],
        full_batch_tok_s=full[(len(full) - 1) // 2] if full else None,
        runs_full_batch_tok_s=[c.full_batch_tok_s for c in runs if c.full_batch_tok_s is not None],
        latencies=latencies,
        spec=spec,
    )


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
