"""``specbatch verify``: the command line of ``specbatch.exactness.verify_exactness``."""

from __future__ import annotations

import argparse
from typing import Any

from specbatch.config import EngineArgs
from specbatch.entrypoints.flags import (
    add_engine_flags,
    add_options,
    add_sampling_flags,
    token_ids_arg,
    values_of,
)
from specbatch.exactness import (
    DEFAULT_TEXT_PROMPT,
    NOT_CHECKED,
    SET_BY_THE_CHECK,
    CheckOptions,
    format_report,
    verify_exactness,
)
from specbatch.exactness_report import POWER, TARGET_TV, USEFUL_TV
from specbatch.sampling_params import SamplingParams
from specbatch.speculative_config import DEFAULT_NUM_SPECULATIVE_TOKENS

DESCRIPTION = f"""\
Check that speculative decoding is exact on your own model pair, as the engine runs it (no
flags: the built-in target with its EAGLE-3 head), at a fixed draft length k (default
{DEFAULT_NUM_SPECULATIVE_TOKENS}; --num-speculative-tokens auto checks auto). Samples
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
    p = subparsers.add_parser(
        "verify",
        help="check statistically that speculation leaves the output distribution unchanged",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, CheckOptions, "check options")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_sampling_flags(p, skip=(*SET_BY_THE_CHECK, *NOT_CHECKED))
    drafter_help = "the drafter to check, as vLLM's JSON (default: the built-in EAGLE-3 head)"
    add_engine_flags(p, skip=("seed",), helps={"speculative_config": drafter_help})
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    engine = values_of(args, EngineArgs)
    report = verify_exactness(
        engine.pop("model"),
        engine.pop("draft_model"),
        speculative_config=engine.pop("speculative_config"),
        num_speculative_tokens=engine.pop("num_speculative_tokens"),
        num_samples=args.num_samples,
        num_tokens=args.tokens,
        prompt=args.prompt,
        prompt_token_ids=args.prompt_token_ids,
        alpha=args.alpha,
        seed=args.seed,
        engine_kwargs=engine,
        progress=not args.no_progress,
        **values_of(args, SamplingParams),
    )
    print(format_report(report), flush=True)
    return 0 if report.passed else 1
