"""Which attention backend a model runs: the names ``attention_backend`` accepts, the checks
that turn an impossible choice into a clear error, and what ``"auto"`` picks."""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

import torch

from specbatch.errors import InvalidInputError
from specbatch.model.layers.attention import AttentionBackend, TorchAttentionBackend

#: Every name ``attention_backend`` accepts besides "auto".
BACKEND_NAMES = ("torch", "cpu", "flash-attn", "xformers")

# The CUDA backends: name -> (module that must import, backend module, class name).
_CUDA_BACKENDS: dict[str, tuple[str, str, str]] = {
    "flash-attn": ("flash_attn", "specbatch.model.layers.flash_attn_backend", "FlashAttnBackend"),
    "xformers": ("xformers.ops", "specbatch.model.layers.xformers_backend", "XFormersBackend"),
}
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_INSTALL_HINT = (
    'install the CUDA extras with `pip install -e ".[gpu]"` on a machine with the CUDA '
    "toolkit (flash-attn compiles from source: install torch first, then "
    "`pip install flash-attn --no-build-isolation`)"
)


def _backend_class(name: str) -> type[AttentionBackend]:
    """The class of a CUDA backend; its module imports without the kernel package."""
    _, module, cls = _CUDA_BACKENDS[name]
    backend: type[AttentionBackend] = getattr(importlib.import_module(module), cls)
    return backend


def _import_error(package: str) -> str | None:
    """None when ``package`` imports, else why it does not."""
    try:
        importlib.import_module(package)
    except Exception as e:  # a broken CUDA build can raise more than ImportError
        return f"{type(e).__name__}: {e}"
    return None


def _auto_choice(
    is_cuda: bool,
    dtype: torch.dtype | None,
    block_size: int | None,
    importable: Collection[str],
) -> str:
    """The backend "auto" picks: on CUDA with fp16/bf16, the first of flash-attn and xformers
    whose package is in ``importable`` and whose block-size multiple divides ``block_size``;
    otherwise (CPU, float32, unknown dtype or block size) "torch"."""
    if not is_cuda or dtype not in _HALF_DTYPES or block_size is None:
        return "torch"
    for name, (package, _, _) in _CUDA_BACKENDS.items():
        if package in importable and block_size % _backend_class(name).block_size_multiple == 0:
            return name
    return "torch"


def _cpu_backend(head_dim: int | None, dtype: torch.dtype | None) -> tuple[Any, str | None]:
    """specbatch's CPU kernel backend for this model, or None and why not."""
    from specbatch.kernels.cpu import cpu_kernels
    from specbatch.model.layers.cpu_attention import CpuAttentionBackend

    kernels = cpu_kernels()
    if kernels is None:
        return None, "the CPU kernels are not available (see the warning above)"
    if head_dim is None:
        return None, "the model's head_dim is not known here"
    why = CpuAttentionBackend.supports(kernels, head_dim, dtype)
    return (None, why) if why else (CpuAttentionBackend(kernels), None)


def select_backend(
    device: torch.device | str,
    name: str = "auto",
    dtype: torch.dtype | None = None,
    block_size: int | None = None,
    head_dim: int | None = None,
    torch_only: str | None = None,
) -> AttentionBackend:
    """The attention backend for a device: ``name`` is ``"auto"`` or one of ``BACKEND_NAMES``.

    "torch" runs anywhere. "cpu" is specbatch's own kernel (float32 / bfloat16, head_dim a
    multiple of 16); on a CPU "auto" takes it where it runs, else "torch". "flash-attn" (paged
    varlen, block_size a multiple of 256) and "xformers" (paged bias, block_size a multiple of
    64) need a CUDA device, fp16/bf16 and their package (``pip install -e ".[gpu]"``); choosing
    one explicitly where it cannot run raises InvalidInputError naming ``attention_backend``
    (or ``block_size`` / ``dtype``). "auto" picks flash-attn, else xformers, else torch on CUDA
    with fp16/bf16, skipping a backend whose block-size rule ``block_size`` breaks (so the
    default 16 keeps torch, as does an unknown ``block_size``).

    ``torch_only``: why the model runs on the torch backend alone (its attention soft-caps its
    scores or slides a window, which only that backend's layout is read for); "auto" then
    picks "torch" on any device, and naming another backend raises with that reason.
    """
    dev = torch.device(device)
    if torch_only is not None:
        if name not in ("auto", "torch"):
            raise InvalidInputError(
                f"attention_backend '{name}' cannot run this model: {torch_only}; use 'torch' "
                "or 'auto'",
                "attention_backend",
            )
        return TorchAttentionBackend()
    if dev.type == "cpu" and name in ("auto", "cpu"):
        backend, why = _cpu_backend(head_dim, dtype)
        if backend is not None:
            return backend
        if name == "cpu":
            raise InvalidInputError(
                f"attention_backend 'cpu' cannot run this model: {why}", "attention_backend"
            )
    if name == "cpu":
        raise InvalidInputError(
            f"attention_backend 'cpu' runs on a CPU device, got device '{dev}'", "attention_backend"
        )
    if name == "auto":
        is_cuda = dev.type == "cuda"
        importable: set[str] = set()
        if is_cuda and dtype in _HALF_DTYPES and block_size is not None:
            importable = {p for p, _, _ in _CUDA_BACKENDS.values() if _import_error(p) is None}
        choice = _auto_choice(is_cuda, dtype, block_size, importable)
        return TorchAttentionBackend() if choice == "torch" else _backend_class(choice)()
    if name == "torch":
        return TorchAttentionBackend()
    if name not in _CUDA_BACKENDS:
        raise InvalidInputError(
            f"attention_backend '{name}' is not available; available: auto, "
            + ", ".join(BACKEND_NAMES),
            "attention_backend",
        )
    if dev.type != "cuda":
        raise InvalidInputError(
            f"attention_backend '{name}' needs a CUDA device, got device '{dev}'; "
            "use attention_backend 'torch' or 'auto' there",
            "attention_backend",
        )
    if dtype is not None and dtype not in _HALF_DTYPES:
        raise InvalidInputError(
            f"attention_backend '{name}' needs dtype float16 or bfloat16, got "
            f"{str(dtype).removeprefix('torch.')}",
            "attention_backend",
        )
    cls = _backend_class(name)
    if block_size is not None:
        cls.check_block_size(block_size)
    package = _CUDA_BACKENDS[name][0]
    error = _import_error(package)
    if error is not None:
        raise InvalidInputError(
            f"attention_backend '{name}' needs the {package} package, which does not import "
            f"({error}); {_INSTALL_HINT}",
            "attention_backend",
        )
    return cls()
