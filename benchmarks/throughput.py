"""Output tokens/s of the engine and of transformers' batched ``generate`` on the same weights.

For each batch size B, B prompts of ``--prompt-len`` random token ids each decode exactly
``--output-len`` tokens, greedily, in float32. Engine: one ``LLM.generate`` call with all B
prompts (max_num_seqs >= B, so they run as one batch). transformers: one ``model.generate`` on
the [B, L] tensor (equal lengths, so no padding), eos disabled so both emit every token. The
wall time of the whole call counts (prefill included, warm-up excluded); runs alternate
engine / transformers so that noise from other processes hits both alike; medians are reported.
Greedy outputs of the two are compared token for token.

    python benchmarks/throughput.py                       # random ~27M-parameter Llama
    python benchmarks/throughput.py --batch-sizes 1 4 --output-len 16 --repeats 1   # smoke
    python benchmarks/throughput.py --model DIR           # an existing checkpoint
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    RESULTS_DIR,
    ModelSize,
    checkpoint_summary,
    format_table,
    machine_info,
    median,
    random_checkpoint,
    random_prompts,
    set_threads,
    timed,
    write_json,
)

# About 27M parameters: 6 layers x 3.1M + embeddings and lm_head 2 x 4.2M.
DEFAULT_SIZE = ModelSize(
    vocab_size=8192,
    hidden_size=512,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1536,
    max_position_embeddings=1024,
    seed=0,
)
TARGET_RATIO_AT_32 = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch size and system")
    ap.add_argument(
        "--warmup-len",
        type=int,
        default=8,
        help="output tokens of the untimed warm-up run per batch size and system",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, the same for both (default 1: on a shared 2-core "
        "machine 2 threads oversubscribe and run ~10x slower)",
    )
    ap.add_argument(
        "--model",
        type=str,
        default=None,
        help="an existing checkpoint directory instead of the random one",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    ap.add_argument("--skip-hf", action="store_true", help="time the engine only")
    ap.add_argument(
        "--profile-batch",
        type=int,
        default=None,
        help="also profile engine decode steps at this batch size",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and compute of both systems (bfloat16 uses AMX where the CPU has it)",
    )
    ap.add_argument("--out", type=str, default=str(RESULTS_DIR / "throughput.json"))
    return ap.parse_args(argv)


class EngineRunner:
    """One ``LLM`` for every batch size: max_num_seqs covers the largest batch."""

    def __init__(
        self, model: str, max_batch: int, prompt_len: int, output_len: int, dtype: str
    ) -> None:
        from specbatch import LLM

        self.llm = LLM(
            model=model,
            dtype=dtype,
            device="cpu",
            max_num_seqs=max(max_batch, 1),
            max_num_batched_tokens=max(2048, max_batch * prompt_len),
            max_model_len=prompt_len + output_len + 1,
            seed=0,
        )

    def generate(self, prompts: list[list[int]], output_len: int) -> Generation:
        from specbatch import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        steps0 = self.llm.engine.metrics.num_steps
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        m = [o.metrics for o in outs]
        arrival = min(x.arrival_time for x in m)
        first = max(x.first_token_time or arrival for x in m)
        last = max(x.last_token_time or first for x in m)
        return Generation(
            token_ids=[list(o.outputs[0].token_ids) for o in outs],
            ttft=first - arrival,
            tpot=(last - first) / max(output_len - 1, 1),
            steps=self.llm.engine.metrics.num_steps - steps0,
        )


@dataclass
class Generation:
    """One timed batch: tokens, time to the first token of the whole batch, and mean time per
    later decode step (TPOT: first to last token over output_len - 1)."""

    token_ids: list[list[int]]
    ttft: float
    tpot: float
    steps: int | None = None


class _StepClock:
    """A transformers streamer that only notes when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFRunner:
    def __init__(self, model: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model.eval()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], output_len: int) -> Generation:
        from transformers import GenerationConfig

        ids = torch.tensor(prompts, dtype=torch.int64)
        # eos_token_id=None: never stop early and never suppress eos, as ignore_eos does.
        gc_ = GenerationConfig(
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
        )
        clock = _StepClock()
        start = time.perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=gc_,
            streamer=clock,
        )
        # put() is called with the prompt first, then once per generated step.
        steps = clock.times[1:]
        return Generation(
            token_ids=out[:, ids.shape[1] :].tolist(),
            ttft=steps[0] - start,
            tpot=(steps[-1] - steps[0]) / max(len(steps) - 1, 1),
        )


