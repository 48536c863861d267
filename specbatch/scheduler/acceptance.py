"""``auto``'s acceptance estimates: each request's alpha, and how acceptance changes along a
round's draft positions, from the rounds the policy observed.

* A request's alpha is a posterior mean given its own accepted / tested drafts, under a prior
  of its sampling class (requests with the same temperature, top-p and top-k): greedy
  requests and requests sampled at a high temperature accept drafts at very different rates,
  so a new request starts near its own kind's rate, not the mix's. Once the class has
  ``MIN_REQUESTS`` finished requests, the prior is a histogram fitted to theirs
  (``GridPrior``, alpha_prior.py). Before that, a Beta: ``prior_strength`` pseudo-draws at the
  class's alpha (itself leaning on the engine-wide alpha while the class is new), with
  ``prior_strength`` learned by empirical Bayes from how much finished requests' rates spread
  around their class's mean.
* Position factors, per class: acceptance at draft position j given the drafts before it were
  accepted, over what the requests' own alphas predicted for those same rounds.

Everything here reads counters of finished rounds only, never a round still to be drawn.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.alpha_prior import MIN_REQUESTS, GridPrior
from specbatch.scheduler.output import SchedulerOutput, StepResult

ALPHA_CAP = 0.99  # E(a, g) grows without bound in g as a -> 1; keep some doubt
CLASS_PRIOR = 20.0  # pseudo-draws at the engine-wide alpha in a sampling class's alpha
FACTOR_PRIOR = 20.0  # pseudo-acceptances at factor 1 in each draft position's factor
REFIT_AFTER = 32  # finished requests of a class before its histogram prior is refitted

SamplingClass = tuple[float, float, int]


def sampling_class(params: SamplingParams) -> SamplingClass:
    """Requests expected to accept drafts alike: temperature and top-p to 0.05, top-k."""
    return (round(params.temperature * 20) / 20, round(params.top_p * 20) / 20, params.top_k)


def beta_prior_strength(rows: Sequence[tuple[SamplingClass, int, int]]) -> float | None:
    """Empirical Bayes (method of moments): the pseudo-draws at its class's mean that a
    request's alpha is worth, from finished requests' (class, accepted, tested) with 10+ tested
    drafts each: the spread of their rates around their class's mean beyond what their own
    sampling noise explains. None with fewer than 8 such requests; clipped to 2..200."""
    rows = [(k, a, t) for k, a, t in rows if t >= 10]
    if len(rows) < 8:
        return None
    counts = np.array([(a, t) for _, a, t in rows], dtype=float)
    rates = counts[:, 0] / counts[:, 1]
    index: dict[SamplingClass, int] = {}
    cls = np.array([index.setdefault(k, len(index)) for k, _, _ in rows])
    centre = (np.bincount(cls, weights=rates) / np.bincount(cls))[cls]
    noise = float(np.mean(centre * (1 - centre) / counts[:, 1]))
    spread = max(float(np.mean((rates - centre) ** 2)) - noise, 1e-4)
    mean = float(rates.mean())
    return float(np.clip(mean * (1 - mean) / spread - 1, 2.0, 200.0))


class AcceptanceEstimates:
    """The alphas and position factors ``AdaptiveDraftLength`` prices its plans with."""

    def __init__(
        self, max_draft_length: int, prior_alpha: float = 0.7, prior_strength: float = 8.0
    ) -> None:
        self.max_draft_length = max_draft_length
        self.prior_alpha = prior_alpha
        self.prior_strength = prior_strength
        # drafts [accepted, tested] over every round observed, and per sampling class (a
        # round tests its drafts up to its first rejection)
        self.counts = [0, 0]
        self.class_counts: dict[SamplingClass, list[int]] = {}
        self._class_of: dict[str, SamplingClass] = {}  # the running requests' classes
        self._own: dict[str, list[int]] = {}  # the running requests' [accepted, tested] drafts
        # per class and draft position: [drafts accepted, acceptances the alphas predicted]
        self._calibration: dict[SamplingClass, list[list[float]]] = {}
        # finished requests' (class, accepted, tested), for the empirical-Bayes prior strength
        self._seen: OrderedDict[str, tuple[SamplingClass, int, int]] = OrderedDict()
        self._seen_changed = False
        self.priors: dict[SamplingClass, GridPrior] = {}  # per class, once learned
        self._finished_since_fit: dict[SamplingClass, int] = {}

    def register(self, requests: list[Request]) -> None:
        """Note the sampling class of requests seen for the first time."""
        for r in requests:
            if r.request_id not in self._class_of:
                self._class_of[r.request_id] = sampling_class(r.sampling_params)

    def classes(self, requests: list[Request]) -> frozenset[SamplingClass]:
        """The sampling classes of (registered) requests."""
        return frozenset(self._class_of[r.request_id] for r in requests)

    @property
    def engine_alpha(self) -> float:
        """Engine-wide alpha over the observed rounds, ``prior_alpha`` before any."""
        accepted, tested = self.counts
        return accepted / tested if tested else self.prior_alpha

    def class_alpha(self, key: SamplingClass) -> float:
        """The alpha of a sampling class: its tested drafts plus ``CLASS_PRIOR`` pseudo-draws at
        the engine-wide alpha."""
        accepted, tested = self.class_counts.get(key, (0, 0))
        return (accepted + CLASS_PRIOR * self.engine_alpha) / (tested + CLASS_PRIOR)

    def alpha_of(self, req: Request) -> float:
        """The posterior mean of the request's alpha given its own tested drafts."""
        s = req.spec
        key = self._class_of.get(req.request_id) or sampling_class(req.sampling_params)
        return self._posterior(key, s.accepted, s.accepted + s.rejections)

    def _posterior(
        self, key: SamplingClass, accepted: int, tested: int, class_alpha: float | None = None
    ) -> float:
        """Under the class's histogram prior once learned, else a Beta around ``class_alpha``
        (computed when not given)."""
        prior = self.priors.get(key)
        if prior is not None:
            return min(prior.estimate(accepted, tested), ALPHA_CAP)
        if class_alpha is None:
            class_alpha = self.class_alpha(key)
        a = (accepted + self.prior_strength * class_alpha) / (tested + self.prior_strength)
        return min(max(a, 0.0), ALPHA_CAP)

    def learn_priors(self) -> None:
        """Refit the histogram prior of each class with ``MIN_REQUESTS`` finished requests and
        ``REFIT_AFTER`` finished since its last fit (from the last 256 finished requests), and
        relearn ``prior_strength``. The policy calls it every 256 steps, off the per-step
        path."""
        self.learn_prior_strength()
        due = [k for k, n in self._finished_since_fit.items() if n >= REFIT_AFTER]
        for key in due:
            rows = [(a, t) for k, a, t in self._seen.values() if k == key and t > 0]
            if len(rows) >= MIN_REQUESTS:
                counts = np.array(rows, dtype=np.float64)
                self.priors[key] = GridPrior(counts[:, 0], counts[:, 1], self.priors.get(key))
                self._finished_since_fit[key] = 0

    def learn_prior_strength(self) -> None:
        """Empirical Bayes: how many pseudo-draws the class alpha is worth in a request's
        estimate, from how much the alphas of recently finished requests (the last 256, 10+
        tested drafts each) spread around their class's mean beyond what their own sampling
        noise explains. Requests that draft alike get a strong prior (little noise from a few
        rounds); requests that differ within their class get a weak one (each request's own
        rate counts soon). Recomputed only when requests finished since the last call."""
        if not self._seen_changed:
            return
        self._seen_changed = False
        strength = beta_prior_strength(list(self._seen.values()))
        if strength is not None:
            self.prior_strength = strength

    def position_factors(self, key: SamplingClass) -> np.ndarray:
        """[J]: how a class's drafts at each position were accepted, given the drafts before
        them were, over what the requests' alphas (as estimated before each round) predicted
        for the same rounds, with ``FACTOR_PRIOR`` pseudo-acceptances at factor 1. Later
        drafts of a round are accepted more often than the first: they follow drafts the
        target agreed with. Against each round's own alpha, not the class's: the rounds that
        reach deep positions are mostly those of the requests that accept most, and a class
        rate there would count their higher alpha twice."""
        return np.array(self._factors(key))

    def _factors(self, key: SamplingClass) -> list[float]:
        """``position_factors`` as a list (plain Python: it runs at every replan, between the
        forwards, where each NumPy call finds the CPU's caches cold)."""
        hits, predicted = self._calibration.get(key, ([], []))
        j = self.max_draft_length
        factors = [(h + FACTOR_PRIOR) / (p + FACTOR_PRIOR) for h, p in zip(hits[:j], predicted)]
        return factors + [1.0] * (j - len(factors))

    def acceptance(self, alphas: Sequence[float], factors: np.ndarray | None = None) -> np.ndarray:
        """[J, n]: the chance that request i's j-th draft is accepted if the ones before it
        were: its alpha times its class's ``position_factors`` ([J, n]; 1 when not given)."""
        a = np.asarray(alphas, dtype=np.float64)[None, :]
        if factors is None:
            return np.minimum(np.ones((self.max_draft_length, 1)) * a, ALPHA_CAP)
        return np.minimum(factors * a, ALPHA_CAP)

    def factors_for(self, requests: list[Request]) -> np.ndarray:
        """[J, n]: the position factors of each (registered) request's class."""
        keys = [self._class_of[r.request_id] for r in requests]
        by_class = {k: self._factors(k) for k in set(keys)}
        return np.array([by_class[k] for k in keys]).T

    def observe(self, plan: SchedulerOutput, result: StepResult) -> None:
        """Count a finished step's rounds: engine-wide, per class, and per class and position
        against the alpha each request had before its round."""
        for rid in plan.finished_request_ids:
            key = self._class_of.pop(rid, None)
            own = self._own.pop(rid, None)
            if key is not None and own is not None:
                self._seen[rid] = (key, own[0], own[1])
                self._seen_changed = True
                # the first fit as soon as the class has MIN_REQUESTS, then every REFIT_AFTER
                since = self._finished_since_fit.get(key, REFIT_AFTER - MIN_REQUESTS) + 1
                self._finished_since_fit[key] = since
                if len(self._seen) > 256:
                    self._seen.popitem(last=False)
        class_alphas: dict[SamplingClass, float] = {}  # as they were before this step
        for sr in plan.requests:
            r = result.results.get(sr.request_id)
            if not sr.sample or r is None or not sr.num_draft:
                continue
            accepted, tested = r.num_accepted, min(r.num_accepted + 1, sr.num_draft)
            key = self._class_of.get(sr.request_id)
            if key is not None:
                prior = class_alphas.get(key)
                if prior is None:
                    prior = class_alphas[key] = self.class_alpha(key)
                own = self._own.setdefault(sr.request_id, [0, 0])
                alpha = self._posterior(key, own[0], own[1], prior)
                hits, predicted = self._calibration.setdefault(key, [[], []])
                if len(hits) < tested:
                    hits.extend([0.0] * (tested - len(hits)))
                    predicted.extend([0.0] * (tested - len(predicted)))
                for j in range(tested):
                    hits[j] += j < accepted
                    predicted[j] += alpha
                own[0] += accepted
                own[1] += tested
                counts = self.class_counts.setdefault(key, [0, 0])
                counts[0] += accepted
                counts[1] += tested
            self.counts[0] += accepted
            self.counts[1] += tested
