"""What the matrix multiplies of one target forward cost as its rows grow, on each of the
kernels' paths: float32 FMA; bfloat16 on AVX-512 BF16 dot products, or as FMA pairs where the
CPU has no dot product; and, where the CPU has them, bfloat16 on AMX tiles.

The weights are random, in the built-in target's shapes (every layer's qkv, o, gate-up and down
projections and the LM head, each its own weight, so they stream from memory as in a real
forward). The paths take turns within each round; a cell is the median of the rounds.
Rows are what a step sends the target: batch B plain decoding is B rows, verifying k drafts
is B (k + 1). ``--baseline REF`` also builds the kernels of a git revision and times them in
the same rounds, turn about with this tree's, reporting this tree's time over the baseline's.

    OMP_NUM_THREADS=1 python benchmarks/gemm_rows.py [--rows 1 2 3 4 8 16 24 32 64 192]
    OMP_NUM_THREADS=1 python benchmarks/gemm_rows.py --baseline main --rounds 15
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    format_table,
    machine_info,
    set_threads,
    write_json,
)
from specbatch.kernels.build import load_module
from specbatch.kernels.cpu import CpuKernels, PackedLinear, cpu_kernels

TARGET_CONFIG = (
    Path(__file__).resolve().parent.parent
    / "specbatch" / "assets" / "default_pair" / "target" / "config.json"
)  # fmt: skip
CSRC = "specbatch/kernels/csrc"


def target_weights(kernels: CpuKernels, dtype: torch.dtype) -> list[PackedLinear]:
    cfg = json.loads(TARGET_CONFIG.read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    shapes = [((heads + 2 * kv) * d, h), (h, heads * d), (2 * i, h), (h, i)]
    shapes = shapes * cfg["num_hidden_layers"] + [(v, h)]
    gen = torch.Generator().manual_seed(0)
    return [kernels.pack_linear(torch.randn(n, k, generator=gen).to(dtype)) for n, k in shapes]


def forward_ms(
    kernels: CpuKernels,
    weights: list[PackedLinear],
    rows: int,
    repeat: int,
    clock: Callable[[], float] = time.perf_counter,
    evict: torch.Tensor | None = None,
) -> float:
    """Milliseconds a forward; with ``evict``, that buffer is written before each forward
    (untimed), as a round's other work would push the weights out of the caches."""
    dtype = weights[0].panels.dtype
    xs = {w.in_features: torch.randn(rows, w.in_features).to(dtype) for w in weights}
    for w in weights:  # warm-up
        kernels.linear(xs[w.in_features], w)
    total = 0.0
    for _ in range(repeat):
        if evict is not None:
            evict.add_(1.0)
        t0 = clock()
        for w in weights:
            kernels.linear(xs[w.in_features], w)
        total += clock() - t0
    return total / repeat * 1e3


def baseline_kernels(ref: str, into: Path, avx2_only: bool) -> CpuKernels:
    """The kernels of git revision ``ref``, built from its sources."""
    try:
        tar = subprocess.run(
            ["git", "archive", ref, CSRC], cwd=REPO_ROOT, capture_output=True, check=True
        ).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: --baseline {ref}: {e.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return CpuKernels(load_module(avx2_only, csrc=into / CSRC))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 24, 32, 64, 192])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline", metavar="REF", help="git revision to time side by side")
    ap.add_argument("--avx2", action="store_true", help="the AVX2 build (on a CPU with AVX-512)")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="the process's CPU time, not the wall clock (steadier on a busy machine; one thread)",
    )
    ap.add_argument("--evict-mib", type=int, default=0, metavar="MIB",
                    help="write a buffer of MIB MiB before each forward (untimed), so that the "
                    "weights come from where a decoding round leaves them, not from a warm "
                    "cache")  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS_DIR / "gemm_rows.json"))
    args = ap.parse_args()
    set_threads(args.threads)
    kernels = CpuKernels(load_module(avx2_only=True)) if args.avx2 else cpu_kernels()
    if kernels is None:
        sys.exit("error: the CPU kernels are not available here")
    builds = {"": kernels}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        builds[args.baseline] = baseline_kernels(args.baseline, Path(tmp.name), args.avx2)
    bf16 = "bfloat16 AVX-512 dot" if kernels.bf16_dot else "bfloat16 FMA"
    paths = [("float32", torch.float32, False), (bf16, torch.bfloat16, False)]
    if kernels.amx_available:
        paths.append(("bfloat16 AMX", torch.bfloat16, True))
    weights = {dtype: target_weights(kernels, dtype) for _, dtype, _ in paths}
    clock = time.process_time if args.cpu_time else time.perf_counter
    evict = torch.zeros(args.evict_mib << 18) if args.evict_mib else None
    times: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for rows in args.rows:
            repeat = max(3, 64 // rows)
            for name, dtype, amx in paths:
                for build, kern in list(builds.items())[:: 1 if r % 2 else -1]:
                    was_amx = kern.amx
                    kern.use_amx(amx)
                    try:
                        ms = forward_ms(kern, weights[dtype], rows, repeat, clock, evict)
                    finally:
                        kern.use_amx(was_amx)
                    times.setdefault((build, name, rows), []).append(ms)
    tmp.cleanup()
    median = {key: statistics.median(v) for key, v in times.items()}
    names = [p[0] for p in paths]
    base = args.baseline

    def cell(name: str, rows: int) -> str:
        ms = median[("", name, rows)]
        if base:
            old = median[(base, name, rows)]
            return f"{ms:.2f} / {old:.2f} ({ms / old:.2f})"
        return f"{ms:.2f} ({ms / median[('', name, 1)]:.1f}x)"

    if base:
        print(f"ms for one forward's matrix multiplies: this tree / {base} (ratio)")
    else:
        print("ms for one forward's matrix multiplies (x: over 1 row)")
    table = [[rows, *(cell(n, rows) for n in names)] for rows in args.rows]
    print(format_table(["rows", *names], table))
    cells = [
        {"build": b or "this tree", "path": n, "rows": r, "ms": median[(b, n, r)],
         "runs_ms": times[(b, n, r)]}
        for b in builds for n in names for r in args.rows
    ]  # fmt: skip
    out = write_json(args.out, {"args": vars(args), "cells": cells, "machine": machine_info()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
