"""What the target's pass costs at batch 1 inside the engine, against the same call repeated
back to back: plain decoding's one row and a k-draft round's k + 1 rows.

One request of the built-in pair (a 64-token held-out prompt, greedy, the engine's dtype)
decodes until it holds ``CONTEXT`` tokens, so that every draft length's passes attend to about
as many keys; then for ``--steps`` steps each target pass is timed as the engine runs it, and
right after it the very same call (same inputs, same cache slots) runs ``--repeats`` times in
a row. The first figure is what a step pays; the later ones what the same pass costs as its
weights and cache lines warm up, so their gap is what the rest of the step (drafting,
sampling, the engine's Python) costs the pass by pushing its data out of the caches.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/verify_pass.py [--draft-lengths 0 3] \
        [--steps 20] [--repeats 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json

CONTEXT = 160  # tokens a request holds when the timed steps start


def pass_times(k: int, steps: int, repeats: int, prompt: list[int], dtype: str) -> dict:
    """Median ms of the target's pass in the engine and of each back-to-back repeat."""
    from specbatch import LLM, SamplingParams
    from specbatch.model.cpu_forward import CpuDecoderPlan

    llm = LLM(num_speculative_tokens=k, dtype=dtype, max_model_len=512, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, params)
    (request,) = engine.scheduler.requests.values()
    while request.num_tokens < CONTEXT:  # prefill, the drafter's catch-up, steady decoding
        engine.step()
    original = CpuDecoderPlan.forward
    times: list[list[float]] = [[] for _ in range(repeats + 1)]
    rows: list[int] = []

    def timed(self: Any, h: Any, *args: Any, **kwargs: Any) -> Any:
        copies = [h.clone() for _ in range(repeats)]  # the pass writes into its input
        t0 = time.perf_counter()
        out = original(self, h, *args, **kwargs)
        times[0].append(time.perf_counter() - t0)
        for i, copy in enumerate(copies):
            t0 = time.perf_counter()
            original(self, copy, *args, **kwargs)
            times[i + 1].append(time.perf_counter() - t0)
        rows.append(h.shape[0])
        return out

    CpuDecoderPlan.forward = timed
    try:
        for _ in range(steps):
            engine.step()
    finally:
        CpuDecoderPlan.forward = original
    llm.shutdown()
    return {
        "k": k,
        "rows": statistics.median(rows),
        "ms": [statistics.median(t) * 1e3 for t in times],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--out", default=str(RESULTS_DIR / "verify_pass.json"))
    args = ap.parse_args()
    set_threads(1)

    from specbatch.bench.workload import heldout_token_stream
    from specbatch.model.model_pair import default_model_path
    from specbatch.tokenizer import load_tokenizer

    stream, _ = heldout_token_stream(load_tokenizer(default_model_path("target")))
    prompt = stream[1000:1064]
    cells = [pass_times(k, args.steps, args.repeats, prompt, args.dtype)
             for k in args.draft_lengths]  # fmt: skip
    headers = ["k", "rows", "in the engine", *(f"repeat {i}" for i in range(1, args.repeats + 1))]
    table = [[c["k"], f"{c['rows']:.0f}", *(f"{ms:.3f}" for ms in c["ms"])] for c in cells]
    print("ms of the target's pass at batch 1 (medians)")
    print(format_table(headers, table))
    out = write_json(args.out, {"machine": machine_info(), "args": vars(args), "cells": cells})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
