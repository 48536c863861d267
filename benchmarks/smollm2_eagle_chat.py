"""SmolLM2-135M-Instruct with its EAGLE-3 head (scripts/train_smollm2_eagle.py) on held-out chat
prompts (kinds and material the head never saw): greedy tokens/s at batch 1 for each draft
length against plain decoding, the engines taking turns prompt by prompt, greedy outputs
compared; then alpha (accepted / tested drafts) at temperature 1, all prompts at once.

    python scripts/train_smollm2_eagle.py   # once: the head
    python benchmarks/smollm2_eagle_chat.py --threads 1 [--k 2 3 4] [--num-prompts 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json
from scripts.chat_instructions import instructions
from scripts.fetch_smollm2 import eagle_head_dir, fetch_smollm2
from specbatch import LLM, SamplingParams


def run(llm: LLM, convs: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def counts(llm: LLM) -> dict[str, float]:
    """The engine's counters now: drafts accepted and tested, rounds, steps, the seconds spent
    drafting and in the target's passes."""
    m = llm.engine.metrics
    s = m.spec
    return {"accepted": s.accepted, "tested": s.accepted + s.rejections, "rounds": s.rounds,
            "steps": m.num_steps, "draft_s": m.draft_time_total,
            "target_s": m.target_time_total}  # fmt: skip


def since(llm: LLM, start: dict[str, float]) -> dict[str, float]:
    return {k: v - start[k] for k, v in counts(llm).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    ap.add_argument("--head", default=str(eagle_head_dir()))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 4], help="draft lengths")
    ap.add_argument("--num-prompts", type=int, default=10, help="batch 1, greedy")
    ap.add_argument("--alpha-prompts", type=int, default=64, help="temperature 1, all at once")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(RESULTS_DIR / "smollm2_eagle_chat.json"))
    a = ap.parse_args()
    if not (Path(a.head) / "config.json").is_file():
        sys.exit(
            f"error: --head: no EAGLE head at {a.head} (python scripts/train_smollm2_eagle.py)"
        )
    threads = set_threads(a.threads)
    model = a.model or str(fetch_smollm2())
    common = dict(dtype=a.dtype, max_model_len=1024, num_kv_blocks=1024, max_num_seqs=64)
    engines = {"plain": LLM(model, **common)}
    for k in a.k:
        spec = {"method": "eagle3", "model": a.head, "num_speculative_tokens": k}
        engines[f"k={k}"] = LLM(model, speculative_config=spec, **common)
    held = instructions("heldout", max(a.num_prompts, a.alpha_prompts), seed=0)
    convs = [[{"role": "user", "content": i["content"]}] for i in held]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    for llm in engines.values():
        run(llm, convs[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    times = dict.fromkeys(engines, 0.0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    before = {n: counts(llm) for n, llm in engines.items()}
    for conv in convs[: a.num_prompts]:  # batch 1, the engines in turn
        for name, llm in engines.items():
            dt, out = run(llm, [conv], greedy)
            times[name] += dt
            outputs[name] += out
    tokens = sum(map(len, outputs["plain"]))
    plain_rate = tokens / times["plain"]
    plain = since(engines["plain"], before["plain"])
    plain_pass = plain["target_s"] / plain["steps"]  # one decoding step of the target
    cells, rows = [], [["plain", f"{plain_rate:.1f}", "1.00", "-", "-", "-", "1.00", "-"]]
    for name, llm in engines.items():
        if name == "plain":
            continue
        d, k = since(llm, before[name]), int(name[2:])
        rate = sum(map(len, outputs[name])) / times[name]
        cell = {"k": k, "tok_s": rate, "speedup": rate / plain_rate,
                "alpha_greedy": d["accepted"] / max(d["tested"], 1),
                "tokens_per_round": (d["accepted"] + d["rounds"]) / max(d["rounds"], 1),
                # a draft pass and a verifying pass, in plain decoding steps of the target
                "c": d["draft_s"] / max(d["rounds"] * k, 1) / plain_pass,
                "verify_cost": d["target_s"] / max(d["steps"], 1) / plain_pass,
                "greedy_equal": outputs[name] == outputs["plain"]}  # fmt: skip
        cells.append(cell)
        rows.append([name, f"{rate:.1f}", f"{cell['speedup']:.2f}", f"{cell['alpha_greedy']:.3f}",
                     f"{cell['tokens_per_round']:.2f}", f"{cell['c']:.3f}",
                     f"{cell['verify_cost']:.2f}", str(cell["greedy_equal"])])  # fmt: skip
    # alpha at temperature 1: the deepest chain, every held-out prompt at once
    deepest = engines[f"k={max(a.k)}"]
    start = counts(deepest)
    sampled = SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=0)
    run(deepest, convs[: a.alpha_prompts], sampled)
    d = since(deepest, start)
    alpha_t1, tested = d["accepted"] / max(d["tested"], 1), d["tested"]
    headers = ["greedy, batch 1", "tok/s", "speedup", "alpha", "tokens/round", "c",
               "verify cost", "output = plain"]  # fmt: skip
    print(format_table(headers, rows))
    print(f"alpha at temperature 1 (k={max(a.k)}, {a.alpha_prompts} prompts): {alpha_t1:.3f}")
    result = {"machine": machine_info(), "threads": threads, "args": vars(a),
              "batch1_plain_tok_s": plain_rate, "batch1_output_tokens": tokens, "cells": cells,
              "alpha_temperature_1": alpha_t1, "alpha_t1_drafts_tested": tested}  # fmt: skip
    print(f"wrote {write_json(a.out, result)}")


if __name__ == "__main__":
    main()
