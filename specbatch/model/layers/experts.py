"""A mixture-of-experts MLP's routing and its expert-grouped forward.

Routing is transformers': a softmax over the router's logits in float32, the top k experts of
each row, their probabilities renormalised to sum to 1 where the model says so (Mixtral
always, Qwen's MoE models by ``norm_topk_prob``).

The forward groups a step's rows by expert: the (row, expert) pairs are sorted by expert, and
each expert that any row woke multiplies all its rows at once, so its weights are read once
per step however many rows chose it (the multiply-adds stay those of the rows' own top k). Each
row's output sums its experts' in ascending expert order in float32, whatever else is in the
step: with matrix multiplies whose rows do not depend on each other (specbatch's CPU kernels),
a row's output does not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.model.layers.activation import SiluAndMul
from specbatch.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> each row's expert weights ``[T, k]`` (float32) and ids
    ``[T, k]`` (int64), the most probable first."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertMLP(nn.Module):
    """One expert (SwiGLU), its intermediate dimension split across ranks: the output is this
    rank's partial sum, reduced by the caller once for all experts."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        kw = {"bias": False, "tp": tp, "dtype": dtype, "device": device}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], **kw
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(self.act(self.gate_up_proj(x)), None)


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Sequence[nn.Module],
) -> torch.Tensor:
    """``sum_j weights[t, j] * experts[ids[t, j]](x[t])`` for every row ``t``, in float32
    ``[T, hidden]``: one call of each woken expert over all the rows that chose it."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    rows = order // k
    gathered = x.index_select(0, rows)
    scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            y = experts[e](gathered[start : start + n])
            out.index_add_(0, rows[start : start + n], y.float() * scale[start : start + n])
            start += n
    return out
