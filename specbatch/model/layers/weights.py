"""Per-parameter weight loading: every parameter copies only this rank's slice of a full tensor.

A "loaded" weight is either a ``torch.Tensor`` holding the full (unsharded) checkpoint tensor or a
lazy safetensors slice (``safe_open(...).get_slice(name)``), so that a rank reads from disk only
the rows or columns it keeps. Both are handled by :func:`full_shape` and :func:`take`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from specbatch.errors import InvalidInputError


class LazySlice(Protocol):
    """What we use of safetensors' ``PySafeSlice``."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


Loaded = torch.Tensor | LazySlice
WeightLoader = Callable[[torch.nn.Parameter, Loaded, Any], None]


def full_shape(loaded: Loaded) -> tuple[int, ...]:
    """Shape of the full checkpoint tensor, without reading it."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def take(loaded: Loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, length)``; a lazy slice reads only that part from disk."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index: list[slice] = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def read_all(loaded: Loaded) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[:]


def check_shape(loaded: Loaded, expected: Sequence[int]) -> None:
    """Raise a clear error when a checkpoint tensor does not have the shape the config implies.

    The message has no weight name; the model loader prefixes it with one.
    """
    got = full_shape(loaded)
    if got != tuple(expected):
        raise InvalidInputError(
            f"has shape {list(got)} in the checkpoint, but the config implies {list(expected)}"
        )


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` converting dtype and device; shapes must match exactly."""
    if tuple(dst.shape) != tuple(src.shape):
        raise InvalidInputError(
            f"has shape {list(src.shape)} in the checkpoint, but the parameter has shape "
            f"{list(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)
    bad = dst.numel() - int(torch.isfinite(dst).sum())
    if bad:
        raise InvalidInputError(
            f"holds {bad} non-finite value(s) (NaN or infinity) in {dst.dtype}: the checkpoint "
            "is damaged, or its values overflow this dtype"
        )


def default_weight_loader(param: torch.nn.Parameter, loaded: Loaded, shard_id: Any = None) -> None:
    """Replicated parameter (norms, biases of row-parallel layers): every rank copies it whole."""
    copy_into(param.data, read_all(loaded))


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def get_weight_loader(param: torch.nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def new_param(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter; the loader fills it."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
