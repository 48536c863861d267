"""What a benchmark ran on: the CPU by name, family and model, and the software around it."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's name with its family and model numbers ("AMD EPYC" alone does not tell a
    Zen 4 from a Zen 5)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def machine_facts() -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
