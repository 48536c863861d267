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
from specbatch.worker.model_runner import ForwardInputs, build_inputs
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

    def proposal(self, vocab: int, device: torch.device) -> Proposal:
        """No drafts yet, with room for them (and for q, unless the step is greedy)."""
        g_max = max(self.gammas, default=0)
        out = Proposal.empty(len(self.sampling), g_max, device)
        if not self.greedy:
            out.probs = torch.zeros((len(self.sampling), g_max, vocab), device=device)
        return out

    def catch_up(self, block_size: int, device: torch.device) -> CatchUp | None:
        """One ragged pass over every request's tokens the drafter has not seen, or None."""
        catch = [r for r in self.requests if r.draft_token_ids]
        if not catch:
            return None
        ids: list[int] = []
        last: dict[str, int] = {}
        for r in catch:
            ids.extend(r.draft_token_ids)
            last[r.request_id] = len(ids) - 1
        inputs = build_inputs(
            torch.tensor(ids, dtype=torch.int64, device=device),
            [len(r.draft_token_ids) for r in catch],
            [r.draft_start for r in catch],
            [r.block_table for r in catch],
            block_size,
            device,
        )
        return CatchUp(catch, inputs, last)

    def next_pass(
        self, tokens: torch.Tensor, active: list[int], j: int, first_position: list[int],
        block_size: int,
    ) -> tuple[list[int], torch.Tensor, ForwardInputs] | None:  # fmt: skip
        """After draft ``j`` of ``active`` (``tokens``): the requests that draft again, their
        rows among ``active``, and the one-token pass reading their draft ``j``, at position
        ``first_position[i] + j`` of request ``i``; None when none drafts again."""
        keep = [k for k, i in enumerate(active) if self.gammas[i] > j + 1]
        if not keep:
            return None
        rows = torch.tensor(keep, dtype=torch.int64, device=tokens.device)
        still = [active[k] for k in keep]
        inputs = build_inputs(
            tokens.index_select(0, rows),
            [1] * len(still),
            [first_position[i] + j for i in still],
            [self.sampling[i].block_table for i in still],
            block_size,
            tokens.device,
        )
        return still, rows, inputs

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
class CatchUp:
    """A drafter's pass over the tokens it has not seen (positions ``draft_start ..``)."""

    requests: list[ScheduledRequest]
    inputs: ForwardInputs
    last_row: dict[str, int]  # request id -> the row of its last token in the pass


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
