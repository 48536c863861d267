"""What ``specbatch bench`` writes: a table on stdout, ``<out>.json``, ``<out>.csv`` and two PNG
plots (``<out>_throughput_latency.png``, ``<out>_speedup.png``)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specbatch.bench.auto_vs_fixed import format_auto_vs_fixed
from specbatch.bench.cells import CellResult
from specbatch.bench.drafts import PLAIN, Draft, is_tree, order
from specbatch.bench.offline import BenchResult

# (header, CellResult field, scale, digits; None: the value as it is spelt)
TABLE_COLUMNS: tuple[tuple[str, str, float, int | None], ...] = (
    ("B", "batch_size", 1, 0),
    ("draft", "draft", 1, None),
    ("reqs", "num_requests", 1, 0),
    ("tok/s", "output_tok_s", 1, 1),
    ("full tok/s", "full_batch_tok_s", 1, 1),
    ("tpot ms", "tpot_mean", 1e3, 2),
    ("p50", "tpot_p50", 1e3, 2),
    ("p99", "tpot_p99", 1e3, 2),
    ("ttft ms", "ttft_mean", 1e3, 1),
    ("e2e s", "e2e_mean", 1, 3),
    ("alpha", "alpha", 1, 3),
    ("acc rate", "acceptance_rate", 1, 3),
    ("tok/round", "mean_tokens_per_round", 1, 2),
    ("rows", "target_rows_per_step", 1, 1),
    ("c", "cost_ratio", 1, 3),
    ("verify", "verify_ratio", 1, 2),
    ("speedup", "measured_speedup", 1, 2),
    ("predicted", "predicted_speedup", 1, 2),
    ("pred(v)", "predicted_speedup_with_verify", 1, 2),
)


def _cell_text(value: Any, scale: float, digits: int | None) -> str:
    if digits is None:
        return str(value)
    if value is None:
        return "-"
    if digits == 0:
        return str(int(value))
    return f"{value * scale:.{digits}f}"


def format_table(cells: Sequence[CellResult]) -> str:
    """One line per cell, numbers right-aligned."""
    headers = [h for h, *_ in TABLE_COLUMNS]
    rows = [
        [_cell_text(getattr(c, name), scale, d) for _, name, scale, d in TABLE_COLUMNS]
        for c in cells
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def drafter_label(cfg: dict) -> str:
    """Who drafts in the grid's speculative cells."""
    spec = cfg.get("speculative_config") or {}
    method = spec.get("method")
    if cfg["draft_model"] or spec.get("model"):
        return f"{method or 'draft_model'} {cfg['draft_model'] or spec['model']}"
    if method == "ngram":
        return "ngram (prompt lookup)"
    if method == "suffix":
        return "suffix (its own and earlier requests' tokens)"
    if method == "self_sparse":
        return "self_sparse (the target over its cache's sinks and window)"
    if cfg["model"] is None:
        return "built-in " + ("draft model" if method == "draft_model" else "EAGLE head")
    return "-"


def format_report(result: BenchResult) -> str:
    cfg = result.config
    model = cfg["model"] or "built-in pair (target)"
    draft = drafter_label(cfg)
    lines = [
        f"specbatch bench: {model}, draft {draft}",
        f"  workload  {cfg['input_len']} input + {cfg['output_len']} output tokens per request, "
        f"temperature {cfg['temperature']}, prompts: {result.workload_source}",
        f"  requests  per cell {cfg['num_requests_per_cell']}, closed loop at batch size B; "
        f"{cfg['warmup']}"
        + (
            f"; each cell run {cfg['repeats']} times, figures over all the runs"
            if cfg.get("repeats", 1) > 1
            else ""
        ),
    ]
    if cfg.get("trees"):
        lines.append(f"  trees     {' '.join(cfg['trees'])}, children {cfg['tree_children']}")
    if cfg.get("auto_shape"):
        lines.append(f"  auto      drafts up to {cfg['auto_shape']}, chosen per step")
    lines += [
        "",
        format_table(result.cells),
        "",
        "tpot: time per output token after the first (mean, p50, p99); ttft: time to first "
        "token; e2e: request latency.",
        "draft: k drafts a round (0: plain decoding), a tree DxK/N (depth D, K children per "
        "node, N nodes verified), or auto;",
        "alpha: accepted / (accepted + rejections), for a tree the chance its walk passes a "
        "level; acc rate: accepted / proposed;",
        "rows: the target's rows per step (prompts, decodes, drafts verified); c: a draft pass "
        "/ a plain target step at this B;",
        "verify: target time per speculative step / per plain step (THEORY's model takes 1);",
        "speedup: tok/s over k=0 at the same B; predicted: THEORY.md's "
        "(1 - a^(g+1)) / ((1 - a)(g c + 1)), g the drafts a round or a tree's depth;",
        "pred(v): the same with the measured verify cost: E[tokens per round] / (g c + verify).",
    ]
    if any(is_tree(c.draft) for c in result.cells):
        lines.append(
            "A tree's prediction takes its levels as passed independently at rate alpha down "
            "to its full depth, as a chain's."
        )
    cross = result.summary.get("crossover")
    best = result.summary.get("best_speedup_by_batch_size", {})
    if best:
        lines.append(
            "best speculative speedup by batch size: "
            + ", ".join(f"B={b}: {s:.2f}x" for b, s in best.items())
        )
        lines.append(
            f"crossover: speculation lowers throughput from batch size {cross} on"
            if cross is not None
            else "crossover: none in this grid (speculation helps at every batch size measured)"
        )
    per_draft = result.summary.get("crossover_by_draft", {})
    if per_draft:
        lines.append(
            "per draft, speculation lowers throughput from batch size: "
            + ", ".join(f"{d}: {'-' if b is None else b}" for d, b in per_draft.items())
        )
    lines += format_auto_vs_fixed(result.summary.get("auto_vs_fixed", {}))
    lines.append(f"wall time {result.wall_s:.1f} s")
    return "\n".join(lines)


