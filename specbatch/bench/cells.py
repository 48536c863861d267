"""One cell of the offline bench (a batch size and what it drafts: nothing, a chain, a tree or
auto, ``drafts.py``): its figures, and how the cells compare with plain decoding (speedups,
THEORY.md's prediction, the crossover batch size). Running a cell is ``cell_run.py``; the grid
around them is ``offline.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from specbatch.bench.drafts import PLAIN, Draft
from specbatch.draft_shape import DraftShape
from specbatch.request import SpecStats
from specbatch.stats import percentile
from specbatch.theory import expected_tokens_per_round, predicted_speedup


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class CellResult:
    """The figures of one (batch size, draft) cell. Times in seconds."""

    batch_size: int
    draft: Draft
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
    target_rows_per_step: float = 0.0  # rows of the target's passes: prompts, decodes, drafts
    draft_passes_per_step: float = 0.0  # the drafter's model passes (n-gram lookup runs none)
    spec_rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    acceptance_rate: float | None = None  # accepted / proposed
    alpha: float | None = None  # THEORY's alpha: accepted / (accepted + rejections)
    mean_draft_length: float | None = None  # drafts proposed a round (a tree's nodes)
    mean_tokens_per_round: float | None = None
    predicted_tokens_per_round: float | None = None
    cost_ratio: float | None = None  # c, filled in against the plain cell (compare_with_plain)
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
        """The written figures: ``draft`` as it is spelt (``0``, ``2``, ``4x4/16``, ``auto``)
        and its ``depth``, ``topk`` and ``nodes`` (None for auto)."""
        shape = self.draft if isinstance(self.draft, DraftShape) else None
        d: dict[str, Any] = {
            "batch_size": self.batch_size,
            "draft": str(self.draft),
            "depth": None if shape is None else shape.depth,
            "topk": None if shape is None else shape.topk,
            "nodes": None if shape is None else shape.nodes,
        }
        for f in fields(self):
            if f.name not in d and f.name not in ("draft", "latencies", "spec"):
                value = getattr(self, f.name)
                d[f.name] = list(value) if isinstance(value, list) else value
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


def depth_drafted(draft: Draft, mean_draft_length: float | None) -> float | None:
    """THEORY's gamma for a cell: the drafts a chain proposed a round on average, a tree's
    depth (the walk passes at most one node a level); None for auto (its shapes vary) and
    for a cell that drafted nothing."""
    if not isinstance(draft, DraftShape) or mean_draft_length is None:
        return None
    return mean_draft_length if draft.is_chain else float(draft.depth)


def spec_figures(s: SpecStats, draft: Draft) -> dict[str, Any]:
    """A cell's speculation figures from its counters (every one None without drafts).
    ``predicted_tokens_per_round`` is THEORY's E[tokens] at the measured alpha; for a tree,
    at its depth, alpha then being the chance that the walk passes a level (any child)."""
    gamma = depth_drafted(draft, s.mean_draft_length)
    alpha = s.alpha
    predicted = None if gamma is None or alpha is None else expected_tokens_per_round(alpha, gamma)
    return {
        "spec_rounds": s.rounds,
        "draft_tokens_proposed": s.proposed,
        "draft_tokens_accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "alpha": s.alpha,
        "mean_draft_length": s.mean_draft_length,
        "mean_tokens_per_round": s.mean_tokens_per_round,
        "predicted_tokens_per_round": predicted,
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
        draft=first.draft,
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
        target_rows_per_step=per_step("target_rows_per_step"),
        draft_passes_per_step=per_step("draft_passes_per_step"),
        **spec_figures(spec, first.draft),
        runs_tok_s=[c.output_tok_s for c in runs],
        runs_tpot_mean=[c.tpot_mean for c in runs],
        full_batch_tok_s=full[(len(full) - 1) // 2] if full else None,
        runs_full_batch_tok_s=[c.full_batch_tok_s for c in runs if c.full_batch_tok_s is not None],
        latencies=latencies,
        spec=spec,
    )


def draft_passes(c: CellResult) -> float | None:
    """The drafter's passes a step that c is per: a chain's length, a tree's depth (THEORY's
    passes a round); for auto, the passes its steps ran on average (None when its drafter
    runs no model)."""
    if isinstance(c.draft, DraftShape):
        return float(c.draft.depth)
    return c.draft_passes_per_step or None


def compare_with_plain(cells: list[CellResult]) -> None:
    """Fill in c, the verify cost, measured and predicted speedup of every speculative cell
    whose batch size has a plain cell. A tree's prediction is THEORY's formula for a chain as
    deep as the tree, its alpha the walk's chance to pass a level: it takes the levels as
    passed independently, at one rate, down to the full depth."""
    plain = {c.batch_size: c for c in cells if c.draft == PLAIN}
    for c in cells:
        p = plain.get(c.batch_size)
        if p is None:
            continue
        if p.output_tok_s > 0:
            c.measured_speedup = c.output_tok_s / p.output_tok_s
        if c.draft == PLAIN:
            c.predicted_speedup = 1.0
            continue
        passes = draft_passes(c)
        if p.target_s_per_step > 0:
            c.verify_ratio = c.target_s_per_step / p.target_s_per_step
            if passes:
                c.cost_ratio = c.draft_s_per_step / passes / p.target_s_per_step
        gamma = depth_drafted(c.draft, c.mean_draft_length)
        if c.alpha is not None and c.cost_ratio is not None and gamma is not None:
            c.predicted_speedup = predicted_speedup(c.alpha, gamma, c.cost_ratio)
            if c.verify_ratio is not None:
                c.predicted_speedup_with_verify = predicted_speedup(
                    c.alpha, gamma, c.cost_ratio, c.verify_ratio
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
    and the same per draft (chain, tree or auto; keys as they are spelt)."""
    best: dict[int, float] = {}
    by_draft: dict[str, dict[int, float]] = {}
    for c in cells:
        if c.draft != PLAIN and c.measured_speedup is not None:
            best[c.batch_size] = max(best.get(c.batch_size, 0.0), c.measured_speedup)
            by_draft.setdefault(str(c.draft), {})[c.batch_size] = c.measured_speedup
    return {
        "best_speedup_by_batch_size": {str(b): best[b] for b in sorted(best)},
        "crossover": _first_below_one(best),
        "crossover_by_draft": {d: _first_below_one(v) for d, v in by_draft.items()},
    }
