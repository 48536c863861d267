"""Which data-parallel replica takes the next request: the one with the fewest outstanding tokens.

A replica's outstanding tokens are what its unfinished requests may still cost it: the prompt of
each request not yet started and every output token it may still generate. Each replica reports
its own figure with every update, as of the last control message it had applied; the router adds
the requests sent to it since, so a burst of requests spreads over the replicas before any of
them has answered.
"""

from __future__ import annotations

from collections.abc import Iterable


class Router:
    def __init__(self, num_replicas: int) -> None:
        self.live: set[int] = set(range(num_replicas))
        self._reported = [0] * num_replicas  # the replica's own figure
        self._applied = [0] * num_replicas  # the last message that figure includes
        self._in_flight: list[list[tuple[int, int]]] = [[] for _ in range(num_replicas)]

    def load(self, replica: int) -> int:
        """Outstanding tokens of ``replica``, the requests not yet reported included."""
        return self._reported[replica] + sum(tokens for _, tokens in self._in_flight[replica])

    def choose(self, among: Iterable[int] | None = None) -> int:
        """The least loaded live replica (of ``among``); ties go to the lowest index."""
        candidates = self.live if among is None else self.live.intersection(among)
        if not candidates:
            raise LookupError("no live replica to route to")
        return min(candidates, key=lambda i: (self.load(i), i))

    def sent(self, replica: int, seq: int, tokens: int) -> None:
        """Requests worth ``tokens`` went to ``replica`` in control message ``seq``."""
        self._in_flight[replica].append((seq, tokens))

    def update(self, replica: int, applied_seq: int, outstanding_tokens: int) -> None:
        """``replica`` reports ``outstanding_tokens`` with every message up to ``applied_seq``
        applied."""
        if applied_seq < self._applied[replica]:
            return  # an older report than one already seen
        self._applied[replica] = applied_seq
        self._reported[replica] = outstanding_tokens
        self._in_flight[replica] = [(s, t) for s, t in self._in_flight[replica] if s > applied_seq]

    def remove(self, replica: int) -> None:
        self.live.discard(replica)
