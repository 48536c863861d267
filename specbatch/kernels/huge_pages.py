"""A model's packed weights in one mapping backed by transparent huge pages.

Every pass streams each weight once. On 4 KiB pages that is a TLB miss every 4 KiB and a
hardware prefetcher that starts over at each page boundary; one mapping advised
``MADV_HUGEPAGE`` and aligned to 2 MiB lets Linux back it with 2 MiB pages (where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``), the weights laid
out in the order the pass reads them. Elsewhere the mapping is ordinary memory and only the
layout remains. The mapping lives as long as any weight in it: each tensor holds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap

import torch
from torch import nn

from specbatch.kernels.cpu import CpuKernels, PackedLinear
from specbatch.kernels.quantized import QuantizedLinear

HUGE_PAGE = 2 << 20
ALIGN = 64  # each weight starts on a cache line


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory (uint8) starting on a 2 MiB boundary, advised to be backed
    by huge pages."""
    size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def pack_for_kernels(model: nn.Module, kernels: CpuKernels) -> None:
    """Repacks the weights of ``model``'s submodules for ``kernels`` (each one's
    ``use_cpu_kernels``) and moves them into one huge-page buffer."""
    for module in model.modules():
        if module is not model and hasattr(module, "use_cpu_kernels"):
            module.use_cpu_kernels(kernels)
    into_huge_pages(model)
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the pages of the weights released by packing back to the OS: glibc keeps freed
    heap memory mapped (malloc_trim(0) releases its free pages)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL(None).malloc_trim(0)


def into_huge_pages(model: nn.Module) -> None:
    """Moves the packed weights of ``model``'s modules (``module.packed``, and the GGUF blocks
    of ``module.quant``) into one huge-page buffer, in the order of ``model.modules()`` (the
    order a pass reads them), and points each at its copy. Call it after packing and before
    anything holds their addresses."""
    found = (w for m in model.modules() for w in (getattr(m, "packed", None),
                                                    getattr(m, "quant", None)))  # fmt: skip
    weights: list[PackedLinear | QuantizedLinear] = list(
        {id(w): w for w in found if w is not None}.values()
    )
    tensors = [t for w in weights for t in _tensors(w)]
    if not tensors:
        return
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buffer = huge_page_buffer(total)
    copies = []
    for t, offset in zip(tensors, offsets, strict=True):
        copy = buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    for w in weights:
        if isinstance(w, PackedLinear):
            w.panels = copies.pop(0)
        else:
            w.repoint([dataclasses.replace(s, q=copies.pop(0)) for s in w.segments])


def _tensors(w: PackedLinear | QuantizedLinear) -> list[torch.Tensor]:
    return [w.panels] if isinstance(w, PackedLinear) else [s.q for s in w.segments]
