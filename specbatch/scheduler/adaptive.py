"""``num_speculative_tokens="auto"``: each step, the draft lengths of most expected tokens/s.

A plan is a count ``m`` and a depth ``g``: the ``m`` decoding requests of the sampling classes
that accept most draft up to ``g`` tokens each, the others none. Each step the policy runs the
plan of highest ``sum_i E(alpha_i, g_i) / T(plan)`` over the depths ``0 .. max`` and the counts
that split the batch between classes (or take all of it): E is THEORY.md's expected tokens per
round, ``alpha_i`` the request's acceptance (its own tested drafts, leaning on its class's), T
the measured step time (step_times.py). Every ``PROBE_EVERY``-th step at a batch bucket runs a
plan beside the choice, so that the prices around it stay measured. The choice reads only
earlier rounds, so the output distribution is untouched. docs/ADAPTIVE.md has the design.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter

from specbatch.kv_cache.kv_cache_manager import KVCacheManager, blocks_for
from specbatch.request import Request
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.step_times import StepTimes, bucket

PRIOR_ALPHA = 0.6  # the acceptance assumed before any draft was tested
PRIOR_WEIGHT = 32.0  # tested drafts that the rate an alpha leans on counts for
PROBE_EVERY = 16  # steps at a batch bucket from one probe of a plan beside the choice to the next

SamplingClass = tuple[float, float, int, float]


def sampling_class(req: Request) -> SamplingClass:
    """Requests expected to accept drafts alike: greedy ones, or those sampled the same way."""
    p = req.sampling_params
    return (0.0, 1.0, 0, 0.0) if p.greedy else (p.temperature, p.top_p, p.top_k, p.min_p)


def lean(accepted: float, tested: float, prior: float) -> float:
    """A rate's posterior mean, with ``PRIOR_WEIGHT`` pseudo-tests at ``prior``."""
    return (accepted + PRIOR_WEIGHT * prior) / (tested + PRIOR_WEIGHT)


