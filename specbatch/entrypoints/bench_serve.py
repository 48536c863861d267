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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specbatch.bench.serve_load import format_table, plot, run_benchmark, synthetic_prompts
from specbatch.entrypoints.flags import add_options, values_of
from specbatch.errors import InvalidInputError
from specbatch.options import check_options, option, same_as
from specbatch.sampling_params import SamplingParams


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


@dataclass
class LoadOptions:
    # fmt: off
    base_url: str = option("http://127.0.0.1:8000", "server URL", metavar="URL")
    num_prompts: int = option(100, "requests per rate", ge=1, metavar="N")
    max_concurrency: int | None = option(None, "most requests in flight at once; a request "
        "that arrives past it waits for one to finish (default: no limit)", type=int, ge=1,
        metavar="C")
    max_tokens: int = same_as(SamplingParams, "max_tokens", 32, help="per request")
    temperature: float = same_as(SamplingParams, "temperature", 0.0, help="0 = greedy")
    ignore_eos: bool = same_as(SamplingParams, "ignore_eos", help="always generate --max-tokens")
    prompts: str | None = option(None, ".txt or .jsonl prompts, cycled (default: synthetic "
        "prompts of --input-words words)", type=Path, metavar="FILE")
    input_words: int = option(16, "synthetic prompt length", ge=1)
    multi_turn: int = option(1, "chat conversations of T turns through /v1/chat/completions, "
        "each prompt the first user turn and a short follow-up after each reply (1: plain "
        "completions)", ge=1, metavar="T")
    seed: int = option(0, "seeds the prompts and arrival times", ge=0)
    model: str | None = option(None, "model name (default: the server's first)", type=str,
        metavar="NAME")
    api_key: str | None = option(None, "bearer token to send (default: none)", type=str,
        metavar="KEY")
    timeout: float = option(300.0, "per request, in seconds", gt=0, metavar="S")
    output_json: str = option("bench_serve.json", "the report", type=Path, metavar="FILE")
    output_png: str = option("bench_serve.png", "latency against throughput", type=Path,
        metavar="FILE")
    # fmt: on

    def __post_init__(self) -> None:
        check_options(LoadOptions, self)


def add_serve_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser(
        "serve",
        help="load-test a running specbatch (or OpenAI-compatible) server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[float("inf")],
        metavar="RATES",
        help="comma-separated requests/s, inf = all at once (default: inf)",
    )
    add_options(p, LoadOptions, "load options")
    p.set_defaults(func=run)
    return p


def load_prompts(opts: LoadOptions) -> list[str | list[int]]:
    if opts.prompts is None:
        return list(synthetic_prompts(opts.num_prompts, opts.input_words, opts.seed))
    from specbatch.prompts_file import read_prompts

    lines = read_prompts(opts.prompts).prompts
    if not lines:
        raise InvalidInputError(f"prompts: '{opts.prompts}' holds no prompts", "prompts")
    if opts.multi_turn > 1 and any(not isinstance(p.prompt, str) for p in lines):
        raise InvalidInputError(
            "prompts: --multi-turn needs text prompts, not token ids", "prompts"
        )
    return [lines[i % len(lines)].prompt for i in range(opts.num_prompts)]


def run(args: argparse.Namespace) -> int:
    opts = LoadOptions(**values_of(args, LoadOptions))
    prompts = load_prompts(opts)
    load = run_benchmark(
        opts.base_url,
        args.request_rate,
        prompts,
        max_tokens=opts.max_tokens,
        temperature=opts.temperature,
        ignore_eos=opts.ignore_eos,
        max_concurrency=opts.max_concurrency,
        seed=opts.seed,
        model=opts.model,
        api_key=opts.api_key,
        timeout=opts.timeout,
        multi_turn=opts.multi_turn,
    )
    try:
        report = asyncio.run(load)
    except httpx.HTTPError as e:
        raise InvalidInputError(
            f"base_url: cannot benchmark {opts.base_url}: {e}", "base_url"
        ) from None
    print(format_table(report))
    Path(opts.output_json).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, opts.output_png)
    print(f"wrote {opts.output_json} and {opts.output_png}", file=sys.stderr)
    failed = sum(r["errors"] for r in report["runs"])
    for r in report["runs"]:
        for e in r["error_examples"]:
            print(f"error (rate {r['request_rate']}): {e}", file=sys.stderr)
    return 1 if failed else 0
