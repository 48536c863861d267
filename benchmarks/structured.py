"""Structured outputs on the built-in pair (its EAGLE-3 head drafting 3 tokens a round), at
temperature 1, on chat prompts asking for each of benchmarks/json_schemas.py's 20
JSON schemas:

1. validity: ``--requests`` requests (schema i % 20, seed i), 32 at a time: how many end by
   their grammar and parse and validate against their schema (``jsonschema``), how many are
   cut by ``--max-tokens`` (length);
2. throughput at batch 32: the requests of 1 against the same prompts without a schema, each
   as long as its structured twin was in 1 (``ignore_eos``), side by side a step at a time;
3. speculation's speedup at batch 1: tokens/s with the head over tokens/s without it, on the
   JSON requests and on free text (the same prompts without a schema), side by side.

    OMP_NUM_THREADS=1 python benchmarks/structured.py [--compact]

``--compact`` asks for JSON without optional whitespace (``disable_any_whitespace``); by
default any whitespace is allowed, as in vLLM and OpenAI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jsonschema  # installed with ray
import torch

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json
from benchmarks.json_schemas import SCHEMAS
from specbatch.bench.cell_run import CellRun, run_side_by_side
from specbatch.bench.cells import CellResult, pool_runs
from specbatch.bench.engines import share_weights
from specbatch.chat import render_chat
from specbatch.config import EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.outputs import RequestOutput
from specbatch.sampling_params import SamplingParams
from specbatch.tokenizer import encode_text


@dataclass
class Requests:
    """A bench workload of given requests: request i is ``prompts[i % n]`` with
    ``params[i % n]``."""

    prompts: list[list[int]]
    params_of: list[SamplingParams]
    input_len: int = 0
    output_len: int = 0
    source: str = "chat prompts asking for JSON"

    def prompt(self, i: int) -> list[int]:
        return self.prompts[i % len(self.prompts)]

    def params(self, i: int, base: SamplingParams) -> SamplingParams:
        return self.params_of[i % len(self.params_of)]


def chat_prompts(engine: LLMEngine) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for name, _ in SCHEMAS:
        text = render_chat(tok, [{"role": "user", "content": f"Give the {name} as JSON."}])
        out.append(encode_text(tok, text, add_special_tokens=False))
    return out


def structured(n: int, max_tokens: int, compact: bool) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            structured_outputs={
                "json": SCHEMAS[i % len(SCHEMAS)][1],
                "disable_any_whitespace": compact,
            },
        )
        for i in range(n)
    ]


def free_text(lengths: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max(1, n), ignore_eos=True)
        for i, n in enumerate(lengths)
    ]


def workload(prompts: list[list[int]], params: list[SamplingParams]) -> Requests:
    """Request i: the prompt of schema i % 20 and ``params[i]``."""
    return Requests([prompts[i % len(prompts)] for i in range(len(params))], params)


def run(engine: LLMEngine, w: Requests, batch: int) -> tuple[CellResult, list[RequestOutput]]:
    cell = CellRun(engine, w, batch, len(w.params_of), SamplingParams())
    return run_side_by_side([cell])[0], cell.finished


def validity(outs: list[RequestOutput]) -> dict[str, Any]:
    counts = {"valid": 0, "invalid": 0, "length": 0}
    bad = []
    for out in outs:
        c = out.outputs[0]
        if c.finish_reason == "length":
            counts["length"] += 1
            continue
        schema = SCHEMAS[int(out.request_id.split("#")[0]) % len(SCHEMAS)][1]
        try:
            jsonschema.validate(json.loads(c.text), schema)
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as e:
            counts["invalid"] += 1
            bad.append({"text": c.text, "error": str(e)[:200]})
    return {**counts, "invalid_examples": bad[:5]}


def summary(c: CellResult) -> dict[str, Any]:
    keys = ("output_tok_s", "runs_tok_s", "output_tokens", "wall_s", "alpha", "tpot_mean")
    return {k: getattr(c, k) for k in keys}


def side_by_side(
    pairs: list[tuple[LLMEngine, Requests]], batch: int, rounds: int, per_round: int
) -> list[CellResult]:
    """Each (engine, workload) cell run ``rounds`` times (``per_round`` requests each), the
    cells of a round side by side, their order alternating; pooled."""
    runs: list[list[CellResult]] = [[] for _ in pairs]
    for r in range(rounds):
        order = list(range(len(pairs))) if r % 2 == 0 else list(reversed(range(len(pairs))))
        cells = []
        for i in order:
            engine, w = pairs[i]
            first = r * per_round
            cells.append(CellRun(engine, w, batch, per_round, SamplingParams(), first_prompt=first))
        for i, result in zip(order, run_side_by_side(cells), strict=True):
            runs[i].append(result)
    return [pool_runs(r) for r in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000, help="requests of the validity run")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--compact", action="store_true", help="JSON without optional whitespace")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the side-by-side runs")
    p.add_argument("--batch-requests", type=int, default=128, help="per round, at batch 32")
    p.add_argument("--single-requests", type=int, default=20, help="per round, at batch 1")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=str(RESULTS_DIR / "structured.json"))
    args = p.parse_args()
    threads = set_threads(args.threads) if args.threads else torch.get_num_threads()
    common = {"max_num_seqs": 32, "max_model_len": 512}
    head = {"method": "eagle3", "num_speculative_tokens": 3}  # the built-in pair's head
    spec = LLMEngine.from_engine_args(EngineArgs(**common, speculative_config=head))
    twin = LLMEngine.from_engine_args(EngineArgs(**common, speculative_config=head))
    plain = LLMEngine.from_engine_args(EngineArgs(**common, num_speculative_tokens=0))
    share_weights([spec, twin, plain])
    prompts = chat_prompts(spec)
    n = args.requests

    t0 = time.perf_counter()
    json_params = structured(n, args.max_tokens, args.compact)
    cell, outs = run(spec, workload(prompts, json_params), 32)
    valid = validity(outs)
    lengths = [0] * n
    for out in outs:
        lengths[int(out.request_id)] = len(out.outputs[0].token_ids)
    print(f"1. validity: {valid['valid']} valid, {valid['invalid']} invalid, {valid['length']} "
          f"cut by length, of {n} ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip

    json_w = workload(prompts, json_params)
    free_w = workload(prompts, free_text(lengths))
    for engine in (twin, plain):  # their first steps, off the clock
        run(engine, workload(prompts, structured(4, 16, args.compact)), 4)
    a, b = side_by_side([(spec, json_w), (twin, free_w)], 32, args.rounds, args.batch_requests)
    ratio = a.output_tok_s / b.output_tok_s
    print(f"2. batch 32: {a.output_tok_s:.0f} tok/s with a schema, {b.output_tok_s:.0f} without "
          f"({ratio:.3f}x)", flush=True)  # fmt: skip

    single = args.single_requests
    json_cells = side_by_side([(spec, json_w), (plain, json_w)], 1, args.rounds, single)
    free_cells = side_by_side([(spec, free_w), (plain, free_w)], 1, args.rounds, single)
    speedups = {
        "json": json_cells[0].output_tok_s / json_cells[1].output_tok_s,
        "free_text": free_cells[0].output_tok_s / free_cells[1].output_tok_s,
    }
    rows = [
        [name, f"{c[1].output_tok_s:.0f}", f"{c[0].output_tok_s:.0f}", f"{speedups[key]:.2f}x",
         f"{c[0].alpha:.2f}" if c[0].alpha is not None else "-"]
        for name, key, c in (("JSON", "json", json_cells), ("free text", "free_text", free_cells))
    ]  # fmt: skip
    print("3. batch 1:")
    print(format_table(["workload", "plain tok/s", "EAGLE tok/s", "speedup", "alpha"], rows))
    for e in (spec, twin, plain):
        e.shutdown()
    result = {
        "args": vars(args),
        "threads": threads,
        "validity": valid,
        "validity_alpha": cell.alpha,
        "mean_json_tokens": sum(lengths) / max(1, len(lengths)),
        "batch32": {
            "json_tok_s": a.output_tok_s,
            "free_tok_s": b.output_tok_s,
            "ratio": ratio,
            "json_runs": a.runs_tok_s,
            "free_runs": b.runs_tok_s,
        },
        "batch1": {
            "json_eagle": summary(json_cells[0]),
            "json_plain": summary(json_cells[1]),
            "free_eagle": summary(free_cells[0]),
            "free_plain": summary(free_cells[1]),
        },
        "speedups": speedups,
        "machine": machine_info(),
    }
    print(f"wrote {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
