"""specbatch.stats: pooling, the two tests on their pooled tables, and the power bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from specbatch.stats import (
    chi_square_gof,
    chi_square_two_sample,
    detectable_tv,
    percentile,
    power,
    total_variation,
)


def test_gof_matches_scipy_without_pooling() -> None:
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(12))
    probs = np.maximum(probs, 0.01)
    probs /= probs.sum()
    for n in [2_000, 50_000]:
        obs = rng.multinomial(n, probs)
        ours = chi_square_gof(obs, probs)
        ref = sps.chisquare(obs, n * probs)
        assert ours.bins == 12 and ours.dof == 11
        assert ours.statistic == pytest.approx(ref.statistic, rel=1e-10)
        assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-7)


def test_gof_pools_small_bins() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.02, 0.015, 0.005])
    obs = np.array([41, 29, 19, 7, 3, 0, 1])
    ours = chi_square_gof(obs, probs, min_expected=5.0)
    # n = 100: bins 4..6 have expected 2, 1.5, 0.5 -> pooled (4.0), too small itself, so it joins
    # the smallest regular bin (index 3, expected 6).
    o = np.array([41, 29, 19, 7 + 3 + 0 + 1])
    e = 100 * np.array([0.4, 0.3, 0.2, 0.1])
    ref = sps.chisquare(o, e)
    assert ours.bins == 4 and ours.dof == 3
    assert ours.statistic == pytest.approx(ref.statistic, rel=1e-10)
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-7)

    # With more samples the pooled bin is big enough to stand on its own.
    probs = np.array([0.4, 0.3, 0.2, 0.07, 0.024, 0.004, 0.002])
    obs = np.array([390, 310, 200, 65, 24, 8, 3])
    ours = chi_square_gof(obs, probs)
    o = np.array([390, 310, 200, 65, 24, 8 + 3])
    ref = sps.chisquare(o, 1000 * np.array([0.4, 0.3, 0.2, 0.07, 0.024, 0.006]))
    assert ours.bins == 6
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-7)


def test_gof_impossible_category_gives_zero_p_value() -> None:
    probs = np.array([0.5, 0.5, 0.0])
    result = chi_square_gof([500, 499, 1], probs)
    assert math.isinf(result.statistic) and result.p_value == 0.0
    assert chi_square_gof([500, 500, 0], probs).p_value > 0.5


def test_gof_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        chi_square_gof([1, 2], [0.5, 0.3])  # does not sum to 1
    with pytest.raises(ValueError):
        chi_square_gof([1, 2, 3], [0.5, 0.5])
    with pytest.raises(ValueError):
        chi_square_gof([0, 0], [0.5, 0.5])


def test_gof_detects_wrong_distribution() -> None:
    rng = np.random.default_rng(1)
    p = np.array([0.25, 0.25, 0.25, 0.25])
    obs = rng.multinomial(20_000, [0.27, 0.25, 0.25, 0.23])
    assert chi_square_gof(obs, p).p_value < 1e-6


def test_gof_false_alarm_rate_is_uniform() -> None:
    """Under the null, p-values are ~uniform: about 5% fall below 0.05."""
    rng = np.random.default_rng(2)
    probs = rng.dirichlet(np.ones(20))
    pvals = np.array(
        [chi_square_gof(rng.multinomial(3_000, probs), probs).p_value for _ in range(2_000)]
    )
    assert 0.035 < np.mean(pvals < 0.05) < 0.065
    assert sps.kstest(pvals, "uniform").pvalue > 1e-3


def test_two_sample_matches_scipy() -> None:
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(10) * 5)
    a = rng.multinomial(4_000, probs)
    b = rng.multinomial(6_000, probs)
    counts_a = {("tok", i): int(c) for i, c in enumerate(a)}
    counts_b = {("tok", i): int(c) for i, c in enumerate(b)}
    ours = chi_square_two_sample(counts_a, counts_b)
    ref = sps.chi2_contingency(np.stack([a, b]), correction=False)
    assert ours.bins == 10 and ours.dof == 9
    assert ours.statistic == pytest.approx(ref.statistic, rel=1e-10)
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-7)


def test_two_sample_pools_rare_and_missing_categories() -> None:
    counts_a = {(1,): 300, (2,): 200, (3,): 5, (4,): 3, (5,): 2}
    counts_b = {(1,): 290, (2,): 210, (3,): 4, (6,): 6}
    ours = chi_square_two_sample(counts_a, counts_b)
    # Totals 510 / 510: categories 3..6 have expected counts 4.5, 1.5, 1, 3 -> pooled (10 each).
    table = np.array([[300, 200, 5 + 3 + 2 + 0], [290, 210, 4 + 0 + 0 + 6]])
    ref = sps.chi2_contingency(table, correction=False)
    assert ours.bins == 3 and ours.dof == 2
    assert ours.statistic == pytest.approx(ref.statistic, rel=1e-10)
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-7)


def test_two_sample_detects_different_samples() -> None:
    rng = np.random.default_rng(4)
    keys = [tuple(int(t) for t in rng.integers(0, 5, size=3)) for _ in range(4)]
    a = dict(zip(keys, rng.multinomial(5_000, [0.4, 0.3, 0.2, 0.1]).tolist(), strict=True))
    b = dict(zip(keys, rng.multinomial(5_000, [0.3, 0.3, 0.2, 0.2]).tolist(), strict=True))
    assert chi_square_two_sample(a, b).p_value < 1e-20
    assert chi_square_two_sample(a, a).p_value == pytest.approx(1.0)
    with pytest.raises(ValueError):
        chi_square_two_sample(a, {})


def test_total_variation() -> None:
    assert total_variation([0.5, 0.5], [0.5, 0.5]) == 0.0
    assert total_variation(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == 1.0
    assert total_variation(torch.tensor([0.2, 0.8]), torch.tensor([0.3, 0.7])) == pytest.approx(0.1)
    assert total_variation({"a": 0.5, "b": 0.5}, {"a": 0.25, "c": 0.75}) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        total_variation([0.5, 0.5], [1.0])


@pytest.mark.parametrize(
    ("n", "dof", "alpha"), [(200, 1, 1e-3), (5_000, 19, 2e-4), (700, 150, 0.05)]
)
def test_detectable_tv_is_where_power_reaches_it(n: int, dof: int, alpha: float) -> None:
    d = detectable_tv(n, dof, alpha, 0.9)
    assert power(n, dof, d, alpha) == pytest.approx(0.9, abs=1e-6)
    assert power(n, dof, 0.9 * d, alpha) < 0.9 < power(n, dof, 1.1 * d, alpha)
    assert detectable_tv(4 * n, dof, alpha, 0.9) == pytest.approx(d / 2, rel=1e-6)
    assert power(n, 0, 0.5, alpha) == alpha and power(n, dof, 0.0, alpha) == alpha


def test_power_against_the_hardest_alternative_by_simulation() -> None:
    """The alternative at total variation d with the least chi-square divergence scales half of
    p's mass by 1 + 2d and the other half by 1 - 2d; its rejection rate is what ``power`` says,
    and any other alternative at the same distance is caught more often."""
    rng = np.random.default_rng(1)
    k, n, d, alpha, trials = 16, 3000, 0.04, 0.01, 4000
    p = np.full(k, 1 / k)
    hardest = p * np.where(np.arange(k) < k // 2, 1 + 2 * d, 1 - 2 * d)
    concentrated = p.copy()  # the same distance, all of it moved between two categories
    concentrated[0] += d
    concentrated[1] -= d
    assert total_variation(p, hardest) == pytest.approx(d)
    assert total_variation(p, concentrated) == pytest.approx(d)
    crit = sps.chi2.isf(alpha, k - 1)

    def rejection_rate(q: np.ndarray) -> float:
        obs = rng.multinomial(n, q, size=trials)
        statistic = ((obs - n * p) ** 2 / (n * p)).sum(axis=1)
        return float((statistic >= crit).mean())

    predicted = power(n, k - 1, d, alpha)
    assert 0.3 < predicted < 0.9
    assert rejection_rate(hardest) == pytest.approx(predicted, abs=0.04)
    assert rejection_rate(concentrated) > predicted + 0.1
    assert power(n, k - 1, detectable_tv(n, k - 1, alpha), alpha) == pytest.approx(0.9, abs=1e-6)


def test_pooled_mass_is_reported() -> None:
    probs = np.array([0.5, 0.45, 0.03, 0.01, 0.01])
    res = chi_square_gof(np.array([50, 45, 3, 1, 1]), probs)  # n = 100: the last three pool
    assert res.bins == 3 and res.pooled_mass == pytest.approx(0.05)
    assert chi_square_gof(np.array([500, 450, 30, 10, 10]), probs).pooled_mass == 0.0


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
