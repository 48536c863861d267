"""How well ``auto`` foresees a request's acceptance: its alpha estimates set beside the rates
that followed them, under the two priors the policy can use.

On the built-in pair (greedy, 64-token prompts of held-out text, outputs of 64 tokens on
average spread as in ``specbatch bench``), the engine runs ``--rounds`` closed-loop cells at
``--batch-size`` under ``auto`` (or a fixed ``--draft-length``) and records every request's
rounds: drafts accepted and tested. The finished requests are split in two, alternately. On
the first half both priors are learned as the policy learns them: a Beta around the class's
rate as strong as empirical Bayes says (``beta_prior_strength``), and the histogram fitted by
EM (``GridPrior``). On the second half, before each round, the request's alpha is estimated
from its earlier rounds under each prior; the estimates are binned and set beside the share
of the round's tested drafts that were accepted. A calibrated estimate matches the rate that
followed it in every bin.

    OMP_NUM_THREADS=1 python benchmarks/alpha_calibration.py --batch-size 4
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections import defaultdict
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
from specbatch.bench.offline import DEFAULT_OUTPUT_LEN_SPREAD, default_num_requests
from specbatch.bench.workload import build_workload, spread_output_lengths
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.acceptance import beta_prior_strength, sampling_class
from specbatch.scheduler.alpha_prior import GridPrior
from specbatch.scheduler.output import SchedulerOutput, StepResult
from specbatch.scheduler.speculation import FixedDraftLength

BINS = (0.0, 0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.9, 1.0)


class RoundRecorder(WrappedPolicy):
    """Wraps a policy; files every drafting request's rounds as (accepted, tested)."""

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        self.rounds: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def observe(self, plan: SchedulerOutput, result: StepResult, seconds: float) -> None:
        self.learn(plan, result, seconds)
        for sr in plan.requests:
            r = result.results.get(sr.request_id)
            if sr.sample and r is not None and sr.num_draft:
                tested = min(r.num_accepted + 1, sr.num_draft)
                self.rounds[sr.request_id].append((r.num_accepted, tested))


def estimates(rounds: np.ndarray, estimate: Any) -> np.ndarray:
    """Before each round: the estimate from the rounds before it."""
    accepted = np.concatenate([[0], np.cumsum(rounds[:, 0])[:-1]]).astype(int)
    tested = np.concatenate([[0], np.cumsum(rounds[:, 1])[:-1]]).astype(int)
    return np.array([estimate(int(a), int(t)) for a, t in zip(accepted, tested)])


def calibration(held_out: list[np.ndarray], estimate: Any) -> dict[str, Any]:
    """Binned estimates against the acceptance that followed, and the mean log-likelihood of
    the rounds' tested drafts under the estimates."""
    est = np.concatenate([estimates(r, estimate) for r in held_out])
    accepted = np.concatenate([r[:, 0] for r in held_out])
    tested = np.concatenate([r[:, 1] for r in held_out])
    p = np.clip(est, 1e-3, 1 - 1e-3)
    loglik = float(np.sum(accepted * np.log(p) + (tested - accepted) * np.log(1 - p)))
    bins = []
    for lo, hi in itertools.pairwise(BINS):
        m = (est >= lo) & (est < hi)
        if m.sum():
            bins.append(
                {
                    "bin": [lo, hi],
                    "rounds": int(m.sum()),
                    "estimate": float(est[m].mean()),
                    "followed": float(accepted[m].sum() / tested[m].sum()),
                }
            )
    gap = sum(b["rounds"] * abs(b["estimate"] - b["followed"]) for b in bins) / len(est)
    return {"bins": bins, "loglik_per_draft": loglik / tested.sum(), "mean_abs_gap": gap}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--draft-length", default="auto", help="'auto' or a fixed k")
    p.add_argument("--max-draft-length", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS_DIR / "alpha_calibration.json"))
    args = p.parse_args()
    b, k_max = args.batch_size, args.max_draft_length
    num_requests = default_num_requests(b)
    longest = math.ceil(64 * (1 + DEFAULT_OUTPUT_LEN_SPREAD))
    engine = builtin_engine(k_max, 64, longest, max_num_seqs=max(64, b))
    inner = (
        engine.adaptive_policy(k_max)
        if args.draft_length == "auto"
        else FixedDraftLength(int(args.draft_length))
    )
    recorder = RoundRecorder(inner)
    engine.scheduler.policy = recorder
    workload = build_workload(
        engine, input_len=64, output_len=64, num_prompts=args.rounds * num_requests
    )
    workload = spread_output_lengths(workload, DEFAULT_OUTPUT_LEN_SPREAD)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for r in range(args.rounds):
        run_cell(engine, workload, b, num_requests, params, first_prompt=r * num_requests)
    requests = [np.array(v, dtype=np.float64) for v in recorder.rounds.values() if len(v) >= 4]
    learn, held_out = requests[0::2], requests[1::2]
    accepted = np.array([r[:, 0].sum() for r in learn])
    tested = np.array([r[:, 1].sum() for r in learn])
    centre = float(accepted.sum() / tested.sum())
    key = sampling_class(params)  # the one sampling class of this workload
    strength = beta_prior_strength([(key, int(a), int(t)) for a, t in zip(accepted, tested)])
    assert strength is not None, "too few requests: raise --rounds"
    histogram = GridPrior(accepted, tested)
    priors = {
        f"Beta ({strength:.1f} pseudo-draws at {centre:.3f})": lambda a, t: (
            (a + strength * centre) / (t + strength)
        ),
        "histogram (EM)": histogram.estimate,
    }
    results = {name: calibration(held_out, est) for name, est in priors.items()}
    rows = []
    for name, res in results.items():
        for bin_ in res["bins"]:
            lo, hi = bin_["bin"]
            rows.append(
                [name, f"{lo:.2f}-{hi:.2f}", bin_["rounds"], bin_["estimate"], bin_["followed"]]
            )
    print(
        f"batch {b}, {args.rounds} rounds of {num_requests} requests, draft length "
        f"{args.draft_length}; priors learned on {len(learn)} requests, estimates checked on "
        f"the rounds of {len(held_out)} others"
    )
    print(format_table(["prior", "estimate in", "rounds", "mean estimate", "accepted after"], rows))
    for name, res in results.items():
        print(
            f"{name}: mean |estimate - accepted after| over the bins "
            f"{res['mean_abs_gap']:.3f}, log-likelihood per tested draft "
            f"{res['loglik_per_draft']:.4f}"
        )
    path = write_json(
        args.out,
        {
            "batch_size": b,
            "rounds": args.rounds,
            "draft_length": args.draft_length,
            "requests": {"learned_on": len(learn), "held_out": len(held_out)},
            "priors": results,
            "machine": machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
