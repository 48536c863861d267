"""``num_speculative_tokens="auto"``: a per-request draft length chosen every step for goodput.

Each step the policy picks ``gamma_i`` in ``0 .. max_draft_length`` for every decoding request to
maximise the batch's expected emitted tokens per second::

    sum_i E(alpha_i, gamma_i) / T(plan)

* ``E(a, g) = (1 - a^(g+1)) / (1 - a)`` (THEORY.md), with ``alpha_i`` and the acceptance at
  each draft position from ``AcceptanceEstimates`` (acceptance.py): the request's own drafts,
  leaning on those of its sampling class.
* ``T`` is ``StepCostModel`` (step_cost.py): the forwards the plan would run, as profiled on
  the real models at start-up, corrected per batch size and deepest draft by the observed time
  of every decoding step. The first ``calibration_rounds`` rounds of steps sweep a uniform gamma
  through ``0 .. max`` so that real steps of every length are timed early.
* KV blocks: when given the KV manager, the policy never plans more draft slots than the free
  blocks hold (the scheduler shrinks further if needed; it never preempts for drafts).
* The choice is remade periodically at each batch size; in between, the last plan made there
  stands (``ReplanClock``, replans.py), except that a batch of one request gets the depth for
  its alpha at every step, priced at the last replan (``OneRequestPrices``).

The choice reads only counters of earlier rounds and earlier step times, never this round's
random draws, so the output distribution is untouched (exactness holds for any gamma).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from specbatch.kv_cache.kv_cache_manager import KVCacheManager
from specbatch.request import Request
from specbatch.scheduler.acceptance import AcceptanceEstimates
from specbatch.scheduler.candidate_plans import CandidatePlans, per_request_plans, uniform_plans
from specbatch.scheduler.draft_room import binding, draft_caps, fit_free_blocks
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.replans import OneRequestPrices, Plan, ReplanClock
from specbatch.scheduler.speculation import StepShape
from specbatch.scheduler.step_cost import StepCostModel

PLAUSIBLE = 0.5  # explore plans without drafts while priced at this share of the best or more
FAR_MARGIN = 0.15  # how much a depth far from those measured must win by (see ``_trusted``)


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
        replan_every: int = 8,
        well_measured: int = 24,
        uniform_margin: float = 0.03,
        switch_margin: float = 0.03,
    ) -> None:
        if max_draft_length < 1:
            raise ValueError(f"max_draft_length must be >= 1, got {max_draft_length}")
        self.max_draft_length = max_draft_length
        self.kv = kv_cache
        self.cost = cost_model
        self.estimates = AcceptanceEstimates(max_draft_length, prior_alpha, prior_strength)
        self.calibration_steps = calibration_rounds * (max_draft_length + 1)
        self.explore_every = explore_every
        self.replan_every = replan_every  # steps at a batch size between periodic replans
        self.well_measured = well_measured
        self.uniform_margin = uniform_margin
        self.switch_margin = switch_margin
        self.profile_seconds = 0.0  # how long the start-up profile of the passes took
        self.draft_length_counts: Counter[int] = Counter()  # granted gamma per decoding request
        self._decode_steps = 0  # steps with decoding requests that the policy planned
        self._depth = 0  # the deepest draft of the last plan the policy chose
        self._steps_by_batch: Counter[int] = Counter()  # planned steps per batch-size bucket
        self.replans = ReplanClock(replan_every)
        self._per_request_won: dict[int, bool] = {}  # per bucket: did its last search win
        self._plain_share = 1.0  # the last replan's rate without drafts over its chosen rate
        self._prices: OneRequestPrices | None = None  # the last one-request replan's prices

    @property
    def lazy_draft(self) -> bool:
        """Whether the draft sees a request's tokens only in the steps it drafts for it (its
        prompt included): while the last plan had no drafts, so that a request that never
        drafts costs no draft work. While the policy drafts, the draft reads prompts in the
        prefill step, with the target, as under a fixed length: a request's first draft then
        does not pay for its whole prompt inside a decoding step, which would show in the time
        per output token."""
        return self._depth == 0

    # ---- the choice ----------------------------------------------------------------------------
    def draft_lengths(self, requests: list[Request], shape: StepShape | None = None) -> list[int]:
        if not requests:
            return []
        shape = shape or StepShape.decoding(requests)
        self.estimates.register(requests)
        # the KV manager only while its free blocks may cap a draft (None: no limit)
        kv = self.kv if binding(self.kv, len(requests), self.max_draft_length) else None
        caps = draft_caps(kv, requests, self.max_draft_length)
        step = self._decode_steps
        self._decode_steps += 1
        if step < self.calibration_steps:  # sweep gamma 0..max, uniform over the batch
            g = step % (self.max_draft_length + 1)
            return fit_free_blocks(kv, requests, [min(g, c) for c in caps])
        if step % 256 == 0:  # over the last 256 finished requests: it changes slowly
            self.estimates.learn_priors()
        bucket = self.cost.batch_bucket(shape.num_seqs)
        seen = self._steps_by_batch[bucket]
        self._steps_by_batch[bucket] += 1
        # between replans (replans.py) a plan made at this batch size stands
        ids = tuple(r.request_id for r in requests)
        classes = self.estimates.classes(requests)
        periodic = self.replans.due(bucket, seen)
        gammas = (
            None if periodic else self.replans.standing(bucket, step, ids, shape, caps, classes)
        )
        if gammas is None:
            started = time.perf_counter()
            self._prices = None
            gammas = self._plan(requests, caps, shape, bucket, periodic)
            plan = Plan.of(ids, shape, step, gammas, caps, classes, self._prices)
            self.replans.record(bucket, plan, seen, periodic, time.perf_counter() - started)
        elif len(requests) == 1 and (prices := self.replans.prices(bucket)) is not None:
            alpha = self.estimates.alpha_of(requests[0])
            gammas = [prices.best(alpha, caps[0], self._depth, self.switch_margin)]
        self._depth = max(gammas, default=0)
        if self._explores(seen, len(requests)):
            gammas = self._explore(gammas, caps, requests, seen)
        return fit_free_blocks(kv, requests, gammas)

    def _plan(
        self,
        requests: list[Request],
        caps: list[int],
        shape: StepShape,
        bucket: int,
        periodic: bool,
    ) -> list[int]:
        """``choose`` on the requests' estimates."""
        alphas = [self.estimates.alpha_of(r) for r in requests]
        lags = [self._amortised_lag(r) for r in requests]
        factors = self.estimates.factors_for(requests)
        # the search over per-request plans is most of the policy's time: while it keeps
        # losing to the uniform plans at this batch size, it runs at the periodic replans only
        search = self._per_request_won.get(bucket, True) or periodic
        around = self.replans.incumbent_depth(bucket)
        gammas = self.choose(alphas, caps, shape, lags, factors, per_request=search, around=around)
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

    def _beside(self, depth: int, seen: int) -> list[int]:
        """The depths exploration keeps measured beside a plan of this deepest draft: one
        shallower, one deeper, and 0. A step without drafts differs in kind from the drafting
        ones (no draft pass, nothing to verify or roll back), so its price cannot be read off
        theirs; measured only from plans one position deep, it went unmeasured where the
        policy drafts two or more, and was priced like a drafting step (at batch 8, 13% too
        high: the policy drafted where plain decoding was faster). Only while the last replan
        priced it at ``PLAUSIBLE`` of the chosen plan's rate or more (far below, no error of
        the profile's makes it the better plan, and a step spent on it is a step lost), and
        not among a batch size's first eight steps, where the plan is not settled yet."""
        near = {depth - 1, depth + 1}
        if seen >= 8 and self._plain_share >= PLAUSIBLE:
            near.add(0)
        return sorted(g for g in near - {depth} if 0 <= g <= self.max_draft_length)

    def _explores(self, seen: int, num_seqs: int) -> bool:
        """Whether this step explores: every other one of a batch size's first eight (its costs
        are new), then every ``explore_every``-th while a depth beside the plan's
        (``_beside``) rests on fewer than ``well_measured`` steps, every ``4 * explore_every``-th
        once all do (a step off the best plan costs throughput; the shifts are contrasts with
        the level, slow to age)."""
        if seen < 8:
            return seen % 2 == 1
        every = self.explore_every
        if seen % every != every - 1:  # nor then at four times the period
            return False
        beside = self._beside(self._depth, seen)
        if min(self.cost.steps_seen(num_seqs, g) for g in beside) >= self.well_measured:
            every *= 4
        return seen % every == every - 1

    def _explore(
        self, chosen: list[int], caps: list[int], requests: list[Request], seen: int
    ) -> list[int]:
        """A plan at a depth beside the chosen one's (``_beside``; the one measured least at
        this batch size), so the step times beside the policy's choice stay measured: the cost
        model's correction for a depth the policy never ran would never change. From a plan
        without drafts, only one request in 16 drafts, those the draft lags least: every
        request drafting would make the draft catch up on all the tokens it skipped at once."""
        deepest = max(chosen)
        g = min(self._beside(deepest, seen), key=lambda d: self.cost.steps_seen(len(requests), d))
        if deepest > 0:
            return [min(g, c) for c in caps]
        lag = [r.num_tokens - r.num_draft_computed for r in requests]
        able = sorted((i for i, c in enumerate(caps) if c > 0), key=lambda i: lag[i])
        picked = set(able[: max(1, len(requests) // 16)])
        return [int(i in picked) for i in range(len(requests))]

    def choose(
        self,
        alphas: Sequence[float],
        caps: Sequence[int],
        shape: StepShape,
        lags: Sequence[float] | None = None,
        factors: np.ndarray | None = None,
        per_request: bool = True,
        around: int | None = None,
    ) -> list[int]:
        """Gammas maximising ``sum E(alpha_i, g_i) / T`` over ``g_i <= caps[i]``.

        Two families of plans (candidate_plans.py) are priced by the cost model in one call:
        the uniform ones (every request ``min(G, cap)``, G = 0 .. max) and per-request ones.
        The j-th draft of request i adds the chance that it and every draft before it are
        accepted (``acceptance``), decreasing in j (THEORY.md's ``alpha_i^j`` when acceptance
        is the same at every position); its first also makes the draft catch up on the
        request's ``lags[i]`` unseen tokens (1 when not given). For each deepest draft
        position G (upwards, until the best rate falls), the candidate drafts (j <= G) are
        taken by decreasing gain, and every prefix of that order is a plan. A per-request plan
        must beat the best uniform one by ``uniform_margin``: the estimates it leans on are
        noisy, and uneven progress leaves the slow requests to finish in a thinner batch.
        Drafting after a plan without drafts, or not after one with, must beat the last plan's
        depth by ``switch_margin``: flapping between the two makes the draft catch up in
        bursts.
        ``per_request=False`` prices the uniform plans only.
        ``around``, the deepest draft of the plan this one replaces, limits the new plan's
        deepest draft to one position either side of it, to 0, to a depth whose step time
        rests on ``well_measured`` steps at this batch size (``_trusted``), or to a depth whose
        uniform plan beats the best of those by ``FAR_MARGIN``; None: any depth.
        """
        n = len(alphas)
        g_max = max(caps, default=0)
        if g_max == 0:
            return [0] * n
        cap = np.asarray(caps)
        lag = np.ones(n) if lags is None else np.asarray(lags, dtype=np.float64)
        accept = self.estimates.acceptance(alphas, factors)[:g_max]
        gains = np.cumprod(accept, axis=0)  # [J, n], j-major
        uniform, plans = uniform_plans(gains, cap, lag)
        search = per_request and n > 1  # one request: the uniform plans are all the plans
        if search:
            tail = per_request_plans(gains, cap, lag)
            plans = CandidatePlans.concat(plans, tail.plans)
        seconds = self.cost.predict(
            shape.num_seqs,
            shape.catchup_tokens + plans.catchup,
            shape.target_tokens,
            plans.drafts,
            plans.sizes,
        )
        rates = plans.tokens / seconds
        uniform_rates = rates[: g_max + 1]
        trusted = self._trusted(shape.num_seqs, g_max, around)
        trusted |= uniform_rates >= uniform_rates[trusted].max() * (1 + FAR_MARGIN)
        u = int(np.argmax(np.where(trusted, uniform_rates, -np.inf)))
        # starting or stopping drafting pays a margin, against flapping between the two
        stay = min(self._depth, g_max)
        flips = (u == 0) != (stay == 0)
        if flips and trusted[stay] and rates[u] < rates[stay] * (1 + self.switch_margin):
            u = stay
        best = uniform[u]
        self._plain_share = float(rates[0] / rates[u])
        if n == 1:  # kept for the steps until the next replan (replans.py)
            f = np.ones(g_max) if factors is None else factors[:g_max, 0]
            allowed = np.where(trusted, seconds, np.inf)
            self._prices = OneRequestPrices(tuple(allowed.tolist()), tuple(f.tolist()))
        if not search:
            return [int(g) for g in best]
        best_rate = float(rates[u]) * (1 + self.uniform_margin)
        by_depth = rates[g_max + 1 :].reshape(g_max, -1)  # [deepest, prefix]
        previous = 0.0
        for deepest in range(1, g_max + 1):
            if not trusted[deepest]:
                continue
            m = int(np.argmax(by_depth[deepest - 1]))
            rate = float(by_depth[deepest - 1, m])
            if rate > best_rate * (1 + 1e-9):
                best_rate = rate
                self._plain_share = float(rates[0]) / rate
                best = tail.gammas(deepest, m, n)
            elif rate < previous:  # past the best depth: deeper only costs more
                break
            previous = rate
        return [int(g) for g in best]

    def _trusted(self, num_seqs: int, g_max: int, around: int | None) -> np.ndarray:
        """[g_max + 1] bool: the deepest drafts a plan may have (see ``choose``). The cost model
        prices a depth by the steps measured at it at this batch size; one hardly run there is
        priced from other batch sizes, a few steps and an extrapolation, and errs by tens of
        percent (at batch 2: depths 5-8 priced 5-15% below the profile where the depths run
        there ran 9-20% above it, so the policy jumped from depth 1 to 6-8 for a replan's
        steps). So a plan moves at most one position deeper or shallower per replan, where
        exploration keeps the step times measured, except to plain decoding or to a depth
        measured on ``well_measured`` steps or more at this batch size. ``choose`` opens the
        other depths too where they win by more than such prices err (``FAR_MARGIN``): at batch
        1, a request that accepts nearly every draft (repetitive code) after one that accepts
        two in three wants 8 drafts, not one more than the last plan's 2, and a request lives
        for a few replans only."""
        ok = np.ones(g_max + 1, dtype=bool)
        if around is None:
            return ok
        for g in range(1, g_max + 1):
            ok[g] = abs(g - around) <= 1 or self.cost.steps_seen(num_seqs, g) >= self.well_measured
        return ok

    # ---- after the step ------------------------------------------------------------------------
    def observe(self, plan: SchedulerOutput, result: StepResult, step_seconds: float) -> None:
        """Learn from a finished step: acceptance counts, and the step time against the plan."""
        self.draft_length_counts.update(sr.num_draft for sr in plan.requests if sr.sample)
        self.estimates.observe(plan, result)
        if all(sr.sample and len(sr.target_token_ids) == 1 for sr in plan.requests):
            self.replans.observe_step(self.cost.batch_bucket(len(plan.requests)), step_seconds)
            self.cost.observe(
                num_seqs=len(plan.requests),
                catchup_tokens=sum(len(sr.draft_token_ids) for sr in plan.requests),
                target_tokens=len(plan.requests),
                gammas=[sr.num_draft for sr in plan.requests],
                step_seconds=step_seconds,
            )
