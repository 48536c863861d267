"""Rotary position embedding (rotate-half / NeoX layout) with static frequency scalings.

Positions are given per token, so one ragged batch can hold any mix of sequences. cos and sin
are computed once, in float32, for every position below ``max_positions``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specbatch.errors import InvalidInputError
from specbatch.kernels.cpu import CpuKernels

# Rope types whose frequencies do not depend on the sequence length. "dynamic" and "longrope"
# change their frequencies with the current length, which a paged cache cannot follow (keys
# already cached would need re-rotating).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings as one flat dict with at least ``rope_type`` and ``rope_theta``.

    transformers 5.x normalises every config to ``rope_parameters``; 4.x configs carry
    ``rope_theta`` and an optional ``rope_scaling`` dict, which this also accepts.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    layer_types = set(getattr(hf_config, "layer_types", None) or ())
    if any(key in layer_types for key in params):
        raise InvalidInputError(
            "per-layer rope_parameters are not supported; expected one flat rope config"
        )
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def compute_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` (float32, CPU) and the cos/sin scaling factor."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise InvalidInputError(
            f"rope_type '{rope_type}' is not supported (only static rope scalings are); "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise InvalidInputError(
            f"partial_rotary_factor={partial} is not supported; only 1.0 (full rotary)"
        )
    if rope_type == "default":
        base = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
        return 1.0 / (base**exponents), 1.0

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    if inv_freq.numel() != head_dim // 2:
        raise InvalidInputError(
            f"rope_type '{rope_type}' gave {inv_freq.numel()} frequencies for "
            f"head_dim={head_dim}; expected {head_dim // 2}"
        )
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` at ``positions [T]``."""

    def __init__(
        self,
        head_dim: int,
        inv_freq: torch.Tensor,
        *,
        max_positions: int,
        attention_scaling: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise InvalidInputError(f"head_dim={head_dim} must be even for rotary embedding")
        self.head_dim = head_dim
        self.max_positions = max_positions
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (freqs.cos() * attention_scaling).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_scaling).to(device), persistent=False)
        self.kernels: CpuKernels | None = None

    def use_cpu_kernels(self, kernels: CpuKernels) -> None:
        if self.cos.device.type == "cpu":
            self.kernels = kernels

    @classmethod
    def from_config(
        cls, hf_config: Any, head_dim: int, device: torch.device | str
    ) -> RotaryEmbedding:
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        return cls(
            head_dim,
            inv_freq,
            max_positions=int(hf_config.max_position_embeddings),
            attention_scaling=scaling,
            device=device,
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions must be below ``max_positions`` (the model's max_position_embeddings).
        With the CPU kernels q and k are rotated in place (and returned)."""
        if self.kernels is not None:
            self.kernels.rope_(q, positions, self.cos, self.sin)
            self.kernels.rope_(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
