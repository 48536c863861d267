"""``auto``'s acceptance estimates: each request's alpha, and how acceptance changes along a
round's draft positions, from the rounds the policy observed.

* A request's alpha is a Beta-style posterior mean: its own accepted / tested drafts plus
  ``prior_strength`` pseudo-draws at the alpha of its sampling class (requests with the same
  temperature, top-p and top-k), itself leaning on the engine-wide alpha while the class is
  new. Greedy requests and requests sampled at a high temperature accept drafts at very
  different rates, so a new request starts near its own kind's rate, not the mix's.
* ``prior_strength`` is learned by empirical Bayes from how much recent requests' rates
  spread around their class's mean.
* Position factors, per class: acceptance at draft position j given the drafts before it were
  accepted, over the class's alpha.

Everything here reads counters of finished rounds only, never a round still to be drawn.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from specbatch.request import Request, SpecStats
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import SchedulerOutput, StepResult

ALPHA_CAP = 0.99  # E(a, g) grows without bound in g as a -> 1; keep some doubt
CLASS_PRIOR = 20.0  # pseudo-draws at the engine-wide alpha in a sampling class's alpha
FACTOR_PRIOR = 20.0  # pseudo-rounds at factor 1 in each draft position's factor

SamplingClass = tuple[float, float, int]


def sampling_class(params: SamplingParams) -> SamplingClass:
    """Requests expected to accept drafts alike: temperature and top-p to 0.05, top-k."""
    return (round(params.temperature * 20) / 20, round(params.top_p * 20) / 20, params.top_k)


class AcceptanceEstimates:
    """The alphas and position factors ``AdaptiveDraftLength`` prices its plans with."""

    def __init__(
        self, max_draft_length: int, prior_alpha: float = 0.7, prior_strength: float = 8.0
    ) -> None:
        self.max_draft_length = max_draft_length
        self.prior_alpha = prior_alpha
        self.prior_strength = prior_strength
        self.spec = SpecStats()  # every round observed, all requests together
        self.class_spec: dict[SamplingClass, SpecStats] = {}  # the same, per sampling class
        self._class_of: dict[str, SamplingClass] = {}  # the running requests' classes
        # recent requests' (class, accepted, tested), for the empirical-Bayes prior strength
        self._seen: OrderedDict[str, tuple[SamplingClass, int, int]] = OrderedDict()

    def register(self, requests: list[Request]) -> None:
        """Note the sampling class of requests seen for the first time."""
        for r in requests:
            if r.request_id not in self._class_of:
                self._class_of[r.request_id] = sampling_class(r.sampling_params)

    @property
    def engine_alpha(self) -> float:
        """Engine-wide alpha over the observed rounds, ``prior_alpha`` before any."""
        a = self.spec.alpha
        return self.prior_alpha if a is None else a

    def class_alpha(self, key: SamplingClass) -> float:
        """The alpha of a sampling class: its tested drafts plus ``CLASS_PRIOR`` pseudo-draws at
        the engine-wide alpha."""
        s = self.class_spec.get(key) or SpecStats()
        tested = s.accepted + s.rejections
        return (s.accepted + CLASS_PRIOR * self.engine_alpha) / (tested + CLASS_PRIOR)

    def alpha_of(self, req: Request) -> float:
        """Posterior mean: the request's own tested drafts plus pseudo-draws at its class's
        alpha."""
        s = req.spec
        tested = s.accepted + s.rejections
        key = self._class_of.get(req.request_id) or sampling_class(req.sampling_params)
        prior = self.class_alpha(key)
        a = (s.accepted + self.prior_strength * prior) / (tested + self.prior_strength)
        return min(max(a, 0.0), ALPHA_CAP)

    def learn_prior_strength(self, requests: list[Request]) -> None:
        """Empirical Bayes: how many pseudo-draws the class alpha is worth in a request's
        estimate, from how much the alphas of recent requests (the last 256 seen, 10+ tested
        drafts each) spread around their class's mean beyond what their own sampling noise
        explains. Requests that draft alike get a strong prior (little noise from a few
        rounds); requests that differ within their class get a weak one (each request's own
        rate counts soon). The policy calls it every few steps, off the per-step path."""
        for r in requests:
            s = r.spec
            key = self._class_of.get(r.request_id) or sampling_class(r.sampling_params)
            self._seen[r.request_id] = (key, s.accepted, s.accepted + s.rejections)
            self._seen.move_to_end(r.request_id)
        while len(self._seen) > 256:
            self._seen.popitem(last=False)
        rows = [(k, a, t) for k, a, t in self._seen.values() if t >= 10]
        if len(rows) < 8:
            return
        counts = np.array([(a, t) for _, a, t in rows], dtype=float)
        rates = counts[:, 0] / counts[:, 1]
        keys = [k for k, _, _ in rows]
        means = {k: float(np.mean([r for kk, r in zip(keys, rates) if kk == k])) for k in set(keys)}
        centre = np.array([means[k] for k in keys])
        noise = float(np.mean(centre * (1 - centre) / counts[:, 1]))
        spread = max(float(np.mean((rates - centre) ** 2)) - noise, 1e-4)
        mean = float(rates.mean())
        strength = mean * (1 - mean) / spread - 1
        self.prior_strength = float(np.clip(strength, 2.0, 200.0))

    def position_factors(self, key: SamplingClass) -> np.ndarray:
        """[J]: a class's acceptance at each draft position, given the drafts before it were
        accepted, over its alpha. Later drafts of a round are accepted more often than the
        first: they follow drafts the target agreed with. Measured per class, as the rounds
        reaching deep positions are mostly those of the classes that accept most; each
        position's rate adds ``FACTOR_PRIOR`` pseudo-rounds at the class's alpha (factor 1), so
        a position the policy seldom runs moves off 1 as its rounds come in, not all at once
        after some threshold."""
        factors = np.ones(self.max_draft_length)
        s = self.class_spec.get(key)
        if s is None or not s.accepted:
            return factors
        a = s.accepted / (s.accepted + s.rejections)
        accepted = s.accepted_by_position  # shorter than reached where none was accepted
        for j, reached in enumerate(s.reached_by_position[: len(factors)]):
            hits = accepted[j] if j < len(accepted) else 0
            factors[j] = (hits + FACTOR_PRIOR * a) / (reached + FACTOR_PRIOR) / a
        return factors

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
        by_class = {k: self.position_factors(k) for k in set(keys)}
        return np.stack([by_class[k] for k in keys], axis=1)

    def observe(self, plan: SchedulerOutput, result: StepResult) -> None:
        """Count a finished step's rounds, engine-wide and per class."""
        for rid in plan.finished_request_ids:
            self._class_of.pop(rid, None)
        for sr in plan.requests:
            r = result.results.get(sr.request_id)
            if not sr.sample or r is None or not sr.num_draft:
                continue
            self.spec.record(sr.num_draft, r.num_accepted)
            key = self._class_of.get(sr.request_id)
            if key is not None:
                self.class_spec.setdefault(key, SpecStats()).record(sr.num_draft, r.num_accepted)
