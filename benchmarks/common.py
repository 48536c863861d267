"""Helpers shared by the benchmarks: thread count, machine facts, JSON and tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from specbatch.bench.machine import cpu_model

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench_results"


def set_threads(threads: int | None) -> int:
    """Fix torch's intra-op thread count (default: the CPUs this process may run on)."""
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return torch.get_num_threads()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def machine_info() -> dict[str, Any]:
    """Where and on what code the numbers were taken (the tree may hold uncommitted edits)."""
    import transformers

    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "specbatch")
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "load_average_1m": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "HEAD"),
        "specbatch_uncommitted_files": [
            ln.split(maxsplit=1)[-1] for ln in (dirty or "").splitlines()
        ],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ---- output --------------------------------------------------------------------------------
def write_json(path: str | Path, obj: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    return p


def fmt(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, numbers right-aligned (cells are pre-formatted strings or values)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def add_expert_args(p: argparse.ArgumentParser, expert_size: int) -> None:
    """The mixture-of-experts benchmarks' ``--experts``, ``--top-k`` and ``--expert-size``."""
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=expert_size)


def run_main(
    p: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace], Any],
    name: str,
) -> int:
    """Add ``--threads`` (1), ``--seed`` (0) and ``--out`` (``bench_results/<name>.json``) to
    ``p``, parse ``argv``, and write ``run(args)``'s result as JSON on that many threads."""
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS_DIR / f"{name}.json"))
    args = p.parse_args(argv)
    set_threads(args.threads)
    path = write_json(args.out, run(args))
    print(f"wrote {path}")
    return 0
