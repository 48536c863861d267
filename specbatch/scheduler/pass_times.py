"""The profiled forwards ``auto``'s cost model (step_cost.py) prices plans with: one pass's
seconds as a function of its token count (``PassTimes``: the draft's forward over N one-token
sequences), and the target's over n sequences verifying u tokens each (``VerifyTimes``), both
from the start-up profile (worker/pass_profile.py) at ``profile_token_counts``.

A forward's time is far from linear in its tokens: on a CPU one target token costs about as
much as six (the weights are read once either way), and past a few dozen each adds the same
again; these keep the profile's shape rather than fitting a line through it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def profile_token_counts(max_tokens: int) -> list[int]:
    """Token counts at which the passes are profiled: every count to 8, then four to an octave
    (8, 10, 12, 14, 16, 20, ...), and ``max_tokens`` itself."""
    counts = list(range(1, 8))
    octave = 8
    while octave < max_tokens:
        counts += [octave * m // 4 for m in (4, 5, 6, 7)]
        octave *= 2
    return [c for c in counts if c < max_tokens] + [max_tokens]


class PassTimes:
    """Seconds of one forward as a function of its token count: piecewise linear through the
    profiled ``(counts, seconds)`` made non-decreasing (``isotonic``), continued past the last
    count with the slope of the last segment; 0 for 0 tokens."""

    def __init__(self, counts: Sequence[int], seconds: Sequence[float]) -> None:
        if len(counts) != len(seconds) or not counts:
            raise ValueError("PassTimes needs one time per token count, and at least one")
        order = np.argsort(counts)
        self.x = np.asarray(counts, dtype=np.float64)[order]
        self.y = isotonic(np.asarray(seconds, dtype=np.float64)[order])
        if len(self.x) > 1:
            self.slope = (self.y[-1] - self.y[-2]) / (self.x[-1] - self.x[-2])
        else:
            self.slope = self.y[-1] / self.x[-1]
        # every whole count up to twice the last one, looked up rather than interpolated: the
        # policy prices hundreds of plans per step
        self.table = self._at(np.arange(int(2 * self.x[-1]) + 1))
        self._table = self.table.tolist()

    def _at(self, n: np.ndarray) -> np.ndarray:
        t = np.interp(n, self.x, self.y)
        t = np.where(n > self.x[-1], self.y[-1] + self.slope * (n - self.x[-1]), t)
        return np.where(n > 0, t, 0.0)

    def __call__(self, tokens: np.ndarray | float) -> np.ndarray:
        n = np.asarray(tokens)
        if n.dtype.kind in "iu" and (n.size == 0 or n.max() < len(self.table)):
            return self.table[n]
        return self._at(n.astype(np.float64))

    def at(self, tokens: int) -> float:
        """``self(tokens)`` for one count, in plain Python: on the per-step path, between the
        forwards, where each NumPy call finds the CPU's caches cold."""
        if 0 <= tokens < len(self._table):
            return self._table[tokens]
        return float(self._at(np.asarray(float(tokens))))


class VerifyTimes:
    """Seconds of one target forward over n sequences that verify u tokens each.

    Profiled at depths d (u = d + 1 tokens a sequence) for each profiled n: piecewise linear in
    the extra tokens per sequence between profiled depths (the last slope past the deepest),
    each depth's row a ``PassTimes`` over n. A verify token is cheaper than a sequence: it
    shares its sequence's context reads and per-sequence work, which is why the target is
    profiled in this shape and not as one-token sequences."""

    def __init__(
        self, seq_counts: Sequence[int], depths: Sequence[int], seconds: Sequence[Sequence[float]]
    ) -> None:
        if len(depths) != len(seconds) or not depths:
            raise ValueError("VerifyTimes needs one row of times per depth, and at least one")
        self.depths = np.asarray(depths, dtype=np.float64)
        self._depths = [float(d) for d in depths]
        self.rows = [PassTimes(seq_counts, row) for row in seconds]
        self._at_n: dict[int, list[float]] = {}

    def _times_at(self, num_seqs: int) -> list[float]:
        """The profiled depths' times at this n, looked up once per n."""
        at_n = self._at_n.get(num_seqs)
        if at_n is None:
            at_n = np.maximum.accumulate([float(row(num_seqs)) for row in self.rows]).tolist()
            self._at_n[num_seqs] = at_n
        return at_n

    def at(self, num_seqs: int, extra_tokens: float) -> float:
        """``self`` for one plan, in plain Python (see ``PassTimes.at``)."""
        at_n = self._times_at(num_seqs)
        depths = self._depths
        per_seq = extra_tokens / max(num_seqs, 1)
        if per_seq > depths[-1] and len(at_n) > 1:
            slope = (at_n[-1] - at_n[-2]) / (depths[-1] - depths[-2])
            return at_n[-1] + slope * (per_seq - depths[-1])
        return interpolate(per_seq, list(zip(depths, at_n)))

    def __call__(self, num_seqs: int, extra_tokens: np.ndarray | float) -> np.ndarray:
        """Seconds for ``num_seqs`` sequences carrying ``extra_tokens`` tokens beyond one each."""
        at_n = self._times_at(num_seqs)
        per_seq = np.asarray(extra_tokens, dtype=np.float64) / max(num_seqs, 1)
        t = np.interp(per_seq, self.depths, at_n)
        if len(at_n) > 1:
            slope = (at_n[-1] - at_n[-2]) / (self.depths[-1] - self.depths[-2])
            t = np.where(
                per_seq > self.depths[-1], at_n[-1] + slope * (per_seq - self.depths[-1]), t
            )
        return t


def interpolate(x: float, points: list[tuple[float, float]]) -> float:
    """Piecewise linear through sorted ``points``, constant past either end (``np.interp`` in
    plain Python)."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def isotonic(y: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to ``y`` in least squares (pool adjacent violators):
    a knot slowed by noise is averaged with its neighbours instead of raising all after it."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in y.tolist():
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, n2 = blocks.pop()
            b = blocks[-1]
            b[0] = (b[0] * b[1] + v2 * n2) / (b[1] + n2)
            b[1] += n2
    return np.concatenate([np.full(int(n), v) for v, n in blocks])
