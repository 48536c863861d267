"""Long-context decoding: plain against self-speculation over a sparse view of the KV cache.

One engine with the ``self_sparse`` drafter; for every (context length, batch size) cell the same
prompts decode with drafting off (plain) and on, in alternation (--repeats pairs), so the
machine's drift falls on both alike. Prompts are distinct windows of real text (this
interpreter's stdlib sources, tokenized with the model's tokenizer), prefilled once per context
length and reused by every cell through the prefix cache: decoding is timed apart from prefill.

Per cell: decoding tokens/s and time per output token, alpha, tokens per round, the speedup, and
a plain step's bytes (weights and the cache it reads) over its time beside one core's streaming
rate (a plain read of a buffer as large, measured here), and a memory-bound prediction of the
plain step (bytes / streaming rate) beside the measured one. Prints a table, writes OUT.json.

    python benchmarks/long_context.py --context-lens 2000 8000 --batch-sizes 1 16 32
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from specbatch import LLM, SamplingParams
from specbatch.draft_shape import DraftShape
from specbatch.scheduler.speculation import FixedDraft


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", platform.processor()).strip()
    fam, mod = fields.get("CPU family", "?").strip(), fields.get("Model", "?").strip()
    return f"{model} (family {fam}, model {mod})"


def default_model() -> str:
    script = Path(__file__).resolve().parent.parent / "scripts" / "fetch_smollm2.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def documents(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` distinct windows of ``length`` tokens: each from its own stdlib file (files run
    together where one is too short), so no two prompts share a prefix."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 20_000)
    out: list[list[int]] = []
    stream: list[int] = []
    for path in files:
        stream += tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
        if len(stream) >= length:
            out.append(stream[:length])
            stream = []
            if len(out) == n:
                return out
    raise SystemExit(f"the stdlib under {root} holds too little text for {n} x {length} tokens")


def streaming_rate(nbytes: int) -> float:
    """Bytes a second one core reads from a buffer of ``nbytes`` (the best of five sums)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every linear layer's (the kernels' packed copies
    where they run) and the norms; the embedding table is only gathered from."""
    total, seen = 0, set()
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None:
            total += packed.panels.numel() * packed.panels.element_size()
            seen |= {p.data_ptr() for p in module.parameters(recurse=False)}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or "Embedding" in type(module).__name__:
            seen |= {p.data_ptr() for p in module.parameters(recurse=False)}
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict:
    """Decode ``prompts`` together; the steps after every request has its first token are timed."""
    engine = llm.engine
    spec = engine.metrics.spec
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request({"prompt_token_ids": p}, params, request_id=rid)
    started = None
    steps = 0
    proposed, accepted, rounds = spec.proposed, spec.accepted, spec.rounds
    while engine.has_unfinished_requests():
        engine.step()
        if started is None:
            running = [engine.scheduler.requests.get(r) for r in ids]
            if all(r is None or r.output_token_ids for r in running):
                started, steps = time.perf_counter(), 0
                proposed, accepted, rounds = spec.proposed, spec.accepted, spec.rounds
        else:
            steps += 1
    seconds = time.perf_counter() - started
    tokens = len(prompts) * (params.max_tokens - 1)
    drafted = spec.proposed - proposed
    return {
        "tokens_per_s": tokens / seconds,
        "tpot_ms": 1000 * seconds / (params.max_tokens - 1),
        "step_ms": 1000 * seconds / max(steps, 1),
        "alpha": (spec.accepted - accepted) / drafted if drafted else None,
        "tokens_per_round": tokens / (spec.rounds - rounds) if drafted else None,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    ap.add_argument("--context-lens", type=int, nargs="+", default=[2000, 8000])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--draft-length", type=int, default=3)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--sinks", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1, help="plain/sparse pairs per cell")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="bench_results/long_context")
    args = ap.parse_args(argv)

    model = args.model or default_model()
    most = max(args.batch_sizes)
    longest = max(args.context_lens) + args.output_len + args.draft_length + 16
    sparse = {"method": "self_sparse", "num_speculative_tokens": args.draft_length}
    sparse |= {k: v for k, v in (("window", args.window), ("sinks", args.sinks)) if v}
    # every context's prompts stay in the prefix cache beside the running requests
    blocks = int(1.1 * most * (len(args.context_lens) + 1) * -(-longest // 16)) + 64
    llm = LLM(model, dtype=args.dtype, speculative_config=sparse, enable_prefix_caching=True,
              max_num_seqs=most, max_model_len=longest, num_kv_blocks=blocks, block_size=16,
              max_num_batched_tokens=max(2048, most * 32))  # fmt: skip
    engine = llm.engine
    worker = engine.executor.worker
    weight_bytes = streamed_weight_bytes(worker.target.model)
    kv_bytes_per_token = worker.target.kv_bytes_per_block(1)
    spec_cfg = engine.config.speculative_config
    drafts, plain = FixedDraft(DraftShape.chain(args.draft_length)), FixedDraft(DraftShape())
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True, seed=0)  # fmt: skip
    rows = []
    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; model {model} "
          f"({args.dtype}, {weight_bytes / 1e6:.0f} MB of weights, {kv_bytes_per_token} B of "
          f"KV a token); self_sparse k={args.draft_length} sinks={spec_cfg.sinks} "
          f"window={spec_cfg.window}", flush=True)  # fmt: skip
    for context in args.context_lens:
        prompts = documents(tokenizer, most, context)
        t = time.perf_counter()
        engine.scheduler.policy = plain
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=1), use_tqdm=False)  # fmt: skip
        prefill = time.perf_counter() - t
        print(f"context {context}: prefill of {most} prompts {prefill:.1f} s "
              f"({most * context / prefill:.0f} tokens/s)", flush=True)  # fmt: skip
        for batch in args.batch_sizes:
            step_bytes = weight_bytes + batch * context * kv_bytes_per_token
            rate = streaming_rate(min(step_bytes, 2 << 30))
            cell: dict[str, list[dict]] = {"plain": [], "sparse": []}
            for r in range(args.repeats):
                for name, policy in (("plain", plain), ("sparse", drafts)):
                    engine.scheduler.policy = policy
                    tag = f"{context}-{batch}-{name}-{r}"
                    cell[name].append(decode(llm, prompts[:batch], params, tag))
            best = {k: max(v, key=lambda m: m["tokens_per_s"]) for k, v in cell.items()}
            p, s = best["plain"], best["sparse"]
            row = {
                "context": context, "batch": batch, "prefill_s": prefill,
                "plain_tokens_per_s": p["tokens_per_s"], "sparse_tokens_per_s": s["tokens_per_s"],
                "plain_tpot_ms": p["tpot_ms"], "sparse_tpot_ms": s["tpot_ms"],
                "speedup": s["tokens_per_s"] / p["tokens_per_s"], "alpha": s["alpha"],
                "tokens_per_round": s["tokens_per_round"], "plain_step_ms": p["step_ms"],
                "predicted_plain_step_ms": 1000 * step_bytes / rate,
                "plain_gb_per_s": step_bytes / (p["step_ms"] / 1000) / 1e9,
                "stream_gb_per_s": rate / 1e9, "runs": cell,
            }  # fmt: skip
            rows.append(row)
            print(f"  B={batch:3d}  plain {p['tokens_per_s']:7.1f} tok/s ({p['step_ms']:6.1f} ms "
                  f"a step, predicted {row['predicted_plain_step_ms']:6.1f}; "
                  f"{row['plain_gb_per_s']:.1f} of {row['stream_gb_per_s']:.1f} GB/s)  "
                  f"self_sparse {s['tokens_per_s']:7.1f} tok/s  x{row['speedup']:.2f}  "
                  f"alpha {s['alpha'] or 0:.2f}  {s['tokens_per_round'] or 0:.2f} tok/round",
                  flush=True)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "model": model, "dtype": args.dtype, "args": vars(args),
            "sinks": spec_cfg.sinks, "window": spec_cfg.window}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cells": rows}, indent=1))
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
