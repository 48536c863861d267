"""The long-context load test (``specbatch bench long-context``): plain decoding against
self-speculation over a sparse view of the KV cache, per (context length, batch size).

One engine with the ``self_sparse`` drafter; in every cell the same prompts decode with drafting
off (plain), with ``auto`` (the engine's own policy, up to the fixed length) and with the fixed
length, in turns (``repeats`` rounds, the best of each kept), so the machine's drift falls on all
alike. Prompts are distinct windows of real text (this interpreter's stdlib
sources through the model's tokenizer), prefilled once per context length and reused by every
cell through the prefix cache: decoding is timed apart from prefill.
"""

from __future__ import annotations

import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specbatch import LLM, SamplingParams
from specbatch.bench.machine import cpu_model
from specbatch.draft_shape import DraftShape
from specbatch.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specbatch.scheduler.draft_controller import DraftController, sampling_class
from specbatch.scheduler.speculation import FixedDraft


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
    """Bytes of weights a decode step reads: every layer's weights once (the kernels' packed
    copies where they run), the LM head included, but not the input embedding table, which a
    step only gathers rows from (unless the head is tied to it)."""
    total, packed_params, head, table = 0, set(), set(), set()
    for module in model.modules():
        own = {p.data_ptr() for p in module.parameters(recurse=False)}
        packed = getattr(module, "packed", None)
        if packed is not None:
            total += packed.panels.numel() * packed.panels.element_size()
            packed_params |= own
        if isinstance(module, ParallelLMHead):
            head |= own
        elif isinstance(module, VocabParallelEmbedding):
            table |= own
    skip = packed_params | (table - head)  # a table tied to the head is read as the head
    for p in model.parameters():
        if p.data_ptr() not in skip:
            skip.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict:
    """Decode ``prompts`` together, timing the steady state: from the step after which every
    request has its first token to the last step after which none has finished (a batch
    whose requests finish at different steps would otherwise charge its tail, a few requests
    decoding alone, to whichever mode finishes less evenly)."""
    engine = llm.engine
    metrics = engine.metrics
    spec = metrics.spec
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request({"prompt_token_ids": p}, params, request_id=rid)
    # (time, tokens so far, steps, proposed, accepted, rounds, drafter s, target s)
    start = last = None
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        running = [engine.scheduler.requests.get(r) for r in ids]
        if any(r is None or r.is_finished for r in running):
            if start is not None:
                break
            continue
        tokens = sum(len(r.output_token_ids) for r in running)
        now = (time.perf_counter(), tokens, steps, spec.proposed, spec.accepted, spec.rounds,
               metrics.draft_time_total, metrics.target_time_total)  # fmt: skip
        if start is None:
            start = now
        last = now
    while engine.has_unfinished_requests():
        engine.step()
    if start is None or last is None or last[2] == start[2]:
        raise ValueError("decode: too few steps with every request running; raise output_len")
    seconds, tokens, n_steps = last[0] - start[0], last[1] - start[1], last[2] - start[2]
    drafted, accepted, rounds, draft_s, target_s = (last[i] - start[i] for i in (3, 4, 5, 6, 7))
    return {
        "tokens_per_s": tokens / seconds,
        "tpot_ms": 1000 * seconds * len(prompts) / tokens,
        "step_ms": 1000 * seconds / n_steps,
        "alpha": accepted / drafted if drafted else None,
        "tokens_per_round": tokens / rounds if rounds else None,
        "draft_ms": 1000 * draft_s / n_steps,  # the drafter's passes, a step
        "target_ms": 1000 * target_s / n_steps,  # the target's pass, a step
    }


def predicted_step_ms(
    policy: object, batch: int, context: int, shape: DraftShape, temperature: float
) -> float | None:
    """What ``auto``'s cost model expects a step of ``batch`` requests at ``context`` tokens
    drafting ``shape`` each to take (None: the policy is not auto's, or has priced nothing)."""
    if not isinstance(policy, DraftController):
        return None
    cls = sampling_class(SamplingParams(temperature=temperature))
    behind = {cls: float(batch) if shape.nodes else 0.0}  # its first pass: a row a request
    seconds = policy.seconds({cls: batch}, {cls: shape}, 0, behind, None, {cls: float(context)})
    return None if seconds is None else 1000 * seconds


