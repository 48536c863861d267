"""Prefix caching on prompts of one shared prefix and a distinct tail each (``specbatch bench
--shared-prefix-len``'s workload), closed loop at one batch size, greedy; by default on the
built-in pair with its EAGLE head (k = 3):

1. hit rates from a cold cache, speculating and not, side by side;
2. TTFT and throughput with the cache on and off, side by side, after a warm-up (the prefix
   is hot, as a deployment's system prompt is);
3. greedy outputs with the cache on and off, token for token, for every drafter (the built-in
   pair's head and draft model, n-gram, none; n-gram and none on another ``--model``).

    OMP_NUM_THREADS=1 python benchmarks/prefix_cache.py [--prefix-len 384] [--input-len 32] \\
        [--output-len 64] [--batch-size 16] [--num-requests 32] \\
        [--model PATH --speculative-config JSON] [--no-identity]

With ``--model`` the engines speculate only as ``--speculative-config`` says (the hit rates
then compare that drafter with none). The cost on prompts without a shared prefix is
``engines_ab.py --b '{"enable_prefix_caching": false}'``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json
from specbatch import LLM, SamplingParams
from specbatch.bench.cell_run import CellRun, run_cell, run_side_by_side
from specbatch.bench.engines import share_weights
from specbatch.bench.offline import WARMUP_REQUESTS, WARMUP_TOKENS
from specbatch.bench.workload import build_workload, shared_prefix, with_shared_prefix
from specbatch.config import EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.model.model_pair import default_model_path

BUILT_IN = {
    "eagle3 head": {"method": "eagle3", "num_speculative_tokens": 3},
    "draft model": {
        "method": "draft_model",
        "model": default_model_path("draft"),
        "num_speculative_tokens": 3,
    },
}
ANY_MODEL = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3},
    "none": None,
}


def engine_args(args: argparse.Namespace, spec: dict | None, caching: bool, **kw) -> EngineArgs:
    """The engine of ``spec`` (None: no speculation) with the cache on or off."""
    model_len = args.prefix_len + args.input_len + args.output_len + 8
    speculation = {"speculative_config": spec} if spec else {"num_speculative_tokens": 0}
    return EngineArgs(
        model=args.model,
        enable_prefix_caching=caching,
        max_model_len=model_len,
        **speculation,
        **kw,
    )


def cells(engines: list[LLMEngine], workload: Any, args: argparse.Namespace, first: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    runs = [
        CellRun(e, workload, args.batch_size, args.num_requests, params, first_prompt=first)
        for e in engines
    ]
    return run_side_by_side(runs)


def greedy_identity(workload: Any, args: argparse.Namespace) -> list[list[str]]:
    """Per drafter: the greedy outputs of prompts on the shared prefix, cache on and off."""
    prompts = [{"prompt_token_ids": workload.prompt(i)} for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    drafters = ANY_MODEL if args.model else BUILT_IN | ANY_MODEL
    rows = []
    for name, spec in drafters.items():
        outs, hits = {}, 0.0
        for caching in (True, False):
            llm = LLM(**vars(engine_args(args, spec, caching)))
            got = llm.generate(prompts[:4], params, use_tqdm=False)  # then the rest hit them
            got += llm.generate(prompts[4:], params, use_tqdm=False)
            outs[caching] = [o.outputs[0].token_ids for o in got]
            if caching:
                hits = llm.engine.metrics.prefix_cache_hit_rate or 0.0
            llm.shutdown()
        same = sum(a == b for a, b in zip(outs[True], outs[False], strict=True))
        rows.append([name, f"{same}/{len(prompts)}", f"{hits:.3f}"])
        print(f"{name}: {same}/{len(prompts)} identical", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--model", default=None, help="default: the built-in pair")
    p.add_argument("--speculative-config", type=json.loads, default=None)
    p.add_argument("--no-identity", action="store_true", help="skip part 3")
    p.add_argument("--out", default=str(RESULTS_DIR / "prefix_cache.json"))
    args = p.parse_args()
    spec = args.speculative_config or (None if args.model else BUILT_IN["eagle3 head"])
    seqs = {"max_num_seqs": args.batch_size}
    spec_on, plain_on, spec_off = engines = [
        LLMEngine.from_engine_args(engine_args(args, s, c, **seqs))
        for s, c in ((spec, True), (None, True), (spec, False))
    ]
    share_weights(engines)
    n = args.num_requests
    workload = build_workload(
        spec_on, input_len=args.input_len, output_len=args.output_len,
        num_prompts=WARMUP_REQUESTS + 2 * n, seed=0,
    )  # fmt: skip
    workload = with_shared_prefix(workload, shared_prefix(spec_on, args.prefix_len))
    name = (spec or {}).get("method", "no speculation")
    report: dict[str, Any] = {"args": vars(args), "machine": machine_info(), "drafter": name}
    try:
        cells([spec_on, plain_on], workload, args, first=0)
        rates = [e.metrics.prefix_cache_hit_rate or 0.0 for e in (spec_on, plain_on)]
        report["cold_hit_rate"] = {name: rates[0], "no speculation": rates[1]}
        print(f"cold hit rate: {name} {rates[0]:.4f}, no speculation {rates[1]:.4f}", flush=True)
        warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
        for e in (spec_on, spec_off):
            run_cell(e, workload, args.batch_size, WARMUP_REQUESTS, warm, first_prompt=n)
        on, off = cells([spec_on, spec_off], workload, args, first=WARMUP_REQUESTS + n)
        hit = spec_on.metrics.prefix_cache_hit_rate or 0.0
    finally:
        for e in engines:
            e.shutdown()
    rows = [
        [label, f"{c.ttft_mean * 1000:.0f}", f"{c.ttft_p50 * 1000:.0f}", f"{c.output_tok_s:.1f}",
         f"{c.tpot_mean * 1000:.1f}", f"{h:.3f}"]
        for label, c, h in (("cache on", on, hit), ("cache off", off, 0.0))
    ]  # fmt: skip
    print(format_table(["", "TTFT mean ms", "p50 ms", "tok/s", "TPOT ms", "hit rate"], rows))
    ttft_x, tok_x = off.ttft_mean / on.ttft_mean, on.output_tok_s / off.output_tok_s
    print(f"TTFT {ttft_x:.2f}x lower, throughput {tok_x:.2f}x higher with the cache on")
    report["hot"] = {"on": on.__dict__, "off": off.__dict__, "ttft_x": ttft_x, "tok_x": tok_x}
    if not args.no_identity:
        identity = greedy_identity(workload, args)
        print(format_table(["drafter", "greedy identical", "hit rate"], identity))
        report["greedy_identity"] = identity
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
