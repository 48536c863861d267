"""How well each drafter of the built-in pair matches the target: alpha = accepted / tested
drafts (THEORY.md's per-draft acceptance, an estimate of E[1 - TV(p, q)]) at temperature 1,
on windows of the held-out stdlib text and on .py files the pair never saw (``--code-dir``,
default: the installed pip's own source).

    python benchmarks/drafter_alpha.py [--num-prompts 64] [--code-dir DIR] [--k 3]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json
from specbatch import LLM, SamplingParams
from specbatch.bench.workload import build_workload

INPUT_LEN, OUTPUT_LEN = 64, 64


def code_windows(llm: LLM, root: Path, n: int, seed: int) -> list[list[int]]:
    """``n`` windows of INPUT_LEN tokens at random offsets of the .py files under ``root``."""
    tok = llm.get_tokenizer()
    files = sorted(root.rglob("*.py"))
    rng = random.Random(seed)
    stream: list[int] = []
    for f in rng.sample(files, min(len(files), 400)):
        stream += tok.encode(f.read_text(errors="replace"), add_special_tokens=False)
    starts = [rng.randrange(len(stream) - INPUT_LEN) for _ in range(n)]
    return [stream[s : s + INPUT_LEN] for s in starts]


def alpha_of(llm: LLM, prompts: list[list[int]]) -> float:
    before = llm.engine.metrics.spec
    accepted, tested = before.accepted, before.accepted + before.rejections
    params = SamplingParams(temperature=1.0, max_tokens=OUTPUT_LEN, ignore_eos=True, seed=0)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    spec = llm.engine.metrics.spec
    a, t = spec.accepted - accepted, spec.accepted + spec.rejections - tested
    return a / t


def main() -> None:
    import pip

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--code-dir", default=str(Path(pip.__file__).parent))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS_DIR / "drafter_alpha.json"))
    args = ap.parse_args()
    rows, cells = [], []
    for method in ("eagle3", "draft_model"):
        spec = {"method": method, "num_speculative_tokens": args.k}
        llm = LLM(speculative_config=spec, max_num_seqs=args.num_prompts)
        heldout = build_workload(
            llm.engine, input_len=INPUT_LEN, output_len=OUTPUT_LEN, num_prompts=args.num_prompts
        ).prompts
        code = code_windows(llm, Path(args.code_dir), args.num_prompts, seed=0)
        a_held, a_code = alpha_of(llm, heldout), alpha_of(llm, code)
        llm.shutdown()
        rows.append([method, f"{a_held:.3f}", f"{a_code:.3f}"])
        cells.append({"method": method, "alpha_heldout": a_held, "alpha_code": a_code})
    print(format_table(["drafter", "alpha held-out stdlib", f"alpha {args.code_dir}"], rows))
    out = write_json(args.out, {"args": vars(args), "cells": cells, "machine": machine_info()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
