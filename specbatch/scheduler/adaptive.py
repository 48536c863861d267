"""``num_speculative_tokens="auto"``: a per-request draft length chosen every step for goodput.

Each step the policy picks ``gamma_i`` in ``0 .. max_draft_length`` for every decoding request to
maximise the batch's expected emitted tokens per second::

    sum_i E(alpha_i, gamma_i) / T(batch)

* ``E(a, g) = (1 - a^(g+1)) / (1 - a)`` (THEORY.md), with ``alpha_i`` a Beta-style posterior
  mean: the request's own accepted / tested drafts plus ``prior_strength`` pseudo-draws at the
  engine-wide alpha (itself counted from the rounds this policy observed).
* ``T`` is a linear step-time model (``StepCostModel``) in the scheduled sequences (per-request
  work: attention, inputs, the draft's catch-up pass), the prompt tokens (prefill chunks), the
  number of draft passes (the largest gamma: the draft proposes autoregressively, one batched
  pass per position) and the draft tokens (each drafted once and verified once), fitted by
  ridge least squares with exponential forgetting on the observed (plan, step time) pairs.
  Its first ``calibration_steps`` steps cycle a uniform gamma
  through ``0 .. max`` so that the fit sees the real models at every draft length.
* KV blocks: when given the KV manager, the policy never plans more draft slots than the free
  blocks hold (the scheduler shrinks further if needed; it never preempts for drafts).

The choice reads only counters of earlier rounds and earlier step times, never this round's
random draws, so the output distribution is untouched (exactness holds for any gamma).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request, SpecStats
from specbatch.scheduler.output import SchedulerOutput, StepResult

ALPHA_CAP = 0.99  # E(a, g) grows without bound in g as a -> 1; keep some doubt


def step_features(num_seqs: int, prompt_tokens: int, gammas: Sequence[int]) -> list[float]:
    """The cost model's features: [1, sequences, prompt tokens, draft passes, draft tokens].

    Prompt tokens are the target tokens of a step other than each sampling request's last token
    and its drafts: prefill is much cheaper per token than a decode or verify position, so the
    two get separate coefficients (a verify position's cost is in the draft-token one)."""
    g = float(max(gammas, default=0))
    return [1.0, float(num_seqs), float(prompt_tokens), g, float(sum(gammas))]


class StepCostModel:
    """``t = th0 + th1 seqs + th2 prompt_tokens + th3 draft_passes + th4 draft_tokens``, seconds.

    Ridge least squares pulled towards ``prior`` (relative to the mean observed step time, so
    the prior is unit-free) with forgetting factor ``decay``; coefficients are clipped at 0.
    ``theta`` may also be set directly (a synthetic cost model in tests).
    """

    def __init__(
        self,
        prior: Sequence[float] = (1.0, 0.01, 0.001, 0.2, 0.01),
        prior_weight: float = 0.05,
        decay: float = 0.995,
    ) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.prior_weight = prior_weight
        self.decay = decay
        self.xtx = np.zeros((5, 5))
        self.xty = np.zeros(5)
        self.weight = 0.0  # sum of decayed observation weights
        self.time_sum = 0.0  # decayed sum of step times, for the prior's scale
        self.num_observations = 0
        self.theta = self.prior.copy()

    def observe(self, features: Sequence[float], seconds: float) -> None:
        x = np.asarray(features, dtype=np.float64)
        self.xtx = self.decay * self.xtx + np.outer(x, x)
        self.xty = self.decay * self.xty + x * seconds
        self.weight = self.decay * self.weight + 1.0
        self.time_sum = self.decay * self.time_sum + seconds
        self.num_observations += 1
        # The prior, in seconds, scaled by the mean step time; its weight on each coefficient is
        # that of ``prior_weight`` typical observations of the feature (unit-free, weak: the data
        # decide once there are a few steps).
        prior = self.prior * (self.time_sum / self.weight)
        lam = max(self.prior_weight, 1e-6) * np.maximum(np.diag(self.xtx) / self.weight, 1e-9)
        theta = np.linalg.solve(self.xtx + np.diag(lam), self.xty + lam * prior)
        self.theta = np.maximum(theta, 0.0)

    def predict(
        self, num_seqs: int, prompt_tokens: int, draft_passes: int, draft_tokens: int
    ) -> float:
        a, b, c, d, e = (float(v) for v in self.theta)
        return a + b * num_seqs + c * prompt_tokens + d * draft_passes + e * draft_tokens


class AdaptiveDraftLength:
    """Per-request draft lengths in ``0 .. max_draft_length`` maximising expected tokens/s."""

    def __init__(
        self,
        max_draft_length: int,
        kv_cache: KVCacheManager | None = None,
        cost_model: StepCostModel | None = None,
        *,
        prior_alpha: float = 0.7,
        prior_strength: float = 8.0,
        calibration_rounds: int = 2,
        explore_every: int = 64,
    ) -> None:
        if max_draft_length < 1:
            raise ValueError(f"max_draft_length must be >= 1, got {max_draft_length}")
        self.max_draft_length = max_draft_length
        self.kv = kv_cache
        self.cost = cost_model or StepCostModel()
        self.prior_alpha = prior_alpha
        self.prior_strength = prior_strength
        self.calibration_steps = calibration_rounds * (max_draft_length + 1)
        self.explore_every = explore_every
        self.spec = SpecStats()  # every round this policy observed, all requests together
        self.draft_length_counts: Counter[int] = Counter()  # granted gamma per decoding request
        self._decode_steps = 0  # steps with decoding requests that the policy planned
        self._since_draft = 0  # planned steps since the last one with a draft

    # ---- estimates ---------------------------------------------------------------------------
    @property
    def engine_alpha(self) -> float:
        """Engine-wide alpha over the observed rounds, ``prior_alpha`` before any."""
        a = self.spec.alpha
        return self.prior_alpha if a is None else a

    def alpha_of(self, req: Request) -> float:
        """Posterior mean: the request's own tested drafts plus pseudo-draws at the engine alpha."""
        s = req.spec
        tested = s.accepted + s.rejections
        a = (s.accepted + self.prior_strength * self.engine_alpha) / (tested + self.prior_strength)
        return min(max(a, 0.0), ALPHA_CAP)

    def _caps(self, requests: list[Request]) -> list[int]:
        """Per-request gamma caps from max_draft_length and, with the KV manager, free blocks."""
        caps = [self.max_draft_length] * len(requests)
        if self.kv is None:
            return caps
        for i, req in enumerate(requests):
            if self.kv.has_table(req.request_id):
                fits = self.kv.max_slots_within_free(req.request_id) - req.num_computed - 1
                caps[i] = max(0, min(caps[i], fits))
        return caps

    # ---- the choice ----------------------------------------------------------------------------
    def draft_lengths(self, requests: list[Request]) -> list[int]:
        if not requests:
            return []
        caps = self._caps(requests)
        step = self._decode_steps
        self._decode_steps += 1
        if step < self.calibration_steps:  # sweep gamma 0..max, uniform over the batch
            g = step % (self.max_draft_length + 1)
            gammas = [min(g, c) for c in caps]
        elif self._since_draft >= self.explore_every:  # keep alpha and draft costs measured
            gammas = [min(1, c) for c in caps]
        else:
            gammas = self.choose([self.alpha_of(r) for r in requests], caps)
        gammas = self._fit_free_blocks(requests, gammas)
        self._since_draft = 0 if any(gammas) else self._since_draft + 1
        return gammas

    def choose(self, alphas: Sequence[float], caps: Sequence[int]) -> list[int]:
        """Gammas maximising sum E(alpha_i, g_i) / T over g_i <= caps[i].

        For each number of draft passes G, the marginal gain of a request's j-th draft is
        alpha^j, decreasing in j, so taking the largest gains first gives the best numerator for
        every total; the best (G, total) pair wins. Ties keep the smaller choice.
        """
        n = len(alphas)
        base_tokens = float(n)  # every request emits at least one token
        best = (base_tokens / self.cost.predict(n, 0, 0, 0), 0, 0)
        best_gains: list[tuple[float, int]] = []
        for passes in range(1, max(caps, default=0) + 1):
            gains = sorted(
                ((alphas[i] ** j, i) for i in range(n) for j in range(1, min(passes, caps[i]) + 1)),
                key=lambda gi: (-gi[0], gi[1]),
            )
            total = base_tokens
            for k, (gain, _) in enumerate(gains, start=1):
                total += gain
                t = self.cost.predict(n, 0, passes, k)
                if t > 0 and total / t > best[0] * (1 + 1e-9):
                    best = (total / t, passes, k)
                    best_gains = gains[:k]
        gammas = [0] * n
        for _, i in best_gains:
            gammas[i] += 1
        return gammas

    def _fit_free_blocks(self, requests: list[Request], gammas: list[int]) -> list[int]:
        """Shrink the plan, last requests first, so that its new blocks fit in the free ones."""
        if self.kv is None:
            return gammas
        free = self.kv.num_free_blocks
        out = []
        for req, g in zip(requests, gammas):
            while g > 0:
                need = self.kv.blocks_needed(req.request_id, req.num_computed + 1 + g)
                if need <= free:
                    break
                g -= 1
            if g:
                free -= self.kv.blocks_needed(req.request_id, req.num_computed + 1 + g)
            out.append(g)
        return out

    # ---- after the step ------------------------------------------------------------------------
    def observe(self, plan: SchedulerOutput, result: StepResult, step_seconds: float) -> None:
        """Learn from a finished step: acceptance counts and the step time against the plan."""
        gammas = []
        prompt_tokens = 0
        for sr in plan.requests:
            prompt_tokens += len(sr.target_token_ids) - (1 if sr.sample else 0)
            r = result.results.get(sr.request_id)
            if sr.sample:
                gammas.append(sr.num_draft)
                self.draft_length_counts[sr.num_draft] += 1
            if r is not None and sr.num_draft:
                self.spec.record(sr.num_draft, r.num_accepted)
        features = step_features(len(plan.requests), prompt_tokens, gammas)
        self.cost.observe(features, step_seconds)
