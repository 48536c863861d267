"""``specbatch verify``: the command line of ``specbatch.exactness.verify_exactness``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from specbatch.config import default_model_path
from specbatch.errors import InvalidInputError
from specbatch.exactness import (
    DEFAULT_TEXT_PROMPT,
    format_report,
    verify_exactness,
)

# Fields whose names an error message may start with, mapped to flags by the CLI.
FIELDS = ("num_samples", "tokens", "num_tokens", "alpha", "prompt", "prompt_token_ids")

DESCRIPTION = """\
Check that speculative decoding is exact on your own model pair: sample --num-samples
continuations of --tokens tokens with speculation and as many without, count whole token
sequences and run a chi-square test of homogeneity. Prints PASS (exit 0) when the p-value is at
least --alpha, FAIL (exit 1) otherwise, and INCONCLUSIVE (exit 1) when the samples cannot tell
anything (every sequence too rare, or the draft never used). An exact engine FAILs by chance
with probability --alpha. The first token comes from the prompt pass, so --tokens L lets the
draft propose at most L-2 tokens a round: use L >= k+2 to exercise every draft position."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from specbatch.entrypoints.engine_flags import (
        add_engine_flags,
        add_sampling_flags,
        token_ids_arg,
    )

    p = subparsers.add_parser(
        "verify",
        help="check statistically that speculation leaves the output distribution unchanged",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", metavar="DIR", help="target model directory (default: the built-in pair)"
    )
    p.add_argument("--draft-model", metavar="DIR", help="draft model directory")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        metavar="K",
        help="draft tokens per round (default: 4)",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=2000,
        metavar="N",
        help="samples per side (default: 2000)",
    )
    p.add_argument(
        "--tokens", type=int, default=3, metavar="L", help="tokens per sample (default: 3)"
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--prompt",
        metavar="TEXT",
        help=f"prompt text (default: {DEFAULT_TEXT_PROMPT!r}, or the BOS token "
        "when the model has no tokenizer)",
    )
    group.add_argument(
        "--prompt-token-ids",
        type=token_ids_arg,
        metavar="IDS",
        help="prompt as comma-separated token ids, e.g. 1,2,3",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=1e-3,
        metavar="A",
        help="significance level: the false-alarm rate (default: 0.001)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the runs (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_sampling_flags(p, skip=("max_tokens",), stop_flags=False)
    add_engine_flags(p, skip=("model", "draft_model", "num_speculative_tokens", "seed"),
                     help_overrides={"speculative_config": "the drafter to check, as JSON "
                                     "(instead of --draft-model; default: the built-in pair's "
                                     "EAGLE head)"})  # fmt: skip
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from specbatch.entrypoints.engine_flags import ENGINE_FLAGS
    from specbatch.speculative_config import parse_speculative_config

    if args.draft_model is not None and args.speculative_config is not None:
        raise InvalidInputError("--draft-model and --speculative-config: give one")
    if args.model is not None and args.draft_model is None and args.speculative_config is None:
        raise InvalidInputError(
            "--model: give its drafter too (--draft-model or --speculative-config), or neither "
            "to check the built-in pair"
        )
    model = args.model or default_model_path("target")
    drafter: dict[str, Any] = {"method": "eagle"}  # the built-in default
    if args.draft_model is not None:
        drafter = {"method": "draft_model", "model": args.draft_model}
    elif args.speculative_config is not None:
        parse_speculative_config(args.speculative_config)  # its errors name the field
        drafter = json.loads(args.speculative_config)
    skip = {"model", "draft_model", "num_speculative_tokens", "seed", "speculative_config"}
    engine_kwargs = {f.field: getattr(args, f.field) for f in ENGINE_FLAGS if f.field not in skip}
    report = verify_exactness(
        model,
        speculative_config=drafter,
        num_speculative_tokens=args.num_speculative_tokens,
        num_samples=args.num_samples,
        num_tokens=args.tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        prompt=args.prompt,
        prompt_token_ids=args.prompt_token_ids,
        alpha=args.alpha,
        seed=args.seed,
        engine_kwargs=engine_kwargs,
        progress=not args.no_progress,
    )
    print(format_report(report), flush=True)
    return 0 if report.passed else 1
