"""What a decoding step costs at batch 1 by the drafts it carries, split into its parts: the
drafter's work, the target's pass, building the pass's inputs, sampling and verifying, the rest
of the worker, and the engine around the worker (scheduling, stop checks, outputs).

One engine of the built-in pair per draft length (``0``: plain decoding), all in one process,
each generating from the same prompts (windows of the standard library's sources, as
``offline_default.py`` writes them) one request at a time, the engines taking turns on chunks
of 16 prompts in alternating order so that the host's drift falls on all of them alike. Every
decoding step of one request (no prompt in it) is timed; a step's row is the drafts it made.
Prints, per engine, tokens/s against plain's and the median step of each draft count seen in
at least 5% of its steps; then the share of each engine's time its prompts' steps took (the
same work with or without drafts) and its tokens/s over the rest, the decoding steps; writes
JSON.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/round_cost.py [--draft-lengths 0 1 3 4] \
        [--chunks 8] [--max-tokens 32] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json
from benchmarks.offline_default import stdlib_windows

PARTS = ["draft", "target pass", "pass inputs", "sample, verify", "worker rest", "engine"]


def split(step_s: float, worker_s: float, result: Any) -> dict[str, float]:
    """A timed step's parts in ms, from the worker's own timings: ``draft`` (the drafter's
    call), ``target`` (the layout, then the pass), ``sample`` (sampling and verification)."""
    t = result.timings
    passes = sum(s for model, _, s in result.passes if model == "target")
    parts = {
        "draft": t["draft"],
        "target pass": passes,
        "pass inputs": t["target"] - passes,
        "sample, verify": t["sample"],
    }
    parts["worker rest"] = worker_s - sum(parts.values())
    parts["engine"] = step_s - worker_s
    return {k: v * 1e3 for k, v in parts.items()} | {"step": step_s * 1e3}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specbatch import LLM, SamplingParams
    from specbatch.engine.llm_engine import LLMEngine
    from specbatch.worker.worker import Worker

    engines = {k: LLM(num_speculative_tokens=k, max_num_seqs=1) for k in args.draft_lengths}
    prompts = stdlib_windows(16 * args.chunks, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for llm in engines.values():  # kernels built, caches touched
        llm.generate(prompts[:4], params, use_tqdm=False)

    steps: dict[int, dict[int, list[dict[str, float]]]] = {k: defaultdict(list) for k in engines}
    current: dict[str, Any] = {}
    execute, step = Worker.execute, LLMEngine.step

    def timed_execute(self: Worker, plan: Any) -> Any:
        t0 = time.perf_counter()
        result = execute(self, plan)
        current["worker"] = time.perf_counter() - t0
        current["prompt"] = any(len(r.target_token_ids) > 1 for r in plan.requests)
        decoding = len(plan.requests) == 1 and len(plan.requests[0].target_token_ids) == 1
        current["result"] = result if decoding and result.results else None
        return result

    def timed_step(self: LLMEngine) -> Any:
        current["result"], current["prompt"] = None, False
        t0 = time.perf_counter()
        out = step(self)
        seconds = time.perf_counter() - t0
        if current["prompt"]:
            prompt_seconds[current["k"]] += seconds
        result = current["result"]
        if result is not None:
            (r,) = result.results.values()
            steps[current["k"]][r.num_proposed].append(split(seconds, current["worker"], result))
        return out

    tokens = dict.fromkeys(engines, 0)
    elapsed = dict.fromkeys(engines, 0.0)
    prompt_seconds = dict.fromkeys(engines, 0.0)  # steps that carried a prompt
    Worker.execute, LLMEngine.step = timed_execute, timed_step
    try:
        for c in range(args.chunks):
            part = prompts[16 * c : 16 * (c + 1)]
            order = list(engines) if c % 2 == 0 else list(engines)[::-1]
            for k in order:
                current["k"] = k
                t0 = time.perf_counter()
                outs = engines[k].generate(part, params, use_tqdm=False)
                elapsed[k] += time.perf_counter() - t0
                tokens[k] += sum(len(o.outputs[0].token_ids) for o in outs)
    finally:
        Worker.execute, LLMEngine.step = execute, step
    for llm in engines.values():
        llm.shutdown()

    cells = []
    for k in engines:
        total = sum(len(v) for v in steps[k].values())
        rounds = {
            drafts: {p: statistics.median(s[p] for s in rows) for p in ["step", *PARTS]}
            | {"steps": len(rows)}
            for drafts, rows in sorted(steps[k].items())
            if len(rows) >= 0.05 * total
        }
        cells.append({"k": k, "tokens": tokens[k], "seconds": elapsed[k],
                      "prompt_seconds": prompt_seconds[k], "rounds": rounds})  # fmt: skip
    return {"cells": cells}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=[0, 1, 3, 4])
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 16 prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS_DIR / "round_cost.json"))
    args = ap.parse_args()
    if 0 not in args.draft_lengths:
        ap.error("--draft-lengths must include 0 (plain decoding, the baseline)")
    set_threads(1)
    got = run(args)
    plain = next(c for c in got["cells"] if c["k"] == 0)
    base = plain["tokens"] / plain["seconds"]
    table = []
    for c in got["cells"]:
        rate = c["tokens"] / c["seconds"]
        for drafts, r in c["rounds"].items():
            table.append([
                c["k"], f"{rate:.0f}", f"{rate / base:.3f}", drafts, r["steps"],
                *(f"{r[p]:.3f}" for p in ["step", *PARTS]),
            ])  # fmt: skip
    headers = ["k", "tokens/s", "x plain", "drafts", "steps", "step ms", *PARTS]
    print("batch 1, one request at a time: median ms of a decoding step by the drafts it made")
    print(format_table(headers, table))
    decode_base = plain["tokens"] / (plain["seconds"] - plain["prompt_seconds"])
    shares = []
    for c in got["cells"]:
        decode_rate = c["tokens"] / (c["seconds"] - c["prompt_seconds"])
        shares.append([
            c["k"], f"{c['prompt_seconds'] / c['seconds']:.1%}", f"{decode_rate:.0f}",
            f"{decode_rate / decode_base:.3f}",
        ])  # fmt: skip
    print("\nthe prompts' steps: share of the time, and tokens/s over the other steps")
    print(format_table(["k", "prompt steps", "tokens/s without them", "x plain"], shares))
    out = write_json(args.out, {"machine": machine_info(), "args": vars(args), **got})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
