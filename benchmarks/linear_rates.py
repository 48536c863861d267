"""The best multiply rate at a model's own shapes, for ``step_profile.py``: each shape's weight
repeated once per layer (each copy its own memory, so they stream from memory as in a forward;
the LM head once), timed through torch's ``F.linear``, through oneDNN on a weight reordered for
the row count (what torch's inductor and vLLM's CPU build run) and through specbatch's kernel,
the fastest kept."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

Shape = tuple[int, int]  # (out_features, in_features)


def model_shapes(hf_config: Any) -> dict[Shape, int]:
    """Each linear shape of the target's forward and how many weights have it: the fused qkv,
    o, fused gate-up and down projections of every layer, and the LM head."""
    cfg = hf_config
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or h // heads
    shapes: dict[Shape, int] = {}
    for shape in (((heads + 2 * kv) * d, h), (h, heads * d), (2 * i, h), (h, i)):
        shapes[shape] = shapes.get(shape, 0) + layers
    head = (cfg.vocab_size, h)
    shapes[head] = shapes.get(head, 0) + 1
    return shapes


def _seconds(
    fn: Any, x: torch.Tensor, weights: list[Any], repeat: int, clock: Callable[[], float]
) -> float:
    """The fastest of ``repeat`` passes of ``fn(x, w)`` over the weights (after one more)."""
    best = float("inf")
    for r in range(repeat + 1):
        t0 = clock()
        for w in weights:
            fn(x, w)
        if r:
            best = min(best, clock() - t0)
    return best


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def best_rates(
    shapes: dict[Shape, int],
    rows: int,
    dtype: torch.dtype,
    repeat: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[Shape, dict[str, float]]:
    """GFLOP/s at ``rows`` rows for each shape: ``torch`` (F.linear), ``onednn`` (where torch
    has it), ``kernel`` (specbatch's, where it takes the dtype) and ``best``, each the fastest
    of ``repeat`` passes over the shape's weights, on ``clock``."""
    from specbatch.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    out: dict[Shape, dict[str, float]] = {}
    for (n, k), count in shapes.items():
        ws = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for _ in range(count)]
        x = torch.randn(rows, k, generator=gen).to(dtype)
        gflop = 2.0 * n * k * rows * count / 1e9
        rates = {"torch": gflop / _seconds(torch.nn.functional.linear, x, ws, repeat, clock)}
        if torch.backends.mkldnn.is_available():
            try:
                reordered = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
            except RuntimeError:  # oneDNN has no path for this dtype on this CPU
                reordered = []
            if reordered:
                rates["onednn"] = gflop / _seconds(_onednn_linear, x, reordered, repeat, clock)
            del reordered
        if kernels is not None and kernels.supports_linear(dtype):
            packed = [kernels.pack_linear(w) for w in ws]
            del ws
            rates["kernel"] = gflop / _seconds(kernels.linear, x, packed, repeat, clock)
            del packed
        rates["best"] = max(rates.values())
        out[(n, k)] = rates
    return out
