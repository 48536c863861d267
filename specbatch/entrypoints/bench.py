"""``specbatch bench`` (or ``specbatch bench offline``): the offline load test.

``bench`` is a group: ``add_parser`` returns its sub-command action, so further load tests
(``bench serve``) register next to ``offline``. Without a sub-command, ``bench`` runs the
offline test; with ``offline``, put its flags after the word ``offline``.
"""

from __future__ import annotations

import argparse
from typing import Any

from specbatch.bench.drafts import TREE_SPELLING, parse_draft_length, parse_tree
from specbatch.bench.offline import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_DRAFT_LENGTHS,
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_OUTPUT_LEN_SPREAD,
    INTERLEAVE,
)
from specbatch.errors import InvalidInputError
from specbatch.speculative_config import TREE_CHILDREN

FIELDS = (
    "batch_sizes",
    "draft_lengths",
    "trees",
    "tree_children",
    "input_len",
    "output_len",
    "output_len_spread",
    "num_requests",
    "temperature",
    "prompts",
    "shared_prefix_len",
)
# Engine flags the command sets itself, per engine (auto's maximum: the deepest cell).
_OWN_ENGINE_FIELDS = ("num_speculative_tokens", "max_draft_length", "max_num_seqs", "max_model_len")

DESCRIPTION = """\
Offline load test. For every batch size B (requests running concurrently: the engine is kept
full at B, a new request taking the place of each finished one) and every cell (a draft length
k of --draft-lengths, 0 being plain decoding of the target alone, auto, or a draft tree of
--trees), run --num-requests requests of exactly --input-len prompt tokens and --output-len
output tokens on average (spread by --output-len-spread), after a warm-up that is not counted.
Reports per cell output tokens/s, time per output token (mean, p50, p99), time to first token,
end-to-end latency, the measured acceptance rate and alpha, tokens per round, the target's rows
per step, the draft/target cost ratio c, the verify cost, and the speedup over k=0 measured
next to THEORY.md's prediction from alpha and c (for a tree: a chain as deep, alpha being the
chance its walk passes a level).
Writes OUT.json, OUT.csv, OUT_throughput_latency.png and OUT_speedup.png.

One engine per cell, sharing the weights. By default the cells of a round run side by side,
taking turns on the machine a step at a time, each measured in its engine's own time
(--interleave steps), so the machine's drift falls on every cell alike; --interleave cells runs
them one after another instead. Default model: the built-in pair; default prompts:
windows of the pair's held-out stdlib files."""


