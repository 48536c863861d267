"""RMS normalisation (replicated on every tensor-parallel rank)."""

from __future__ import annotations

import torch
from torch import nn

from specbatch.model.layers.weights import new_param


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistics are computed in float32 and the normalised value is cast back to the input
    dtype before the weight multiplies it, the same order as the reference implementation, so
    half-precision outputs agree with it bit for bit.
    """

    def __init__(
        self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