@dataclass
class LongContextConfig:
    model: str | None  # None: the built-in target
    context_lens: list[int] = field(default_factory=lambda: [2000, 8000])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16, 32])
    output_len: int = 64
    draft_length: int = 3
    window: int | None = None  # None: the drafter's defaults
    sinks: int | None = None
    temperature: float = 0.0
    repeats: int = 1
    dtype: str = "bfloat16"


def run_long_context(cfg: LongContextConfig, log=print) -> dict:
    """Every (context, batch) cell; ``log`` gets a line as each finishes."""
    most = max(cfg.batch_sizes)
    longest = max(cfg.context_lens) + cfg.output_len + cfg.draft_length + 16
    # auto up to the fixed length: the engine's own policy, kept beside the fixed ones below
    sparse = {"method": "self_sparse", "num_speculative_tokens": "auto",
              "max_draft_length": cfg.draft_length}  # fmt: skip
    sparse |= {k: v for k, v in (("window", cfg.window), ("sinks", cfg.sinks)) if v is not None}
    # every context's prompts stay in the prefix cache; the running requests share their
    # blocks and add their outputs' (and the round's lookahead)
    prompts = sum(-(-c // 16) for c in cfg.context_lens)
    blocks = most * (prompts + 2 * -(-(longest - min(cfg.context_lens)) // 16)) + 64
    llm = LLM(cfg.model, dtype=cfg.dtype, speculative_config=sparse, enable_prefix_caching=True,
              max_num_seqs=most, max_model_len=longest, num_kv_blocks=blocks, block_size=16,
              max_num_batched_tokens=max(2048, most * 32))  # fmt: skip
    engine = llm.engine
    worker = engine.executor.worker
    weight_bytes = streamed_weight_bytes(worker.target.model)
    kv_bytes = worker.target.kv_bytes_per_block(1)
    spec = engine.config.speculative_config
    policies = {"plain": FixedDraft(DraftShape()), "auto": engine.scheduler.policy,
                "self_sparse": FixedDraft(DraftShape.chain(cfg.draft_length))}  # fmt: skip
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.output_len,
                            ignore_eos=True, seed=0)  # fmt: skip
    meta = {"cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "model": cfg.model,
            "dtype": cfg.dtype, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes,
            "draft_length": cfg.draft_length, "sinks": spec.sinks,
            "window": spec.window}  # fmt: skip
    log(
        f"CPU: {meta['cpu']}; {meta['torch_threads']} torch thread(s); {cfg.model} in "
        f"{cfg.dtype}: {weight_bytes / 1e6:.0f} MB of weights a step, {kv_bytes} B of KV a "
        f"token; self_sparse k={cfg.draft_length} sinks={spec.sinks} window={spec.window}"
    )
    rows = []
    for context in cfg.context_lens:
        prompts = documents(llm.get_tokenizer(), most, context)
        t = time.perf_counter()
        engine.scheduler.policy = policies["plain"]
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=1), use_tqdm=False)  # fmt: skip
        prefill = time.perf_counter() - t
        log(
            f"context {context}: prefill of {most} prompts {prefill:.1f} s "
            f"({most * context / prefill:.0f} tokens/s)"
        )
        for batch in cfg.batch_sizes:
            step_bytes = weight_bytes + batch * context * kv_bytes
            rate = streaming_rate(min(step_bytes, 1 << 30))
            runs: dict[str, list[dict]] = {name: [] for name in policies}
            for r in range(cfg.repeats):
                for name, policy in policies.items():
                    engine.scheduler.policy = policy
                    runs[name].append(
                        decode(llm, prompts[:batch], params, f"{context}-{batch}-{name}-{r}")
                    )
            p, a, s = (max(runs[k], key=lambda m: m["tokens_per_s"]) for k in policies)
            model_ms = [predicted_step_ms(policies["auto"], batch, context, shape, cfg.temperature)
                        for shape in (DraftShape(), policies["self_sparse"].shape)]  # fmt: skip
            row = {
                "context": context, "batch": batch, "prefill_s": prefill,
                "plain_tokens_per_s": p["tokens_per_s"], "sparse_tokens_per_s": s["tokens_per_s"],
                "plain_tpot_ms": p["tpot_ms"], "sparse_tpot_ms": s["tpot_ms"],
                "speedup": s["tokens_per_s"] / p["tokens_per_s"], "alpha": s["alpha"],
                "tokens_per_round": s["tokens_per_round"], "plain_step_ms": p["step_ms"],
                "sparse_step_ms": s["step_ms"], "auto_tokens_per_s": a["tokens_per_s"],
                "auto_tpot_ms": a["tpot_ms"], "auto_speedup": a["tokens_per_s"] / p["tokens_per_s"],
                # THEORY.md's c (a draft pass over a plain step's target pass) and verify cost
                "c": s["draft_ms"] / cfg.draft_length / p["target_ms"],
                "verify_cost": s["target_ms"] / p["target_ms"],
                "predicted_plain_step_ms": 1000 * step_bytes / rate,
                "model_plain_step_ms": model_ms[0], "model_sparse_step_ms": model_ms[1],
                "plain_gb_per_s": step_bytes / (p["step_ms"] / 1000) / 1e9,
                "stream_gb_per_s": rate / 1e9, "runs": runs,
            }  # fmt: skip
            rows.append(row)
            log(format_row(row))
    return {"meta": meta, "cells": rows, "crossover": crossover(rows)}


def crossover(rows: list[dict]) -> dict[int, int | None]:
    """Per context length, the smallest batch size where self_sparse made less than plain
    decoding (None: it paid at every batch size measured)."""
    out: dict[int, int | None] = {}
    for row in sorted(rows, key=lambda r: (r["context"], r["batch"])):
        out.setdefault(row["context"], None)
        if out[row["context"]] is None and row["speedup"] < 1.0:
            out[row["context"]] = row["batch"]
    return out


HEADER = ("context", "batch", "plain tok/s", "sparse tok/s", "speedup", "auto tok/s", "auto",
          "alpha", "tok/round", "c", "verify cost",
          "plain TPOT ms", "sparse TPOT ms", "plain step ms", "model", "sparse step ms",
          "model", "bytes-bound ms", "GB/s", "stream GB/s")  # fmt: skip


def format_row(r: dict) -> str:
    cells = (r["context"], r["batch"], f"{r['plain_tokens_per_s']:.1f}",
             f"{r['sparse_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
             f"{r['auto_tokens_per_s']:.1f}", f"{r['auto_speedup']:.2f}x", f"{r['alpha'] or 0:.2f}",
             f"{r['tokens_per_round'] or 0:.2f}", f"{r['c']:.3f}", f"{r['verify_cost']:.2f}",
             f"{r['plain_tpot_ms']:.1f}",
             f"{r['sparse_tpot_ms']:.1f}", f"{r['plain_step_ms']:.1f}",
             _ms(r.get("model_plain_step_ms")), f"{r['sparse_step_ms']:.1f}",
             _ms(r.get("model_sparse_step_ms")),
             f"{r['predicted_plain_step_ms']:.1f}", f"{r['plain_gb_per_s']:.1f}",
             f"{r['stream_gb_per_s']:.1f}")  # fmt: skip
    return " | ".join(str(c) for c in cells)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(result: dict) -> str:
    lines = [" | ".join(HEADER), " | ".join("---" for _ in HEADER)]
    lines += [format_row(r) for r in result["cells"]]
    cross = ", ".join(f"{c}: {b if b else 'none measured'}" for c, b in result["crossover"].items())
    return "\n".join(
        [*lines, f"crossover batch size (self_sparse below plain), by context: {cross}"]
    )


def plot(result: dict, path: Path) -> None:
    """Throughput against time per output token, a curve per context and decoding mode, each
    point a batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for context in sorted({r["context"] for r in result["cells"]}):
        cells = sorted((r for r in result["cells"] if r["context"] == context),
                       key=lambda r: r["batch"])  # fmt: skip
        for mode, style in (("plain", "--o"), ("sparse", "-s"), ("auto", ":^")):
            xs = [r[f"{mode}_tpot_ms"] for r in cells]
            ys = [r[f"{mode}_tokens_per_s"] for r in cells]
            (line,) = ax.plot(xs, ys, style, label=f"{context} tokens, {mode}")
            for r, x, y in zip(cells, xs, ys, strict=True):
                ax.annotate(f"B={r['batch']}", (x, y), fontsize=7, color=line.get_color())
    ax.set_xlabel("time per output token (ms)")
    ax.set_ylabel("decoding tokens/s")
    ax.set_title(f"{Path(result['meta']['model'] or 'built-in target').name}: plain vs self_sparse")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
