"""Chi-square tests for checking that speculative decoding is exact, on ``scipy.stats``.

Used by the test suite and by ``specbatch verify``: goodness of fit (samples against a known
distribution), homogeneity (two samples, e.g. token sequences with and without speculation),
their power against a total-variation difference, and the total-variation distance itself.

Both tests pool the categories whose expected count is below ``min_expected`` into one bin, so
that the chi-square approximation holds; a pooled bin that is itself too small is merged into
the smallest regular bin.

Power: any distribution q at total-variation distance d from p has a chi-square divergence
sum (q - p)^2 / p >= 4 d^2 (Cauchy-Schwarz), equality for the hardest alternative (mass moved
by a factor 1 +- 2d between two halves of p). With n samples the Pearson statistic is then
asymptotically noncentral chi-square with noncentrality >= 4 n d^2, so ``power`` is a lower bound
on the probability of catching ANY error of total variation d on the test's bins. A difference
inside the pooled bin is invisible: over the categories the test catches d + ``pooled_mass``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize
from scipy import stats as sps


@dataclass
class ChiSquareResult:
    statistic: float
    dof: int
    p_value: float
    bins: int
    pooled_mass: float = 0.0  # expected share of the bin that holds the pooled categories


def power(n: float, dof: int, tv: float, alpha: float) -> float:
    """Lower bound (asymptotic) on the probability that a chi-square test with ``dof`` degrees
    of freedom at level ``alpha`` rejects when the truth is at total-variation distance ``tv``
    over its bins (see the module doc). ``n``: the sample size for goodness of fit, or
    ``n_a * n_b / (n_a + n_b)`` for two samples."""
    if dof <= 0 or tv <= 0:
        return alpha
    return float(sps.ncx2.sf(sps.chi2.isf(alpha, dof), dof, 4.0 * n * tv * tv))


@functools.lru_cache(maxsize=1024)
def noncentrality_for(dof: int, alpha: float, probability: float = 0.9) -> float:
    """The noncentrality at which a chi-square test with ``dof`` degrees of freedom at level
    ``alpha`` rejects with ``probability``."""
    critical = sps.chi2.isf(alpha, dof)

    def short(noncentrality: float) -> float:
        return float(sps.ncx2.sf(critical, dof, noncentrality)) - probability

    high = 1.0
    while short(high) < 0:
        high *= 2.0
    return float(optimize.brentq(short, 0.0, high, xtol=1e-10))


def detectable_tv(n: float, dof: int, alpha: float, probability: float = 0.9) -> float:
    """The total-variation distance that ``power`` catches with ``probability``."""
    return math.sqrt(noncentrality_for(dof, alpha, probability) / (4.0 * n))


def _pool_columns(expected: np.ndarray, min_expected: float) -> list[np.ndarray]:
    """Group column indices: one group per column whose expected count is >= min_expected, and
    the rest pooled; a pooled group below min_expected joins the smallest regular group.

    `expected` is [K] (or [R, K]: a column is small when any of its cells is small).
    """
    smallest = expected if expected.ndim == 1 else expected.min(axis=0)
    big = np.flatnonzero(smallest >= min_expected)
    small = np.flatnonzero(smallest < min_expected)
    groups = [np.array([i]) for i in big]
    if small.size:
        pooled_smallest = (
            expected[small].sum() if expected.ndim == 1 else expected[:, small].sum(axis=1).min()
        )
        if pooled_smallest >= min_expected or not groups:
            groups.append(small)
        else:
            j = int(np.argmin(smallest[big]))
            groups[j] = np.concatenate([groups[j], small])
    return groups


def _pooled_mass(groups: list[np.ndarray], expected: np.ndarray) -> float:
    """Expected count of the group holding several categories (``_pool_columns`` makes at most
    one), 0 if none does."""
    return float(sum(e for g, e in zip(groups, expected) if len(g) > 1))


def chi_square_gof(
    observed: Sequence[int] | np.ndarray,
    expected_probs: Sequence[float] | np.ndarray,
    min_expected: float = 5.0,
) -> ChiSquareResult:
    """Pearson goodness of fit of observed category counts to `expected_probs` (sum ~ 1).

    Categories with expected count < min_expected are pooled (see module doc). Any observation
    in a category of probability exactly 0 is impossible under the hypothesis: the statistic is
    then infinite and the p-value 0.
    """
    obs = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    if obs.shape != probs.shape:
        raise ValueError(f"observed has {obs.size} categories, expected_probs {probs.size}")
    if np.any(obs < 0) or np.any(probs < 0) or not np.all(np.isfinite(probs)):
        raise ValueError("counts and probabilities must be finite and non-negative")
    total_prob = probs.sum()
    if abs(total_prob - 1.0) > 1e-4:
        raise ValueError(f"expected_probs sum to {total_prob}, not 1")
    n = obs.sum()
    if n == 0:
        raise ValueError("no observations")
    if np.any(obs[probs == 0] > 0):
        bins = int(np.count_nonzero(probs)) + 1
        return ChiSquareResult(statistic=math.inf, dof=bins - 1, p_value=0.0, bins=bins)
    support = np.flatnonzero(probs > 0)
    expected = n * probs[support] / total_prob
    obs = obs[support]
    groups = _pool_columns(expected, min_expected)
    e = np.array([expected[g].sum() for g in groups])
    o = np.array([obs[g].sum() for g in groups])
    pooled = _pooled_mass(groups, e) / n
    if len(groups) == 1:
        return ChiSquareResult(0.0, 0, 1.0, 1, pooled)
    statistic, p_value = sps.chisquare(o, e * (o.sum() / e.sum()))
    return ChiSquareResult(float(statistic), len(groups) - 1, float(p_value), len(groups), pooled)


def chi_square_two_sample(
    counts_a: Mapping[Hashable, int],
    counts_b: Mapping[Hashable, int],
    min_expected: float = 5.0,
) -> ChiSquareResult:
    """Chi-square homogeneity test: were the two samples drawn from the same distribution?

    Categories are the union of both mappings' keys (e.g. whole token sequences as tuples). A
    category is pooled when its expected count in either sample is below min_expected. Samples
    of different sizes are fine.
    """
    keys = list(set(counts_a) | set(counts_b))
    table = np.array(
        [[counts_a.get(k, 0) for k in keys], [counts_b.get(k, 0) for k in keys]], dtype=np.float64
    ).reshape(2, len(keys))
    if np.any(table < 0):
        raise ValueError("counts must be non-negative")
    row_totals = table.sum(axis=1)
    if np.any(row_totals == 0):
        raise ValueError("both samples need at least one observation")
    expected = np.outer(row_totals, table.sum(axis=0)) / row_totals.sum()
    groups = _pool_columns(expected, min_expected)
    o = np.stack([table[:, g].sum(axis=1) for g in groups], axis=1)
    pooled = _pooled_mass(groups, o.sum(axis=0)) / row_totals.sum()
    if len(groups) == 1:
        return ChiSquareResult(0.0, 0, 1.0, 1, pooled)
    result = sps.chi2_contingency(o, correction=False)
    return ChiSquareResult(
        float(result.statistic), int(result.dof), float(result.pvalue), len(groups), pooled
    )


def total_variation(
    p: Sequence[float] | np.ndarray | torch.Tensor | Mapping[Hashable, float],
    q: Sequence[float] | np.ndarray | torch.Tensor | Mapping[Hashable, float],
) -> float:
    """Total-variation distance `0.5 * sum |p - q|` between two distributions.

    Accepts arrays/tensors of the same shape (summed over everything) or mappings from category
    to probability (missing keys count as 0). Inputs are used as given, not renormalised.
    """
    if isinstance(p, Mapping) or isinstance(q, Mapping):
        if not (isinstance(p, Mapping) and isinstance(q, Mapping)):
            raise TypeError("total_variation: both arguments must be mappings, or neither")
        keys = set(p) | set(q)
        return 0.5 * sum(abs(float(p.get(k, 0.0)) - float(q.get(k, 0.0))) for k in keys)
    a = p.detach().cpu().double().numpy() if isinstance(p, torch.Tensor) else np.asarray(p, float)
    b = q.detach().cpu().double().numpy() if isinstance(q, torch.Tensor) else np.asarray(q, float)
    if a.shape != b.shape:
        raise ValueError(f"total_variation: shapes {a.shape} and {b.shape} differ")
    return float(0.5 * np.abs(a - b).sum())


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``xs``, linear between order statistics; None if empty."""
    return float(np.percentile(xs, q)) if len(xs) else None
