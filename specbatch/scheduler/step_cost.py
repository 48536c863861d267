"""What a step costs, in seconds, as a function of its plan: the adaptive policy's cost model.

A speculative step is a sequence of forwards (worker.py): the draft's catch-up pass over the
tokens it has not seen (only when some request drafts), one draft pass per further draft
position over the requests still drafting, and ONE target pass over every scheduled token plus
the drafts. So::

    T = first_draft(catch-up tokens) + sum_{j >= 2} draft(n_j) + target(tokens + drafts)

``first_draft`` and ``draft`` are the draft's time for one forward of N one-token sequences
(``PassTimes``), a step's first such forward (after the target's, the draft's weights out of the
caches: dearer on a CPU) and a further one; ``target`` the target's for n sequences verifying
u tokens each (``VerifyTimes``); all profiled on the real models at start-up, each inside a
real step (worker/pass_profile.py); ``n_j`` is the number of requests drafting at least ``j``
tokens (pass_times.py). Every decoding step's observed time corrects the profile's level where
the policy works (``StepCostModel``).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from specbatch.scheduler.pass_times import PassTimes, VerifyTimes, interpolate


class StepCostModel:
    """Predicted seconds of a step: the profiled forwards, times a measured correction.

    ``T = (target_profiled + draft_profiled) * exp(level(batch) + shift(batch, G))``, where G
    is the plan's deepest draft position (0: no drafts), in log(observed / profiled) of the
    decoding steps:

    * ``level`` is the mean over the last ``level_memory`` steps at this batch size
      (half-octave buckets of sequences), at whatever depth, less each one's shift: the
      machine's speed now, and what the profile misses at every depth (inputs built per
      sequence, sampling, scheduling). A machine that slows down slows every depth, the ones
      the policy does not run included.
    * ``shift`` is how much steps at depth G ran above the steps at other depths among the
      last ``level_memory`` at this batch size (the mean of the last ``memory`` such
      contrasts), leaning on what this batch size's other depths say while it has few, or at
      a new batch size on the nearest one's steps at that depth (``_shift``). A step with no
      other depth among those teaches the shift nothing: the policy runs a plan for several
      steps in a row, and measured against a level made of its own depth's steps, a shift
      would only confirm what it already was, however wrong.

    Only the shifts tell one plan from another at a batch size (a level scales every plan
    alike), so the level may follow the last few steps, and the shifts, learned as contrasts
    with those, stay out of the machine's drift: a depth measured minutes ago is not compared
    at the machine speed of then with one measured now, on a machine whose step time drifts
    by tens of percent.
    Each prediction adds a doubt in proportion to the shift's standard error, so that a depth
    run a few times does not win on one lucky step over the one the policy has been running.
    """

    def __init__(
        self,
        draft: PassTimes,
        target: VerifyTimes,
        memory: int = 128,
        level_memory: int = 4,
        prior_weight: float = 2.0,
        step_noise: float = 0.08,
        first_draft: PassTimes | None = None,
    ) -> None:
        self.draft = draft
        self.first_draft = draft if first_draft is None else first_draft
        self.target = target
        self.memory = memory
        self.level_memory = level_memory
        self.prior_weight = prior_weight
        self.step_noise = step_noise  # spread of one step's log(observed / profiled)
        # [mean, number of steps (at most the memory)], in log(observed / profiled)
        self.level: dict[int, list[float]] = {}  # per batch bucket
        self.shift: dict[int, dict[int, list[float]]] = {}  # batch bucket -> depth -> shift
        self._buckets_at: dict[int, list[int]] = {}  # depth -> buckets with a shift there (index)
        self.overall = [0.0, 0.0]  # the level over every batch size
        # (bucket, depth) -> (shift, doubt), and bucket -> exp(shift + doubt) per depth: both
        # memoised until a shift changes
        self._shifts: dict[tuple[int, int], tuple[float, float]] = {}
        self._cache: dict[int, np.ndarray] = {}
        # per batch bucket: the last level_memory steps' (depth, log ratio less its shift)
        self._recent: dict[int, deque[tuple[int, float]]] = {}

    @classmethod
    def from_profile(
        cls,
        seq_counts: Sequence[int],
        depths: Sequence[int],
        draft_counts: Sequence[int],
        profile: dict[str, Any],
    ) -> StepCostModel:
        """From ``Worker.profile_passes(seq_counts, context, depths, draft_counts)``."""
        return cls(
            PassTimes(seq_counts, profile["draft_further"]),
            VerifyTimes(seq_counts, depths, profile["target"]),
            first_draft=PassTimes(draft_counts, profile["draft_first"]),
        )

    @staticmethod
    @functools.cache
    def batch_bucket(num_seqs: int) -> int:
        """Half-octave buckets of batch sizes. Cached: on the per-step path, where code run
        between the forwards finds the CPU's caches cold and a NumPy call costs tens of
        microseconds."""
        return round(2 * math.log2(max(num_seqs, 1)))

    def profiled(
        self,
        num_seqs: int,
        catchup_tokens: np.ndarray | float,
        target_tokens: int,
        draft_tokens: np.ndarray,
        pass_sizes: np.ndarray,
    ) -> np.ndarray:
        """The profile's seconds for candidate plans [P] (see ``predict``)."""
        extra = target_tokens - num_seqs + np.asarray(draft_tokens, dtype=np.float64)
        seconds = self.target(num_seqs, extra) + self.first_draft(catchup_tokens)
        if pass_sizes.size:
            seconds = seconds + self.draft(pass_sizes).sum(axis=1)
        return seconds

    def _shift(self, bucket: int, depth: int) -> float:
        """The shift at (bucket, depth), leaning with ``prior_weight`` steps on a prior: this
        batch size's shifts at the other depths, interpolated (flat past the deepest and the
        shallowest); at a batch size with none yet, the shift at this depth at the nearest
        batch size that ran it, counted by the steps it rests on against ``prior_weight`` at 0
        (one step held up on a shared machine does not set a price anywhere). Another batch
        size's shift is not a prior where this one has measured depths of its own: the
        profile's error at a depth differs from one batch size to the next, and a depth priced
        from batch 1's deep drafts at batch 2 came out 5-15% below the profile where the
        depths batch 2 ran were 9-20% above it; a plan chosen at that price was slower."""
        k = self.prior_weight
        at_bucket = self.shift.get(bucket, {})
        here = sorted((g, v[0]) for g, v in at_bucket.items() if g != depth)
        if here:
            prior = interpolate(depth, here)
        else:
            prior = 0.0
            near = [b for b in self._buckets_at.get(depth, ()) if b != bucket]
            if near:
                mean, steps = self.shift[min(near, key=lambda b: (abs(b - bucket), -b))][depth]
                prior = mean * steps / (steps + k)
        own = at_bucket.get(depth)
        if own is None:
            return prior
        return (own[0] * own[1] + prior * k) / (own[1] + k)

    def _shift_entry(self, bucket: int, depth: int) -> list[float]:
        at_bucket = self.shift.setdefault(bucket, {})
        if depth not in at_bucket:
            at_bucket[depth] = [0.0, 0.0]
            self._buckets_at.setdefault(depth, []).append(bucket)
        return at_bucket[depth]

    def log_ratio(self, num_seqs: int, depth: int) -> float:
        """log(observed / profiled) expected at this batch size and deepest draft position,
        with the doubt added."""
        bucket = self.batch_bucket(num_seqs)
        return self.level.get(bucket, self.overall)[0] + sum(self._shift_and_doubt(bucket, depth))

    def _shift_and_doubt(self, bucket: int, depth: int) -> tuple[float, float]:
        """``_shift`` and the doubt, memoised until a shift changes: most steps change only a
        level (a step teaches a shift only beside steps of other depths)."""
        value = self._shifts.get((bucket, depth))
        if value is None:
            own = self.shift.get(bucket, {}).get(depth)
            steps = 0.0 if own is None else own[1]
            doubt = self.step_noise / math.sqrt(steps + self.prior_weight)
            value = self._shifts[(bucket, depth)] = (self._shift(bucket, depth), doubt)
        return value

    def steps_seen(self, num_seqs: int, depth: int) -> float:
        """How many recent steps the shift at (batch, G) rests on."""
        own = self.shift.get(self.batch_bucket(num_seqs), {}).get(depth)
        return 0.0 if own is None else own[1]

    def predict(
        self,
        num_seqs: int,
        catchup_tokens: np.ndarray | float,
        target_tokens: int,
        draft_tokens: np.ndarray,
        pass_sizes: np.ndarray,
    ) -> np.ndarray:
        """Seconds of candidate plans [P]: ``catchup_tokens`` [P] in the draft's first forward
        (0: no draft forward at all), ``draft_tokens`` [P] drafts in all, ``pass_sizes`` [P, J]
        requests in draft forwards 2.. (0 where one does not run); ``target_tokens`` excludes
        the drafts."""
        seconds = self.profiled(num_seqs, catchup_tokens, target_tokens, draft_tokens, pass_sizes)
        drafts = np.broadcast_to(np.asarray(draft_tokens), seconds.shape)
        depth = np.where(drafts > 0, 1, 0)
        if pass_sizes.size:
            depth = depth + (pass_sizes > 0).sum(axis=1)
        bucket = self.batch_bucket(num_seqs)
        level = math.exp(self.level.get(bucket, self.overall)[0])
        return seconds * (level * self._ratios(bucket, int(depth.max())))[depth]

    def _ratios(self, bucket: int, max_depth: int) -> np.ndarray:
        """exp(shift + doubt) for depths 0..max_depth, cached until a shift changes."""
        cached = self._cache.get(bucket)
        if cached is None or len(cached) <= max_depth:
            cached = np.exp([sum(self._shift_and_doubt(bucket, g)) for g in range(max_depth + 1)])
            self._cache[bucket] = cached
        return cached

    def profiled_step(
        self, num_seqs: int, catchup_tokens: int, target_tokens: int, gammas: Sequence[int]
    ) -> float:
        """``profiled`` for one step that ran draft lengths ``gammas``, in plain Python: it runs
        after every step, between the forwards, where each NumPy call finds the CPU's caches
        cold (a step's shapes vary too much to look them up: at batch 4 a memo missed often
        enough to cost 0.1 ms a step)."""
        seconds = self.target.at(num_seqs, target_tokens - num_seqs + sum(gammas))
        seconds += self.first_draft.at(catchup_tokens)
        for j in range(2, max(gammas, default=0) + 1):
            seconds += self.draft.at(sum(g >= j for g in gammas))
        return seconds

    def observe(
        self,
        num_seqs: int,
        catchup_tokens: int,
        target_tokens: int,
        gammas: Sequence[int],
        step_seconds: float,
    ) -> None:
        """Learn from one finished decoding step (no prompt chunks: a prompt token costs less
        than a decoded one, which carries logits) that ran draft lengths ``gammas``."""
        depth = max(gammas, default=0)
        profiled = self.profiled_step(num_seqs, catchup_tokens, target_tokens, gammas)
        if step_seconds <= 0 or profiled <= 0:
            return
        x = math.log(step_seconds / profiled)
        bucket = self.batch_bucket(num_seqs)
        shift = self._shift_and_doubt(bucket, depth)[0]
        recent = self._recent.get(bucket)
        if recent is None:
            recent = self._recent[bucket] = deque(maxlen=self.level_memory)
        others = [v for g, v in recent if g != depth]
        updates = [(self.overall, x - shift, self.level_memory)]
        # a new batch size's level starts from that of all steps (before its first step is in)
        start = self.overall[0] if self.overall[1] else x - shift
        updates.append((self.level.setdefault(bucket, [start, 0.0]), x - shift, self.level_memory))
        if others:
            contrast = x - sum(others) / len(others)
            updates.append((self._shift_entry(bucket, depth), contrast, self.memory))
            self._shifts.clear()
            self._cache.clear()
        for entry, value, memory in updates:
            entry[1] = min(entry[1] + 1.0, memory)
            entry[0] += (value - entry[0]) / entry[1]
        recent.append((depth, x - shift))