class AdaptiveDraftLength:
    """Per-request draft lengths in ``0 .. max_draft_length``, within the free KV blocks."""

    def __init__(
        self, max_draft_length: int, kv: KVCacheManager | None = None, catch_up: int = 3
    ) -> None:
        """``catch_up``: the tokens a drafting request's drafter reads in a step when it is not
        behind (a draft model one step behind: 1-2, one more after a step without drafts; an
        EAGLE head: the last round's accepted drafts and one more). A step where the drafters
        read more was a catch-up on a backlog, and is not priced."""
        if max_draft_length < 1:
            raise ValueError(f"max_draft_length must be >= 1, got {max_draft_length}")
        self.max_draft_length = max_draft_length
        self.kv = kv
        self.catch_up = catch_up
        self.times = StepTimes()
        self.tested: dict[SamplingClass, list[int]] = {}  # class -> [accepted, tested] drafts
        self._classes: dict[str, SamplingClass] = {}  # the requests of the last plan
        self._steps: Counter[int] = Counter()  # planned steps per batch bucket
        self._probed = False  # the last plan was a probe due by the schedule
        self._retry = False  # ... and its step measured nothing

    def rates(self, requests: list[Request]) -> tuple[list[float], list[float]]:
        """Each request's alpha, and its class's rate: the class's accepted / tested drafts,
        leaning on the rate over every class; a request's, leaning on its class's."""
        accepted = sum(c[0] for c in self.tested.values())
        overall = lean(accepted, sum(c[1] for c in self.tested.values()), PRIOR_ALPHA)
        classes = [sampling_class(r) for r in requests]
        by_class = {c: lean(*self.tested.get(c, (0, 0)), overall) for c in set(classes)}
        rates = [by_class[c] for c in classes]
        alphas = [
            lean(r.spec.accepted, r.spec.accepted + r.spec.rejections, rate)
            for r, rate in zip(requests, rates)
        ]
        return alphas, rates

    # ---- the choice ----------------------------------------------------------------------
    def draft_lengths(self, requests: list[Request]) -> list[int]:
        n, top = len(requests), self.max_draft_length
        if n == 0:
            return []
        self.times.tick(n)
        seen = self._steps[bucket(n)]
        self._steps[bucket(n)] += 1
        retry, self._retry = self._retry, False
        self._classes = {r.request_id: sampling_class(r) for r in requests}
        alphas, rates = self.rates(requests)
        order = sorted(range(n), key=lambda i: -rates[i])
        ranked = [requests[i] for i in order]
        counts = [m for m in range(1, n) if rates[order[m - 1]] != rates[order[m]]] + [n]
        caps = [self._cap(r) for r in ranked]
        room = self._room(ranked, caps)
        unpriced = [
            g for g in range(top + 1) if self.times.price(n, n, g) is None and _fits(room, n, g)
        ]
        if unpriced:  # the first steps ever: one at each depth
            m, g = n, unpriced[0]
        else:
            m, g = self._best([alphas[i] for i in order], caps, counts, room)
            # a probe that measured nothing (a prompt chunk came with it, or the draft caught
            # up) runs again once; from no drafts, where the draft lags every request, only a
            # depth whose price here is borrowed is probed
            turn, phase = divmod(seen + 1, PROBE_EVERY)
            due = turn > 0 and phase == 0
            if (due or retry) and (g > 0 or not self.times.measured(n, 1)):
                m, g = self._beside(m, g, counts, turn)
                self._probed = due
        while g and not _fits(room, m, g):
            g -= 1
        gammas = [0] * n
        for rank, i in enumerate(order[:m]):
            gammas[i] = min(g, caps[rank])
        return gammas

    def _best(
        self, alphas: list[float], caps: list[int], counts: list[int], room: list[list[int]] | None
    ) -> tuple[int, int]:
        """The plan (m, g) of most expected tokens per second (requests in ranked order)."""
        n, top = len(alphas), self.max_draft_length
        gains = []  # gains[k][g]: E(alpha, g) of the k-th request, flat past its cap
        for a, cap in zip(alphas, caps):
            powers = itertools.accumulate(itertools.repeat(a, cap), operator.mul, initial=1.0)
            row = list(itertools.accumulate(powers))
            gains.append(row + [row[-1]] * (top - cap))
        tokens = [list(itertools.accumulate(col)) for col in zip(*gains)]  # [g][m - 1]
        best, best_rate = (n, 0), n / (self.times.price(n, 0, 0) or 1.0)
        for m in counts:
            for g in range(1, top + 1):
                t = self.times.price(n, m, g)
                rate = (tokens[g][m - 1] + n - m) / t if t and _fits(room, m, g) else 0.0
                if rate > best_rate:
                    best, best_rate = (m, g), rate
        return best

    def _beside(self, m: int, g: int, counts: list[int], turn: int) -> tuple[int, int]:
        """A plan next to (m, g), in turn: a draft deeper, a draft shallower, the next count of
        drafting requests down, the next up; next to no drafts, every request drafting one."""
        if g == 0:
            return counts[-1], 1
        i = counts.index(m)
        near = [(m, g - 1), *((counts[j], g) for j in (i - 1, i + 1) if 0 <= j < len(counts))]
        if g < self.max_draft_length:
            near.insert(0, (m, g + 1))
        return near[turn % len(near)]

    def _cap(self, req: Request) -> int:
        """The most drafts the request's length limits leave room for."""
        left = req.max_output_tokens - len(req.output_token_ids) - 1
        return max(0, min(self.max_draft_length, req.max_model_len - req.num_tokens, left))

    def _room(self, requests: list[Request], caps: list[int]) -> list[list[int]] | None:
        """room[g][m]: the free KV blocks left if the first ``m`` requests draft ``g`` (None
        while the free blocks would hold every request's deepest draft)."""
        kv, top = self.kv, self.max_draft_length
        if kv is None or kv.num_free_blocks >= len(requests) * (blocks_for(top, kv.block_size) + 1):
            return None
        need = [
            [kv.blocks_needed(r.request_id, r.num_computed + 1 + min(g, c)) for g in range(top + 1)]
            for r, c in zip(requests, caps)
        ]
        free = kv.num_free_blocks
        return [[free, *(free - s for s in itertools.accumulate(col))] for col in zip(*need)]

    # ---- after the step ------------------------------------------------------------------
    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        """Count each class's tested drafts; price the step if every request in it decoded
        and no draft caught up on more than a step's tokens."""
        decoding = True
        drafting = catch_up = deepest = 0
        for sr in plan.requests:
            r = result.results.get(sr.request_id)
            decoding = decoding and r is not None and len(sr.target_token_ids) == 1
            if r is None or not r.num_proposed:  # an n-gram lookup may propose none
                continue
            c = self._classes.get(sr.request_id)
            if c is not None:
                counts = self.tested.setdefault(c, [0, 0])
                counts[0] += r.num_accepted
                counts[1] += r.num_accepted + (r.num_accepted < r.num_proposed)
            drafting += 1
            catch_up += len(sr.draft_token_ids)
            deepest = max(deepest, r.num_proposed)
        measured = bool(plan.requests) and decoding and catch_up <= self.catch_up * drafting
        if measured:
            self.times.observe(len(plan.requests), drafting, deepest, seconds)
        self._retry, self._probed = self._probed and not measured, False


def _fits(room: list[list[int]] | None, m: int, g: int) -> bool:
    return room is None or room[g][m] >= 0
