"""``num_speculative_tokens="auto"``: a per-request draft length chosen every step for goodput.

Each step the policy picks ``gamma_i`` in ``0 .. max_draft_length`` for every decoding request to
maximise the batch's expected emitted tokens per second::

    sum_i E(alpha_i, gamma_i) / T(plan)

* ``E(a, g) = (1 - a^(g+1)) / (1 - a)`` (THEORY.md), with ``alpha_i`` a Beta-style posterior
  mean: the request's own accepted / tested drafts plus ``prior_strength`` pseudo-draws at the
  alpha of its sampling class (requests with the same temperature, top-p and top-k; counted
  from the rounds this policy observed, leaning on the engine-wide alpha while the class is
  new). Greedy requests and requests sampled at a high temperature accept drafts at very
  different rates, so a request starts near its own kind's rate, not the mix's.
* ``T`` is ``StepCostModel`` (step_cost.py): the forwards the plan would run, as profiled on
  the real models at start-up, corrected per batch size and deepest draft by the observed time
  of every decoding step. The first ``calibration_rounds`` rounds of steps sweep a uniform gamma
  through ``0 .. max`` so that real steps of every length are timed early.
* KV blocks: when given the KV manager, the policy never plans more draft slots than the free
  blocks hold (the scheduler shrinks further if needed; it never preempts for drafts).

The choice reads only counters of earlier rounds and earlier step times, never this round's
random draws, so the output distribution is untouched (exactness holds for any gamma).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request, SpecStats
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.speculation import StepShape
from specbatch.scheduler.step_cost import StepCostModel

ALPHA_CAP = 0.99  # E(a, g) grows without bound in g as a -> 1; keep some doubt
CLASS_PRIOR = 20.0  # pseudo-draws at the engine-wide alpha in a sampling class's alpha

SamplingClass = tuple[float, float, int]


def sampling_class(params: SamplingParams) -> SamplingClass:
    """Requests expected to accept drafts alike: temperature and top-p to 0.05, top-k."""
    return (round(params.temperature * 20) / 20, round(params.top_p * 20) / 20, params.top_k)


class AdaptiveDraftLength:
    """Per-request draft lengths in ``0 .. max_draft_length`` maximising expected tokens/s."""

    def __init__(
        self,
        max_draft_length: int,
        cost_model: StepCostModel,
        kv_cache: KVCacheManager | None = None,
        *,
        prior_alpha: float = 0.7,
        prior_strength: float = 8.0,
        calibration_rounds: int = 1,
        explore_every: int = 16,
        replan_every: int = 4,
        uniform_margin: float = 0.03,
        switch_margin: float = 0.03,
    ) -> None:
        if max_draft_length < 1:
            raise ValueError(f"max_draft_length must be >= 1, got {max_draft_length}")
        self.max_draft_length = max_draft_length
        self.kv = kv_cache
        self.cost = cost_model
        self.prior_alpha = prior_alpha
        self.prior_strength = prior_strength
        self.calibration_steps = calibration_rounds * (max_draft_length + 1)
        self.explore_every = explore_every
        self.replan_every = replan_every  # a batch unchanged since the last step keeps its plan
        self.uniform_margin = uniform_margin
        self.switch_margin = switch_margin
        self.profile_seconds = 0.0  # how long the start-up profile of the passes took
        self.spec = SpecStats()  # every round this policy observed, all requests together
        self.class_spec: dict[SamplingClass, SpecStats] = {}  # the same, per sampling class
        self._class_of: dict[str, SamplingClass] = {}  # the running requests' classes
        self.draft_length_counts: Counter[int] = Counter()  # granted gamma per decoding request
        self._decode_steps = 0  # steps with decoding requests that the policy planned
        self._depth = 0  # the deepest draft of the last plan the policy chose
        self._steps_by_batch: Counter[int] = Counter()  # planned steps per batch-size bucket
        self._per_request_won: dict[int, bool] = {}  # per bucket: did its last search win
        self._last_plan: tuple[tuple[str, ...], StepShape, list[int]] | None = None
        # recent requests' (class, accepted, tested), for the empirical-Bayes prior strength
        self._seen: OrderedDict[str, tuple[SamplingClass, int, int]] = OrderedDict()

    @property
    def lazy_draft(self) -> bool:
        """Whether the draft sees a request's tokens only in the steps it drafts for it (its
        prompt included): while the last plan had no drafts, so that a request that never
        drafts costs no draft work. While the policy drafts, the draft reads prompts in the
        prefill step, with the target, as under a fixed length: a request's first draft then
        does not pay for its whole prompt inside a decoding step, which would show in the time
        per output token."""
        return self._depth == 0

    # ---- estimates ---------------------------------------------------------------------------
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
        prior = self.class_alpha(sampling_class(req.sampling_params))
        a = (s.accepted + self.prior_strength * prior) / (tested + self.prior_strength)
        return min(max(a, 0.0), ALPHA_CAP)

    def _learn_prior_strength(self, requests: list[Request]) -> None:
        """Empirical Bayes: how many pseudo-draws the class alpha is worth in a request's
        estimate, from how much the alphas of recent requests (the last 256 seen, 10+ tested
        drafts each) spread around their class's mean beyond what their own sampling noise
        explains. Requests that draft alike get a strong prior (little noise from a few
        rounds); requests that differ within their class get a weak one (each request's own
        rate counts soon). Called every ``explore_every`` steps, off the per-step path."""
        for r in requests:
            s = r.spec
            key = sampling_class(r.sampling_params)
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
    def draft_lengths(self, requests: list[Request], shape: StepShape | None = None) -> list[int]:
        if not requests:
            return []
        shape = shape or StepShape.decoding(requests)
        for r in requests:
            if r.request_id not in self._class_of:
                self._class_of[r.request_id] = sampling_class(r.sampling_params)
        caps = self._caps(requests)
        step = self._decode_steps
        self._decode_steps += 1
        if step < self.calibration_steps:  # sweep gamma 0..max, uniform over the batch
            g = step % (self.max_draft_length + 1)
            return self._fit_free_blocks(requests, [min(g, c) for c in caps])
        if step % self.explore_every == 0:
            self._learn_prior_strength(requests)
        bucket = self.cost.batch_bucket(shape.num_seqs)
        seen = self._steps_by_batch[bucket]
        self._steps_by_batch[bucket] += 1
        ids = tuple(r.request_id for r in requests)
        last = self._last_plan
        if last is not None and last[:2] == (ids, shape) and seen % self.replan_every:
            # the same batch in the same shape as the last step: its plan stands (the inputs
            # of the choice move little in a step, and on a CPU the choice costs a few
            # percent of a small batch's step)
            gammas = [min(g, c) for g, c in zip(last[2], caps)]
        else:
            gammas = self._plan(requests, caps, shape, bucket, seen)
            self._last_plan = (ids, shape, gammas)
        self._depth = max(gammas, default=0)
        # explore every explore_every-th step at a batch size, and every other one of its first
        # eight: a new batch size has its own costs to learn
        if seen % self.explore_every == self.explore_every - 1 or (seen < 8 and seen % 2):
            gammas = self._explore(gammas, caps, requests)
        return self._fit_free_blocks(requests, gammas)

    def _plan(
        self, requests: list[Request], caps: list[int], shape: StepShape, bucket: int, seen: int
    ) -> list[int]:
        """``choose`` on the requests' estimates."""
        alphas = [self.alpha_of(r) for r in requests]
        lags = [self._amortised_lag(r) for r in requests]
        keys = [self._class_of[r.request_id] for r in requests]
        by_class = {k: self.position_factors(k) for k in set(keys)}
        factors = np.stack([by_class[k] for k in keys], axis=1)
        # the search over per-request plans is most of the policy's time: while it keeps
        # losing to the uniform plans at this batch size, it runs every 8th step only
        search = self._per_request_won.get(bucket, True) or seen % 8 == 0
        gammas = self.choose(alphas, caps, shape, lags, factors, per_request=search)
        if search:
            deepest = max(gammas, default=0)
            self._per_request_won[bucket] = any(g != min(deepest, c) for g, c in zip(gammas, caps))
        return gammas

    @staticmethod
    def _amortised_lag(req: Request) -> float:
        """The draft's catch-up on the request's unseen tokens (its prompt, on its first draft),
        priced per round as if spread over the rounds left: it is paid once, and then the
        request drafts with a lag of a token or two. Paid at once, it would make the first
        draft, or drafting again after a pause, look too dear ever to start; ignored, it would
        start drafting near the end of a request, where it cannot pay off."""
        lag = req.num_tokens - req.num_draft_computed
        rounds_left = max(1.0, (req.max_output_tokens - len(req.output_token_ids)) / 2)
        return 1.0 + max(0, lag - 1) / rounds_left

    def _explore(self, chosen: list[int], caps: list[int], requests: list[Request]) -> list[int]:
        """A plan one draft position shallower or deeper than the chosen one (the one measured
        less at this batch size), so the step times beside the policy's choice stay measured:
        the cost model's correction for a depth the policy never ran would never change. From
        a plan without drafts, only one request in 16 drafts, those the draft lags least: every
        request drafting would make the draft catch up on all the tokens it skipped at once."""
        deepest = max(chosen)
        depths = [g for g in (deepest - 1, deepest + 1) if 0 <= g <= self.max_draft_length]
        g = min(depths, key=lambda d: self.cost.steps_seen(len(requests), d))
        if deepest > 0:
            return [min(g, c) for c in caps]
        lag = [r.num_tokens - r.num_draft_computed for r in requests]
        able = sorted((i for i, c in enumerate(caps) if c > 0), key=lambda i: lag[i])
        picked = set(able[: max(1, len(requests) // 16)])
        return [int(i in picked) for i in range(len(requests))]

    def position_factors(self, key: SamplingClass) -> np.ndarray:
        """[J]: a class's acceptance at each draft position, given the drafts before it were
        accepted, over its alpha (1 where fewer than 50 of its rounds reached the position).
        Later drafts of a round are accepted more often than the first: they follow drafts
        the target agreed with. Measured per class, as the rounds reaching deep positions
        are mostly those of the classes that accept most."""
        factors = np.ones(self.max_draft_length)
        s = self.class_spec.get(key)
        if s is None or not s.accepted:
            return factors
        a = s.accepted / (s.accepted + s.rejections)
        accepted = s.accepted_by_position  # shorter than reached where none was accepted
        for j, reached in enumerate(s.reached_by_position[: len(factors)]):
            if reached >= 50:
                factors[j] = (accepted[j] if j < len(accepted) else 0) / reached / a
        return factors

    def acceptance(self, alphas: Sequence[float], factors: np.ndarray | None = None) -> np.ndarray:
        """[J, n]: the chance that request i's j-th draft is accepted if the ones before it
        were: its alpha times its class's ``position_factors`` ([J, n]; 1 when not given)."""
        a = np.asarray(alphas, dtype=np.float64)[None, :]
        if factors is None:
            return np.minimum(np.ones((self.max_draft_length, 1)) * a, ALPHA_CAP)
        return np.minimum(factors * a, ALPHA_CAP)

    def choose(
        self,
        alphas: Sequence[float],
        caps: Sequence[int],
        shape: StepShape,
        lags: Sequence[float] | None = None,
        factors: np.ndarray | None = None,
        per_request: bool = True,
    ) -> list[int]:
        """Gammas maximising ``sum E(alpha_i, g_i) / T`` over ``g_i <= caps[i]``.

        Two families of plans are priced by the cost model: the uniform ones (every request
        ``min(G, cap)``, G = 0 .. max) and per-request ones. The j-th draft of request i adds
        the chance that it and every draft before it are accepted (``acceptance``), decreasing
        in j (THEORY.md's ``alpha_i^j`` when acceptance is the same at every position); its
        first also makes the draft catch up on the request's ``lags[i]`` unseen tokens (1 when
        not given). For each deepest draft position G (upwards, until the best rate falls),
        the candidate drafts (j <= G) are taken by decreasing gain, and every prefix of that
        order is a plan. A per-request plan must beat the best uniform one by
        ``uniform_margin``: the estimates it leans on are noisy, and uneven progress leaves the
        slow requests to finish in a thinner batch. Drafting after a plan without drafts, or
        not after one with, must beat the last plan's depth by
        ``switch_margin``: flapping between the two makes the draft catch up in bursts.
        ``per_request=False`` prices the uniform plans only.
        """
        n = len(alphas)
        g_max = max(caps, default=0)
        if g_max == 0:
            return [0] * n
        cap = np.asarray(caps)
        lag = np.ones(n) if lags is None else np.asarray(lags, dtype=np.float64)
        gains = np.cumprod(self.acceptance(alphas, factors)[:g_max], axis=0)  # [J, n], j-major

        def seconds(catchup: np.ndarray, drafts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
            return self.cost.predict(
                shape.num_seqs, shape.catchup_tokens + catchup, shape.target_tokens, drafts, sizes
            )

        # uniform plans [G+1, n]
        uniform = np.minimum(np.arange(g_max + 1)[:, None], cap[None, :])
        expected = np.vstack([np.ones(n), 1 + np.cumsum(gains, axis=0)])  # [g, i]: E(tokens)
        tokens = np.take_along_axis(expected, uniform, axis=0)
        sizes = (uniform[:, :, None] >= np.arange(2, g_max + 1)[None, None, :]).sum(axis=1)
        rates = tokens.sum(axis=1) / seconds(
            (lag[None, :] * (uniform > 0)).sum(axis=1), uniform.sum(axis=1), sizes
        )
        u = int(np.argmax(rates))
        # starting or stopping drafting pays a margin, against flapping between the two
        stay = min(self._depth, g_max)
        if (u == 0) != (stay == 0) and rates[u] < rates[stay] * (1 + self.switch_margin):
            u = stay
        best_rate = float(rates[u]) * (1 + self.uniform_margin)
        best = uniform[u]
        if n == 1:  # one request: the uniform plans are all the plans
            return [int(best[0])]
        if not per_request:
            return [int(g) for g in best]

        allowed = np.arange(1, g_max + 1)[:, None] <= cap[None, :]  # [J, n]
        previous = 0.0
        for deepest in range(1, g_max + 1):
            pos_j, pos_i = np.nonzero(allowed[:deepest])
            gain = gains[pos_j, pos_i]
            order = np.argsort(-gain, kind="stable")  # ties: shallower drafts first
            pos_j, pos_i, gain = pos_j[order], pos_i[order], gain[order]
            k = len(gain)
            passes = np.zeros((k, deepest - 1))  # requests in draft passes 2..deepest
            deep = pos_j > 0
            passes[np.nonzero(deep)[0], pos_j[deep] - 1] = 1.0
            catchup = np.cumsum(np.where(pos_j == 0, lag[pos_i], 0.0))
            drafts = np.arange(1, k + 1, dtype=np.float64)
            rate = (n + np.cumsum(gain)) / seconds(catchup, drafts, np.cumsum(passes, axis=0))
            m = int(np.argmax(rate))
            if rate[m] > best_rate * (1 + 1e-9):
                best_rate = float(rate[m])
                best = np.bincount(pos_i[: m + 1], minlength=n)
            elif rate[m] < previous:  # past the best depth: deeper only costs more
                break
            previous = float(rate[m])
        return [int(g) for g in best]

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
        """Learn from a finished step: acceptance counts, and the step time against the plan."""
        for rid in plan.finished_request_ids:
            self._class_of.pop(rid, None)
        for sr in plan.requests:
            if not sr.sample:
                continue
            self.draft_length_counts[sr.num_draft] += 1
            r = result.results.get(sr.request_id)
            if r is not None and sr.num_draft:
                self.spec.record(sr.num_draft, r.num_accepted)
                key = self._class_of.get(sr.request_id)
                if key is not None:
                    self.class_spec.setdefault(key, SpecStats()).record(
                        sr.num_draft, r.num_accepted
                    )
        if all(sr.sample and len(sr.target_token_ids) == 1 for sr in plan.requests):
            self.cost.observe(
                num_seqs=len(plan.requests),
                catchup_tokens=sum(len(sr.draft_token_ids) for sr in plan.requests),
                target_tokens=len(plan.requests),
                gammas=[sr.num_draft for sr in plan.requests],
                step_seconds=step_seconds,
            )
