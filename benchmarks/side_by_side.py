"""How much of a bench ratio is the machine: two engines run one after another, then side by side.

Two engines on the built-in pair (draft lengths ``--k`` and ``--other``; the same by default,
so every ratio between them should be 1), their weights shared as in ``specbatch bench``. Each
round runs the same closed-loop cell on both twice: side by side (``run_side_by_side``, a step
at a time, each on its own clock; ``--interleave steps``) and one after the other, each alone
(``--interleave cells``), on prompts of the round's own. It prints every round's tokens/s and
the ratio of the two engines' figures, and the spread of those ratios per way of running.

    OMP_NUM_THREADS=1 python benchmarks/side_by_side.py --batch-size 8 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, format_table, machine_info, write_json

from specbatch.bench.cell_run import CellRun, run_cell, run_side_by_side
from specbatch.bench.offline import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_OUTPUT_LEN_SPREAD,
    WARMUP_REQUESTS,
    WARMUP_TOKENS,
    BenchConfig,
    _engine,
    default_num_requests,
    share_weights,
)
from specbatch.bench.workload import build_workload, spread_output_lengths
from specbatch.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--k", type=int, default=2, help="the first engine's draft length")
    p.add_argument("--other", type=int, default=None, help="the second's (default: --k)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", default=str(RESULTS_DIR / "side_by_side.json"))
    args = p.parse_args()
    b, lengths = args.batch_size, (args.k, args.k if args.other is None else args.other)
    cfg = BenchConfig(draft_lengths=[0, *lengths])
    engines = [_engine(cfg, k, b) for k in lengths]
    share_weights(engines)
    n = default_num_requests(b)
    workload = build_workload(
        engines[0],
        input_len=DEFAULT_INPUT_LEN,
        output_len=DEFAULT_OUTPUT_LEN,
        num_prompts=WARMUP_REQUESTS + args.rounds * n,
        prompts_file=None,
        seed=0,
    )
    workload = spread_output_lengths(workload, DEFAULT_OUTPUT_LEN_SPREAD, 0)
    params = SamplingParams(temperature=0.0, max_tokens=DEFAULT_OUTPUT_LEN, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    rounds = []
    try:
        for r in range(args.rounds):
            first = WARMUP_REQUESTS + r * n
            order = engines if r % 2 == 0 else engines[::-1]  # who goes first alternates
            for e in order:
                run_cell(e, workload, b, min(b, WARMUP_REQUESTS), warm)
            side = run_side_by_side(
                [CellRun(e, workload, b, n, params, first_prompt=first) for e in order]
            )
            alone = [run_cell(e, workload, b, n, params, first_prompt=first) for e in order]
            if order is not engines:
                side, alone = side[::-1], alone[::-1]
            rounds.append(
                {
                    "side_by_side_tok_s": [c.output_tok_s for c in side],
                    "alone_tok_s": [c.output_tok_s for c in alone],
                    "side_by_side_ratio": side[0].output_tok_s / side[1].output_tok_s,
                    "alone_ratio": alone[0].output_tok_s / alone[1].output_tok_s,
                    "side_by_side_tpot_ratio": side[0].tpot_mean / side[1].tpot_mean,
                    "alone_tpot_ratio": alone[0].tpot_mean / alone[1].tpot_mean,
                }
            )
    finally:
        for e in engines:
            e.shutdown()
    rows = [
        [
            i,
            " / ".join(f"{x:.1f}" for x in r["side_by_side_tok_s"]),
            f"{r['side_by_side_ratio']:.3f}",
            " / ".join(f"{x:.1f}" for x in r["alone_tok_s"]),
            f"{r['alone_ratio']:.3f}",
        ]
        for i, r in enumerate(rounds)
    ]
    print(f"batch {b}, k = {lengths[0]} and k = {lengths[1]}, {n} requests a cell, built-in pair")
    heads = ["round", "side by side tok/s", "ratio", "one after the other tok/s", "ratio"]
    print(format_table(heads, rows))
    summary = {}
    for way in ("side_by_side", "alone"):
        ratios = [r[f"{way}_ratio"] for r in rounds]
        tok = [x for r in rounds for x in r[f"{way}_tok_s"]]
        summary[way] = {
            "ratio_mean": statistics.mean(ratios),
            "ratio_sd": statistics.pstdev(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "tok_s_mean": statistics.mean(tok),
        }
        s = summary[way]
        print(
            f"{way.replace('_', ' ')}: ratio mean {s['ratio_mean']:.3f}, sd {s['ratio_sd']:.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f}; mean tok/s {s['tok_s_mean']:.1f}"
        )
    path = write_json(
        args.out,
        {
            "batch_size": b,
            "draft_lengths": list(lengths),
            "rounds": rounds,
            "summary": summary,
            "machine": machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
