"""``specbatch verify``: the command line of ``specbatch.exactness.verify_exactness``."""

from __future__ import annotations

import argparse
from typing import Any

from specbatch.exactness import (
    DEFAULT_TEXT_PROMPT,
    format_report,
    verify_exactness,
)
from specbatch.exactness_report import POWER, TARGET_TV, USEFUL_TV

# Fields whose names an error message may start with, mapped to flags by the CLI.
FIELDS = ("num_samples", "tokens", "num_tokens", "alpha", "prompt", "prompt_token_ids")

DESCRIPTION = f"""\
Check that speculative decoding is exact on your own model pair, as the engine runs it (no
flags: the built-in target with its EAGLE-3 head and the engine's draft length k). Samples
--num-samples continuations of --tokens tokens with speculation and as many without, and
compares them token by token: each token's law given its prefix bin, a chi-square test per
token, Bonferroni across tokens. Prints FAIL (exit 1) when the p-value is below --alpha,
INCONCLUSIVE (exit 1) when the draft never ran or the test could not catch a total-variation
difference of {USEFUL_TV:g}, PASS (exit 0) otherwise, with the difference it would have caught
with probability {POWER:g}. An exact engine FAILs by chance with probability at most --alpha.
By default --tokens is k + 2, so that the first round after the prompt proposes all k drafts,
and --num-samples what catches {TARGET_TV:g} at every token. With --temperature 0 the sequences
must simply be the same."""


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
        "--num-samples",
        type=int,
        default=None,
        metavar="N",
        help=f"samples per side (default: enough to catch a difference of {TARGET_TV:g} "
        "at every token)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="L",
        help="tokens per sample (default: the draft length k + 2)",
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
    add_sampling_flags(p, skip=("max_tokens", "min_tokens", "n", "logprobs"), stop_flags=False)
    drafter_help = "the drafter to check, as vLLM's JSON (default: the built-in EAGLE-3 head)"
    add_engine_flags(p, skip=("seed",), help_overrides={"speculative_config": drafter_help})
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from specbatch.entrypoints.engine_flags import ENGINE_FLAGS

    engine_kwargs = {f.field: getattr(args, f.field) for f in ENGINE_FLAGS if f.field != "seed"}
    report = verify_exactness(
        engine_kwargs.pop("model"),
        engine_kwargs.pop("draft_model"),
        speculative_config=engine_kwargs.pop("speculative_config"),
        num_speculative_tokens=engine_kwargs.pop("num_speculative_tokens"),
        num_samples=args.num_samples,
        num_tokens=args.tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        prompt=args.prompt,
        prompt_token_ids=args.prompt_token_ids,
        alpha=args.alpha,
        seed=args.seed,
        engine_kwargs=engine_kwargs,
        progress=not args.no_progress,
    )
    print(format_report(report), flush=True)
    return 0 if report.passed else 1
