"""How many tokens each request may draft this step (before KV and length limits)."""

from __future__ import annotations

from typing import Protocol

from specbatch.request import Request
from specbatch.scheduler.output import SchedulerOutput, StepResult


class SpeculationPolicy(Protocol):
    """Everything the engine and the scheduler call on a draft-length policy."""

    max_draft_length: int

    def draft_lengths(self, requests: list[Request]) -> list[int]:
        """The draft length each decoding request would like this step (0 allowed)."""
        ...

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        """What the step the scheduler planned did, and how long the engine step took."""
        ...


class FixedDraftLength:
    """Every decoding request drafts the same ``k`` tokens (0 turns speculation off)."""

    def __init__(self, k: int) -> None:
        self.max_draft_length = k

    def draft_lengths(self, requests: list[Request]) -> list[int]:
        return [self.max_draft_length] * len(requests)

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        pass
