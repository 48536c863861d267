"""``num_speculative_tokens="auto"``: each step, the drafts of most expected tokens per second.

Each decoding request's sampling class gets a shape from ``ladder`` (no drafts, chains of 1 ..
``max_draft_length``, trees when ``topk`` > 1), the one that maximises the step's expected tokens
over its priced seconds (Dinkelbach's iteration). Tokens: the class's acceptance (``lean`` on the
rate of every class, priced ``OPTIMISM`` standard errors high) through THEORY.md's chain formula,
each shape cut to the drafts a request's max_tokens leaves room for; a tree's bound, replaced
by its measured yield. Seconds: each pass at its measured row price (row_costs.py) plus, at long
contexts, each request's cached keys at their measured price (``KvPrices``). The choice reads
only earlier steps, so the output law is the target's whatever it picks. docs/ADAPTIVE.md has
the whole argument.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from specbatch.draft_shape import DraftShape
from specbatch.request import Request
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.kv_prices import KvPrices
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.row_costs import RowCosts

PRIOR_ALPHA = 0.6  # the acceptance assumed before any draft was tested
PRIOR_WEIGHT = 32.0  # pseudo-tests a rate leans on its prior with
TREE_PRIOR_ROUNDS = 8.0  # pseudo-rounds a tree's measured yield leans on its bound with
MARGIN = 0.05  # tokens a request a step that drafting must gain over no drafts
REUSE_STEPS = 8  # steps a choice stands while what it reads stays about the same
STANDING_TIMING = 4  # steps of the same requests on a standing choice: one in this many is timed
ALPHA_SLACK = 0.03  # the acceptance a choice stands through
RATE_ROUNDS = 4  # Dinkelbach rounds at most (two or three settle it)
OPTIMISM = 2.0  # standard errors added to an acceptance rate before it is priced
DECODE_ROWS = 65  # a request's rows in a pass up to which its cache reads are priced apart

SamplingClass = tuple[float, float, int, float]
Counts = dict[SamplingClass, int]  # requests of each class in the step
Rooms = dict[SamplingClass, dict[int, int]]  # per class: draft room -> requests with that room
Alphas = dict[SamplingClass, float]
Shapes = dict[SamplingClass, DraftShape]  # a plan: each class's shape


def sampling_class(p: SamplingParams) -> SamplingClass:
    """Requests expected to accept drafts alike: greedy ones, or those sampled the same way."""
    return (0.0, 1.0, 0, 0.0) if p.greedy else (p.temperature, p.top_p, p.top_k, p.min_p)


def lean(accepted: float, tested: float, prior: float) -> float:
    """A rate's posterior mean, with ``PRIOR_WEIGHT`` pseudo-tests at ``prior``."""
    return (accepted + PRIOR_WEIGHT * prior) / (tested + PRIOR_WEIGHT)


def chain_tokens(alpha: float, k: int) -> float:
    """Expected tokens a round of a k-draft chain accepted at ``alpha`` (THEORY.md)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tree_bound(alpha: float, shape: DraftShape) -> float:
    """Tokens a round of a tree, were its levels accepted independently (an upper bound:
    siblings are correlated)."""
    b = max(1.0, min(shape.topk, shape.nodes / max(shape.depth, 1)))
    return chain_tokens(1.0 - (1.0 - alpha) ** b, shape.depth)


def ladder(max_depth: int, topk: int, max_nodes: int) -> list[DraftShape]:
    """The candidate shapes: none, every chain up to ``max_depth``, trees of ``topk``."""
    shapes = [DraftShape.chain(k) for k in range(max_depth + 1)]
    if topk > 1:
        for depth in range(2, max_depth + 1):
            for nodes in sorted({2 * depth, max_nodes}):
                tree = DraftShape(depth, topk, min(nodes, max_nodes))
                if tree.nodes > depth and tree not in shapes:
                    shapes.append(tree)
    return shapes


@dataclass
class _Step:
    """What one step's choice reads, and the plans it priced."""

    counts: Counts
    rooms: Rooms  # the drafts each request's max_tokens leaves room for (a shape is cut to it)
    rates: Alphas  # what each class's acceptance is priced at
    behind: dict[SamplingClass, float]  # the catch-up rows each class's drafts are charged
    prompt_rows: int
    plain: int  # requests decoding without a drafter: a row and a token each, whatever the plan
    contexts: dict[SamplingClass, float]  # each class's mean context a request
    memo: dict[tuple, tuple[float, float | None]] = field(default_factory=dict)


