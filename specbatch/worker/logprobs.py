"""Log-probabilities of chosen tokens and of the most likely alternatives, row by row."""

from __future__ import annotations

import torch

from specbatch.scheduler.output import PositionLogprobs


def position_logprobs(
    logprobs: torch.Tensor, tokens: list[int], ks: list[int]
) -> list[PositionLogprobs]:
    """For row r of ``logprobs`` [R, V]: the logprob of ``tokens[r]``, its rank (1 = most
    likely; ties share the better rank) and the ``ks[r]`` most likely ids with their logprobs."""
    if not tokens:
        return []
    ids = torch.tensor(tokens, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    k_max = max(ks)
    top_values, top_ids = logprobs.topk(k_max, dim=1) if k_max else (chosen[:, :0], ids[:, :0])
    rows = zip(
        chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(), ks
    )
    return [(lp, rank, tid[:k], tv[:k]) for lp, rank, tid, tv, k in rows]
