"""Where ``auto`` spends its time against a fixed draft length, at one batch size.

On the built-in pair (greedy, 64-token prompts, outputs of 64 tokens on average spread as in
``specbatch bench``): one engine, one ``auto`` policy profiled at start-up, and closed-loop
cells of ``auto`` and of ``FixedDraftLength(--fixed)`` in turn, each round on prompts of its
own (the same for both). Every step is put in one class, and its forward time (the
executor's) and emitted tokens are summed per class:

* ``full batch``: every one of the batch's requests decoding;
* ``drain``: decoding steps with fewer requests, once no request is left to admit;
* ``prefill``: steps that carry a prompt chunk.

Beside them, the time outside the forwards (scheduling, the policy's choice and its learning
after the step, bookkeeping), from the engine's step time.

    OMP_NUM_THREADS=1 python benchmarks/auto_where.py --batch-size 4 --fixed 1
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

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
from specbatch.bench.offline import DEFAULT_OUTPUT_LEN_SPREAD, default_num_requests
from specbatch.bench.workload import build_workload, spread_output_lengths
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.speculation import FixedDraftLength

CLASSES = ("full batch", "drain", "prefill")


class Ledger:
    """Per step class: [steps, forward seconds, tokens]; and the seconds outside forwards."""

    def __init__(self) -> None:
        self.by_class: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
        self.outside = 0.0


class Recording(WrappedPolicy):
    """Wraps a policy: after each step, files its forward time and tokens in a ledger."""

    def __init__(self, policy: Any, batch: int, forward: dict[str, float]) -> None:
        super().__init__(policy)
        self.batch, self.forward = batch, forward
        self.ledger = Ledger()
        self.active = False  # off during warm-ups

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        started = time.perf_counter()
        self.learn(plan, result, seconds)
        if not self.active:
            return
        reqs = plan.requests
        if not all(r.sample and len(r.target_token_ids) == 1 for r in reqs):
            kind = "prefill"
        else:
            kind = "full batch" if len(reqs) == self.batch else "drain"
        row = self.ledger.by_class[kind]
        row[0] += 1
        row[1] += self.forward["seconds"]
        row[2] += sum(len(r.token_ids) for r in result.results.values())
        # the engine's step time ends before the policy learns from it: add that back
        self.ledger.outside += seconds - self.forward["seconds"] + time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--fixed", type=int, default=1, help="the fixed draft length to set beside")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-draft-length", type=int, default=8)
    p.add_argument("--output-len-spread", type=float, default=DEFAULT_OUTPUT_LEN_SPREAD)
    p.add_argument("--out", default=str(RESULTS_DIR / "auto_where.json"))
    args = p.parse_args()
    b, k_max = args.batch_size, args.max_draft_length
    num_requests = default_num_requests(b)  # as specbatch bench
    longest = math.ceil(64 * (1 + args.output_len_spread))
    engine = builtin_engine(k_max, 64, longest, max_num_seqs=max(64, b))
    forward = {"seconds": 0.0}
    execute = engine.executor.execute

    def timed_execute(plan: SchedulerOutput) -> StepResult:
        started = time.perf_counter()
        result = execute(plan)
        forward["seconds"] = time.perf_counter() - started
        return result

    engine.executor.execute = timed_execute  # type: ignore[method-assign]
    policies = {
        "auto": Recording(engine.adaptive_policy(k_max), b, forward),
        f"k = {args.fixed}": Recording(FixedDraftLength(args.fixed), b, forward),
    }
    workload = build_workload(
        engine, input_len=64, output_len=64, num_prompts=4 + args.rounds * num_requests
    )
    workload = spread_output_lengths(workload, args.output_len_spread)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    wall: dict[str, float] = defaultdict(float)
    for r in range(args.rounds):
        for name, policy in policies.items():
            engine.scheduler.policy = policy
            policy.active = False
            run_cell(engine, workload, b, min(b, 4), warm)
            policy.active = True
            first = 4 + r * num_requests
            wall[name] += run_cell(
                engine, workload, b, num_requests, params, first_prompt=first
            ).wall_s
    rows, records = [], {}
    for name, policy in policies.items():
        ledger = policy.ledger
        for kind in CLASSES:
            steps, seconds, tokens = ledger.by_class.get(kind, [0, 0.0, 0])
            ms_per_token = seconds / tokens * 1e3 if tokens else ""
            rows.append([name, kind, steps, seconds, tokens, ms_per_token])
        rows.append([name, "outside forwards", "", ledger.outside, "", ""])
        records[name] = {
            "wall_s": wall[name],
            "outside_forwards_s": ledger.outside,
            "classes": {
                kind: dict(
                    zip(("steps", "forward_s", "tokens"), ledger.by_class.get(kind, [0, 0.0, 0]))
                )
                for kind in CLASSES
            },
        }
    print(f"batch {b}, {args.rounds} rounds of {num_requests} requests (built-in pair, greedy)")
    print(format_table(["policy", "class", "steps", "forward s", "tokens", "ms/token"], rows))
    for name in policies:
        print(f"{name}: wall {wall[name]:.2f} s")
    path = write_json(args.out, {"batch_size": b, "policies": records, "machine": machine_info()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
