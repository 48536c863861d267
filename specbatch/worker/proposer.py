"""What the speculative round asks of a drafter (THEORY.md, step 1): given the step's requests
and how many tokens each may draft, propose tokens and, when it has one, the distribution q
each was drawn from. The worker's round is the same for every drafter; the rejection sampler
needs only the tokens, q (or "point mass") and the target's p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import NewRequestData, ScheduledRequest
from specbatch.worker.penalties import Penalties
from specbatch.worker.sampler import SamplingTensors, logits_to_probs, sample


@dataclass
class DraftRound:
    """One step, as a drafter sees it."""

    requests: list[ScheduledRequest]  # every request of the step, prompt chunks included
    sampling: list[ScheduledRequest]  # the requests that emit tokens this step (result order)
    gammas: list[int]  # how many tokens each of ``sampling`` may draft (0 allowed)
    params: list[SamplingParams]  # their sampling parameters
    uniforms: torch.Tensor  # [len(sampling), max(gammas)]: one draw per draft position
    greedy: bool  # every request of ``sampling`` is greedy
    penalties: Penalties | None = None  # the histories of ``sampling``, if any is penalised

    def draw(self, logits: torch.Tensor, active: list[int], j: int, out: Proposal) -> torch.Tensor:
        """Draft ``j`` of the requests ``active`` (indices into ``sampling``) from the drafter's
        logits [len(active), V]: penalised for the history and drafts ``0 .. j-1``, then the
        argmax (greedy) or a sample under each request's transforms, whose q is kept in
        ``out.probs``. Writes the tokens into ``out.tokens`` and returns them."""
        idx = torch.tensor(active, dtype=torch.int64, device=out.tokens.device)
        if self.penalties is not None:
            before = torch.full_like(idx, j)
            logits = self.penalties.apply(logits, idx, out.tokens[idx, :j], before)
        if out.probs is None:
            tokens = logits.argmax(dim=-1)
        else:
            st = SamplingTensors.from_params([self.params[i] for i in active], logits.device)
            probs = logits_to_probs(logits, st)
            tokens = sample(probs, self.uniforms[idx, j])
            out.probs[idx, j] = probs
        out.tokens[idx, j] = tokens
        return tokens


@dataclass
class Proposal:
    """Request b's drafts are ``tokens[b, :counts[b]]`` (counts[b] <= its gamma)."""

    tokens: torch.Tensor  # int64 [B, G], G = max(gammas); padding 0
    counts: list[int]
    probs: torch.Tensor | None  # q [B, G, V] each draft was sampled from; None: point masses

    @staticmethod
    def empty(batch: int, width: int, device: torch.device) -> Proposal:
        tokens = torch.zeros((batch, width), dtype=torch.int64, device=device)
        return Proposal(tokens, [0] * batch, None)


@dataclass
class TargetPass:
    """What the step's target pass computed that a drafter may read."""

    features: torch.Tensor  # [T, F]: every row of the pass (prompt chunks' and drafts' too)
    row_starts: list[int]  # the first row of each request of the step, in step order


class Proposer(Protocol):
    """A drafter on one rank. Every method is called on every rank, with the same arguments."""

    # The target features the drafter reads after each pass: None (none), () (the final
    # hidden states), or the residual streams entering these target layers.
    feature_layers: tuple[int, ...] | None

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block costs the drafter (0: it keeps no KV cache)."""
        ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def add_request(self, new: NewRequestData) -> None: ...

    def finish_request(self, request_id: str) -> None: ...

    def propose(self, step: DraftRound) -> Proposal:
        """Draft tokens for ``step.sampling``. Called every step (a drafter with a KV cache
        catches up on prompt chunks even when nothing is drafted)."""
        ...

    def observe(
        self,
        step: DraftRound,
        emitted: list[list[int]],
        accepted: list[int],
        target: TargetPass | None,
    ) -> None:
        """After verification: the tokens each request of ``step.sampling`` emitted and how
        many of its drafts were accepted, and the target's features (``feature_layers``)."""
        ...
