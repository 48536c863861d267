"""What one model pass costs on this machine as a function of its rows, as measured.

The worker times every pass it runs (the target's, each drafter pass) with its row count. A
pass's log-seconds is read as a level, shared by every row count and following the machine's
speed (which drifts by tens of percent within minutes on a shared host), plus an offset per
row bucket: so a bucket measured a minute ago still compares fairly with one measured now. A
bucket's first pass sets its offset; later ones move the level fast and the offset slowly.
Buckets never measured are interpolated between measured ones on a log-log scale; outside
them they are priced optimistically (the smallest's cost scaled down with the rows, the
largest's kept flat), so that a plan whose rows were never measured is tried once and priced.
"""

from __future__ import annotations

import bisect
import math

LEVEL_RATE = 0.3  # share of a pass's unexplained log-time that moves the level
OFFSET_MEMORY = 20  # passes a bucket's offset averages over (then a moving average as long)


def row_bucket(rows: int) -> int:
    """Row counts priced alike: four buckets per doubling (1, 2, 3, 4, 5, 6, 7, 8, 10, ...)."""
    return round(4 * math.log2(max(rows, 1)))


class RowCosts:
    def __init__(self) -> None:
        self.level: float | None = None  # log seconds
        self.offsets: dict[int, float] = {}  # row bucket -> log seconds beyond the level
        self.counts: dict[int, int] = {}  # row bucket -> passes measured
        self._sorted: list[int] = []

    def observe(self, rows: int, seconds: float) -> None:
        y = math.log(max(seconds, 1e-7))
        b = row_bucket(rows)
        if self.level is None:
            self.level = y
        if b not in self.offsets:  # a new row count: its contrast, not the machine's drift
            bisect.insort(self._sorted, b)
            self.offsets[b], self.counts[b] = y - self.level, 1
            return
        self.level += LEVEL_RATE * (y - self.level - self._offset(4 * math.log2(max(rows, 1))))
        self.counts[b] += 1
        self.offsets[b] += (y - self.level - self.offsets[b]) / min(self.counts[b], OFFSET_MEMORY)

    def seconds(self, rows: int) -> float | None:
        """A pass over ``rows`` rows now; None before any pass was measured."""
        if self.level is None or rows <= 0:
            return None if self.level is None else 0.0
        return math.exp(self.level + self._offset(4 * math.log2(rows)))

    def _offset(self, x: float) -> float:
        """The offset at bucket position ``x`` (fractional: rows between two buckets)."""
        s = self._sorted
        if not s:
            return 0.0
        i = bisect.bisect_left(s, x)
        if i < len(s) and s[i] == x:
            return self.offsets[s[i]]
        if i == 0:  # fewer rows than any measured: proportionally cheaper
            return self.offsets[s[0]] + (x - s[0]) / 4 * math.log(2)
        if i == len(s):  # more rows than any measured: as dear as the largest
            return self.offsets[s[-1]]
        lo, hi = s[i - 1], s[i]
        w = (x - lo) / (hi - lo)
        return (1 - w) * self.offsets[lo] + w * self.offsets[hi]
