"""``auto``'s histogram prior over request alphas (alpha_prior.py) and how the acceptance
estimates switch to it. Simulated requests with known alphas, fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest

from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.acceptance import sampling_class
from specbatch.scheduler.alpha_prior import GRID, MIN_REQUESTS, TABLE_DRAFTS, GridPrior
from tests.test_adaptive import finish, make_request, observe_rounds, policy


def two_kinds(n: int, seed: int, drafts: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` requests, four in five at alpha 0.6 and one in five at 0.95: (alphas, accepted,
    tested)."""
    rng = np.random.default_rng(seed)
    alphas = np.where(rng.random(n) < 0.2, 0.95, 0.6)
    accepted = rng.binomial(drafts, alphas).astype(np.float64)
    return alphas, accepted, np.full(n, float(drafts))


def test_the_prior_finds_both_kinds_of_request() -> None:
    _, accepted, tested = two_kinds(400, seed=0)
    prior = GridPrior(accepted, tested)
    assert prior.weights.sum() == pytest.approx(1.0)
    assert prior.weights[GRID > 0.85].sum() == pytest.approx(0.2, abs=0.05)
    assert prior.weights[(GRID > 0.45) & (GRID < 0.75)].sum() == pytest.approx(0.8, abs=0.05)
    assert prior.mean == pytest.approx(0.8 * 0.6 + 0.2 * 0.95, abs=0.02)


def test_estimates_are_posterior_means_under_the_histogram() -> None:
    _, accepted, tested = two_kinds(200, seed=1)
    prior = GridPrior(accepted, tested)
    for a, t in [(0, 0), (0, 3), (3, 3), (5, 10), (9, 10), (60, 100), (TABLE_DRAFTS, TABLE_DRAFTS)]:
        post = prior.weights * GRID**a * (1 - GRID) ** (t - a)
        assert prior.estimate(a, t) == pytest.approx(float(post @ GRID / post.sum()), abs=1e-4)
    assert prior.estimate(0, 0) == pytest.approx(prior.mean, abs=1e-5)
    # past the table: the same rate over TABLE_DRAFTS drafts
    assert prior.estimate(300, 400) == prior.estimate(96, TABLE_DRAFTS)


def test_after_a_few_drafts_the_histogram_estimates_alphas_better_than_a_beta() -> None:
    # 300 finished requests teach the prior; 2000 new ones are estimated after 10 drafts each.
    # A Beta with the same mean and spread (method of moments) cannot be bimodal: it pulls
    # the easy requests far down towards the mean and leaves the others too spread.
    _, accepted, tested = two_kinds(300, seed=2)
    prior = GridPrior(accepted, tested)
    alphas, seen, drafts = two_kinds(2000, seed=3, drafts=10)
    grid = np.array([prior.estimate(int(a), 10) for a in seen])
    mean, var = alphas.mean(), alphas.var()
    strength = mean * (1 - mean) / var - 1
    beta = (seen + strength * mean) / (drafts + strength)
    grid_error, beta_error = np.mean((grid - alphas) ** 2), np.mean((beta - alphas) ** 2)
    assert grid_error < 0.8 * beta_error
    easy = alphas == 0.95
    assert grid[easy].mean() > beta[easy].mean() + 0.03  # followed towards their own kind


def test_a_class_estimates_under_its_histogram_once_enough_requests_finished() -> None:
    p = policy(4, (1.0, 0.0), (0.1, 0.0), calibration_rounds=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=200)
    key = sampling_class(greedy)
    for i in range(MIN_REQUESTS):
        req = make_request(f"r{i}", 4, 200)
        req.sampling_params = greedy
        observe_rounds(p, req, [(1, 1), (1, 0)] * 10 if i % 4 else [(1, 1)] * 20)
        p.estimates.learn_priors()
        assert key not in p.estimates.priors  # the Beta until MIN_REQUESTS finished
        finish(p, req)
    p.estimates.learn_priors()
    prior = p.estimates.priors[key]
    new = make_request("new", 4, 200)
    new.sampling_params = greedy
    p.draft_lengths([new])
    assert p.estimates.alpha_of(new) == pytest.approx(prior.mean, abs=1e-5)
    new.spec.record(4, 4)  # four drafts accepted: most likely one of the easy quarter
    assert p.estimates.alpha_of(new) > 0.85
    hot = make_request("hot", 4, 200)
    hot.sampling_params = SamplingParams(temperature=1.0, max_tokens=200)
    p.draft_lengths([hot])
    assert sampling_class(hot.sampling_params) not in p.estimates.priors  # a class of its own