def _arg(parse: Any) -> Any:
    """An argparse type from a parser raising ``InvalidInputError``."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except InvalidInputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _add_flags(p: argparse.ArgumentParser) -> None:
    from specbatch.entrypoints.engine_flags import add_engine_flags

    p.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=list(DEFAULT_BATCH_SIZES),
        metavar="B",
        help=f"concurrent requests (default: {' '.join(map(str, DEFAULT_BATCH_SIZES))})",
    )
    p.add_argument(
        "--draft-lengths",
        type=_arg(parse_draft_length),
        nargs="+",
        default=list(DEFAULT_DRAFT_LENGTHS),
        metavar="K",
        help="chains of K draft tokens per round, 0 = plain decoding, auto = "
        "num_speculative_tokens=auto up to the deepest cell (4 when no other drafts), with "
        "trees of the largest topk and nodes of --trees in its ladder "
        f"(default: {' '.join(map(str, DEFAULT_DRAFT_LENGTHS))})",
    )
    p.add_argument(
        "--trees",
        type=_arg(parse_tree),
        nargs="+",
        default=[],
        metavar="DxK/N",
        help="draft trees, cells beside the draft lengths: depth D (drafter passes a round), "
        f"K >= 2 children per expanded node, N nodes verified ({TREE_SPELLING}; default: none)",
    )
    p.add_argument(
        "--tree-children",
        choices=TREE_CHILDREN,
        default=TREE_CHILDREN[0],
        help="the trees' children: sampled (drawn from q without replacement, verified by "
        "recursive rejection sampling) or top (the top K, verified by the walk) "
        f"(default: {TREE_CHILDREN[0]})",
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=DEFAULT_INPUT_LEN,
        metavar="N",
        help=f"prompt tokens per request (default: {DEFAULT_INPUT_LEN})",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=DEFAULT_OUTPUT_LEN,
        metavar="N",
        help=f"output tokens per request, on average (default: {DEFAULT_OUTPUT_LEN})",
    )
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=DEFAULT_OUTPUT_LEN_SPREAD,
        metavar="S",
        help="each prompt's output length uniform in --output-len x [1 - S, 1 + S], the same "
        "for every draft length; 0: all exactly --output-len (default: "
        f"{DEFAULT_OUTPUT_LEN_SPREAD})",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests measured per cell (default: max(4 B, 16))",
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="prompts file (.txt or .jsonl), each cut or repeated to --input-len tokens "
        "(default: the built-in pair's held-out stdlib text; random ids without a tokenizer)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature, 0 = greedy (default: 0)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run every cell N times, the draft lengths of a batch size in interleaved rounds, "
        "and report each cell over all its runs: tokens/s as the output tokens over the "
        "time, both summed (default: 1)",
    )
    p.add_argument(
        "--interleave",
        choices=INTERLEAVE,
        default="steps",
        help="steps: a round's cells side by side, in turns of one engine step, each timed on "
        "its own clock; cells: one after another, each alone on the machine (default: steps)",
    )
    p.add_argument(
        "--mixed",
        type=float,
        default=None,
        metavar="T",
        help="the mixed workload: easy requests (repetitive code, greedy) in turn with hard "
        "ones (the prompts sampled at temperature T); --temperature is then unused",
    )
    p.add_argument(
        "--workload",
        choices=("heldout", "grounded"),
        default="heldout",
        help="heldout: windows of the built-in pair's held-out stdlib files; grounded: each a "
        "held-out function followed by its first lines again, so outputs copy spans of the "
        "prompt (what n-gram drafting is for; give --input-len 256 or so) (default: heldout)",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="every prompt starts with the same N tokens (a window of the held-out text), then "
        "its own --input-len tokens: the workload the prefix cache serves (default: 0)",
    )
    p.add_argument(
        "--out",
        default="bench_results/bench",
        metavar="PATH",
        help="output path without extension (default: bench_results/bench)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_flags(p, skip=_OWN_ENGINE_FIELDS)


def add_parser(subparsers: Any) -> Any:
    """Register ``bench`` and ``bench offline``; returns ``bench``'s sub-command action."""
    p = subparsers.add_parser(
        "bench",
        help="load tests: offline (default) over batch sizes x drafts (chains, trees, auto)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_flags(p)
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="bench_command", metavar="MODE", required=False)
    offline = sub.add_parser(
        "offline",
        help="the offline load test (the default)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_flags(offline)
    offline.set_defaults(func=run)
    return sub


def config_from(args: argparse.Namespace) -> Any:
    from specbatch.bench.offline import BenchConfig
    from specbatch.entrypoints.engine_flags import ENGINE_FLAGS
    from specbatch.speculative_config import parse_speculative_config

    skip = {"model", "draft_model", "seed", "speculative_config", *_OWN_ENGINE_FIELDS}
    engine_kwargs = {f.field: getattr(args, f.field) for f in ENGINE_FLAGS if f.field not in skip}
    spec = None
    if args.speculative_config is not None:  # the drafter; its draft lengths are the grid's
        parsed = parse_speculative_config(args.speculative_config)
        tree = {"topk": parsed.topk != 1, "num_draft_tokens": parsed.num_draft_tokens is not None,
                "tree_children": parsed.tree_children != TREE_CHILDREN[0]}  # fmt: skip
        for key, given in tree.items():
            if given:
                flag = "--tree-children" if key == "tree_children" else "--trees"
                raise InvalidInputError(
                    f"speculative_config.{key}: bench takes the grid's trees from {flag}"
                )
        spec = {"method": parsed.method, "prompt_lookup_max": parsed.prompt_lookup_max,
                "prompt_lookup_min": parsed.prompt_lookup_min}  # fmt: skip
        if parsed.model is not None:
            spec["model"] = parsed.model
        if parsed.draft_tensor_parallel_size is not None:
            spec["draft_tensor_parallel_size"] = parsed.draft_tensor_parallel_size
    return BenchConfig(
        model=args.model,
        draft_model=args.draft_model,
        batch_sizes=list(args.batch_sizes),
        draft_lengths=list(args.draft_lengths),
        trees=list(args.trees),
        tree_children=args.tree_children,
        input_len=args.input_len,
        output_len=args.output_len,
        output_len_spread=args.output_len_spread,
        num_requests=args.num_requests,
        prompts_file=args.prompts,
        temperature=args.temperature,
        mixed_hard_temperature=args.mixed,
        repeats=args.repeats,
        interleave=args.interleave,
        seed=args.seed,
        speculative_config=spec,
        workload=args.workload,
        shared_prefix_len=args.shared_prefix_len,
        engine_kwargs=engine_kwargs,
    )


def run(args: argparse.Namespace) -> int:
    from specbatch.bench.offline import run_bench
    from specbatch.bench.report import format_report, write_all
    from specbatch.errors import InvalidInputError
    from specbatch.sampling_params import SamplingParams

    cfg = config_from(args)
    cfg.check()
    SamplingParams(temperature=cfg.temperature)  # a bad value fails before any model loads
    if cfg.mixed_hard_temperature is not None:
        try:
            SamplingParams(temperature=cfg.mixed_hard_temperature)
        except InvalidInputError as e:
            raise InvalidInputError(f"--mixed: {e}") from None
    result = run_bench(cfg, progress=not args.no_progress)
    print(format_report(result), flush=True)
    for kind, path in write_all(result, args.out).items():
        print(f"wrote {kind}: {path}", flush=True)
    return 0
