"""A request's state as the scheduler sees it: tokens, progress counters, statistics."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from specbatch.sampling_params import SamplingParams
from specbatch.theory import expected_tokens_per_round

# one position's logprobs: (the token's logprob, its rank, the top ids, their logprobs)
PositionLogprobs = tuple[float, int, list[int], list[float]]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass
class SpecStats:
    """Speculation counters of one request (or, summed, of the engine).

    Two rates, both reported: ``acceptance_rate`` is accepted / proposed (vLLM's "draft
    acceptance rate"), and ``alpha`` is THEORY.md's per-proposal acceptance probability,
    accepted / (accepted + rejections): a round stops at its first rejection, so later drafts of
    a rejected round were never tested and must not count as failures.
    """

    rounds: int = 0  # verification rounds that had at least one draft token
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    rejections: int = 0  # rounds that stopped at a rejected draft
    emitted: int = 0  # tokens emitted by those rounds (accepted + one per round)
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: rounds accepting > i
    reached_by_position: list[int] = field(default_factory=list)  # [i]: rounds testing draft i

    def record(self, num_draft: int, num_accepted: int, rejected: bool | None = None) -> None:
        """A round that proposed ``num_draft`` drafts (a chain, or a tree's nodes) and accepted
        ``num_accepted``; ``rejected``: it ended at a rejected draft (None: a chain's rule,
        fewer accepted than proposed). Position i counts the drafts at depth i + 1."""
        if num_draft == 0:
            return
        if rejected is None:
            rejected = num_accepted < num_draft
        self.rounds += 1
        self.proposed += num_draft
        self.accepted += num_accepted
        self.rejections += rejected
        self.emitted += num_accepted + 1
        tested = num_accepted + rejected
        for counts, n in (
            (self.reached_by_position, tested),
            (self.accepted_by_position, num_accepted),
        ):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.rejections += other.rejections
        self.emitted += other.emitted
        for mine, theirs in (
            (self.reached_by_position, other.reached_by_position),
            (self.accepted_by_position, other.accepted_by_position),
        ):
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def alpha(self) -> float | None:
        """THEORY.md's alpha: probability that a tested draft is accepted."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else None

    @property
    def mean_tokens_per_round(self) -> float | None:
        return self.emitted / self.rounds if self.rounds else None

    @property
    def mean_draft_length(self) -> float | None:
        return self.proposed / self.rounds if self.rounds else None

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft i accepted | draft i was tested), position by position."""
        return [
            a / r if r else 0.0 for a, r in zip(self.accepted_by_position, self.reached_by_position)
        ]

    def predicted_tokens_per_round(self) -> float | None:
        """THEORY.md's E[tokens] at the measured alpha and the mean draft length."""
        alpha = self.alpha
        if alpha is None:
            return None
        return expected_tokens_per_round(alpha, self.proposed / self.rounds)


@dataclass
class Request:
    """One generation request. ``num_computed`` counts tokens whose K/V the target holds.

    ``num_draft_computed`` counts the same for the draft; it may lag the target (by one token after
    a round that accepted every draft). Both move back after a round to what was accepted.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    seed: int = 0  # the seed of this request's generator (its own, or derived from the engine's)
    arrival_time: float = field(default_factory=time.monotonic)
    grammar: Future[Any] | None = None  # a structured output's grammar, compiled or compiling

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_computed: int = 0
    num_draft_computed: int = 0
    # its drafter keeps nothing of it and it drafts nothing (until preempted): an EAGLE head
    # lacks cached blocks it cannot catch up on, or the drafter slept (DrafterLag) while it ran
    drafter_off: bool = False
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    spec: SpecStats = field(default_factory=SpecStats)
    draft_lengths: list[int] = field(default_factory=list)  # gamma granted, round by round
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each emitted token
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)  # when asked for
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # prompt tokens 1..

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without building the concatenation."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_output_tokens(self) -> int:
        """How many tokens this request may still emit in all (max_tokens and max_model_len)."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def grammar_pending(self) -> bool:
        """Its grammar is still being compiled (it cannot run yet)."""
        return self.grammar is not None and not self.grammar.done()
