"""Helpers shared by the benchmarks: cached random checkpoints, timing, machine facts, output.

Checkpoints are built once and cached under ``bench_results/ckpt/`` (git-ignored), one directory
per distinct set of arguments, so a rerun with the same sizes reuses the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench_results"
CKPT_DIR = RESULTS_DIR / "ckpt"
_DONE_MARKER = ".complete"


# ---- checkpoints ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSize:
    """Arguments of ``make_random_checkpoint`` that decide a random Llama checkpoint."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return (
            f"llama-v{self.vocab_size}-h{self.hidden_size}-l{self.num_layers}-"
            f"{hashlib.sha1(blob).hexdigest()[:10]}"
        )


def _build_once(out: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` unless ``out`` is already complete; publish with one rename, so
    an interrupted build never leaves a half-written checkpoint that looks usable."""
    if (out / _DONE_MARKER).exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / _DONE_MARKER).write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def random_checkpoint(size: ModelSize, cache_dir: Path = CKPT_DIR) -> Path:
    """A random Llama checkpoint of ``size``, built once and cached under ``cache_dir``."""
    from specbatch.testing.checkpoints import make_random_checkpoint

    def build(tmp: Path) -> None:
        make_random_checkpoint(
            tmp,
            "llama",
            vocab_size=size.vocab_size,
            hidden_size=size.hidden_size,
            num_layers=size.num_layers,
            num_heads=size.num_heads,
            num_kv_heads=size.num_kv_heads,
            intermediate_size=size.intermediate_size,
            max_position_embeddings=size.max_position_embeddings,
            seed=size.seed,
        )

    return _build_once(cache_dir / size.key(), build)


def derived_checkpoint(
    source: Path,
    name: str,
    transform: Callable[[dict[str, torch.Tensor], dict[str, Any]], None],
    cache_dir: Path = CKPT_DIR,
) -> Path:
    """A copy of the checkpoint ``source`` whose tensors and config.json ``transform`` edited in
    place, cached as ``cache_dir/name`` (``name`` must encode every argument of the transform)."""
    from safetensors.torch import load_file, save_file

    def build(tmp: Path) -> None:
        tensors = load_file(str(source / "model.safetensors"))
        config = json.loads((source / "config.json").read_text())
        transform(tensors, config)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for extra in ("generation_config.json",):
            if (source / extra).exists():
                shutil.copy(source / extra, tmp / extra)

    return _build_once(cache_dir / name, build)


def num_parameters(checkpoint: Path) -> int:
    """Parameters stored in a checkpoint directory's safetensors files (read from the headers)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
    return total


def checkpoint_summary(checkpoint: Path) -> dict[str, Any]:
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    return {
        "path": str(checkpoint),
        "parameters": num_parameters(checkpoint),
        **{k: cfg.get(k) for k in keys},
    }


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly from ``[3, vocab_size)`` (ids 0-2
    are the random checkpoints' unk/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n, length), generator=g).tolist()


# ---- machine and timing --------------------------------------------------------------------
def set_threads(threads: int | None) -> int:
    """Fix torch's intra-op thread count (default: the CPUs this process may run on)."""
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return torch.get_num_threads()


def _cpu_model() -> str:
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
        "cpu_model": _cpu_model(),
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


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` took, and what it returned."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


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


def builtin_engine(draft_length: int, prompt_len: int, output_len: int, max_num_seqs: int) -> Any:
    """An engine on the built-in pair speculating up to ``draft_length`` tokens, with room in a
    sequence for ``prompt_len + output_len`` tokens and the drafts."""
    from specbatch.config import EngineArgs
    from specbatch.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(
            num_speculative_tokens=draft_length,
            max_model_len=prompt_len + output_len + draft_length + 2,
            max_num_seqs=max_num_seqs,
        )
    )
