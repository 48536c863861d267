"""The ``auto`` cell against the best fixed cell at each batch size.

The best fixed cell is the one of highest throughput among every other cell: plain decoding,
each draft length, each tree. Two views:

* ``tok_ratio`` and ``tpot_ratio``: the cells' own figures (tok/s and mean TPOT over all the
  runs, ``pool_runs``), as the bench's table shows them;
* ``round_tok_ratios`` and ``round_tpot_ratios``: round by round, where both ran the same
  prompts (each repeat has prompts of its own), so the machine's drift between rounds and the
  prompts' differences cancel; their medians say what most rounds showed, one slow round
  (a hiccup of the machine) moving them little, where it moves a pooled mean TPOT.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from specbatch.bench.cells import CellResult
from specbatch.bench.drafts import Draft

TOK_BAR = 0.97  # throughput at least this share of the best fixed cell's
TPOT_BAR = 1.05  # time per output token at most this multiple of the best fixed cell's


def _ratios(xs: Sequence[float | None], ys: Sequence[float | None]) -> list[float]:
    return [x / y for x, y in zip(xs, ys) if x is not None and y]


def auto_vs_fixed(cells: Sequence[CellResult]) -> dict[str, dict[str, Any]]:
    """Per batch size with an ``auto`` cell (keys as strings, for JSON); ``best_fixed`` is
    spelt as the cell is (``0``, ``2``, ``4x4/16``)."""
    by_batch: dict[int, dict[Draft, CellResult]] = {}
    for c in cells:
        by_batch.setdefault(c.batch_size, {})[c.draft] = c
    out: dict[str, dict[str, Any]] = {}
    for b in sorted(by_batch):
        row = by_batch[b]
        auto = row.get("auto")
        fixed = {d: c for d, c in row.items() if d != "auto"}
        if auto is None or not fixed:
            continue
        best = max(fixed.values(), key=lambda c: c.output_tok_s)
        tok = auto.output_tok_s / best.output_tok_s if best.output_tok_s else None
        tpot = auto.tpot_mean / best.tpot_mean if auto.tpot_mean and best.tpot_mean else None
        rounds_tok = _ratios(auto.runs_tok_s, best.runs_tok_s)
        rounds_tpot = _ratios(auto.runs_tpot_mean, best.runs_tpot_mean)
        out[str(b)] = {
            "best_fixed": str(best.draft),
            "tok_ratio": tok,
            "tpot_ratio": tpot,
            "meets_bar": bool(tok and tpot and tok >= TOK_BAR and tpot <= TPOT_BAR),
            "round_tok_ratios": rounds_tok,
            "round_tpot_ratios": rounds_tpot,
            "median_round_tok_ratio": statistics.median(rounds_tok) if rounds_tok else None,
            "median_round_tpot_ratio": statistics.median(rounds_tpot) if rounds_tpot else None,
        }
    return out


def format_auto_vs_fixed(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The report's lines: one per batch size."""
    if not rows:
        return []

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}x"

    lines = [
        f"auto against the best fixed cell (bar: tok/s >= {TOK_BAR}x, "
        f"TPOT <= {TPOT_BAR}x; per round: the median of the rounds' paired ratios):"
    ]
    for b, r in rows.items():
        lines.append(
            f"  B={b}: best {r['best_fixed']}, tok/s {num(r['tok_ratio'])}, "
            f"TPOT {num(r['tpot_ratio'])}: {'meets' if r['meets_bar'] else 'MISSES'} the bar; "
            f"per round tok/s {num(r['median_round_tok_ratio'])}, "
            f"TPOT {num(r['median_round_tpot_ratio'])}"
        )
    return lines
