"""One mixture-of-experts layer's experts at batch 1 to 64: specbatch's expert-grouped forward
(``layers/experts.py`` over the CPU kernels) against the time to read each woken expert's
weights once (their bytes at the core's streaming rate, measured here by summing a buffer
larger than the caches) and against transformers' loop over experts (``MixtralExperts``: one
torch matmul pair per woken expert, its rows found by masks), in bfloat16.

Each row takes ``--top-k`` of ``--experts`` experts uniformly at random; every figure is the
median of ``--repeats`` calls, each on fresh rows and routes, after warm-up. Prints a table,
writes JSON.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/moe_experts.py [--rows 1 4 16 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_expert_args, fmt, format_table, machine_info, run_main


def streaming_rate(nbytes: int, repeats: int = 7) -> float:
    """Bytes a second one core reads summing a float32 buffer of ``nbytes``."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def median_time(fn: Any, inputs: list[Any]) -> float:
    fn(*inputs[0])
    times = []
    for args in inputs:
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from specbatch.distributed.parallel_state import SINGLE
    from specbatch.kernels.cpu import cpu_kernels
    from specbatch.model.layers.experts import ExpertMLP, grouped_experts

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("specbatch's CPU kernels do not build here")
    dtype, e, k, h, size = torch.bfloat16, args.experts, args.top_k, args.hidden, args.expert_size
    gen = torch.Generator().manual_seed(args.seed)
    theirs = MixtralExperts(MixtralConfig(hidden_size=h, intermediate_size=size,
                                          num_local_experts=e)).to(dtype)  # fmt: skip
    with torch.no_grad():
        theirs.gate_up_proj.copy_(torch.randn(e, 2 * size, h, generator=gen) / h**0.5)
        theirs.down_proj.copy_(torch.randn(e, h, size, generator=gen) / size**0.5)
    ours = []
    for i in range(e):
        mlp = ExpertMLP(h, size, tp=SINGLE, dtype=dtype, device="cpu")
        mlp.gate_up_proj.weight.data.copy_(theirs.gate_up_proj.data[i])
        mlp.down_proj.weight.data.copy_(theirs.down_proj.data[i])
        for m in (mlp.gate_up_proj, mlp.down_proj):
            m.use_cpu_kernels(kernels)
        ours.append(mlp)
    expert_bytes = 3 * h * size * 2
    rate = streaming_rate(max(4 * e * expert_bytes, 256 << 20))
    rows, table = [], []
    for r in args.rows:
        inputs = []
        for _ in range(args.repeats):
            x = torch.randn(r, h, generator=gen).to(dtype)
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(r)])
            weights = torch.rand(r, k, generator=gen)
            inputs.append((x, weights / weights.sum(-1, keepdim=True), ids))
        woken = statistics.mean(len(set(ids.flatten().tolist())) for _, _, ids in inputs)
        grouped = median_time(lambda x, w, ids: grouped_experts(x, w, ids, ours), inputs)
        with torch.inference_mode():
            loop = median_time(lambda x, w, ids: theirs(x, ids, w), inputs)
        floor = woken * expert_bytes / rate
        rows.append({"rows": r, "woken_experts": woken, "grouped_s": grouped, "loop_s": loop,
                     "read_floor_s": floor})  # fmt: skip
        table.append([r, fmt(woken, 1), fmt(floor * 1e3, 3), fmt(grouped * 1e3, 3),
                      fmt(grouped / floor), fmt(loop * 1e3, 3), fmt(loop / grouped)])  # fmt: skip
    print(f"streaming rate {rate / 1e9:.1f} GB/s; expert {expert_bytes / 1e6:.1f} MB (bfloat16)")
    print(format_table(["rows", "woken", "read floor ms", "grouped ms", "grouped/floor",
                        "torch loop ms", "loop/grouped"], table))  # fmt: skip
    return {"config": vars(args), "machine": machine_info(), "streaming_rate": rate,
            "expert_bytes": expert_bytes, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    add_expert_args(p, expert_size=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=21)
    return run_main(p, argv, run, "moe_experts")


if __name__ == "__main__":
    raise SystemExit(main())
