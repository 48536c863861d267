"""Two samples of token sequences compared position by position (``specbatch verify``).

At position j every sequence falls into one cell: its first j + 1 tokens when that prefix is
among the frequent ones; else its previous and its own token, when that pair is; else its own
token, when that is; else the pooled cell of rare continuations. A cell is thus one token in
the context of a prefix bin as fine as the samples allow, and the test at position j compares
the two samples' laws of (prefix bin, token). The cells come from both samples together (so the
choice favours neither), the most frequent first, each expected at least ``MIN_EXPECTED`` times
in either sample, at most ``MAX_CELLS`` of them: capping the cells caps the degrees of freedom,
which is what sets the power for a given number of samples (``specbatch.stats.power``).

Each position gets a chi-square homogeneity test at ``alpha / m`` for m positions (Bonferroni),
so the whole fails an exact engine with probability at most ``alpha``; the p-value reported is
``min(1, m * smallest p)``, and what the whole catches is the largest of the positions'
detectable differences.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from specbatch.stats import chi_square_two_sample, detectable_tv, noncentrality_for

MAX_CELLS = 20  # per position, the pooled cell included
MIN_EXPECTED = 5.0
POOLED = "pooled"


@dataclass
class PositionResult:
    position: int  # 0-based: the token's index in the generated sequence
    cells: int  # after pooling, the pooled cell included
    statistic: float
    p_value: float
    pooled_share: float  # share of both samples in the pooled cell
    detectable_tv: float | None  # caught with the stated probability; None: one cell, no test

    @property
    def dof(self) -> int:
        return self.cells - 1


@dataclass
class SequenceComparison:
    positions: list[PositionResult]
    alpha: float
    probability: float  # the power at which ``detectable_tv`` is stated

    @property
    def p_value(self) -> float:
        """Bonferroni: the smallest position's p-value times the number of positions."""
        smallest = min((r.p_value for r in self.positions), default=1.0)
        return min(1.0, smallest * len(self.positions))

    @property
    def detectable_tv(self) -> float | None:
        """The largest of the tested positions' detectable differences; None if none was."""
        tested = [r.detectable_tv for r in self.positions if r.detectable_tv is not None]
        return max(tested) if tested else None

    @property
    def worst_position(self) -> PositionResult | None:
        return min(self.positions, key=lambda r: r.p_value, default=None)


def position_cells(
    seqs: Sequence[tuple[int, ...]], j: int, min_count: float, max_cells: int = MAX_CELLS
) -> list[Hashable]:
    """The cell of every sequence at position ``j`` (see the module doc).

    Candidates are the token, the (previous, current) pair and the whole prefix, each kept when
    at least ``min_count`` sequences share it; the ``max_cells - 1`` most frequent are chosen (a
    token before its refinements, which are never more frequent), each sequence goes to the
    finest chosen one that matches it, and cells left below ``min_count`` join the pooled one.
    """
    keys: list[Callable[[tuple[int, ...]], tuple[int, ...]]] = [lambda s: s[j : j + 1]]
    if j >= 1:
        keys.append(lambda s: s[: j + 1])
    if j >= 2:
        keys.insert(1, lambda s: s[j - 1 : j + 1])
    table = [[key(s) for s in seqs] for key in keys]
    counts: Counter[tuple[int, tuple[int, ...]]] = Counter()
    for level, column in enumerate(table):
        counts.update((level, k) for k in column)
    frequent = sorted((-c, level, k) for (level, k), c in counts.items() if c >= min_count)
    chosen = {(level, k) for _, level, k in frequent[: max_cells - 1]}
    cells: list[Hashable] = [POOLED] * len(seqs)
    for level, column in enumerate(table):
        for i, k in enumerate(column):
            if (level, k) in chosen:
                cells[i] = (level, k)
    sizes = Counter(cells)
    return [c if sizes[c] >= min_count else POOLED for c in cells]


def compare_positions(
    a: Sequence[tuple[int, ...]],
    b: Sequence[tuple[int, ...]],
    alpha: float,
    probability: float = 0.9,
    max_cells: int = MAX_CELLS,
) -> SequenceComparison:
    """Test, position by position, whether samples ``a`` and ``b`` come from one law."""
    if not a or not b:
        raise ValueError("both samples need at least one sequence")
    both = [*a, *b]
    positions = max(len(s) for s in both)
    min_count = MIN_EXPECTED * len(both) / min(len(a), len(b))
    n = len(a) * len(b) / len(both)
    results = []
    for j in range(positions):
        cells = position_cells(both, j, min_count, max_cells)
        res = chi_square_two_sample(Counter(cells[: len(a)]), Counter(cells[len(a) :]))
        results.append(
            PositionResult(
                position=j,
                cells=res.bins,
                statistic=res.statistic,
                p_value=res.p_value,
                pooled_share=cells.count(POOLED) / len(both),
                detectable_tv=(
                    detectable_tv(n, res.dof, alpha / positions, probability)
                    if res.dof > 0
                    else None
                ),
            )
        )
    return SequenceComparison(results, alpha, probability)


def samples_for(
    tv: float,
    positions: int,
    alpha: float,
    probability: float = 0.9,
    max_cells: int = MAX_CELLS,
) -> int:
    """Samples per side with which ``compare_positions`` catches ``tv`` at every position with
    ``probability``, however many cells the positions turn out to have."""
    return math.ceil(
        noncentrality_for(max_cells - 1, alpha / positions, probability) / (2.0 * tv * tv)
    )
