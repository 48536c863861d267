"""A model's packed weights in one huge-page buffer (specbatch/kernels/huge_pages.py): laid out
in the order of the model's modules, each where the kernels read it, the buffer backed by
2 MiB pages where Linux's transparent huge pages allow them. That the outputs do not change is
test_cpu_kernels.py's (the models there run on the moved weights)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from specbatch.kernels.cpu import cpu_kernels
from specbatch.kernels.huge_pages import ALIGN, HUGE_PAGE, huge_page_buffer
from specbatch.model.loader import load_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels do not build here")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_a_models_packed_weights_lie_in_one_buffer_in_module_order(make_checkpoint) -> None:
    model = load_model(make_checkpoint("llama", num_layers=3), torch.bfloat16, "cpu")
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    assert len(packed) == 3 * 4 + 1  # qkv, o, gate_up, down a layer; the LM head
    starts = [p.panels.data_ptr() for p in packed]
    ends = [s + p.panels.numel() * p.panels.element_size() for s, p in zip(starts, packed)]
    assert starts[0] % HUGE_PAGE == 0
    assert all(s % ALIGN == 0 for s in starts)
    assert all(end <= nxt < end + ALIGN for end, nxt in zip(ends, starts[1:]))  # packed tight


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages here",
)
def test_the_buffer_is_backed_by_huge_pages() -> None:
    buffer = huge_page_buffer(3 * HUGE_PAGE)
    buffer.fill_(1)
    address = buffer.data_ptr()
    huge_kb = None
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        start, end = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if start <= address < end:
            huge_kb = int(re.search(r"AnonHugePages:\s+(\d+) kB", block).group(1))
    assert huge_kb is not None and huge_kb >= HUGE_PAGE // 1024
