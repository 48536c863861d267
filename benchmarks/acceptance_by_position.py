"""How draft acceptance changes along a request's output, at a fixed draft length.

On the built-in pair (greedy, 64-token prompts of held-out text, ``--output-len`` tokens each,
``--batch-size`` requests kept running): every round of ``--draft-length`` drafts is filed by
the output position it starts at, and per band of positions the table gives the rounds, the
acceptance of the first draft, of the second given the first, alpha (accepted / tested) and
the tokens per round. ``auto`` estimates a request's alpha from all its rounds so far, so a
rate that drifts along the output leaves that estimate behind it.

    OMP_NUM_THREADS=1 python benchmarks/acceptance_by_position.py
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, builtin_engine, format_table, machine_info, write_json

from specbatch.bench.cell_run import run_cell
from specbatch.bench.workload import build_workload
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.speculation import FixedDraftLength

PROMPT_LEN = 64


class RoundLog(FixedDraftLength):
    """A fixed draft length that files every round as (output position, drafts, accepted)."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.rounds: list[tuple[int, int, int]] = []

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        for sr in plan.requests:
            r = result.results.get(sr.request_id)
            if r is not None and sr.num_draft:
                self.rounds.append((sr.target_start - PROMPT_LEN, sr.num_draft, r.num_accepted))


def bands(output_len: int) -> list[tuple[int, int]]:
    """Four equal bands of the output positions."""
    return list(itertools.pairwise(output_len * i // 4 for i in range(5)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--out", default=str(RESULTS_DIR / "acceptance_by_position.json"))
    args = p.parse_args()
    k, b = args.draft_length, args.batch_size
    engine = builtin_engine(k, PROMPT_LEN, args.output_len, max_num_seqs=b)
    log = RoundLog(k)
    engine.scheduler.policy = log
    workload = build_workload(
        engine, input_len=PROMPT_LEN, output_len=args.output_len, num_prompts=args.num_requests
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    run_cell(engine, workload, b, args.num_requests, params)
    engine.shutdown()
    rows, records = [], []
    for lo, hi in bands(args.output_len):
        full = [a for pos, g, a in log.rounds if lo <= pos < hi and g == k]
        if not full:
            continue
        first = sum(a >= 1 for a in full) / len(full)
        second = [a >= 2 for a in full if a >= 1]
        accepted, rejections = sum(full), sum(a < k for a in full)
        record = {
            "positions": [lo, hi],
            "rounds": len(full),
            "first_draft_accepted": first,
            "second_given_first": sum(second) / len(second) if second else None,
            "alpha": accepted / (accepted + rejections),
            "tokens_per_round": 1 + accepted / len(full),
        }
        records.append(record)
        rows.append([f"{lo}-{hi}", len(full), first, record["second_given_first"]])
        rows[-1] += [record["alpha"], record["tokens_per_round"]]
    print(f"batch {b}, k = {k}, {args.num_requests} requests of {args.output_len} tokens (greedy)")
    headers = ["output tokens", "rounds", "1st accepted", "2nd | 1st", "alpha", "tokens/round"]
    print(format_table(headers, rows))
    path = write_json(args.out, {"draft_length": k, "bands": records, "machine": machine_info()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
