"""A model's packed weights in one mapping backed by transparent huge pages.

Every pass streams each weight once. On 4 KiB pages that is a TLB miss every 4 KiB and a
hardware prefetcher that starts over at each page boundary; one mapping advised
``MADV_HUGEPAGE`` and aligned to 2 MiB lets Linux back it with 2 MiB pages (where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``), the weights laid
out in the order the pass reads them. Elsewhere the mapping is ordinary memory and only the
layout remains. The mapping lives as long as any weight in it: each tensor holds it.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

from specbatch.kernels.cpu import CpuKernels, PackedLinear

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


def into_huge_pages(model: nn.Module) -> None:
    """Moves the packed weights of ``model``'s modules (``module.packed``) into one huge-page
    buffer, in the order of ``model.modules()`` (the order a pass reads them), and points each
    at its copy. Call it after packing and before anything holds their addresses."""
    packed = (getattr(m, "packed", None) for m in model.modules())
    weights: list[PackedLinear] = list({id(p): p for p in packed if p is not None}.values())
    if not weights:
        return
    offsets, total = [], 0
    for p in weights:
        offsets.append(total)
        total += -(-p.panels.numel() * p.panels.element_size() // ALIGN) * ALIGN
    buffer = huge_page_buffer(total)
    for p, offset in zip(weights, offsets, strict=True):
        nbytes = p.panels.numel() * p.panels.element_size()
        copy = buffer[offset : offset + nbytes].view(p.panels.dtype).view(p.panels.shape)
        copy.copy_(p.panels)
        p.panels = copy
