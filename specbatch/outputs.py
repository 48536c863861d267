"""What ``generate`` returns, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specbatch.request import PositionLogprobs, Request


@dataclass
class Logprob:
    """One token's log-probability at a position, its rank there (1 = most likely), and the
    token as text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# per position: token id -> Logprob, for the chosen token and the top K
PositionLogprobDict = dict[int, Logprob]


def logprob_dicts(
    entries: list[PositionLogprobs], chosen: list[int], decode: Callable[[int], str] | None
) -> list[PositionLogprobDict]:
    """vLLM's shape of logprobs: per position, the top K in rank order, then the chosen token
    if it is not among them."""
    out = []
    for (lp, rank, top_ids, top_lps), token in zip(entries, chosen, strict=True):
        d = {
            t: Logprob(v, r + 1, decode(t) if decode else None)
            for r, (t, v) in enumerate(zip(top_ids, top_lps))
        }
        if token not in d:
            d[token] = Logprob(lp, rank, decode(token) if decode else None)
        out.append(d)
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None  # with logprobs: the sum over token_ids
    logprobs: list[PositionLogprobDict] | None = None  # with logprobs: one per token


@dataclass
class RequestMetrics:
    """Times are ``time.monotonic()`` seconds; durations in seconds."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    spec_rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    acceptance_rate: float | None = None  # accepted / proposed drafts
    alpha: float | None = None  # THEORY.md's per-draft acceptance probability
    mean_tokens_per_round: float | None = None
    predicted_tokens_per_round: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        end = self.finished_time or self.last_token_time
        return None if end is None else end - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (TPOT)."""
        if self.num_generated_tokens < 2 or self.first_token_time is None:
            return None
        assert self.last_token_time is not None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @classmethod
    def of(cls, req: Request) -> RequestMetrics:
        s = req.spec
        return cls(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            last_token_time=req.last_token_time,
            finished_time=req.finished_time,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generated_tokens=len(req.output_token_ids),
            num_preemptions=req.num_preemptions,
            spec_rounds=s.rounds,
            draft_tokens_proposed=s.proposed,
            draft_tokens_accepted=s.accepted,
            acceptance_rate=s.acceptance_rate,
            alpha=s.alpha,
            mean_tokens_per_round=s.mean_tokens_per_round,
            predicted_tokens_per_round=s.predicted_tokens_per_round(),
            acceptance_by_position=s.acceptance_by_position,
            draft_lengths=list(req.draft_lengths),
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics  # of the first completion
    prompt_logprobs: list[PositionLogprobDict | None] | None = None  # first entry None
    num_cached_tokens: int = 0  # prompt tokens the first completion found in the prefix cache
