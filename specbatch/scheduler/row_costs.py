"""What one model pass costs on this machine as a function of its rows, as measured.

A pass's log-seconds is a level shared by every row count (the machine's speed, which drifts by
tens of percent within minutes on a shared host) plus an offset per row bucket. Other work only
adds time, so the level moves fast towards a faster pass than expected and slowly towards a
slower one. A bucket's offset is the least of its first ``SETTLE`` passes (capped by its
neighbours'); later passes move the level only. A curve's first pass (buffers allocated, code
warmed) is left out. Between measured buckets the price is interpolated in log rows and log
seconds, below them in proportion to the rows, beyond them on the last two's slope (between
flat and proportional), and never below what fewer rows cost.
"""

from __future__ import annotations

import bisect
import itertools
import math

FAST, SLOW = 0.3, 0.03  # shares of a faster / slower pass's surprise that move the level
SETTLE = 3  # a bucket's first passes: its offset is the least of them, the level stays


def row_bucket(rows: int) -> int:
    """Row counts priced alike: four buckets per doubling (1, 2, 3, 4, 5, 6, 7, 8, 10, ...)."""
    return round(4 * math.log2(max(rows, 1)))


class RowCosts:
    def __init__(self) -> None:
        self.level: float | None = None  # log seconds
        self.offsets: dict[int, float] = {}  # row bucket -> log seconds beyond the level
        self._sorted: list[int] = []
        self._warm = False  # whether the first pass was seen (and left out)
        self._passes: dict[int, int] = {}  # row bucket -> passes measured there
        self._prices: dict[int, float] = {}  # rows -> seconds, until the next pass is measured
        self._floors: list[float] = []  # [i]: the largest offset of measured buckets 0..i

    def observe(self, rows: int, seconds: float) -> None:
        self._prices.clear()
        self._floors.clear()
        y = math.log(max(seconds, 1e-7))
        x = 4 * math.log2(max(rows, 1))
        b = row_bucket(rows)
        if not self._warm:
            self._warm = True
            return
        if self.level is None:
            self.level = y
        seen = self._passes[b] = self._passes.get(b, 0) + 1
        if seen == 1:  # a new row count: its contrast, not the machine's drift
            bisect.insort(self._sorted, b)
            self.offsets[b] = min(y - self.level, self._cap(b))
            return
        if seen <= SETTLE:  # one pass may have been interrupted: the least of the first few
            self.offsets[b] = min(self.offsets[b], y - self.level)
            return
        surprise = y - self._offset(x) - self.level  # the level this pass shows, less ours
        self.level += (FAST if surprise < 0 else SLOW) * surprise

    def _cap(self, b: int) -> float:
        """The most a new bucket ``b``'s offset may be: in proportion to a smaller bucket's
        rows, and no more than a larger bucket's."""
        i = bisect.bisect_left(self._sorted, b)
        cap = math.inf
        if i > 0:
            lo = self._sorted[i - 1]
            cap = self.offsets[lo] + (b - lo) / 4 * math.log(2)
        if i + 1 < len(self._sorted):  # ``b`` itself is at ``i``
            cap = min(cap, self.offsets[self._sorted[i + 1]])
        return cap

    def seconds(self, rows: int) -> float | None:
        """A pass over ``rows`` rows now; None before any pass was measured."""
        if self.level is None or rows <= 0:
            return None if self.level is None else 0.0
        price = self._prices.get(rows)
        if price is None:
            price = self._prices[rows] = math.exp(self.level + self._offset(4 * math.log2(rows)))
        return price

    def _offset(self, x: float) -> float:
        """The offset at bucket position ``x`` (fractional: rows between two buckets)."""
        s = self._sorted
        if not s:
            return 0.0
        i = bisect.bisect_right(s, x)
        if i == 0:  # fewer rows than any measured: in proportion to the smallest
            return self._floor(0) + (x - s[0]) / 4 * math.log(2)
        lo = self._floor(i - 1)
        if i == len(s):  # more rows than any measured: on the last two's slope
            if len(s) == 1:
                return lo
            slope = (lo - self._floor(len(s) - 2)) / (s[-1] - s[-2])
            return lo + min(max(slope, 0.0), math.log(2) / 4) * (x - s[-1])
        hi = max(lo, self.offsets[s[i]])
        return lo + (hi - lo) * (x - s[i - 1]) / (s[i] - s[i - 1])

    def _floor(self, i: int) -> float:
        """The offset of the ``i``-th measured bucket, or of a smaller one if that costs more."""
        if not self._floors:
            self._floors = list(itertools.accumulate((self.offsets[b] for b in self._sorted), max))
        return self._floors[i]
