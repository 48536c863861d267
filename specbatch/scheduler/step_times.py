"""``auto``'s prices: what an engine step costs per batch bucket and deepest draft, as measured.

The machine's speed drifts (on a shared host by tens of percent within seconds), the same for
every depth. So a step's log-time is read as a level that follows the machine, one per batch
bucket, plus its depth's offset from that level: a step moves its depth's offset by its share
of what the offset does not explain (the mean of the depth's first ``MEMORY`` steps, then a
moving average over as many), and the level by ``LEVEL`` of what is left. Only offsets tell one
depth from another at a batch bucket, so a depth measured long ago still compares with one
measured now. A bucket's first step borrows the level and offsets of the nearest bucket.
"""

from __future__ import annotations

import math

MEMORY = 16  # steps a depth's offset averages over
LEVEL = 0.5  # share of a step's unexplained log-time that moves its bucket's level


def bucket(n: int) -> int:
    """Batch sizes priced alike: ``n`` rounded to the nearest power of two (on a log scale)."""
    return 1 << round(math.log2(n))


class StepTimes:
    def __init__(self) -> None:
        self._level: dict[int, float] = {}  # batch bucket -> log seconds
        self._borrowed: set[int] = set()  # buckets whose level is another's, none measured
        self._offsets: dict[tuple[int, int], list[float]] = {}  # (bucket, depth) -> [log, steps]

    def tick(self, n: int) -> None:
        """Note a planned step of ``n`` requests: a bucket's first borrows."""
        b = bucket(n)
        if b in self._level or not self._level:
            return
        src = min(self._level, key=lambda o: (abs(math.log2(o / b)), o))
        self._level[b] = self._level[src]
        self._borrowed.add(b)
        for (ob, g), (c, _) in list(self._offsets.items()):
            if ob == src:
                self._offsets[b, g] = [c, 0]

    def seconds(self, b: int, g: int) -> float | None:
        """A step at batch bucket ``b`` in which every request drafts up to ``g`` tokens."""
        cell = self._offsets.get((b, g))
        return None if cell is None else math.exp(self._level[b] + cell[0])

    def measured(self, n: int, g: int) -> int:
        """Steps measured at ``n``'s bucket with every request drafting up to ``g``."""
        cell = self._offsets.get((bucket(n), g))
        return 0 if cell is None else cell[1]

    def price(self, n: int, m: int, g: int) -> float | None:
        """Seconds for a step of ``n`` requests where ``m`` draft up to ``g``; None: unknown.
        Fewer drafting requests than the bucket holds: the step without drafts plus what
        drafting adds at the drafting requests' own batch bucket."""
        b, bm = bucket(n), bucket(m) if m else 0
        if g == 0 or bm == b:
            return self.seconds(b, g if m else 0)
        parts = self.seconds(b, 0), self.seconds(bm, g), self.seconds(bm, 0)
        if parts[0] is None or parts[1] is None or parts[2] is None:
            return None
        return parts[0] + parts[1] - parts[2]

    def observe(self, n: int, m: int, g: int, seconds: float) -> None:
        """A step of ``n`` requests, ``m`` of them drafting up to ``g``: it prices its bucket's
        depth ``g`` when the drafting requests fill the bucket (depth 0 when none draft)."""
        b = bucket(n)
        if m and g and bucket(m) != b:
            return
        y = math.log(max(seconds, 1e-9))
        g = g if m else 0
        cell = self._offsets.setdefault((b, g), [0.0, 0])
        cell[1] += 1
        if b not in self._level or b in self._borrowed:  # the bucket's first measured step
            self._borrowed.discard(b)
            self._level[b] = y - cell[0]
            return
        level = self._level[b]
        cell[0] += (y - level - cell[0]) / min(cell[1], MEMORY)
        self._level[b] = level + LEVEL * (y - level - cell[0])
