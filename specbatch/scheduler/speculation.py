"""How many tokens each request may draft this step (before KV and length limits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specbatch.request import Request


@dataclass(frozen=True)
class StepShape:
    """The step being planned, before drafts: what the plan's cost depends on besides them."""

    num_seqs: int  # scheduled sequences
    target_tokens: int  # target tokens other than drafts (each decoding request's last token)
    catchup_tokens: int  # draft tokens of the prompt chunks (a decoding request's catch-up on
    # its own unseen tokens runs only if it drafts: see Scheduler.schedule)

    @staticmethod
    def decoding(requests: list[Request]) -> StepShape:
        """A step of these decoding requests alone."""
        return StepShape(len(requests), len(requests), 0)


class SpeculationPolicy(Protocol):
    max_draft_length: int

    @property
    def lazy_draft(self) -> bool:
        """Lazy: the draft sees a request's tokens only when the request drafts (prompt
        included), so a request the policy never drafts for costs no draft work; eager: the
        draft also processes every prompt chunk as the target does (a long prompt's draft
        prefill chunked). Read at the start of each step."""
        ...

    def draft_lengths(self, requests: list[Request], shape: StepShape | None = None) -> list[int]:
        """The draft length each decoding request would like this step (0 allowed)."""
        ...


class FixedDraftLength:
    """Every decoding request drafts the same ``k`` tokens (0 turns speculation off)."""

    lazy_draft = False

    def __init__(self, k: int) -> None:
        self.max_draft_length = k

    def draft_lengths(self, requests: list[Request], shape: StepShape | None = None) -> list[int]:
        return [self.max_draft_length] * len(requests)
