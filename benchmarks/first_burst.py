"""A fresh engine's first bursts: `auto` (the default) against plain decoding, and against
`auto` with its start-up timing forgotten (its pass prices cleared after the engine starts, as
if it had never timed them).

Three engines of the built-in pair in one process, each fresh, take turns on bursts of
``--batch`` prompts at once (windows of the standard library's sources, sampled at temperature
1), one thread. Prints each burst's time over plain's and the drafts each made, and each
engine's start-up seconds (the first pays the process's first imports); writes JSON.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/first_burst.py [--batch 64] [--bursts 5] \
        [--max-tokens 32] [--out bench_results/first_burst.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json
from benchmarks.offline_default import stdlib_windows
from specbatch import LLM, SamplingParams
from specbatch.scheduler.row_costs import RowCosts

CURVES = ("target", "catch_up", "depth", "rest_plain", "rest_drafting")
SETTINGS = ("plain", "auto", "auto, untimed")


def engine(setting: str) -> LLM:
    llm = LLM(num_speculative_tokens=0 if setting == "plain" else "auto")
    if setting == "auto, untimed":
        policy = llm.engine.scheduler.policy
        for curve in CURVES:
            setattr(policy, curve, RowCosts())
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS_DIR / "first_burst.json"))
    args = ap.parse_args()
    set_threads(1)
    prompts = stdlib_windows(args.batch * args.bursts, 1)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    engines, start_s = {}, {}
    for s in SETTINGS:
        start = time.perf_counter()
        engines[s] = engine(s)
        start_s[s] = time.perf_counter() - start
    seconds: dict[str, list[float]] = {s: [] for s in SETTINGS}
    drafts: dict[str, list[int]] = {s: [] for s in SETTINGS}
    for i in range(args.bursts):
        burst = prompts[i * args.batch : (i + 1) * args.batch]
        order = SETTINGS if i % 2 == 0 else SETTINGS[::-1]
        for s in order:
            metrics = engines[s].engine.metrics
            before = metrics.spec.proposed
            start = time.perf_counter()
            engines[s].generate(burst, params, use_tqdm=False)
            seconds[s].append(time.perf_counter() - start)
            drafts[s].append(metrics.spec.proposed - before)
    rows = [
        [i + 1, round(1e3 * seconds["plain"][i])]
        + [f"{seconds[s][i] / seconds['plain'][i]:.2f}x ({drafts[s][i]})" for s in SETTINGS[1:]]
        for i in range(args.bursts)
    ]
    print(format_table(["burst", "plain ms", "auto (drafts)", "auto untimed (drafts)"], rows))
    print("engine start-up s: " + ", ".join(f"{s} {t:.2f}" for s, t in start_s.items()))
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "start_s": start_s,
                          "seconds": seconds, "drafts": drafts})  # fmt: skip


if __name__ == "__main__":
    main()
