"""How well ``auto``'s cost model predicts a step: predicted against measured step times.

On the built-in pair (greedy, 64-token prompts and outputs, as ``specbatch bench``): one
``auto`` policy is profiled at start-up, then runs a closed-loop cell at each batch size of
``--warm-batch-sizes`` and at ``--batch-size`` (learning as in a server). Then fixed uniform
draft lengths run at ``--batch-size`` and the median time of their full decoding steps (every
request decoding, no prompt chunk) is set beside what the policy's cost model predicts for the
same uniform plan, and beside the profile alone.

    OMP_NUM_THREADS=1 python benchmarks/auto_cost_model.py --batch-size 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    RESULTS_DIR,
    WrappedPolicy,
    builtin_engine,
    format_table,
    machine_info,
    write_json,
)

from specbatch.bench.cell_run import run_cell
from specbatch.bench.workload import build_workload
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.adaptive import AdaptiveDraftLength
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.speculation import FixedDraftLength


class Timed(WrappedPolicy):
    """A policy that records the time of every full decoding step of ``batch`` requests."""

    def __init__(self, policy: Any, batch: int, log: list[tuple[int, float]]) -> None:
        super().__init__(policy)
        self.batch, self.log = batch, log

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        reqs = plan.requests
        if len(reqs) == self.batch and all(r.sample and len(r.target_token_ids) == 1 for r in reqs):
            self.log.append((max(r.num_draft for r in reqs), seconds))
        self.learn(plan, result, seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warm-batch-sizes", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--draft-lengths", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--max-draft-length", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS_DIR / "auto_cost_model.json"))
    args = p.parse_args()
    b, k_max = args.batch_size, args.max_draft_length
    engine = builtin_engine(k_max, 64, 64, max_num_seqs=max(64, b))
    auto: AdaptiveDraftLength = engine.adaptive_policy(k_max)
    workload = build_workload(engine, input_len=64, output_len=64, num_prompts=64)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for size in [*args.warm_batch_sizes, b]:  # the policy learns as it would in a server
        engine.scheduler.policy = auto
        run_cell(engine, workload, size, max(2 * size, 8), params)
    rows, records = [], []
    for k in args.draft_lengths:
        log: list[tuple[int, float]] = []
        engine.scheduler.policy = Timed(FixedDraftLength(k), b, log)
        run_cell(engine, workload, b, max(2 * b, 8), params)
        measured = statistics.median(s for _, s in log)
        sizes = np.array([[b] * (k - 1)], dtype=float) if k > 1 else np.zeros((1, 0))
        plan = (b, b if k else 0, b, np.array([b * k]), sizes)
        predicted = float(auto.cost.predict(*plan)[0])
        profiled = float(auto.cost.profiled(*plan)[0])
        rows.append(
            [k, len(log), measured * 1e3, predicted * 1e3, profiled * 1e3, predicted / measured]
        )
        records.append(
            {
                "gamma": k,
                "steps": len(log),
                "measured_s": measured,
                "predicted_s": predicted,
                "profile_s": profiled,
            }
        )
    headers = ["gamma", "steps", "measured ms", "predicted ms", "profile ms", "pred/meas"]
    print(f"auto's cost model at batch {b} (built-in pair, greedy), median full decoding step")
    print(format_table(headers, rows))
    path = write_json(args.out, {"batch_size": b, "rows": records, "machine": machine_info()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
