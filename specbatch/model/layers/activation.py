"""Gated activation of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbatch.kernels.cpu import CpuKernels


class SiluAndMul(nn.Module):
    """``[..., 2 * d]`` laid out as ``[gate | up]`` -> ``silu(gate) * up`` of shape ``[..., d]``."""

    kernels: CpuKernels | None = None

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
