"""Penalties and min_tokens: logit changes that depend on what came before each position.

Under speculation the position after draft j of a round is conditioned on the drafts before
it, so its logits are penalised with the request's history plus drafts ``0 .. j-1``. The target
applies this at every verified position and the drafter at every draft it samples, so p and q
are each the penalised distribution at their position and the rejection rule keeps the output
law that of plain penalised sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.sampling_params import SamplingParams


class History:
    """One request's generated-token counts and prompt tokens, as the worker sees them."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        stop_ids: list[int],
        vocab: int,
        device: torch.device,
    ) -> None:
        self.params = params
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        if params.repetition_penalty != 1.0:
            ids = torch.tensor(prompt_token_ids, dtype=torch.int64, device=device)
            self.prompt[ids] = True
        self.banned = torch.zeros(vocab, dtype=torch.bool, device=device)
        if stop_ids:
            self.banned[torch.tensor(stop_ids, dtype=torch.int64, device=device)] = True
        self.num_generated = 0

    def append(self, tokens: list[int]) -> None:
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            self.num_generated += len(tokens)


@dataclass
class Penalties:
    """The penalty inputs of a step's B sampling requests, stacked (neutral rows for requests
    without penalties, which leave their logits bit for bit as they were)."""

    counts: torch.Tensor  # float32 [B, V]: occurrences among the generated tokens
    prompt: torch.Tensor  # bool [B, V]: in the prompt (only where repetition_penalty != 1)
    banned: torch.Tensor  # bool [B, V]: masked while fewer than min_tokens were generated
    min_left: torch.Tensor  # int64 [B]: min_tokens minus the tokens generated so far
    presence: torch.Tensor  # float32 [B, 1]
    frequency: torch.Tensor  # float32 [B, 1]
    repetition: torch.Tensor  # float32 [B, 1]

    @classmethod
    def of(
        cls, histories: list[History | None], vocab: int, device: torch.device
    ) -> Penalties | None:
        """None when no request of the step is penalised."""
        if all(h is None for h in histories):
            return None
        zeros = torch.zeros(vocab, dtype=torch.float32, device=device)
        off = torch.zeros(vocab, dtype=torch.bool, device=device)
        params = [h.params if h else SamplingParams() for h in histories]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        return cls(
            counts=torch.stack([h.counts if h else zeros for h in histories]),
            prompt=torch.stack([h.prompt if h else off for h in histories]),
            banned=torch.stack([h.banned if h else off for h in histories]),
            min_left=torch.tensor(
                [p.min_tokens - (h.num_generated if h else 0) for p, h in zip(params, histories)],
                dtype=torch.int64,
                device=device,
            ),
            presence=column([p.presence_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            repetition=column([p.repetition_penalty for p in params]),
        )

    def apply(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        drafts: torch.Tensor | None = None,
        num_before: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Penalised float32 logits [R, V]. Row r belongs to request ``rows[r]`` and comes after
        its first ``num_before[r]`` drafts, ``drafts[r, :num_before[r]]`` (none if not given)."""
        logits = logits.float()
        counts = self.counts.index_select(0, rows)
        if drafts is not None and num_before is not None and drafts.shape[1] > 0:
            width = torch.arange(drafts.shape[1], device=drafts.device).unsqueeze(0)
            earlier = (width < num_before.unsqueeze(1)).to(torch.float32)
            counts = counts.scatter_add(1, drafts, earlier)
        before = num_before if num_before is not None else torch.zeros_like(rows)
        early = (self.min_left.index_select(0, rows) > before).unsqueeze(1)
        logits = logits.masked_fill(early & self.banned.index_select(0, rows), float("-inf"))
        seen = self.prompt.index_select(0, rows) | (counts > 0)
        rep = self.repetition.index_select(0, rows)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - self.frequency.index_select(0, rows) * counts
        return logits - self.presence.index_select(0, rows) * (counts > 0).to(torch.float32)
