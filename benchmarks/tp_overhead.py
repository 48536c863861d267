"""Per-step cost of tensor parallelism over Ray on CPU: TP=1 in-process against TP=2 on Ray.

Executors compared, each on the same model, batch and draft length:

* ``uni``   TP=1, the worker in the engine's own process (no Ray, no collectives);
* ``ray1``  TP=1 through one Ray actor: the cost of the Ray round trip alone;
* ``ray2``  TP=2, two Ray actors over gloo: the Ray round trip plus the all-reduces.

For every engine step (decode steps only, after a warm-up) it records the step's wall time in
``LLMEngine.step`` and, from rank 0, the phases the Ray executor reports: ``ray`` (the round
trip minus rank 0's ``execute``: pickling, scheduling, the result's way back), ``collectives``
(rank 0's time inside all-reduce / all-gather, which includes waiting for the slower rank) and
``worker`` (rank 0's ``execute``). The table gives medians over the steps, and each phase's
median as a share of the median step time.

Threads: ``--threads`` torch threads per rank (default 1), so TP=2 uses twice the cores of TP=1;
the point is the overhead per step, not a speed-up on a 2-core machine.

    python benchmarks/tp_overhead.py                      # defaults (about 1-2 minutes on 2 cores)
    python benchmarks/tp_overhead.py --batch-sizes 1 8 32 --steps 60 --gammas 0 3
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    RESULTS_DIR,
    ModelSize,
    checkpoint_summary,
    format_table,
    machine_info,
    median,
    random_checkpoint,
    random_prompts,
    write_json,
)

# ~32M parameters: small enough that two CPU ranks are not hidden behind their matmuls.
TARGET = ModelSize(
    vocab_size=8192,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1408,
    max_position_embeddings=1024,
    seed=1,
)
DRAFT = ModelSize(
    vocab_size=8192,
    hidden_size=256,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=704,
    max_position_embeddings=1024,
    seed=2,
)
EXECUTORS = ("uni", "ray1", "ray2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--executors", nargs="+", default=list(EXECUTORS), choices=EXECUTORS)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--gammas", nargs="+", type=int, default=[0, 3], help="0 = no draft")
    ap.add_argument("--steps", type=int, default=40, help="measured decode steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before measuring")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "tp_overhead.json")
    return ap.parse_args(argv)


def start_ray() -> None:
    """One local Ray for every run (RAY_NOTES.md settings), so no engine pays its start-up."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(
            address="local",
            include_dashboard=False,
            object_store_memory=256 << 20,
            logging_level="WARNING",
            _node_ip_address="127.0.0.1",
        )


def build_llm(executor: str, target: Path, draft: Path, gamma: int, threads: int) -> Any:
    from specbatch import LLM

    kw: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "num_kv_blocks": 1024,
        "block_size": 16,
        "max_model_len": 1024,
        "seed": 0,
    }
    if gamma:
        kw.update(draft_model=str(draft), num_speculative_tokens=gamma)
    if executor == "uni":
        torch.set_num_threads(threads)
        return LLM(str(target), **kw)
    os.environ["SPECBATCH_WORKER_THREADS"] = str(threads)
    tp = 2 if executor == "ray2" else 1
    return LLM(str(target), tensor_parallel_size=tp, distributed_executor_backend="ray", **kw)


def measure(llm: Any, batch: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Decode steps of ``batch`` requests: per step, wall time and the executor's phases."""
    from specbatch import SamplingParams

    engine = llm.engine
    phases: list[dict[str, float]] = []
    real = engine.executor.execute

    def recording(plan: Any) -> Any:
        result = real(plan)
        phases.append(dict(result.timings))
        return result

    engine.executor.execute = recording
    total = args.warmup + args.steps + 1
    params = SamplingParams(temperature=1.0, max_tokens=4 * total + 8, ignore_eos=True)
    ids = [
        engine.add_request({"prompt_token_ids": p}, params)
        for p in random_prompts(batch, args.prompt_len, vocab, seed=batch)
    ]
    steps: list[float] = []
    tokens = 0
    try:
        for i in range(total):
            before = engine.metrics.num_generated_tokens
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if i > args.warmup:  # step 0 is the prefill
                steps.append(dt)
                tokens += engine.metrics.num_generated_tokens - before
    finally:
        engine.abort_request(ids)
        del engine.executor.execute
    kept = phases[args.warmup + 1 :]
    step_ms = median(steps) * 1e3

    def phase_ms(name: str) -> float | None:
        vals = [p[name] for p in kept if name in p]
        return median(vals) * 1e3 if vals else None

    row: dict[str, Any] = {
        "batch": batch,
        "steps": len(steps),
        "step_ms_median": step_ms,
        "step_ms_p90": sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3,
        "tokens_per_step": tokens / len(steps),
    }
    for name in ("worker", "ray", "collectives", "draft", "target"):
        ms = phase_ms(name)
        row[f"{name}_ms_median"] = ms
        row[f"{name}_share"] = None if ms is None else ms / step_ms
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target, draft = random_checkpoint(TARGET), random_checkpoint(DRAFT)
    if any(e != "uni" for e in args.executors):
        start_ray()
    runs: list[dict[str, Any]] = []
    for gamma in args.gammas:
        for executor in args.executors:
            t0 = time.perf_counter()
            llm = build_llm(executor, target, draft, gamma, args.threads)
            start_s = time.perf_counter() - t0
            try:
                for batch in args.batch_sizes:
                    row = measure(llm, batch, args, TARGET.vocab_size)
                    row.update(executor=executor, gamma=gamma, engine_start_s=start_s)
                    runs.append(row)
                    print(
                        f"{executor:5s} gamma={gamma} batch={batch:3d}: "
                        f"{row['step_ms_median']:.2f} ms/step",
                        flush=True,
                    )
            finally:
                llm.shutdown()
                gc.collect()

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    headers = [
        "executor",
        "gamma",
        "batch",
        "step ms",
        "p90 ms",
        "tok/step",
        "ray ms",
        "ray %",
        "all-reduce ms",
        "all-reduce %",
    ]
    rows = [
        [
            r["executor"],
            r["gamma"],
            r["batch"],
            ms(r["step_ms_median"]),
            ms(r["step_ms_p90"]),
            f"{r['tokens_per_step']:.2f}",
            ms(r["ray_ms_median"]),
            pct(r["ray_share"]),
            ms(r["collectives_ms_median"]),
            pct(r["collectives_share"]),
        ]
        for r in runs
    ]
    table = format_table(headers, rows)
    print()
    print(table)
    write_json(
        args.out,
        {
            "benchmark": "tp_overhead",
            "command": " ".join(["python", "benchmarks/tp_overhead.py", *(argv or sys.argv[1:])]),
            "machine": machine_info(),
            "threads_per_rank": args.threads,
            "target": checkpoint_summary(target),
            "draft": checkpoint_summary(draft),
            "runs": runs,
            "table": table,
        },
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
