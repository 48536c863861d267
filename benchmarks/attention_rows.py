"""What attention over the paged cache costs in one target forward as the batch, the cached
context and the query rows a sequence sends grow, on the kernels' float32 and bfloat16 paths,
optionally against the kernels of another git revision in the same process.

The built-in target's shapes (its layers, query and KV heads, head size; block size 16), random
keys and values in shuffled blocks, as many caches as the target has layers so that they
stream from memory as in a real forward. A sequence sends one query row when decoding and
k + 1 when its k drafts are verified. The paths (and with ``--baseline REV`` the kernels built
from REV's sources) take turns within each round; a cell is the median of the rounds. KV GB/s:
the keys and values read, over the time; stream GB/s: a plain read of as many bytes in the same
rounds (what one core streams from memory).

    OMP_NUM_THREADS=1 python benchmarks/attention_rows.py [--batch-sizes 1 8 64] \
        [--contexts 128 512] [--query-rows 1 3 5] [--dtypes bfloat16] [--baseline REV] \
        [--clock cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

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
from benchmarks.gemm_rows import TARGET_CONFIG
from specbatch.bench.long_context import streaming_rate
from specbatch.kernels.build import load_module
from specbatch.kernels.cpu import CpuKernels, cpu_kernels

BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Build:
    """One build of the kernels: this tree's (``kernels``), or another revision's module (before
    the tree-mask argument, when its info has no "tree")."""

    label: str
    module: ModuleType
    kernels: CpuKernels | None = None

    def attend(self, q, starts, lens, tables, kc, vc, scale: float) -> None:
        if self.kernels is not None:
            self.kernels.paged_attention(q, starts, lens, tables, kc, vc, scale)
            return
        legacy = "tree" not in self.module.info()
        out = torch.empty_like(q)
        self.module.paged_attention(
            lens.shape[0], starts.data_ptr(), lens.data_ptr(), tables.data_ptr(),
            tables.stride(0), q.data_ptr(), q.stride(0), q.shape[1], kc.shape[1], q.shape[2],
            kc.data_ptr(), vc.data_ptr(), kc.shape[3], scale, out.data_ptr(),
            *(() if legacy else (None,)), int(q.dtype == torch.bfloat16),
        )  # fmt: skip


def baseline_build(rev: str) -> Build:
    """The kernels of git revision ``rev``, compiled from its ``csrc`` into the kernel cache."""
    tmp = Path(tempfile.mkdtemp(prefix="specbatch-csrc-"))
    archive = subprocess.run(
        ["git", "archive", rev, "specbatch/kernels/csrc"], cwd=REPO_ROOT, capture_output=True
    )
    if archive.returncode != 0:
        sys.exit(f"error: --baseline: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    module = load_module(csrc=tmp / "specbatch" / "kernels" / "csrc")
    current = "layer_fields" in module.info()  # this tree's interface: call it as this tree does
    return Build(rev, module, CpuKernels(module) if current else None)


def target_shape() -> tuple[int, int, int, int]:
    """Layers, query heads, KV heads and head size of the built-in target."""
    cfg = json.loads(TARGET_CONFIG.read_text())
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads") or heads, d


def caches_of(
    kernels: CpuKernels, dtype: torch.dtype, batch: int, context: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's key and value caches, full of random values, for ``batch`` sequences."""
    layers, _, hkv, d = target_shape()
    num_blocks = batch * -(-context // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    k_shape, v_shape = kernels.kv_cache_shapes(num_blocks, BLOCK_SIZE, hkv, d)

    def random(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    return [(random(k_shape), random(v_shape)) for _ in range(layers)]


def queries_of(dtype: torch.dtype, batch: int, context: int, rows: int) -> tuple[torch.Tensor, ...]:
    """``rows`` query rows a sequence, their row starts, the lengths and shuffled block tables."""
    _, hq, _, d = target_shape()
    per_seq = -(-context // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(1)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    q = torch.randn(batch * rows, hq, d, generator=gen).to(dtype)
    starts = torch.arange(0, batch * rows + 1, rows, dtype=torch.int64)
    return q, starts, torch.full((batch,), context, dtype=torch.int64), tables


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def forward_ms(build: Build, caches, inputs, repeat: int, clock=time.perf_counter) -> float:
    q, starts, lens, tables = inputs
    scale = q.shape[-1] ** -0.5
    for kc, vc in caches:  # warm-up
        build.attend(q, starts, lens, tables, kc, vc, scale)
    t0 = clock()
    for _ in range(repeat):
        for kc, vc in caches:
            build.attend(q, starts, lens, tables, kc, vc, scale)
    return (clock() - t0) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--query-rows", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--baseline", metavar="REV", help="also time the kernels of this git revision")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="cpu: the process's CPU time, which leaves out the time other processes take the "
        "core (on a shared machine); with one thread, the time the kernels ran",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "attention_rows.json"))
    args = ap.parse_args()
    set_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("error: the CPU kernels are not available here")
    builds = [Build("this tree", kernels._m, kernels)]
    if args.baseline:
        builds.append(baseline_build(args.baseline))
    layers, _, hkv, d = target_shape()
    paths = [(name, build) for name in args.dtypes for build in builds]
    clock = CLOCKS[args.clock]
    times: dict[tuple[str, str, int, int, int], list[float]] = {}
    stream: dict[tuple[int, int], list[float]] = {}  # a plain read of as many bytes, GB/s
    for b in args.batch_sizes:
        for c in args.contexts:
            caches = {name: caches_of(kernels, DTYPES[name], b, c) for name in args.dtypes}
            largest = max(sum(k.nbytes + v.nbytes for k, v in cs) for cs in caches.values())
            queries = {(name, r): queries_of(DTYPES[name], b, c, r)
                       for name in args.dtypes for r in args.query_rows}  # fmt: skip
            repeat = max(2, 4096 // (b * c // 16))
            for _ in range(args.rounds):
                for r in args.query_rows:
                    for name, build in paths:
                        times.setdefault((name, build.label, b, c, r), []).append(
                            forward_ms(build, caches[name], queries[(name, r)], repeat, clock)
                        )
                stream.setdefault((b, c), []).append(streaming_rate(largest) / 1e9)
            del caches
    median = {key: statistics.median(v) for key, v in times.items()}
    heads, table, cells = ["batch", "context", "rows", "stream GB/s"], [], []
    for name, build in paths:
        tag = name if len(builds) == 1 else f"{name} {build.label}"
        heads += [f"{tag} ms", "GB/s"]
    if len(builds) > 1:
        heads += [f"{name} new/base" for name in args.dtypes]
    for b in args.batch_sizes:
        for c in args.contexts:
            for r in args.query_rows:
                row: list[object] = [b, c, r, f"{statistics.median(stream[(b, c)]):.1f}"]
                for name, build in paths:
                    ms = median[(name, build.label, b, c, r)]
                    kv_bytes = 2 * layers * b * c * hkv * d * torch.finfo(DTYPES[name]).bits // 8
                    over_one = ms / median[(name, build.label, b, c, args.query_rows[0])]
                    row += [f"{ms:.3f} ({over_one:.2f}x)", f"{kv_bytes / ms / 1e6:.1f}"]
                    cells.append({"path": name, "kernels": build.label, "batch": b, "context": c,
                                  "query_rows": r, "ms": ms, "kv_gb_s": kv_bytes / ms / 1e6,
                                  "runs_ms": times[(name, build.label, b, c, r)]})  # fmt: skip
                if len(builds) > 1:
                    for name in args.dtypes:
                        new, base = (median[(name, x.label, b, c, r)] for x in builds)
                        row.append(f"{new / base:.2f}")
                table.append(row)
    print(
        f"ms ({args.clock} clock) for one forward's attention ({layers} layers; x: over "
        f"{args.query_rows[0]} row)"
    )
    print(format_table(heads, table))
    out = write_json(args.out, {"args": vars(args), "cells": cells, "machine": machine_info()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
