"""Where a decoding step's time goes: the target's decoder stack and the draft head (each a
few kernel calls on the flat forward), the multiplies, attention and layer ops outside them,
sampling and rejection, building the step's inputs, scheduling, and the engine's own work.

For each batch size and draft length, B requests of the built-in pair or of --model
(64-token prompts from the held-out stdlib files, greedy) are brought to steady decoding, then
``--steps`` steps are timed with light wrappers around the engine's functions (about a
microsecond a call): "worker" is the worker's own Python between them, "inputs" building the
forward's inputs. The multiplies outside the flat forward's kernel calls (the target's LM
head; every multiply where the module path runs) are also split by weight shape, each
shape's rate set beside the best rate (torch's F.linear, oneDNN's or the kernel's, on a weight
per layer) measured in the same run at its shape, rows and dtype. "bound": the step's
multiplies at those best rates, as a share of the step; "multiplies at best rate": the same
over the multiplies' own time.

    python benchmarks/step_profile.py [--model FILE.gguf|DIR] [--batch-sizes 1 8 64] \
        [--draft-lengths 0 2] [--steps 40] [--dtype float32] [--out bench_results/step_profile.json]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json
from benchmarks.linear_rates import best_rates, model_shapes

PHASES = (
    "decoder stack", "draft head", "matmul", "attention", "layer ops", "sampling", "inputs",
    "worker", "scheduling", "engine",
)  # fmt: skip
LAYER_OPS = ("rms_norm", "head_rms_norm_", "rope_", "silu_and_mul")


def linear_shape(args: tuple) -> tuple[int, int, int]:
    """(out features, in features, rows) of a call of F.linear or CpuKernels.linear, from its
    positional arguments."""
    if isinstance(args[0], torch.Tensor):  # F.linear(x, weight)
        x, w = args[0], args[1]
        return w.shape[0], w.shape[1], x.numel() // x.shape[-1]
    x, w = args[1], args[2]  # CpuKernels.linear(self, x, packed)
    return w.out_features, w.in_features, x.numel() // x.shape[-1]


class Clock:
    """Seconds spent inside wrapped functions, by phase; nested phases are subtracted from
    the phase that encloses them, so the phases add up to the step. A multiply's phase is
    "matmul N x K" (its weight's shape), and its FLOPs are counted too."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []
        self.now = now

    def wrap(self, owner: Any, name: str, phase: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            ph = phase
            if phase == "matmul":
                n, k, m = linear_shape(args)
                ph = f"matmul {n} x {k}"
                self.flops[ph] += 2.0 * n * k * m
                self.calls[ph] += 1
            frame = [ph, 0.0]
            self._stack.append(frame)
            t0 = self.now()
            try:
                return original(*args, **kwargs)
            finally:
                dt = self.now() - t0
                self._stack.pop()
                self.seconds[ph] += dt - frame[1]
                if self._stack:
                    self._stack[-1][1] += dt

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


@contextlib.contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    import torch.nn.functional as F

    from specbatch.engine.llm_engine import LLMEngine
    from specbatch.kernels import cpu
    from specbatch.model.cpu_forward import CpuDecoderPlan, Eagle3HeadPlan
    from specbatch.model.layers import attention, cpu_attention
    from specbatch.model.llama import LlamaForCausalLM
    from specbatch.scheduler.scheduler import Scheduler
    from specbatch.worker import (
        draft_loop,
        model_runner,
        rejection_sampler,
        round_layout,
        sampler,
        tree_verify,
        worker,
    )

    wraps = [
        (LLMEngine, "step", "engine"),
        (Scheduler, "schedule", "scheduling"),
        (Scheduler, "update", "scheduling"),
        (worker.Worker, "execute", "worker"),
        (LlamaForCausalLM, "forward", "layer ops"),
        (LlamaForCausalLM, "compute_logits", "layer ops"),
        (cpu.CpuKernels, "linear", "matmul"),
        *((cpu.CpuKernels, op, "layer ops") for op in LAYER_OPS),
        (cpu.CpuKernels, "write_kv", "attention"),
        # the flat forward (model/cpu_forward.py): a layer's multiplies, attention and norms
        # in one kernel call, a head's pass or whole drafting call (its LM head included) in one
        (CpuDecoderPlan, "forward", "decoder stack"),
        (Eagle3HeadPlan, "forward", "draft head"),
        (Eagle3HeadPlan, "round", "draft head"),
        (F, "linear", "matmul"),
        (cpu_attention.CpuAttentionBackend, "forward", "attention"),
        (attention.TorchAttentionBackend, "forward", "attention"),
    ]
    for module in (worker, rejection_sampler, draft_loop, tree_verify):
        for name in ("logits_to_probs", "sample", "rejection_sample", "greedy_walk",
                     "verify_tree"):  # fmt: skip
            if hasattr(module, name):
                wraps.append((module, name, "sampling"))
    wraps.append((round_layout.RoundLayout, "build", "inputs"))
    for name in ("build_inputs", "beam_inputs"):
        for module in (draft_loop, model_runner):
            if hasattr(module, name):
                wraps.append((module, name, "inputs"))
    del sampler
    undo = [clock.wrap(owner, name, phase) for owner, name, phase in wraps]
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def shape_rows(clock: Clock, steps: int, hf_config: Any, dtype: str) -> list[dict]:
    """Each multiply shape of the timed steps: ms a step, its rate and the best rate measured
    now at its shape, rows and dtype (``linear_rates.py``)."""
    counts = model_shapes(hf_config)
    out = []
    for ph, flops in sorted(clock.flops.items(), key=lambda kv: -clock.seconds[kv[0]]):
        n, k = (int(v) for v in ph.removeprefix("matmul ").split(" x "))
        calls = clock.calls[ph]
        rows = max(1, round(flops / (2.0 * n * k * calls)))
        shape = {(n, k): counts.get((n, k), 1)}
        best = best_rates(shape, rows, getattr(torch, dtype), clock=clock.now)[(n, k)]
        seconds = clock.seconds[ph]
        out.append(
            {
                "shape": [n, k],
                "lm_head": (n, k) == (hf_config.vocab_size, hf_config.hidden_size),
                "rows": rows,
                "calls_per_step": calls / steps,
                "ms_per_step": seconds / steps * 1e3,
                "gflops": flops / seconds / 1e9,
                "best_gflops": best["best"],
                "torch_gflops": best["torch"],
                "onednn_gflops": best.get("onednn"),
                "kernel_gflops": best.get("kernel"),
                "best_ms_per_step": flops / (best["best"] * 1e9) / steps * 1e3,
            }
        )
    return out


def profile_cell(
    model: str | None,
    batch: int,
    k: int,
    steps: int,
    dtype: str,
    prompts: list[list[int]],
    now: Callable[[], float],
) -> dict:
    from specbatch import LLM, SamplingParams

    llm = LLM(model=model, num_speculative_tokens=k, dtype=dtype, max_model_len=512,
              max_num_seqs=batch)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for p in prompts[:batch]:
        engine.add_request({"prompt_token_ids": p}, params)
    for _ in range(8):  # prefill and warm-up
        engine.step()
    clock = Clock(now)
    tokens = 0
    with instrumented(clock):
        t0 = now()
        for _ in range(steps):
            tokens += sum(1 for _ in engine.step())  # requests that emitted
        wall = now() - t0
    accounted = sum(clock.seconds.values())
    phases = {p: clock.seconds.get(p, 0.0) / steps for p in PHASES if p != "matmul"}
    phases["matmul"] = sum(v for p, v in clock.seconds.items() if p.startswith("matmul")) / steps
    phases["engine"] += max(0.0, wall - accounted) / steps  # the loop between steps
    hf_config = engine.config.target.hf_config
    engine.abort_request([r for r in list(engine.scheduler.requests)])
    llm.shutdown()
    del llm, engine
    shapes = shape_rows(clock, steps, hf_config, dtype)
    return {
        "batch": batch,
        "k": k,
        "dtype": dtype,
        "step_ms": wall / steps * 1e3,
        "phases_ms": {p: phases[p] * 1e3 for p in PHASES},
        "matmul_shapes": shapes,
        "matmul_bound_ms": sum(s["best_ms_per_step"] for s in shapes),
        "emitted_requests": tokens,
    }


SHAPE_HEADERS = ["weight N x K", "rows", "calls", "ms a step", "GFLOP/s", "F.linear GFLOP/s",
                 "oneDNN GFLOP/s", "kernel GFLOP/s", "share of best"]  # fmt: skip


def shape_row(s: dict, step_ms: float) -> list[str]:
    name = f"{s['shape'][0]} x {s['shape'][1]}" + (" (LM head)" if s["lm_head"] else "")
    rates = (s["torch_gflops"], s["onednn_gflops"], s["kernel_gflops"])
    return [name, str(s["rows"]), f"{s['calls_per_step']:.0f}",
            f"{s['ms_per_step']:.2f} ({s['ms_per_step'] / step_ms:.0%})", f"{s['gflops']:.1f}",
            *("-" if r is None else f"{r:.1f}" for r in rates),
            f"{s['gflops'] / s['best_gflops']:.0%}"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="FILE.gguf or a checkpoint folder "
                    "(default: the built-in pair); only --draft-lengths 0 with it")  # fmt: skip
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "step_profile.json"))
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (steadier on a machine other jobs share)",
    )
    args = ap.parse_args(argv)
    if args.model is not None and any(args.draft_lengths):
        ap.error("--draft-lengths: only 0 with --model (drafting needs the built-in pair)")
    set_threads(args.threads)

    from specbatch.bench.workload import heldout_token_stream
    from specbatch.model.model_pair import default_model_path
    from specbatch.tokenizer import load_tokenizer

    stream, _ = heldout_token_stream(load_tokenizer(args.model or default_model_path("target")))
    rng = random.Random(0)
    prompts = [
        stream[s : s + 64]
        for s in (rng.randrange(len(stream) - 64) for _ in range(max(args.batch_sizes)))
    ]
    cells = []
    for b in args.batch_sizes:
        for k in args.draft_lengths:
            now = time.process_time if args.clock == "cpu" else time.perf_counter
            cells.append(profile_cell(args.model, b, k, args.steps, args.dtype, prompts, now))
            c = cells[-1]
            print(f"batch {b} k {k}: {c['step_ms']:.2f} ms a step", flush=True)
    headers = ["batch", "k", "step ms", *PHASES, "bound", "multiplies at best rate"]
    rows = []
    for c in cells:
        ph = c["phases_ms"]
        rows.append(
            [
                c["batch"],
                c["k"],
                f"{c['step_ms']:.2f}",
                *(f"{ph[p]:.2f} ({ph[p] / c['step_ms']:.0%})" for p in PHASES),
                f"{c['matmul_bound_ms'] / c['step_ms']:.0%}",
                f"{c['matmul_bound_ms'] / ph['matmul']:.0%}" if ph["matmul"] else "-",
            ]
        )
    print()
    print(format_table(headers, rows))
    for c in cells:
        print(f"\nbatch {c['batch']} k {c['k']} {c['dtype']}: the multiplies by weight shape")
        print(format_table(SHAPE_HEADERS, [shape_row(s, c["step_ms"]) for s in c["matmul_shapes"]]))
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "cells": cells})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
