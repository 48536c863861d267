"""RMS normalisation (replicated on every tensor-parallel rank)."""

from __future__ import annotations

import torch
from torch import nn

from specbatch.kernels.cpu import CpuKernels
from specbatch.model.layers.weights import new_param


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistics are computed in float32 and the normalised value is cast back to the input
    dtype before the weight multiplies it, the same order as the reference implementation, so
    half-precision outputs agree with it bit for bit.

    ``forward(x, residual)`` first adds the residual stream (``x + residual``) and returns the
    normalised sum with the sum itself, the next residual; with the CPU kernels the sum is
    written into ``residual`` in place.
    """

    def __init__(
        self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((hidden_size,), dtype, device)
        self.kernels: CpuKernels | None = None

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; no residual yet: ``(norm(x), x)``."""
        if residual is None:
            return self.forward(x), x
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual), residual
        h = x + residual
        return self._norm(h), h

    def norm_heads_(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head norm of ``x [T, H, D]`` (Qwen3's q/k norm); in place with the kernels."""
        if self.kernels is not None:
            self.kernels.head_rms_norm_(x, self.weight, self.eps)
            return x
        return self._norm(x)
