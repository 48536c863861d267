"""specbatch next to Hugging Face transformers, same weights, same prompts, one run.

* plain decoding at each batch size: transformers' batched ``generate`` (all prompts the same
  length, so no padding) against specbatch's plain engine kept full at the same batch size;
* speculative decoding at batch size 1 (all transformers' assisted generation supports):
  ``generate(assistant_model=draft)`` with a constant ``--draft-length`` (schedule "constant",
  confidence threshold 0, so every round drafts exactly k tokens) against specbatch with the
  same k, greedy and sampled (``--temperature``, no top-k/top-p on either side).

Every request generates exactly ``--output-len`` tokens (``min_new_tokens`` / ``ignore_eos``).
Time per output token here is end-to-end request latency over output tokens on both sides
(transformers gives no first-token time), so it includes the prompt pass. A warm-up call of
each configuration runs first and is not counted.

    python benchmarks/compare_hf.py                                   # built-in pair
    python benchmarks/compare_hf.py --batch-sizes 1 8 32 --draft-length 4 --output-len 64
    python benchmarks/compare_hf.py --model T --draft-model D
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, format_table, machine_info, set_threads, write_json

from specbatch.bench.cell_run import run_cell
from specbatch.bench.workload import Workload, build_workload
from specbatch.config import EngineArgs, default_model_path
from specbatch.engine.llm_engine import LLMEngine
from specbatch.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target checkpoint (default: built-in pair)")
    ap.add_argument("--draft-model", default=None, help="draft checkpoint (default: built-in)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--draft-length", type=int, default=4, help="k for both engines")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--min-requests",
        type=int,
        default=4,
        help="requests per configuration at least (batch size B runs ceil(N/B) waves of B)",
    )
    ap.add_argument("--temperature", type=float, default=1.0, help="of the sampled runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS_DIR / "compare_hf.json"))
    return ap.parse_args(argv)


# ---- transformers --------------------------------------------------------------------------
def load_hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def hf_generate(
    model: Any,
    prompts: list[list[int]],
    output_len: int,
    temperature: float,
    assistant: Any | None = None,
    draft_length: int = 0,
) -> tuple[float, int]:
    """Seconds of one ``generate`` call over ``prompts`` (one batch), and tokens generated."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": output_len,
        "min_new_tokens": output_len,
        "pad_token_id": model.generation_config.pad_token_id or 0,
        "top_k": None,
        "top_p": None,
    }
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature)
    else:
        kwargs.update(do_sample=False)
    if assistant is not None:
        gc = assistant.generation_config
        gc.num_assistant_tokens = draft_length
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0
        kwargs.update(
            assistant_model=assistant,
            num_assistant_tokens=draft_length,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - t0
    generated = int((out.shape[1] - ids.shape[1]) * out.shape[0])
    if out.shape[1] - ids.shape[1] != output_len:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens")
    return seconds, generated


def hf_waves(
    model: Any,
    wl: Workload,
    batch_size: int,
    waves: int,
    temperature: float,
    assistant: Any | None = None,
    draft_length: int = 0,
) -> dict[str, Any]:
    hf_generate(model, [wl.prompt(0)] * batch_size, 8, temperature, assistant, draft_length)
    total_s, tokens, lat = 0.0, 0, []
    for w in range(waves):
        batch = [wl.prompt(1 + w * batch_size + i) for i in range(batch_size)]
        s, n = hf_generate(model, batch, wl.output_len, temperature, assistant, draft_length)
        total_s += s
        tokens += n
        lat.append(s)
    return {
        "requests": waves * batch_size,
        "tokens": tokens,
        "seconds": total_s,
        "tok_s": tokens / total_s,
        "ms_per_token": 1e3 * sum(lat) / len(lat) / wl.output_len,
    }


# ---- specbatch -----------------------------------------------------------------------------
def sb_cell(
    engine: LLMEngine, wl: Workload, batch_size: int, requests: int, temperature: float
) -> dict[str, Any]:
    warm = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
    run_cell(engine, wl, batch_size, batch_size, warm)
    params = SamplingParams(temperature=temperature, max_tokens=wl.output_len, ignore_eos=True)
    c = run_cell(engine, wl, batch_size, requests, params, first_prompt=1)
    if c.output_tokens != requests * wl.output_len:
        raise RuntimeError("specbatch generated the wrong number of tokens")
    return {
        "requests": c.num_requests,
        "tokens": c.output_tokens,
        "seconds": c.wall_s,
        "tok_s": c.output_tok_s,
        "ms_per_token": 1e3 * (c.e2e_mean or 0.0) / wl.output_len,
        "alpha": c.alpha,
        "mean_tokens_per_round": c.mean_tokens_per_round,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_threads(args.threads)
    target = args.model or str(default_model_path("target"))
    draft = args.draft_model or str(default_model_path("draft"))
    k = args.draft_length
    sizes = sorted(set(args.batch_sizes))
    max_len = args.input_len + args.output_len + k + 2
    common = {"seed": args.seed, "max_model_len": max_len, "device": "cpu", "dtype": "float32"}
    plain = LLMEngine.from_engine_args(
        EngineArgs(model=target, num_speculative_tokens=0, max_num_seqs=max(sizes), **common)
    )
    spec = LLMEngine.from_engine_args(
        EngineArgs(
            model=target, draft_model=draft, num_speculative_tokens=k, max_num_seqs=1, **common
        )
    )
    n_prompts = max(args.min_requests, max(sizes)) * 2 + 2
    wl = build_workload(
        plain, input_len=args.input_len, output_len=args.output_len, num_prompts=n_prompts
    )
    hf_target, hf_draft = load_hf(target), load_hf(draft)
    rows: list[dict[str, Any]] = []

    def add(system: str, mode: str, b: int, kk: int, temp: float, r: dict[str, Any]) -> None:
        rows.append({"system": system, "mode": mode, "batch_size": b, "k": kk, "temp": temp, **r})
        print(
            f"  {system:12s} {mode:9s} B={b:<3d} k={kk} T={temp}: {r['tok_s']:.1f} tok/s, "
            f"{r['ms_per_token']:.2f} ms/token",
            flush=True,
        )

    for b in sizes:
        waves = -(-args.min_requests // b)
        add("transformers", "plain", b, 0, 0.0, hf_waves(hf_target, wl, b, waves, 0.0))
        add("specbatch", "plain", b, 0, 0.0, sb_cell(plain, wl, b, waves * b, 0.0))
    n1 = args.min_requests
    for temp in (0.0, args.temperature):
        add(
            "transformers",
            "assisted",
            1,
            k,
            temp,
            hf_waves(hf_target, wl, 1, n1, temp, hf_draft, k),
        )
        add("specbatch", "spec", 1, k, temp, sb_cell(spec, wl, 1, n1, temp))
        add("transformers", "plain", 1, 0, temp, hf_waves(hf_target, wl, 1, n1, temp))
        add("specbatch", "plain", 1, 0, temp, sb_cell(plain, wl, 1, n1, temp))
    plain.shutdown()
    spec.shutdown()

    def find(system: str, mode: str, b: int, temp: float) -> dict[str, Any] | None:
        for r in rows:
            if (r["system"], r["mode"], r["batch_size"], r["temp"]) == (system, mode, b, temp):
                return r
        return None

    ratios: dict[str, float] = {}
    for temp in (0.0, args.temperature):
        a, s = find("transformers", "assisted", 1, temp), find("specbatch", "spec", 1, temp)
        if a and s:
            ratios[f"B=1 T={temp}: specbatch spec / transformers assisted, ms per token"] = (
                s["ms_per_token"] / a["ms_per_token"]
            )
    for b in sizes:
        h, s = find("transformers", "plain", b, 0.0), find("specbatch", "plain", b, 0.0)
        if h and s:
            ratios[f"B={b} greedy: specbatch plain / transformers generate, tok/s"] = (
                s["tok_s"] / h["tok_s"]
            )
    return {
        "config": vars(args) | {"model": target, "draft_model": draft},
        "workload_source": wl.source,
        "machine": machine_info(),
        "rows": rows,
        "ratios": ratios,
    }


def print_report(report: dict[str, Any]) -> None:
    headers = ["system", "mode", "B", "k", "T", "reqs", "tok/s", "ms/token", "alpha", "tok/round"]
    table = [
        [
            r["system"],
            r["mode"],
            r["batch_size"],
            r["k"],
            r["temp"],
            r["requests"],
            r["tok_s"],
            r["ms_per_token"],
            r.get("alpha"),
            r.get("mean_tokens_per_round"),
        ]
        for r in report["rows"]
    ]
    cfg = report["config"]
    print(
        f"\nspecbatch vs transformers: {cfg['input_len']} in / {cfg['output_len']} out tokens, "
        f"{cfg['threads']} torch thread(s), prompts: {report['workload_source']}"
    )
    print(format_table(headers, table))
    print("ms/token: end-to-end request latency / output tokens (prompt pass included)")
    for name, v in report["ratios"].items():
        print(f"  {name}: {v:.2f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
