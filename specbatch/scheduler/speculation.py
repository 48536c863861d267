"""What each request may draft this step (before KV and length limits)."""

from __future__ import annotations

from typing import Protocol

from specbatch.draft_shape import DraftShape
from specbatch.request import Request
from specbatch.scheduler.output import SchedulerOutput, StepResult


class SpeculationPolicy(Protocol):
    """Everything the engine and the scheduler call on a draft policy."""

    shape: DraftShape  # the largest drafts it asks any request for

    def draft_shapes(
        self, requests: list[Request], prompt_rows: int = 0, plain: int = 0
    ) -> list[DraftShape]:
        """The drafts each decoding request would like this step, in a step that also carries
        about ``prompt_rows`` rows of prompts and ``plain`` requests decoding undrafted."""
        ...

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        """What the step the scheduler planned did, and how long the engine step took."""
        ...


class FixedDraft:
    """Every decoding request drafts the same shape (a chain of ``k``; 0: none)."""

    def __init__(self, shape: DraftShape | int) -> None:
        self.shape = shape if isinstance(shape, DraftShape) else DraftShape.chain(shape)

    def draft_shapes(
        self, requests: list[Request], prompt_rows: int = 0, plain: int = 0
    ) -> list[DraftShape]:
        return [self.shape] * len(requests)

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        pass
