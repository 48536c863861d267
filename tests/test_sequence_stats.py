"""specbatch.sequence_stats: the cells of each token, the false-alarm rate of the whole and the
power it states, by simulation on Markov chains whose laws are known."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from specbatch.sequence_stats import (
    MAX_CELLS,
    POOLED,
    compare_positions,
    position_cells,
    samples_for,
)


def test_cells_prefer_frequent_prefixes_then_pairs_then_tokens() -> None:
    seqs = (
        [(1, 2, 3)] * 30  # a frequent whole prefix
        + [(4, 2, 3)] * 3  # its pair (2, 3) with other prefixes...
        + [(5, 2, 3)] * 3
        + [(6, 2, 3)] * 3  # ...frequent together
        + [(7, 8, 3)] * 4  # token 3 after other pairs
        + [(7, 8, 9)] * 2  # rare
    )
    cells = position_cells(seqs, 2, min_count=6)
    assert cells[0] == (2, (1, 2, 3))
    assert set(cells[30:39]) == {(1, (2, 3))}
    assert set(cells[39:43]) == {POOLED}  # token 3's remainder: 4 < 6
    assert set(cells[43:]) == {POOLED}
    first = position_cells(seqs, 0, min_count=6)
    assert Counter(first) == Counter({(0, (1,)): 30, (0, (7,)): 6, POOLED: 9})


def test_cells_are_capped_most_frequent_first() -> None:
    seqs = [(t,) for t in range(40) for _ in range(10 + t)]
    cells = position_cells(seqs, 0, min_count=5, max_cells=6)
    assert {c for c in cells if c != POOLED} == {(0, (t,)) for t in range(35, 40)}


def _markov_samples(
    rng: np.random.Generator, start: np.ndarray, trans: np.ndarray, n: int, length: int
) -> list[tuple[int, ...]]:
    vocab = len(start)
    tokens = np.empty((n, length), dtype=np.int64)
    tokens[:, 0] = rng.choice(vocab, size=n, p=start)
    cum = trans.cumsum(axis=1)
    for j in range(1, length):
        u = rng.random(n)[:, None]
        tokens[:, j] = np.minimum((u > cum[tokens[:, j - 1]]).sum(axis=1), vocab - 1)
    return [tuple(row) for row in tokens.tolist()]


def _chain(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    start = rng.dirichlet(np.full(vocab, 0.5))
    trans = rng.dirichlet(np.full(vocab, 0.3), size=vocab)
    return start, trans


def test_false_alarm_rate_is_at_most_alpha() -> None:
    rng = np.random.default_rng(0)
    alpha, trials = 0.05, 200
    start, trans = _chain(rng, 30)
    rejected = 0
    for _ in range(trials):
        a = _markov_samples(rng, start, trans, 400, 4)
        b = _markov_samples(rng, start, trans, 500, 4)
        rejected += compare_positions(a, b, alpha).p_value < alpha
    # Bonferroni keeps the rate at or below alpha; 0.09 is 2.6 standard errors above 0.05.
    assert rejected / trials < 0.09


def test_a_difference_of_the_stated_size_is_caught_as_often_as_stated() -> None:
    """Three tokens drawn independently from 16 equally likely ones; the alternative tilts the
    third token's law the hardest way at the stated distance d (half of the tokens scaled by
    1 + 2d, half by 1 - 2d), which scales every cell of that token the same way. It must be
    caught with probability about 0.9: the bound is exact for this alternative."""
    rng = np.random.default_rng(1)
    vocab, n, alpha, trials = 16, 2000, 1e-3, 100
    uniform = np.full(vocab, 1 / vocab)

    def draw(third: np.ndarray) -> list[tuple[int, ...]]:
        cols = [rng.choice(vocab, size=n, p=uniform) for _ in range(2)]
        cols.append(rng.choice(vocab, size=n, p=third))
        return [tuple(row) for row in np.stack(cols, axis=1).tolist()]

    d = compare_positions(draw(uniform), draw(uniform), alpha).positions[2].detectable_tv
    assert d is not None and 0.05 < d < 0.15
    tilted = uniform * np.where(np.arange(vocab) < vocab // 2, 1 + 2 * d, 1 - 2 * d)
    caught = sum(
        compare_positions(draw(tilted), draw(uniform), alpha).p_value < alpha for _ in range(trials)
    )
    assert 0.8 <= caught / trials <= 0.98


def test_samples_for_gives_the_difference_asked() -> None:
    n = samples_for(0.05, 5, 1e-3)
    rng = np.random.default_rng(2)
    start, trans = _chain(rng, 64)
    a = _markov_samples(rng, start, trans, n, 5)
    b = _markov_samples(rng, start, trans, n, 5)
    c = compare_positions(a, b, 1e-3)
    assert all(p.cells <= MAX_CELLS for p in c.positions)
    assert c.detectable_tv is not None and c.detectable_tv <= 0.05
    assert samples_for(0.1, 5, 1e-3) == pytest.approx(n / 4, abs=1)


def test_bonferroni_p_value_and_refusals() -> None:
    a = [(1, 2)] * 50 + [(2, 2)] * 50
    b = [(1, 2)] * 90 + [(2, 2)] * 10
    c = compare_positions(a, b, 1e-3)
    assert c.positions[0].p_value < 1e-6
    assert c.p_value == pytest.approx(2 * c.positions[0].p_value)
    assert c.positions[1].cells == 2 and c.positions[1].detectable_tv is not None
    same = compare_positions([(1, 1)] * 10, [(1, 1)] * 10, 1e-3)
    assert same.p_value == 1.0 and same.detectable_tv is None
    with pytest.raises(ValueError):
        compare_positions([], [(1,)], 0.01)