def compare(engine: list[list[int]], hf: list[list[int]]) -> dict[str, Any]:
    """How many sequences agree exactly, and where the others first differ."""
    first_diff = []
    for a, b in zip(engine, hf, strict=True):
        d = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if d is None and len(a) != len(b):
            d = min(len(a), len(b))
        if d is not None:
            first_diff.append(d)
    return {
        "sequences": len(engine),
        "identical": len(engine) - len(first_diff),
        "first_divergence_positions": sorted(first_diff),
    }


def _system_row(name: str, tokens: int, times: list[float], gens: list[Generation]) -> dict:
    return {
        f"{name}_seconds": times,
        f"{name}_tok_s": tokens / median(times),
        f"{name}_ttft_s": median([g.ttft for g in gens]),
        f"{name}_decode_step_s": median([g.tpot for g in gens]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = set_threads(args.threads)
    if args.model:
        model_path = Path(args.model)
    else:
        print("building / reusing the random checkpoint ...", flush=True)
        model_path = random_checkpoint(DEFAULT_SIZE)
    summary = checkpoint_summary(model_path)
    vocab = int(summary["vocab_size"])
    batch_sizes = sorted(set(args.batch_sizes))
    print(
        f"model: {model_path} ({summary['parameters'] / 1e6:.1f}M parameters), "
        f"torch threads {threads}",
        flush=True,
    )

    engine = EngineRunner(
        str(model_path), max(batch_sizes), args.prompt_len, args.output_len, args.dtype
    )
    hf = None if args.skip_hf else HFRunner(str(model_path), args.dtype)

    results = []
    for b in batch_sizes:
        prompts = random_prompts(b, args.prompt_len, vocab, seed=args.seed + b)
        engine.generate(prompts, args.warmup_len)
        if hf is not None:
            hf.generate(prompts, args.warmup_len)
        runs: dict[str, tuple[list[float], list[Generation]]] = {"engine": ([], []), "hf": ([], [])}
        for i in range(args.repeats):
            # Alternate, who goes first too, so load from other processes hits both alike.
            systems: list[tuple[str, Any]] = [("engine", engine)]
            if hf is not None:
                systems.append(("hf", hf))
            if i % 2:
                systems.reverse()
            for name, runner in systems:
                gc.collect()
                t, gen = timed(lambda r=runner, p=prompts: r.generate(p, args.output_len))
                if any(len(x) != args.output_len for x in gen.token_ids):
                    raise RuntimeError(f"{name} emitted a different number of tokens than asked")
                runs[name][0].append(t)
                runs[name][1].append(gen)
        tokens = b * args.output_len
        row: dict[str, Any] = {
            "batch_size": b,
            "output_tokens": tokens,
            "engine_steps": runs["engine"][1][-1].steps,
            **_system_row("engine", tokens, *runs["engine"]),
        }
        msg = f"  B={b:3d}: engine {row['engine_tok_s']:8.1f} tok/s"
        if hf is not None:
            row.update(_system_row("hf", tokens, *runs["hf"]))
            row["ratio"] = row["engine_tok_s"] / row["hf_tok_s"]
            row["decode_step_ratio"] = row["hf_decode_step_s"] / row["engine_decode_step_s"]
            row["greedy_agreement"] = compare(
                runs["engine"][1][-1].token_ids, runs["hf"][1][-1].token_ids
            )
            agree = row["greedy_agreement"]
            msg += (
                f", transformers {row['hf_tok_s']:8.1f} tok/s, ratio {row['ratio']:.2f}, "
                f"identical {agree['identical']}/{agree['sequences']}"
            )
        results.append(row)
        print(msg, flush=True)

    report = {
        "benchmark": "throughput",
        "machine": machine_info(),
        "config": {
            "model": summary,
            "random_checkpoint": None if args.model else vars(DEFAULT_SIZE),
            "dtype": args.dtype,
            "device": "cpu",
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "warmup_len": args.warmup_len,
            "greedy": True,
            "timing": "tok/s: batch x output_len over the wall time of one generate call "
            "(prefill included); ttft: start of the call to the batch's first token; "
            "decode step: (last token - first token) / (output_len - 1); "
            "medians over repeats",
        },
        "results": results,
    }
    if args.profile_batch:
        prompts = random_prompts(args.profile_batch, args.prompt_len, vocab, seed=args.seed)
        report["profile"] = profile_engine_steps(engine, prompts, args.output_len)
    return report


def profile_engine_steps(
    engine: EngineRunner, prompts: list[list[int]], output_len: int
) -> dict[str, Any]:
    """Profile decode steps of one batch (after prefill and two warm steps): timed, then under
    cProfile (Python functions), then under torch.profiler (operators), ``steps`` each."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from specbatch import SamplingParams

    steps = min(8, (output_len - 4) // 3)  # prefill, 2 warm steps, 3 x steps, 1 spare token
    if steps < 1:
        raise ValueError("--profile-batch needs --output-len >= 7")
    eng = engine.llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [eng.add_request({"prompt_token_ids": p}, sp) for p in prompts]
    try:
        for _ in range(3):  # prefill + warm decode steps
            eng.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        step_s = (time.perf_counter() - t0) / steps
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            eng.step()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(20)
        python_table = buf.getvalue()
        with profile(activities=[ProfilerActivity.CPU]) as tprof:
            for _ in range(steps):
                eng.step()
        op_table = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    finally:
        eng.abort_request(ids)
    return {
        "batch_size": len(prompts),
        "decode_step_seconds": step_s,
        "cprofile_by_tottime": python_table,
        "torch_ops_by_self_cpu": op_table,
    }


def print_report(report: dict[str, Any]) -> None:
    rows = []
    has_hf = any("hf_tok_s" in r for r in report["results"])
    for r in report["results"]:
        row: list[Any] = [r["batch_size"], r["engine_tok_s"]]
        if has_hf:
            row += [r["hf_tok_s"], f"{r['ratio']:.2f}x"]
        row += [r["engine_ttft_s"] * 1e3]
        if has_hf:
            row += [r["hf_ttft_s"] * 1e3]
        row += [r["engine_decode_step_s"] * 1e3]
        if has_hf:
            a = r["greedy_agreement"]
            row += [r["hf_decode_step_s"] * 1e3, f"{a['identical']}/{a['sequences']}"]
        rows.append(row)
    if has_hf:
        headers = [
            "batch",
            "engine tok/s",
            "hf tok/s",
            "engine/hf",
            "engine ttft ms",
            "hf ttft ms",
            "engine ms/step",
            "hf ms/step",
            "greedy identical",
        ]
    else:
        headers = ["batch", "engine tok/s", "engine ttft ms", "engine ms/step"]
    m, c = report["machine"], report["config"]
    print()
    print(
        f"{c['model']['parameters'] / 1e6:.1f}M-parameter Llama, {c['dtype']} CPU, "
        f"prompt {c['prompt_len']} + output {c['output_len']} tokens, greedy, "
        f"median of {c['repeats']}; {m['cpu_model']}, {m['cpus_usable']} CPUs "
        f"(load {m['load_average_1m']:.1f}), torch {m['torch']} with "
        f"{m['torch_threads']} threads"
    )
    print(format_table(headers, rows))
    print("ms/step: decode steps after the first token (TPOT); ttft includes the batch's prefill")
    at32 = next((r for r in report["results"] if r["batch_size"] == 32 and "ratio" in r), None)
    if at32 is not None:
        verdict = "met" if at32["ratio"] >= TARGET_RATIO_AT_32 else "MISSED"
        print(
            f"target >= {TARGET_RATIO_AT_32:.1f}x transformers at batch 32: {verdict} "
            f"({at32['ratio']:.2f}x)"
        )
    disagree = [
        r["batch_size"]
        for r in report["results"]
        if "greedy_agreement" in r and r["greedy_agreement"]["first_divergence_positions"]
    ]
    if disagree:
        print(
            f"greedy outputs differ from transformers at batch sizes {disagree} "
            "(see first_divergence_positions in the JSON)"
        )
    prof = report.get("profile")
    if prof:
        print(
            f"\nprofile of engine decode steps at batch {prof['batch_size']} "
            f"({prof['decode_step_seconds'] * 1e3:.1f} ms/step unprofiled):"
        )
        print(prof["torch_ops_by_self_cpu"])
        print(prof["cprofile_by_tottime"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    path = write_json(args.out, report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
