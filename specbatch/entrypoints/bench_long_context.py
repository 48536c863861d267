"""``specbatch bench long-context``: plain decoding against self-speculation over a sparse view
of the KV cache, per (context length, batch size), on long documents of real text.

Prompts are distinct windows of this interpreter's stdlib sources through the model's tokenizer,
prefilled once per context length and reused by every cell through the prefix cache; decoding is
timed apart from prefill. Reported per cell: decoding tokens/s and time per output token plain,
with self_sparse at the fixed length and with ``auto`` up to it, the speedups, alpha, tokens per
round, a plain step's time beside the memory-bound prediction (the weights and the cache it
reads over one core's streaming rate, measured here) and the bytes a second it reached; then
the crossover batch size per context length. Writes OUT.json and OUT.png (throughput against
time per output token, a curve per context and mode).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from specbatch.errors import invalid


def add_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "long-context",
        help="plain decoding against self_sparse (fixed and auto) at long contexts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="PATH",
                   help="a checkpoint directory or GGUF file (for SmolLM2: "
                   "scripts/fetch_smollm2.py prints its path)")  # fmt: skip
    p.add_argument("--context-lens", type=int, nargs="+", default=[2000, 8000], metavar="L",
                   help="prompt tokens per request (default: 2000 8000)")  # fmt: skip
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 32], metavar="B",
                   help="requests decoding together (default: 1 16 32)")  # fmt: skip
    p.add_argument("--output-len", type=int, default=64, metavar="N",
                   help="tokens each request generates (default: 64)")  # fmt: skip
    p.add_argument("--draft-length", type=int, default=3, metavar="K",
                   help="self_sparse's chain of drafts a round (default: 3)")  # fmt: skip
    p.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="W",
        help="the last keys a draft pass sees (default: the drafter's, 256)",
    )
    p.add_argument(
        "--sinks",
        type=int,
        default=None,
        metavar="S",
        help="the first keys a draft pass sees (default: the drafter's, 16)",
    )
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (default)")  # fmt: skip
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="plain/self_sparse pairs a cell, the best of each kept (default: 1)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--out",
        default="bench_results/long_context",
        metavar="PATH",
        help="output path without extension (default: bench_results/long_context)",
    )
    p.set_defaults(func=run)
    return p


def check(args: Any) -> None:
    """The long-context settings (flags, or a ``LongContextConfig``), named by their flags."""
    for name in ("context_lens", "batch_sizes"):
        if bad := [v for v in getattr(args, name) if v < 1]:
            raise invalid("--" + name.replace("_", "-"), f": each must be >= 1, got {bad[0]}")
    for name, least in (("output_len", 2), ("draft_length", 1), ("repeats", 1)):
        if (value := getattr(args, name)) < least:
            raise invalid("--" + name.replace("_", "-"), f": must be >= {least}, got {value}")
    if args.temperature < 0:
        raise invalid("--temperature", f": must be >= 0, got {args.temperature}")


def run(args: argparse.Namespace) -> int:
    from specbatch.bench.long_context import LongContextConfig

    check(args)
    cfg = LongContextConfig(
        model=args.model, context_lens=list(args.context_lens), batch_sizes=list(args.batch_sizes),
        output_len=args.output_len, draft_length=args.draft_length, window=args.window,
        sinks=args.sinks, temperature=args.temperature, repeats=args.repeats, dtype=args.dtype,
    )  # fmt: skip
    return report(cfg, args.out)


def report(cfg: Any, out_path: str) -> int:
    """Run the long-context test of ``cfg`` (a ``LongContextConfig``), print its table, write
    OUT.json and OUT.png."""
    from specbatch.bench.long_context import format_table, plot, run_long_context

    result = run_long_context(cfg, log=lambda line: print(line, flush=True))
    print(format_table(result), flush=True)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", flush=True)
    return 0
