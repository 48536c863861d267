"""``specbatch bench serve``: load-test a running server at several request rates.

For each rate, ``--num-prompts`` streaming completions arrive as a Poisson process (seeded;
``inf`` sends them all at once), at most ``--max-concurrency`` in flight. Reported per rate:
request and output-token throughput, TTFT, time per output token (TPOT, per request, after the
first token) and inter-token latency (ITL: the gaps between streamed chunks, so a round that
accepts several tokens counts as one gap), each as mean/p50/p90/p99 in milliseconds, and the
draft acceptance rate and prefix-cache hit rate over the run, read from the server's
``/metrics``. With ``--multi-turn T``, each prompt opens a chat of T turns instead (the rate
counts conversations; each turn resends the conversation so far), and TTFT is also reported
turn by turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import httpx

from specbatch.bench.serve_load import format_table, plot, run_benchmark, synthetic_prompts
from specbatch.errors import InvalidInputError


def parse_rates(value: str) -> list[float]:
    """``"1,2,4,inf"`` as floats (``inf`` = all requests at once)."""
    rates = []
    for part in value.split(","):
        part = part.strip().lower()
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated rates such as 1,2,4,inf, got {value!r}"
            ) from None
        if not rate > 0 or math.isnan(rate):
            raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def add_serve_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "serve",
        help="load-test a running specbatch (or OpenAI-compatible) server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server URL (default: %(default)s)"
    )
    p.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[float("inf")],
        metavar="RATES",
        help="comma-separated requests/s, inf = all at once (default: inf)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=100,
        metavar="N",
        help="requests per rate (default: %(default)s)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="C",
        help="most requests in flight at once; a request that arrives past it waits for one "
        "to finish (default: no limit)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, metavar="N", help="per request (default: %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 = greedy (default: %(default)s)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help=".txt or .jsonl prompts, cycled (default: synthetic prompts of --input-words words)",
    )
    p.add_argument(
        "--input-words",
        type=int,
        default=16,
        metavar="N",
        help="synthetic prompt length (default: %(default)s)",
    )
    p.add_argument(
        "--multi-turn",
        type=int,
        default=1,
        metavar="T",
        help="chat conversations of T turns through /v1/chat/completions, each prompt the "
        "first user turn and a short follow-up after each reply (default: 1, plain "
        "completions)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the prompts and arrival times (default: %(default)s)",
    )
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument(
        "--api-key", default=None, metavar="KEY", help="bearer token to send (default: none)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="per request, in seconds (default: %(default)s)",
    )
    p.add_argument(
        "--output-json",
        default="bench_serve.json",
        metavar="FILE",
        help="the report (default: %(default)s)",
    )
    p.add_argument(
        "--output-png",
        default="bench_serve.png",
        metavar="FILE",
        help="latency against throughput (default: %(default)s)",
    )
    p.set_defaults(func=run)
    return p


def load_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    if args.num_prompts < 1:
        raise InvalidInputError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InvalidInputError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.multi_turn < 1:
        raise InvalidInputError(f"--multi-turn must be >= 1, got {args.multi_turn}")
    if args.prompts is None:
        return list(synthetic_prompts(args.num_prompts, args.input_words, args.seed))
    from specbatch.entrypoints.prompts_file import read_prompts

    lines = read_prompts(args.prompts).prompts
    if not lines:
        raise InvalidInputError(f"--prompts: '{args.prompts}' holds no prompts")
    if args.multi_turn > 1 and any(not isinstance(p.prompt, str) for p in lines):
        raise InvalidInputError("--prompts: --multi-turn needs text prompts, not token ids")
    return [lines[i % len(lines)].prompt for i in range(args.num_prompts)]


def _run_async(args: argparse.Namespace, prompts: list[str | list[int]]) -> dict[str, Any]:
    return asyncio.run(
        run_benchmark(
            args.base_url,
            args.request_rate,
            prompts,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            model=args.model,
            api_key=args.api_key,
            timeout=args.timeout,
            multi_turn=args.multi_turn,
        )
    )


def run(args: argparse.Namespace) -> int:
    prompts = load_prompts(args)
    try:
        report = _run_async(args, prompts)
    except httpx.HTTPError as e:
        raise InvalidInputError(f"--base-url: cannot benchmark {args.base_url}: {e}") from None
    print(format_table(report))
    Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.output_png)
    print(f"wrote {args.output_json} and {args.output_png}", file=sys.stderr)
    failed = sum(r["errors"] for r in report["runs"])
    for r in report["runs"]:
        for e in r["error_examples"]:
            print(f"error (rate {r['request_rate']}): {e}", file=sys.stderr)
    return 1 if failed else 0
