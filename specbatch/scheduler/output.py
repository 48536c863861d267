"""What the scheduler hands the executor each step, and what comes back. Plain Python data."""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.draft_shape import DraftShape
from specbatch.grammar.backend import CompiledGrammarRef
from specbatch.request import PositionLogprobs
from specbatch.sampling_params import SamplingParams

NO_DRAFTS = DraftShape()


@dataclass
class NewRequestData:
    """Sent once, the first step a request is scheduled: what the worker keeps about it."""

    request_id: str
    sampling_params: SamplingParams
    seed: int
    prompt_token_ids: list[int] = field(default_factory=list)
    min_tokens_banned: list[int] = field(default_factory=list)  # EOS and stop ids, for min_tokens
    grammar: CompiledGrammarRef | None = None  # a structured output's compiled grammar


@dataclass
class ScheduledRequest:
    """One request's work in one step.

    The target processes ``target_token_ids`` at positions ``target_start ..`` and, when
    ``sample`` is set (they reach the last known token), verifies ``num_draft`` draft tokens after
    them (a chain, or a tree of that many nodes: ``draft_shape``) and emits 1 .. depth + 1
    tokens. The draft first catches up on ``draft_token_ids`` at positions ``draft_start ..``,
    then proposes. ``drafter_off``: the drafter keeps nothing of this request, which will never
    draft again.
    """

    request_id: str
    target_token_ids: list[int]
    target_start: int
    draft_token_ids: list[int]
    draft_start: int
    num_draft: int
    sample: bool
    block_table: list[int]
    draft_shape: DraftShape | None = None  # None: a chain of num_draft tokens
    drafter_off: bool = False

    @property
    def shape(self) -> DraftShape:
        if self.draft_shape is not None:
            return self.draft_shape
        return DraftShape.chain(self.num_draft) if self.num_draft else NO_DRAFTS


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # the worker forgets these
    num_preempted: int = 0
    # (source, copy) blocks: copy every model's K/V of the source block into the copy before
    # the step runs (a request about to rewrite slots of a cached block it took)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    prefix_cache_queries: int = 0  # tokens of the requests admitted for the first time
    prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_target_tokens(self) -> int:
        return sum(len(r.target_token_ids) + r.num_draft for r in self.requests)


@dataclass
class RequestStepResult:
    """Per scheduled request that sampled: tokens emitted, drafts accepted, and drafts the
    drafter proposed (at most the request's ``num_draft``; an n-gram lookup may find none);
    ``rejected``: the round ended at a rejected draft (not at the end of its chain or at a
    tree's leaf); with ``logprobs``, one entry per emitted token; ``grammar_done``: the
    request's grammar ended with its last token (the output is complete)."""

    token_ids: list[int]
    num_accepted: int
    num_proposed: int
    logprobs: list[PositionLogprobs] | None = None
    rejected: bool | None = None  # None: num_accepted < num_proposed (a chain)
    grammar_done: bool = False


@dataclass
class StepResult:
    results: dict[str, RequestStepResult] = field(default_factory=dict)
    # request id -> (position of the first prompt token scored, one entry per token from there)
    prompt_logprobs: dict[str, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds spent per phase, rank 0
    # every model pass of the step: ("target", "catch-up" or "draft", its rows, seconds), rank 0's
    passes: list[tuple[str, int, float]] = field(default_factory=list)