@dataclass
class _Standing:
    """The shapes last handed out, and what they were chosen for."""

    requests: list[Request]
    rows: tuple[int, int]  # prompt rows and plain requests
    rates: Alphas
    shapes: list[DraftShape]
    steps_left: int


def _fitted(
    counts: Counts, plan: Shapes, rooms: Rooms | None
) -> dict[SamplingClass, list[tuple[DraftShape, int]]]:
    """Each class's shape cut to its requests' rooms: (shape, requests drafting it)."""
    if rooms is None:
        return {c: [(plan[c], n)] for c, n in counts.items()}
    return {c: [(plan[c].fit(room), n) for room, n in rooms[c].items()] for c in counts}


class DraftController:
    """Per step and sampling class, a shape from ``ladder`` (the scheduler grants what fits)."""

    def __init__(self, shapes: list[DraftShape], kv: KvPrices | None = None) -> None:
        self.shapes = shapes
        self.kv = kv
        self.shape = max(shapes, key=lambda s: (s.lookahead, s.nodes))
        self.target = RowCosts()
        self.catch_up = RowCosts()  # the drafter's first pass, up to the roots' logits
        self.depth = RowCosts()  # one of its passes per depth after the first, sampling included
        # the rest of a step (sampling, bookkeeping) by the target's rows, drafted or not
        self.rest_plain = RowCosts()
        self.rest_drafting = RowCosts()
        self.tested: dict[SamplingClass, list[float]] = {}  # class -> [accepted, tested]
        self.yields: dict[tuple[SamplingClass, DraftShape], list[float]] = {}  # [tokens, rounds]
        self._class_of: dict[str, SamplingClass] = {}
        self._standing: _Standing | None = None
        self._untimed = 0  # steps served from ``_standing`` since one was timed
        self._served = False  # whether the last call was served from ``_standing``
        self._pricing = 0.0  # seconds spent choosing since the last step was observed

    # ---- expectations --------------------------------------------------------------------
    def class_rate(self, cls: SamplingClass) -> float:
        """The class's acceptance, leaning on the rate over every class."""
        overall = lean(
            sum(c[0] for c in self.tested.values()),
            sum(c[1] for c in self.tested.values()),
            PRIOR_ALPHA,
        )
        acc, tested = self.tested.get(cls, (0.0, 0.0))
        return lean(acc, tested, overall)

    def priced_rate(self, cls: SamplingClass) -> float:
        """The class's acceptance plus ``OPTIMISM`` standard errors: drafts priced on a rate
        low by chance would stop, and with them the tests that would show it."""
        a = self.class_rate(cls)
        known = self.tested.get(cls, (0.0, 0.0))[1] + PRIOR_WEIGHT
        return min(1.0, a + OPTIMISM * math.sqrt(a * (1 - a) / known))

    def tokens(self, cls: SamplingClass, alpha: float, shape: DraftShape) -> float:
        """Expected tokens a round for one request of ``cls`` accepting at ``alpha``."""
        if shape.nodes == 0:
            return 1.0
        if shape.is_chain:
            return chain_tokens(alpha, shape.depth)
        bound = tree_bound(alpha, shape)
        got, rounds = self.yields.get((cls, shape), (0.0, 0.0))
        return (got + TREE_PRIOR_ROUNDS * bound) / (rounds + TREE_PRIOR_ROUNDS)

    # ---- prices --------------------------------------------------------------------------
    def seconds(
        self,
        counts: Counts,
        plan: Shapes,
        prompt_rows: int,
        behind: dict[SamplingClass, float] | None = None,
        rooms: Rooms | None = None,
        contexts: dict[SamplingClass, float] | None = None,
    ) -> float | None:
        """Seconds of a step where each class drafts its shape (cut to its requests' ``rooms``),
        ``behind`` its drafter's catch-up rows, ``contexts`` its mean cached tokens."""
        fitted = _fitted(counts, plan, rooms)
        rows = prompt_rows + sum(n * (1 + s.nodes) for c in counts for s, n in fitted[c])
        t = self.target.seconds(rows)
        if t is None:
            return None
        catch_up = sum(behind[c] for c in counts if behind and plan[c].nodes)
        if catch_up:
            t += self.catch_up.seconds(catch_up) or 0.0
        depth = max(s.depth for c in counts for s, _ in fitted[c])
        for d in range(1, depth):  # one drafter pass per depth after the first
            beam = sum(n * s.topk for c in counts for s, n in fitted[c] if s.depth > d)
            t += self.depth.seconds(beam) or 0.0
        plain_rows = prompt_rows + sum(counts.values())
        rest = self.rest_plain.seconds(plain_rows) or 0.0
        if depth:  # at least what the same step without drafts pays
            rest = max(rest, self.rest_drafting.seconds(rows) or 0.0)
        return t + rest + (self._kv_seconds(fitted, contexts) if contexts else 0.0)

    def _kv_seconds(
        self,
        fitted: dict[SamplingClass, list[tuple[DraftShape, int]]],
        contexts: dict[SamplingClass, float],
    ) -> float:
        """What a plan's passes pay for the cached keys they read: the target's rows of a
        request share one read of its context; each drafter row reads the drafter's view."""
        kv, t = self.kv, 0.0
        for c, shapes in fitted.items():
            view = self._view_read(contexts[c])
            for s, n in shapes:
                if kv is not None and kv.target is not None:
                    t += n * kv.target.seconds(contexts[c], 1 + s.nodes)
                if s.nodes:  # its first pass, then every node of a depth after the first
                    t += n * view * (1 + s.nodes - min(s.topk, s.nodes))
        return t

    def _view_read(self, context: float) -> float:
        """Seconds one drafter row pays for a request of ``context`` cached tokens."""
        kv = self.kv
        if kv is None or kv.draft is None:
            return 0.0
        view = context if kv.draft_view is None else min(context, kv.draft_view)
        return kv.draft.seconds(view, 1)

    # ---- the choice ----------------------------------------------------------------------
    def draft_shapes(
        self, requests: list[Request], prompt_rows: int = 0, plain: int = 0
    ) -> list[DraftShape]:
        """Each request's shape. The seconds this call takes are left out of the step's
        seconds ``observe`` prices: they are the choice's, not the plan's."""
        start = time.perf_counter()
        try:
            return self._shapes(requests, prompt_rows, plain)
        finally:
            self._pricing += time.perf_counter() - start

    def _shapes(self, requests: list[Request], prompt_rows: int, plain: int) -> list[DraftShape]:
        if not requests:
            return []
        shapes = self._as_before(requests, prompt_rows, plain)
        self._served = shapes is not None
        if shapes is not None:
            return shapes
        classes = [sampling_class(r.sampling_params) for r in requests]
        self._class_of = {r.request_id: c for r, c in zip(requests, classes, strict=True)}
        if self.target.level is None:  # nothing priced yet
            return [DraftShape()] * len(requests)
        step = self.read(requests, prompt_rows, plain)
        plan = self._fastest(step, {c: DraftShape() for c in step.counts})
        shapes = [plan[c] for c in classes]
        self._standing = _Standing(
            list(requests), (prompt_rows, plain), step.rates, shapes, REUSE_STEPS - 1
        )
        return shapes

    def read(self, requests: list[Request], prompt_rows: int = 0, plain: int = 0) -> _Step:
        """What the choice for ``requests`` reads."""
        groups: dict[SamplingClass, list[Request]] = defaultdict(list)
        for r in requests:
            groups[sampling_class(r.sampling_params)].append(r)
        rates = {c: self.priced_rate(c) for c in groups}
        return _Step(
            counts={c: len(rs) for c, rs in groups.items()},
            rooms={c: self._rooms(rs) for c, rs in groups.items()},
            rates=rates,
            behind={c: self._catch_up(rs, rates[c]) for c, rs in groups.items()},
            prompt_rows=prompt_rows,
            plain=plain,
            contexts={c: sum(r.num_tokens for r in rs) / len(rs) for c, rs in groups.items()},
        )

    def _as_before(
        self, requests: list[Request], prompt_rows: int, plain: int
    ) -> list[DraftShape] | None:
        """The shapes last handed out, for the very same requests and prompt rows, for at most
        ``REUSE_STEPS`` steps while each class's acceptance stays within ``ALPHA_SLACK``."""
        s = self._standing
        if s is None or s.steps_left <= 0 or s.rows != (prompt_rows, plain):
            return None
        if len(s.requests) != len(requests) or any(
            a is not b for a, b in zip(s.requests, requests, strict=True)
        ):
            return None
        if any(abs(self.priced_rate(c) - a) > ALPHA_SLACK for c, a in s.rates.items()):
            return None
        s.steps_left -= 1
        return s.shapes

    def _rooms(self, requests: list[Request]) -> dict[int, int]:
        """How many of ``requests`` have room for each number of drafts before their
        max_tokens (beyond the largest shape's lookahead: that many)."""
        most = self.shape.lookahead
        rooms: dict[int, int] = defaultdict(int)
        for r in requests:
            rooms[min(most, max(0, r.max_output_tokens - len(r.output_token_ids) - 1))] += 1
        return dict(rooms)

    def _catch_up(self, requests: list[Request], alpha: float) -> float:
        """The drafter's catch-up rows charged to this round: a round's tokens in full, the
        lag beyond them spread over the rounds each request has left."""
        per_round = chain_tokens(alpha, self.shape.depth)
        charge = 0.0
        for r in requests:
            lag = r.num_tokens - r.num_draft_computed
            rounds_left = max(1.0, (r.max_output_tokens - len(r.output_token_ids)) / per_round)
            charge += min(lag, per_round) + max(0.0, lag - per_round) / rounds_left
        return charge

    def _estimate(self, step: _Step, plan: Shapes) -> tuple[float, float | None]:
        """Expected tokens and seconds of ``plan`` (each computed once a step)."""
        key = tuple(sorted(plan.items()))
        got = step.memo.get(key)
        if got is None:
            counts = step.counts
            fitted = _fitted(counts, plan, step.rooms)
            tokens = step.plain + sum(
                n * self.tokens(c, step.rates[c], s) for c in counts for s, n in fitted[c]
            )
            rows = step.prompt_rows + step.plain
            got = step.memo[key] = (
                tokens,
                self.seconds(counts, plan, rows, step.behind, step.rooms, step.contexts),
            )
        return got

    def _value(self, step: _Step, plan: Shapes, rate: float) -> float:
        """Expected tokens less what the step's seconds are worth at ``rate``."""
        tokens, seconds = self._estimate(step, plan)
        return float("-inf") if seconds is None else tokens - rate * seconds

    def _fastest(self, step: _Step, none: Shapes) -> Shapes:
        """The plan of most tokens a second in the step's decoding (Dinkelbach: the plan of
        most value at a rate, then the rate it makes, until the rate stops rising), starting
        at what no drafts make."""
        bare = dataclasses.replace(step, prompt_rows=0, memo={}) if step.prompt_rows else None
        tokens, seconds = self._estimate(bare or step, none)
        rate = tokens / (seconds or 1.0)
        plan = none
        for _ in range(RATE_ROUNDS):
            trial = self._best(step, bare, rate, none)
            tokens, seconds = self._estimate(bare or step, trial)
            if trial == plan or not seconds or tokens / seconds <= rate:
                break
            plan, rate = trial, tokens / seconds
        return plan

    def _best(self, step: _Step, bare: _Step | None, rate: float, plan: Shapes) -> Shapes:
        """The plan of most value at ``rate``, by ``MARGIN`` over ``plan`` (no drafts) and, in
        a step carrying prompts, also in ``bare`` (the step without them)."""
        n = sum(step.counts.values())
        best = self._value(step, plan, rate) + MARGIN * n
        floor = 0.0 if bare is None else self._value(bare, plan, rate) + MARGIN * n
        classes = sorted(step.counts, key=lambda c: -step.counts[c])
        for _ in range(1 if len(classes) == 1 else 2):
            for c in classes:
                others = {s.topk for d, s in plan.items() if d != c and s.nodes}
                for shape in self.shapes:
                    if shape.nodes and others and shape.topk not in others:
                        continue  # one number of children per node in a step
                    trial = {**plan, c: shape}
                    value = self._value(step, trial, rate)
                    if value > best and (bare is None or self._value(bare, trial, rate) > floor):
                        plan, best = trial, value
        return plan

    # ---- after the step ------------------------------------------------------------------
    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        """Count each class's tested drafts and trees' yields; price the passes it ran."""
        seconds, self._pricing = max(seconds - self._pricing, 1e-6), 0.0
        drafted = 0
        for sr in plan.requests:
            r = result.results.get(sr.request_id)
            if r is None or not r.num_proposed:
                continue
            drafted += 1
            cls = self._class_of.get(sr.request_id)
            if cls is None:
                continue
            rejected = r.rejected if r.rejected is not None else r.num_accepted < r.num_proposed
            counts = self.tested.setdefault(cls, [0.0, 0.0])
            counts[0] += r.num_accepted
            counts[1] += r.num_accepted + rejected
            if not sr.shape.is_chain:
                y = self.yields.setdefault((cls, sr.shape), [0.0, 0.0])
                y[0], y[1] = y[0] + r.num_accepted + 1, y[1] + 1
        if self._served:  # the same requests on a standing choice: one step in a few timed
            self._untimed = (self._untimed + 1) % STANDING_TIMING
            if self._untimed:
                return
        self.time_step(plan, result, seconds, drafted > 0)

    def time_step(
        self, plan: SchedulerOutput, result: StepResult, seconds: float, drafted: bool
    ) -> None:
        """Price the passes a step ran (less their cache reads) and the rest of its
        ``seconds``."""
        target_kv, draft_row = self._kv_of(plan)
        passes = 0.0
        target_rows = 0
        for model, rows, secs in result.passes:
            kv = target_kv if model == "target" else draft_row * rows
            {"target": self.target, "catch-up": self.catch_up, "draft": self.depth}[model].observe(
                rows, max(secs - kv, 0.05 * secs)
            )
            passes += secs
            target_rows += rows if model == "target" else 0
        if target_rows:
            rest = self.rest_drafting if drafted else self.rest_plain
            rest.observe(target_rows, max(seconds - passes, 1e-6))

    def _kv_of(self, plan: SchedulerOutput) -> tuple[float, float]:
        """The seconds ``plan``'s target pass spent reading its decoding requests' caches, and
        one drafter row's (the mean over its drafting requests)."""
        if self.kv is None:
            return 0.0, 0.0
        target, views = 0.0, []
        for r in plan.requests:
            rows = len(r.target_token_ids) + r.num_draft
            context = r.target_start + rows
            if self.kv.target is not None and rows <= DECODE_ROWS:
                target += self.kv.target.seconds(context, rows)
            if r.num_draft:
                views.append(self._view_read(context))
        return target, (sum(views) / len(views) if views else 0.0)