def write_json(result: BenchResult, path: Path) -> Path:
    obj = {
        "config": result.config,
        "workload_source": result.workload_source,
        "machine": result.machine,
        "wall_s": result.wall_s,
        "summary": result.summary,
        "cells": [c.to_dict() for c in result.cells],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path


def write_csv(cells: Sequence[CellResult], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [c.to_dict() for c in cells]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return path


def _by_draft(cells: Sequence[CellResult]) -> dict[Draft, list[CellResult]]:
    groups: dict[Draft, list[CellResult]] = {}
    for c in sorted(cells, key=lambda c: (order(c.draft), c.batch_size)):
        groups.setdefault(c.draft, []).append(c)
    return groups


def _curve_label(draft: Draft) -> str:
    if draft == PLAIN:
        return "plain (k=0)"
    if draft == "auto":
        return "auto"
    if draft.is_chain:
        return f"k={draft}"
    return f"tree {draft}"


def plot_throughput_latency(cells: Sequence[CellResult], path: Path, title: str) -> Path:
    """Output tokens/s against mean time per output token, one curve per draft (length, tree,
    auto), each point labelled with its batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for draft, group in _by_draft(cells).items():
        pts = [(c.tpot_mean * 1e3, c.output_tok_s, c.batch_size) for c in group if c.tpot_mean]
        if not pts:
            continue
        xs, ys, _ = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", label=_curve_label(draft))
        for x, y, b in pts:
            ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("time per output token, mean (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(title="draft")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_speedup(
    cells: Sequence[CellResult], path: Path, title: str, crossover: int | None
) -> Path:
    """Speedup over plain decoding against batch size: measured (solid) and THEORY.md's
    prediction (dashed), one colour per draft (length, tree, auto); the crossover marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    spec = {d: g for d, g in _by_draft(cells).items() if d != PLAIN}
    for i, (draft, group) in enumerate(spec.items()):
        color = colors[i % len(colors)]
        name = _curve_label(draft)
        meas = [(c.batch_size, c.measured_speedup) for c in group if c.measured_speedup]
        pred = [(c.batch_size, c.predicted_speedup) for c in group if c.predicted_speedup]
        if meas:
            ax.plot(*zip(*meas, strict=True), marker="o", color=color, label=f"{name} measured")
        if pred:
            ax.plot(
                *zip(*pred, strict=True),
                marker="x",
                linestyle="--",
                color=color,
                label=f"{name} predicted",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    if crossover is not None:
        ax.axvline(crossover, color="red", linestyle=":", linewidth=1.2)
        ax.annotate(
            f"crossover: B={crossover}",
            (crossover, 1.0),
            textcoords="offset points",
            xytext=(5, 10),
            color="red",
            fontsize=8,
        )
    ax.set_xscale("log", base=2)
    sizes = sorted({c.batch_size for c in cells})
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(b) for b in sizes])
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no k = 0 cell: no speedups to draw
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(result: BenchResult, out: str | Path) -> dict[str, Path]:
    """Write ``<out>.json``, ``<out>.csv`` and the two PNGs; returns their paths by kind."""
    base = Path(out)
    if base.suffix in (".json", ".csv", ".png"):
        base = base.with_suffix("")
    stem = base.name
    title = f"specbatch bench ({result.config['input_len']} in / {result.config['output_len']} out)"
    return {
        "json": write_json(result, base.with_name(stem + ".json")),
        "csv": write_csv(result.cells, base.with_name(stem + ".csv")),
        "throughput_latency_png": plot_throughput_latency(
            result.cells, base.with_name(stem + "_throughput_latency.png"), title
        ),
        "speedup_png": plot_speedup(
            result.cells,
            base.with_name(stem + "_speedup.png"),
            title,
            result.summary.get("crossover"),
        ),
    }
