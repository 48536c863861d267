"""When ``auto`` remakes its choice at a batch size, and which plan stands in between.

A replan prices every candidate plan (adaptive.py); on this 2-core CPU it costs 1-2 ms, run
between the forwards with the caches cold, while a step at batch 1 takes about 13 ms. So the
choice is remade periodically per batch size (half-octave buckets), and in between the last
plan made at that batch size stands, if no older than two intervals:

* as it was, for the same batch in the same shape;
* as its depth, for another batch of the same size whose sampling classes it was made for,
  when it was uniform (a large batch changes a request or two almost every step; a small one
  goes one request thinner and back with every request that finishes; a request sampled
  otherwise accepts drafts at another rate and gets a plan of its own).

A plan for a batch of one request keeps its prices instead (``OneRequestPrices``): in between
the replans that price the depths, the depth is chosen again at every step from those prices
and the request's alpha then. At batch 1 a request lives for one or two periodic replans: with
its plan standing, a request that turned out to accept every draft kept the one draft planned
from its first rounds for 20 steps, and one that accepts a draft in three inherited the 8
planned for an easy request before it.

The period is ``replan_every`` steps, or longer where replans would take more than
``PLAN_BUDGET`` of the step time (up to four times as long).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specbatch.scheduler.acceptance import ALPHA_CAP, SamplingClass
from specbatch.scheduler.speculation import StepShape

PLAN_BUDGET = 0.0025  # the share of the step time the periodic replans may take


@dataclass(frozen=True)
class OneRequestPrices:
    """What a replan for a batch of one request priced: the step time of each deepest draft
    it allowed (``inf`` where it did not), and the request's class's position factors."""

    seconds: tuple[float, ...]  # [G + 1]
    factors: tuple[float, ...]  # [G]

    def best(self, alpha: float, cap: int, current: int, switch_margin: float) -> int:
        """The depth with the most expected tokens a second at ``alpha``, up to ``cap``;
        starting or stopping drafting (against ``current``) must win by ``switch_margin``, as
        in ``AdaptiveDraftLength.choose``. Plain Python: it runs at every step at batch 1."""
        rates = [1.0 / self.seconds[0]]
        tokens = gain = 1.0
        for g in range(1, min(cap, len(self.factors)) + 1):
            gain *= min(self.factors[g - 1] * alpha, ALPHA_CAP)
            tokens += gain
            rates.append(tokens / self.seconds[g])
        best = max(range(len(rates)), key=rates.__getitem__)
        stay = min(current, len(rates) - 1)
        if (best == 0) != (stay == 0) and rates[best] < rates[stay] * (1 + switch_margin):
            return stay
        return best


@dataclass(frozen=True)
class Plan:
    """A plan the policy chose, kept for the steps until its next replan."""

    ids: tuple[str, ...]
    shape: StepShape
    step: int  # the policy's decoding step it was made at
    gammas: list[int]
    uniform_depth: int | None  # G when every request got min(G, its cap), else None
    classes: frozenset[SamplingClass]  # the sampling classes of the batch it was made for
    prices: OneRequestPrices | None = None  # a batch of one request: what its replan priced

    @classmethod
    def of(
        cls,
        ids: tuple[str, ...],
        shape: StepShape,
        step: int,
        gammas: list[int],
        caps: list[int],
        classes: frozenset[SamplingClass],
        prices: OneRequestPrices | None = None,
    ) -> Plan:
        depth = max(gammas, default=0)
        uniform = all(g == min(depth, c) for g, c in zip(gammas, caps))
        return cls(ids, shape, step, gammas, depth if uniform else None, classes, prices)


class ReplanClock:
    """Per batch-size bucket: the last plan, and when the next periodic replan is due."""

    def __init__(self, replan_every: int) -> None:
        self.replan_every = replan_every
        self.plans: dict[int, Plan] = {}  # per bucket: the last plan chosen there
        self._next: dict[int, int] = {}  # per bucket: the step count of its next replan
        self._interval: dict[int, int] = {}  # per bucket: steps between its periodic replans
        self._plan_seconds = 0.0  # a replan's time, a moving mean
        self._step_seconds: dict[int, float] = {}  # per bucket: a decoding step's, ditto

    def due(self, bucket: int, seen: int) -> bool:
        """Whether the bucket's ``seen``-th step is a periodic replan."""
        return seen >= self._next.get(bucket, 0)

    def standing(
        self,
        bucket: int,
        step: int,
        ids: tuple[str, ...],
        shape: StepShape,
        caps: list[int],
        classes: frozenset[SamplingClass],
    ) -> list[int] | None:
        """The gammas of the plan that stands for this batch (see the module's docstring), or
        None when it needs a new one. ``step`` is the policy's step count, over all buckets."""
        last = self.plans.get(bucket)
        if last is None or step - last.step >= 2 * self._interval.get(bucket, self.replan_every):
            return None
        if (last.ids, last.shape) == (ids, shape):
            return [min(g, c) for g, c in zip(last.gammas, caps)]
        if last.uniform_depth is not None and classes <= last.classes:
            return [min(last.uniform_depth, c) for c in caps]
        return None

    def prices(self, bucket: int) -> OneRequestPrices | None:
        """The prices of the last plan at this bucket, if it was made for one request."""
        last = self.plans.get(bucket)
        return None if last is None else last.prices

    def record(self, bucket: int, plan: Plan, seen: int, periodic: bool, seconds: float) -> None:
        """A new plan at the bucket's ``seen``-th step, that took ``seconds`` to choose."""
        self.plans[bucket] = plan
        self._plan_seconds += (seconds - self._plan_seconds) / 8
        if periodic:
            self._interval[bucket] = self.interval(bucket)
            self._next[bucket] = seen + self._interval[bucket]

    def observe_step(self, bucket: int, seconds: float) -> None:
        """A decoding step's time at this bucket."""
        mean = self._step_seconds.get(bucket, seconds)
        self._step_seconds[bucket] = mean + (seconds - mean) / 16

    def interval(self, bucket: int) -> int:
        """Steps until the bucket's next periodic replan: ``replan_every``, or more where
        replans would take over ``PLAN_BUDGET`` of the step time (up to 4x)."""
        step_seconds = self._step_seconds.get(bucket)
        if not step_seconds:
            return self.replan_every
        steps = math.ceil(self._plan_seconds / (PLAN_BUDGET * step_seconds))
        return min(max(self.replan_every, steps), 4 * self.replan_every)

    def incumbent_depth(self, bucket: int) -> int | None:
        """The deepest draft of the last plan at this batch size, or, at a new one, at the
        nearest that has a plan (larger first); None before any plan."""
        if not self.plans:
            return None
        nearest = min(self.plans, key=lambda b: (abs(b - bucket), -b))
        return max(self.plans[nearest].gammas, default=0)
