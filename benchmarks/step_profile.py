"""Where a decoding step's time goes: matrix multiplies, attention, the other layer ops,
sampling and rejection, building the step's inputs, scheduling, and the engine's own work.

For each batch size and draft length, B requests of the built-in pair (64-token prompts from
the held-out stdlib files, greedy) are brought to steady decoding, then ``--steps`` steps are
timed with light wrappers around the engine's functions (about a microsecond a call):
"worker" is the worker's own Python between them, "inputs" building the forward's inputs.
"bound" is the matrix-multiply bound as a share of the step: the target's linear-layer FLOPs
of the step at the best rate (torch's or the kernel's) measured for those row counts in this
run, over the step's time.

    python benchmarks/step_profile.py [--batch-sizes 1 8 64] [--draft-lengths 0 2] \
        [--steps 40] [--dtype float32] [--out bench_results/step_profile.json]
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

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json

PHASES = (
    "matmul", "attention", "layer ops", "sampling", "inputs", "worker", "scheduling", "engine"
)  # fmt: skip
LAYER_OPS = ("rms_norm", "head_rms_norm_", "rope_", "silu_and_mul")


class Clock:
    """Seconds spent inside wrapped functions, by phase; nested phases are subtracted from
    the phase that encloses them, so the phases add up to the step."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []
        self.now = now

    def wrap(self, owner: Any, name: str, phase: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [phase, 0.0]
            self._stack.append(frame)
            t0 = self.now()
            try:
                return original(*args, **kwargs)
            finally:
                dt = self.now() - t0
                self._stack.pop()
                self.seconds[phase] += dt - frame[1]
                if self._stack:
                    self._stack[-1][1] += dt

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


@contextlib.contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    import torch.nn.functional as F

    from specbatch.engine.llm_engine import LLMEngine
    from specbatch.kernels import cpu
    from specbatch.model.cpu_forward import _FlatLayers
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
        (_FlatLayers, "linear", "matmul"),  # the flat forward's calls (model/cpu_forward.py)
        (_FlatLayers, "attention", "attention"),  # with q/k rotation and the K/V write
        (_FlatLayers, "norm", "layer ops"),
        (_FlatLayers, "mlp", "layer ops"),
        (F, "linear", "matmul"),
        (cpu_attention.CpuAttentionBackend, "forward", "attention"),
        (attention.TorchAttentionBackend, "forward", "attention"),
    ]
    for module in (worker, rejection_sampler, draft_loop, tree_verify):
        for name in ("logits_to_probs", "sample", "rejection_sample", "greedy_verify",
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


def linear_flops_per_token(engine: Any) -> float:
    """2 x the weights of every linear layer of the target (and of the LM head)."""
    cfg = engine.config.target.hf_config
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or 0
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = kv or heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * i
    return 2.0 * (layers * per_layer + h * cfg.vocab_size)


def best_linear_rate(rows: int, engine: Any, dtype: str) -> float:
    """FLOP/s of the faster of torch's F.linear and the engine's kernel on the target's MLP
    shape at ``rows`` rows, in the profile's dtype."""
    import torch

    from specbatch.kernels.cpu import cpu_kernels

    cfg = engine.config.target.hf_config
    dt = getattr(torch, dtype)
    w = torch.randn(cfg.intermediate_size, cfg.hidden_size).to(dt)
    x = torch.randn(rows, cfg.hidden_size).to(dt)
    fns = [lambda: torch.nn.functional.linear(x, w)]
    k = cpu_kernels()
    if k is not None and k.supports_linear(dt):
        packed = k.pack_linear(w)
        fns.append(lambda: k.linear(x, packed))
    best = 0.0
    for fn in fns:
        for _ in range(5):
            fn()
        n = max(20, 2000 // rows)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = max(best, 2.0 * w.numel() * rows * n / (time.perf_counter() - t0))
    return best


def profile_cell(
    batch: int, k: int, steps: int, dtype: str, prompts: list[list[int]], now: Callable[[], float]
) -> dict:
    from specbatch import LLM, SamplingParams

    llm = LLM(num_speculative_tokens=k, dtype=dtype, max_model_len=512, max_num_seqs=batch)
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
    emitted = (
        engine.metrics.num_generated_tokens
        if hasattr(engine.metrics, "num_generated_tokens")
        else None
    )
    accounted = sum(clock.seconds.values())
    phases = {p: clock.seconds.get(p, 0.0) / steps for p in PHASES}
    phases["engine"] += max(0.0, wall - accounted) / steps  # the loop between steps
    flops = linear_flops_per_token(engine)
    rows = batch * (k + 1)  # the target's rows in a decoding step
    rate = best_linear_rate(rows, engine, dtype)
    engine.abort_request([r for r in list(engine.scheduler.requests)])
    llm.shutdown()
    return {
        "batch": batch,
        "k": k,
        "dtype": dtype,
        "step_ms": wall / steps * 1e3,
        "phases_ms": {p: v * 1e3 for p, v in phases.items()},
        "linear_flops_per_token": flops,
        "best_linear_gflops": rate / 1e9,
        "matmul_bound_ms": flops * rows / rate * 1e3,
        "emitted_requests": tokens,
        "generated_tokens": emitted,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    set_threads(args.threads)

    from specbatch.bench.workload import heldout_token_stream
    from specbatch.model.model_pair import default_model_path
    from specbatch.tokenizer import load_tokenizer

    stream, _ = heldout_token_stream(load_tokenizer(default_model_path("target")))
    rng = random.Random(0)
    prompts = [
        stream[s : s + 64]
        for s in (rng.randrange(len(stream) - 64) for _ in range(max(args.batch_sizes)))
    ]
    cells = []
    for b in args.batch_sizes:
        for k in args.draft_lengths:
            now = time.process_time if args.clock == "cpu" else time.perf_counter
            cells.append(profile_cell(b, k, args.steps, args.dtype, prompts, now))
            c = cells[-1]
            print(f"batch {b} k {k}: {c['step_ms']:.2f} ms a step", flush=True)
    headers = ["batch", "k", "step ms", *PHASES, "bound"]
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
            ]
        )
    print()
    print(format_table(headers, rows))
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "cells": cells})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
