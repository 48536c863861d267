"""What a step's attention pays per cached token it reads (measured by ``worker/kv_price.py``):
how the draft policy prices long contexts. Plain Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvPrice:
    """Seconds a pass's attention spends per cached token of a request: ``read`` for its first
    query row, ``row`` for each further one (never negative)."""

    read: float
    row: float

    def seconds(self, tokens: float, rows: float) -> float:
        """A request's ``tokens`` cached keys attended by ``rows`` query rows."""
        return tokens * (self.read + self.row * max(rows - 1.0, 0.0))


@dataclass(frozen=True)
class KvPrices:
    """What a step's passes pay per cached token: the target's, and the drafter's (None: it
    runs no attention of its own worth pricing), whose passes read at most ``draft_view`` keys a
    request (None: the whole context)."""

    target: KvPrice | None
    draft: KvPrice | None
    draft_view: int | None
