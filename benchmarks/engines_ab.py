"""Two engine configurations side by side: what a setting costs, measured as the bench measures.

A and B are ``EngineArgs`` overrides and ``SamplingParams`` overrides (JSON), on the built-in
pair by default. For every batch size and round, both run the same closed-loop cell (the
held-out prompts of ``specbatch bench``, greedy unless the sampling overrides say otherwise) side
by side, a step at a time, each on its own clock, who goes first alternating; a cell pools its
rounds (tokens over time, both summed). With A = B every ratio should be 1: its spread is the
method's noise.

    OMP_NUM_THREADS=1 python benchmarks/engines_ab.py --b '{"batch_invariant": true}'
    OMP_NUM_THREADS=1 python benchmarks/engines_ab.py --b-sampling '{"logprobs": 5}'
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json
from specbatch.bench.bench_config import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_OUTPUT_LEN_SPREAD,
    default_num_requests,
)
from specbatch.bench.cell_run import CellRun, run_cell, run_side_by_side
from specbatch.bench.cells import pool_runs
from specbatch.bench.engines import share_weights
from specbatch.bench.offline import WARMUP_REQUESTS, WARMUP_TOKENS
from specbatch.bench.workload import build_workload, spread_output_lengths
from specbatch.config import EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.sampling_params import SamplingParams


def engine(overrides: dict[str, Any], max_seqs: int) -> LLMEngine:
    args: dict[str, Any] = {"max_model_len": DEFAULT_INPUT_LEN + 2 * DEFAULT_OUTPUT_LEN + 16}
    args.update(overrides)
    args["max_num_seqs"] = max(max_seqs, int(args.get("max_num_seqs") or 0))
    return LLMEngine.from_engine_args(EngineArgs(**args))


def same_checkpoints(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether A and B load the same target and draft weights in the same dtype."""

    def draft(c: dict[str, Any]) -> Any:
        return (c.get("speculative_config") or {}).get("model"), c.get("draft_model")

    return all(a.get(k) == b.get(k) for k in ("model", "dtype")) and draft(a) == draft(b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="{}", help="engine A's EngineArgs overrides (JSON)")
    p.add_argument("--b", default="{}", help="engine B's (JSON)")
    p.add_argument("--a-sampling", default="{}", help="A's SamplingParams overrides (JSON)")
    p.add_argument("--b-sampling", default="{}", help="B's (JSON)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS_DIR / "engines_ab.json"))
    args = p.parse_args()
    configs = [json.loads(args.a), json.loads(args.b)]
    samplings = [json.loads(args.a_sampling), json.loads(args.b_sampling)]
    top = max(args.batch_sizes)
    engines = [engine(c, top) for c in configs]
    if same_checkpoints(*configs):
        share_weights(engines)  # as the bench does: one copy of the weights in the caches
    n_max = default_num_requests(top)
    workload = build_workload(
        engines[0],
        input_len=DEFAULT_INPUT_LEN,
        output_len=DEFAULT_OUTPUT_LEN,
        num_prompts=WARMUP_REQUESTS + args.rounds * n_max,
        prompts_file=None,
        seed=0,
    )
    workload = spread_output_lengths(workload, DEFAULT_OUTPUT_LEN_SPREAD, 0)
    params = [
        SamplingParams(
            **{"temperature": 0.0, "max_tokens": DEFAULT_OUTPUT_LEN, "ignore_eos": True, **s}
        )
        for s in samplings
    ]
    rows, cells = [], []
    try:
        for b in args.batch_sizes:
            n = default_num_requests(b)
            runs: list[list[Any]] = [[], []]
            for r in range(args.rounds):
                order = [0, 1] if r % 2 == 0 else [1, 0]
                for i in order:
                    warm = replace(params[i], max_tokens=WARMUP_TOKENS)
                    run_cell(engines[i], workload, b, min(b, WARMUP_REQUESTS), warm)
                first = WARMUP_REQUESTS + r * n
                results = run_side_by_side(
                    [
                        CellRun(engines[i], workload, b, n, params[i], first_prompt=first)
                        for i in order
                    ]
                )
                for i, cell in zip(order, results, strict=True):
                    runs[i].append(cell)
            a, bb = pool_runs(runs[0]), pool_runs(runs[1])
            ratio = bb.output_tok_s / a.output_tok_s
            tpot = bb.tpot_mean / a.tpot_mean if a.tpot_mean and bb.tpot_mean else None
            rows.append([b, f"{a.output_tok_s:.0f}", f"{bb.output_tok_s:.0f}", f"{ratio:.3f}",
                         "-" if tpot is None else f"{tpot:.3f}"])  # fmt: skip
            cells.append({"batch": b, "a_tok_s": a.output_tok_s, "b_tok_s": bb.output_tok_s,
                          "b_over_a": ratio, "tpot_b_over_a": tpot,
                          "a_runs_tok_s": a.runs_tok_s, "b_runs_tok_s": bb.runs_tok_s})  # fmt: skip
            print(f"batch {b}: B/A {ratio:.3f}", flush=True)
    finally:
        for e in engines:
            e.shutdown()
    print(f"A = {args.a} {args.a_sampling}; B = {args.b} {args.b_sampling}")
    print(format_table(["batch", "A tok/s", "B tok/s", "B / A", "TPOT B / A"], rows))
    out = write_json(args.out, {"args": vars(args), "cells": cells, "machine": machine_info()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
