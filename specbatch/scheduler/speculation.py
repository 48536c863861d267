"""How many tokens each request may draft this step (before KV and length limits)."""

from __future__ import annotations

from typing import Protocol

from specbatch.request import Request


class SpeculationPolicy(Protocol):
    max_draft_length: int

    def draft_lengths(self, requests: list[Request]) -> list[int]:
        """The draft length each decoding request would like this step (0 allowed)."""
        ...


class FixedDraftLength:
    """Every decoding request drafts the same ``k`` tokens (0 turns speculation off)."""

    def __init__(self, k: int) -> None:
        self.max_draft_length = k

    def draft_lengths(self, requests: list[Request]) -> list[int]:
        return [self.max_draft_length] * len(requests)
