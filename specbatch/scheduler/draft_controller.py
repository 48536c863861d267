"""``num_speculative_tokens="auto"``: each step, the drafts of most expected tokens per second.

For the decoding requests of a step, every candidate shape of a small ladder (no drafts, chains
of 1 .. ``max_draft_length``, and, when ``topk`` > 1, trees of that many children per node) is
priced by what this machine's passes cost and what the requests are expected to accept; the
step runs the best. docs/ADAPTIVE.md explains it; the choice reads only earlier steps, so the
output law is the target's whatever it picks.

Tokens. A sampling class's ``alpha`` (accepted / tested drafts of its requests) leans on the
rate of every class (``PRIOR_WEIGHT`` pseudo-tests), starting at ``PRIOR_ALPHA``. A draft deeper
in a chain may be accepted less often (the drafter reads more of its own guesses), so each class
also counts its chains' tests and acceptances at each depth: the acceptance at depth d is that
rate, leaning on the class's. A request's own record is not read: a few rounds of it are noise,
and a shape chosen because a request looked lucky yields less than priced. A chain of k drafts
yields ``1 + a_1 + a_1 a_2 + ... + a_1 ... a_k`` tokens a round (THEORY.md's
``E(a, k) = (1 - a^(k+1)) / (1 - a)`` when every ``a_d`` is ``a``), cut to the drafts the
request's max_tokens leaves room for. A tree of depth D accepts
level d with at most ``1 - (1 - a_d)^b`` (b its children per level); its expectation from that
bound is replaced, as rounds come in, by what trees of that shape yielded in its class.

Seconds. A step costs the target's pass over all its rows (the prompt chunks it carries
included, and what admissions will add), the drafter's passes (its first over what it catches
up on, one per depth after that over the requests' beams), and the rest of the step (sampling,
bookkeeping: by the target's rows, prompts included, measured in steps that draft and in
steps that do not; a step that drafts pays at least what the same step without drafts pays),
each measured (row_costs.py). At long contexts a pass also reads every request's cached keys,
whatever its rows: that part is priced per cached token (``KvPrices``, measured at start-up),
by each request's context for the target and by what the drafter's view of it holds for the
drafter, and left out of what the row prices learn.

The choice. The plan of most tokens a second in the step's decoding: the plan of highest
``tokens - rate * seconds`` with ``rate`` first what the same requests make a second without
drafts and without prompts, then what the plan chosen makes, until it stops rising
(Dinkelbach's iteration). So drafting stops where verifying rows or drafting passes cost more
than the tokens they bring, a chain stops where a deeper draft's tokens come slower than the
chain's own, and a step that carries prompts is priced at its margin. Requests of the step
decoding without a drafter (admitted while it slept) are part of its decoding: a row and a
token each whatever the plan, so drafts for the others are weighed against every token the
step makes. Each sampling class gets
its own shape (two sweeps of choosing one class's shape with the others fixed), all drafting
classes of a step with the same children per node.
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
from specbatch.scheduler.draft_yield import PRIOR_WEIGHT, chain_tokens, lean, tree_bound
from specbatch.scheduler.kv_prices import KvPrices
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.row_costs import RowCosts

PRIOR_ALPHA = 0.6  # the acceptance assumed before any draft was tested
TREE_PRIOR_ROUNDS = 8.0  # pseudo-rounds a tree's measured yield leans on its bound with
PROBE_EVERY = 32  # steps between two probes of another plan (keeps its figures fresh)
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
Rates = tuple[float, ...]  # the acceptance at each depth 1, 2, ...
Shapes = dict[SamplingClass, DraftShape]  # a plan: each class's shape


def sampling_class(p: SamplingParams) -> SamplingClass:
    """Requests expected to accept drafts alike: greedy ones, or those sampled the same way."""
    return (0.0, 1.0, 0, 0.0) if p.greedy else (p.temperature, p.top_p, p.top_k, p.min_p)


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
    alphas: Alphas
    rates: dict[SamplingClass, Rates]
    behind: dict[SamplingClass, float]  # the catch-up rows each class's drafts are charged
    prompt_rows: int
    plain: int  # requests decoding without a drafter: a row and a token each, whatever the plan
    contexts: dict[SamplingClass, float]  # each class's mean context a request
    memo: dict[tuple, tuple[float, float | None]] = field(default_factory=dict)

    def near(self, other: _Step) -> bool:
        """Whether a choice priced reading ``other`` stands for this step: the same batch,
        rooms and prompt rows, each class's acceptance within ``ALPHA_SLACK`` and its catch-up
        rows a request within a factor of four (one more or fewer draft accepted last round
        moves them; a request arriving with its whole prompt to catch up on does not stay
        near)."""
        if (self.counts, self.rooms, self.prompt_rows, self.plain) != (
            other.counts,
            other.rooms,
            other.prompt_rows,
            other.plain,
        ):
            return False
        for c, n in self.counts.items():
            if abs(self.alphas[c] - other.alphas[c]) > ALPHA_SLACK:
                return False
            if abs(math.log2((1 + self.behind[c] / n) / (1 + other.behind[c] / n))) > 2:
                return False
            if abs(math.log2((1 + self.contexts[c]) / (1 + other.contexts[c]))) > 0.1:
                return False
        return True


@dataclass
class _Choice:
    """A choice that later steps reading about the same reuse."""

    read: _Step
    plan: Shapes
    steps_left: int


def _fitted(
    counts: Counts, plan: Shapes, rooms: Rooms | None
) -> dict[SamplingClass, list[tuple[DraftShape, int]]]:
    """Each class's shape cut to its requests' rooms: (shape, requests drafting it)."""
    if rooms is None:
        return {c: [(plan[c], n)] for c, n in counts.items()}
    return {c: [(plan[c].fit(room), n) for room, n in rooms[c].items()] for c in counts}


class DraftController:
    """Per step and sampling class, a shape from ``ladder``; within the free KV blocks the
    scheduler grants what fits."""

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
        # class -> [accepted, tested] of its chains' drafts at each depth
        self.by_depth: dict[SamplingClass, list[list[float]]] = {}
        self.yields: dict[tuple[SamplingClass, DraftShape], list[float]] = {}  # [tokens, rounds]
        self._class_of: dict[str, SamplingClass] = {}
        self._steps: defaultdict[int, int] = defaultdict(int)
        self._choice: _Choice | None = None
        # the requests, prompt rows and plain requests the standing choice was last handed out
        # for, and its shapes
        self._standing: tuple[list[Request], tuple[int, int], list[DraftShape], _Choice] | None = (
            None
        )
        self._untimed = 0  # steps served from ``_standing`` since one was timed
        self._served = False  # whether the last call was served from ``_standing``
        self._idle = 0  # steps since a plan last drafted (the probes' loss is paid from it)
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

    def depth_rates(self, cls: SamplingClass) -> Rates:
        """The class's acceptance at each depth, leaning on its rate, plus ``OPTIMISM``
        standard errors of a rate read from as many tests as the class has had: a rate read
        from a few tests may be low by chance, and drafts priced on it would stop, and with
        them the tests that would show it."""
        rate = self.class_rate(cls)
        counts = self.by_depth.get(cls, [])
        known = self.tested.get(cls, (0.0, 0.0))[1] + PRIOR_WEIGHT
        rates = []
        for d in range(max(self.shape.depth, 1)):
            a = lean(*(counts[d] if d < len(counts) else (0.0, 0.0)), rate)
            rates.append(min(1.0, a + OPTIMISM * math.sqrt(a * (1 - a) / known)))
        return tuple(rates)

    def tokens(self, cls: SamplingClass, rates: Rates, shape: DraftShape) -> float:
        """Expected tokens a round for one request of ``cls`` accepting at ``rates``."""
        if shape.nodes == 0:
            return 1.0
        if shape.is_chain:
            return chain_tokens(rates, shape.depth)
        bound = tree_bound(rates, shape)
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
        """Seconds of a step where each class drafts its shape (cut to each request's room,
        ``rooms``); ``behind``: the catch-up rows each class's drafts are charged
        (``_catch_up``); ``contexts``: each class's mean context a request."""
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
        if kv is None:
            return t
        for c, shapes in fitted.items():
            view = self._view_read(contexts[c])
            for s, n in shapes:
                if kv.target is not None:
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
        seconds ``observe`` prices: a priced step (every probe is one) would otherwise charge
        the pricing to the plan it ran, and no drafts, run only by probes, would look dearer
        than they are."""
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
        groups: dict[SamplingClass, list[Request]] = defaultdict(list)
        for c, r in zip(classes, requests, strict=True):
            groups[c].append(r)
        self._class_of = {r.request_id: c for r, c in zip(requests, classes, strict=True)}
        none = {c: DraftShape() for c in groups}
        if self.target.level is None:  # nothing priced yet
            return [DraftShape()] * len(requests)
        alphas = {c: self.class_rate(c) for c in groups}
        rates = {c: self.depth_rates(c) for c in groups}
        step = _Step(
            counts={c: len(rs) for c, rs in groups.items()},
            rooms={c: self._rooms(rs) for c, rs in groups.items()},
            alphas=alphas,
            rates=rates,
            behind={c: self._catch_up(rs, rates[c]) for c, rs in groups.items()},
            prompt_rows=prompt_rows,
            plain=plain,
            contexts={c: sum(r.num_tokens for r in rs) / len(rs) for c, rs in groups.items()},
        )
        n = len(requests)
        self._steps[n] += 1
        probe = self._steps[n] % PROBE_EVERY == 0
        choice = self._choice
        if probe or choice is None or not choice.steps_left or not step.near(choice.read):
            plan, rate = self._fastest(step, none)
            if probe:
                plan = self._runner_up(step, rate, plan, groups)
            choice = _Choice(step, plan, REUSE_STEPS)
            if not probe:  # a probe's plan is not the choice
                self._choice = choice
        choice.steps_left -= 1
        plan = choice.plan
        self._idle = 0 if any(s.nodes for s in plan.values()) else self._idle + 1
        shapes = [plan[c] for c in classes]
        self._standing = (list(requests), (prompt_rows, plain), shapes, choice)  # not a probe's
        return shapes

    def _as_before(
        self, requests: list[Request], prompt_rows: int, plain: int
    ) -> list[DraftShape] | None:
        """The shapes handed out last, for the very same requests and prompt rows while the
        choice stands, each class's acceptance has stayed within ``ALPHA_SLACK`` and no probe
        is due: what pricing would mostly find again, at a fraction of its cost (pricing every
        step of a batch-1 run cost several percent of its steps). Else None."""
        standing = self._standing
        if standing is None:
            return None
        before, rows, shapes, choice = standing
        if choice is not self._choice or choice.steps_left <= 0:
            return None
        if rows != (prompt_rows, plain) or len(before) != len(requests):
            return None
        if any(a is not b for a, b in zip(before, requests, strict=True)):
            return None
        if any(abs(self.class_rate(c) - a) > ALPHA_SLACK for c, a in choice.read.alphas.items()):
            return None
        n = len(requests)
        if (self._steps[n] + 1) % PROBE_EVERY == 0:
            return None
        self._steps[n] += 1
        choice.steps_left -= 1
        self._idle = 0 if any(s.nodes for s in shapes) else self._idle + 1
        return shapes

    def _rooms(self, requests: list[Request]) -> dict[int, int]:
        """How many of ``requests`` have room for each number of drafts before their
        max_tokens (beyond the largest shape's lookahead: that many)."""
        most = self.shape.lookahead
        rooms: dict[int, int] = defaultdict(int)
        for r in requests:
            rooms[min(most, max(0, r.max_output_tokens - len(r.output_token_ids) - 1))] += 1
        return dict(rooms)

    def _catch_up(self, requests: list[Request], rates: Rates) -> float:
        """The rows the drafter's first pass reads for ``requests`` before drafting, as a
        charge on this round: a round's own tokens in full; what the drafter lags beyond them
        (it does while a request drafts nothing) serves every later round of its request too,
        so it is spread over the rounds the request has left (at the deepest chain's tokens a
        round)."""
        per_round = chain_tokens(rates, self.shape.depth)
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

    def _fastest(self, step: _Step, none: Shapes) -> tuple[Shapes, float]:
        """The plan to run and the rate (tokens a second) its seconds are worth: the plan of
        most tokens a second in the step's requests' decoding, found as Dinkelbach's iteration
        does (the plan of most value at a rate, then the rate that plan makes, until it stops
        rising). Its first round prices at what no drafts make, so drafts are made only where
        they beat decoding without them; the later rounds, at what the drafts chosen make, so
        a deeper draft is made only if its tokens come as fast as the shorter chain's: one
        that merely beats no drafts would lower the rate."""
        bare = dataclasses.replace(step, prompt_rows=0, memo={}) if step.prompt_rows else None
        decoding = bare or step
        tokens = sum(step.counts.values()) + step.plain
        seconds = self.seconds(step.counts, none, step.plain, contexts=step.contexts)
        rate = tokens / (seconds or 1.0)
        plan = none
        for _ in range(RATE_ROUNDS):
            trial = self._best(step, bare, rate, none)
            tokens, seconds = self._estimate(decoding, trial)
            if trial == plan or not seconds or tokens / seconds <= rate:
                break
            plan, rate = trial, tokens / seconds
        return plan, rate

    def _best(self, step: _Step, bare: _Step | None, rate: float, plan: Shapes) -> Shapes:
        """The plan of most value at ``rate``; ``plan`` drafts nothing, ``bare`` is the step
        without its prompts (None: it has none). Drafts must beat no drafts by a margin: where
        they barely pay, the model's errors would decide, and a wrong draft costs more than a
        wrong abstention. In a step carrying prompts they must also pay in the same step
        without them: priced at the margin of a prompt-heavy step, drafts look cheap, and the
        drafter's catch-up they start is worth its price only if the requests go on drafting
        in the steps that follow, which carry fewer prompts."""
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

    def _runner_up(
        self, step: _Step, rate: float, plan: Shapes, groups: dict[SamplingClass, list[Request]]
    ) -> Shapes:
        """The plan to probe instead of ``plan``. A plan that drafts: no drafts, whose price
        every choice is weighed against (an over-priced one would keep drafts running that
        lose). Else the best plan that differs in the largest class's shape, unless it is
        expected to lose more than a tenth of a token a request for every ``PROBE_EVERY`` steps
        since drafts last ran (then ``plan`` again): so drafts priced too dear by a slow moment
        are measured again, the probes costing at most that much; a probe drafts for one step,
        so it is charged the drafter's whole lag, not a share of it."""
        if any(s.nodes for s in plan.values()):
            return {c: DraftShape() for c in plan}
        lags = {c: float(sum(r.num_tokens - r.num_draft_computed for r in rs))
                for c, rs in groups.items()}  # fmt: skip
        step = dataclasses.replace(step, behind=lags, memo={})
        c = max(step.counts, key=lambda c: step.counts[c])
        topks = {s.topk for d, s in plan.items() if d != c and s.nodes}
        others = [s for s in self.shapes
                  if s != plan[c] and not (s.nodes and topks and s.topk not in topks)]  # fmt: skip
        if not others:
            return plan

        def value(s: DraftShape) -> float:
            return self._value(step, {**plan, c: s}, rate)

        pick = max(others, key=value)
        allowed = 0.1 * sum(step.counts.values()) * max(1.0, self._idle / PROBE_EVERY)
        if value(plan[c]) - value(pick) > allowed:
            return plan
        return {**plan, c: pick}

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
            shape = sr.shape
            cls = self._class_of.get(sr.request_id)
            if cls is None:
                continue
            rejected = r.rejected if r.rejected is not None else r.num_accepted < r.num_proposed
            counts = self.tested.setdefault(cls, [0.0, 0.0])
            counts[0] += r.num_accepted
            counts[1] += r.num_accepted + rejected
            if shape.is_chain:  # drafts 1 .. accepted + 1 were tested, 1 .. accepted passed
                depths = self.by_depth.setdefault(cls, [])
                tested = min(r.num_accepted + rejected, r.num_proposed)
                while len(depths) < tested:
                    depths.append([0.0, 0.0])
                for d in range(tested):
                    depths[d][0] += d < r.num_accepted
                    depths[d][1] += 1
            else:
                y = self.yields.setdefault((cls, shape), [0.0, 0.0])
                y[0] += r.num_accepted + 1
                y[1] += 1
        if self._served:  # the same requests on a standing choice: one step in a few timed
            self._untimed = (self._untimed + 1) % STANDING_TIMING
            if self._untimed:
                return
        self.time_step(plan, result, seconds, drafted > 0)

    def time_step(
        self, plan: SchedulerOutput, result: StepResult, seconds: float, drafted: bool
    ) -> None:
        """Price the passes a step ran and the rest of its ``seconds``; ``drafted``: whether
        any request of it drafted. The row prices learn each pass less its cache reads."""
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
        those each of its drafter's rows spent (the mean over its drafting requests)."""
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
