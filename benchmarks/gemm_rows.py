"""What the matrix multiplies of one target forward cost as its rows grow, on each of the
kernels' paths: float32 FMA; bfloat16 on AVX-512 BF16 dot products, or as FMA pairs where the
CPU has no dot product; and, where the CPU has them, bfloat16 on AMX tiles.

The weights are random, in the built-in target's shapes (every layer's qkv, o, gate-up and down
projections and the LM head, each its own weight, so they stream from memory as in a real
forward). The paths take turns within each round; a cell is the median of the rounds.
Rows are what a step sends the target: batch B plain decoding is B rows, verifying k drafts
is B (k + 1).

    OMP_NUM_THREADS=1 python benchmarks/gemm_rows.py [--rows 1 2 3 4 8 16 24 32 64 192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json
from specbatch.kernels.cpu import CpuKernels, PackedLinear, cpu_kernels

TARGET_CONFIG = (
    Path(__file__).resolve().parent.parent
    / "specbatch" / "assets" / "default_pair" / "target" / "config.json"
)  # fmt: skip


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


def forward_ms(kernels: CpuKernels, weights: list[PackedLinear], rows: int, repeat: int) -> float:
    dtype = weights[0].panels.dtype
    xs = {w.in_features: torch.randn(rows, w.in_features).to(dtype) for w in weights}
    for w in weights:  # warm-up
        kernels.linear(xs[w.in_features], w)
    t0 = time.perf_counter()
    for _ in range(repeat):
        for w in weights:
            kernels.linear(xs[w.in_features], w)
    return (time.perf_counter() - t0) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 24, 32, 64, 192])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "gemm_rows.json"))
    args = ap.parse_args()
    set_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("error: the CPU kernels are not available here")
    bf16 = "bfloat16 AVX-512 dot" if kernels.bf16_dot else "bfloat16 FMA"
    paths = [("float32", torch.float32, False), (bf16, torch.bfloat16, False)]
    if kernels.amx_available:
        paths.append(("bfloat16 AMX", torch.bfloat16, True))
    weights = {dtype: target_weights(kernels, dtype) for _, dtype, _ in paths}
    was_amx = kernels.amx
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for rows in args.rows:
                repeat = max(3, 64 // rows)
                for name, dtype, amx in paths:
                    kernels.use_amx(amx)
                    times.setdefault((name, rows), []).append(
                        forward_ms(kernels, weights[dtype], rows, repeat)
                    )
    finally:
        kernels.use_amx(was_amx)
    median = {key: statistics.median(v) for key, v in times.items()}
    names = [p[0] for p in paths]
    table = [
        [rows, *(f"{median[(n, rows)]:.2f} ({median[(n, rows)] / median[(n, 1)]:.1f}x)"
                 for n in names)]
        for rows in args.rows
    ]  # fmt: skip
    print("ms for one forward's matrix multiplies (x: over 1 row)")
    print(format_table(["rows", *names], table))
    cells = [{"path": n, "rows": r, "ms": median[(n, r)], "runs_ms": times[(n, r)]}
             for n in names for r in args.rows]  # fmt: skip
    out = write_json(args.out, {"args": vars(args), "cells": cells, "machine": machine_info()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
