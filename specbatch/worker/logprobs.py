"""Log-probabilities of chosen tokens and of the most likely alternatives, row by row."""

from __future__ import annotations

import torch

from specbatch.request import PositionLogprobs


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


def emitted_logprobs(
    logprobs: torch.Tensor, first_rows: dict[int, int], ks: list[int], emitted: list[list[int]]
) -> dict[int, list[PositionLogprobs]]:
    """Request index -> its logprobs at each token it emitted: request i's verified rows
    start at ``first_rows[i]`` of ``logprobs`` [L, V], one per position of its round, and it
    asks for ``ks`` alternatives (in ``first_rows``' order)."""
    rows: list[int] = []
    tokens: list[int] = []
    k_rows: list[int] = []
    for (i, first), k in zip(first_rows.items(), ks, strict=True):
        rows.extend(range(first, first + len(emitted[i])))
        tokens.extend(emitted[i])
        k_rows.extend([k] * len(emitted[i]))
    index = torch.tensor(rows, dtype=torch.int64, device=logprobs.device)
    flat = position_logprobs(logprobs.index_select(0, index), tokens, k_rows)
    out, at = {}, 0
    for i in first_rows:
        out[i], at = flat[at : at + len(emitted[i])], at + len(emitted[i])
    return out
