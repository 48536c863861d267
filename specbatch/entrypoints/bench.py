"""``specbatch bench`` (or ``specbatch bench offline``): the offline load test.

``bench`` is a group: ``add_parser`` returns its sub-command action, so further load tests
(``bench serve``) register next to ``offline``. Without a sub-command, ``bench`` runs the
offline test; with ``offline``, put its flags after the word ``offline``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from specbatch.bench.bench_config import DEFAULT_BATCH_SIZES, DEFAULT_DRAFT_LENGTHS, BenchConfig
from specbatch.bench.drafts import TREE_SPELLING, parse_draft_length, parse_tree
from specbatch.entrypoints.flags import add_engine_flags, add_options, values_of
from specbatch.errors import InvalidInputError
from specbatch.speculative_config import SpeculativeConfig

# Engine flags the command sets itself, per engine (auto's maximum: the deepest cell).
_OWN_ENGINE_FIELDS = ("num_speculative_tokens", "max_draft_length", "max_num_seqs", "max_model_len")
_OWN_SPEC_KEYS = ("num_speculative_tokens", "max_draft_length")
# speculative_config keys the grid sets from its own flags
_TREE_KEYS = {"topk": "--trees", "num_draft_tokens": "--trees", "tree_children": "--tree-children"}

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
windows of the pair's held-out stdlib files. With --data-parallel-size N, each engine is N
replicas on a Ray cluster and B counts the requests running on all of them together."""


def _arg(parse: Any) -> Any:
    """An argparse type from a parser raising ``InvalidInputError``."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except InvalidInputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _add_flags(p: argparse.ArgumentParser) -> None:
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
        f"num_speculative_tokens=auto up to the deepest cell ({SpeculativeConfig.max_draft_length} "
        "when no other drafts), with trees of the largest topk and nodes of --trees in its ladder "
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
        "--out",
        default="bench_results/bench",
        metavar="PATH",
        help="output path without extension (default: bench_results/bench)",
    )
    p.add_argument(
        "--context-lens",
        type=int,
        nargs="+",
        default=None,
        metavar="L",
        help="the long-context test instead of the grid: L-token documents (prefilled once, "
        "through the prefix cache), decoded plain, with auto and with self_sparse at the deepest "
        "--draft-lengths chain (3 unless given) per context and batch size; --speculative-config "
        "may set self_sparse's window and sinks (`bench long-context --help`)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_options(p, BenchConfig, "bench options")
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


def config_from(args: argparse.Namespace) -> BenchConfig:
    from specbatch.config import EngineArgs
    from specbatch.options import options_of
    from specbatch.speculative_config import normalise

    skip = {"model", "draft_model", "seed", "speculative_config", *_OWN_ENGINE_FIELDS}
    defaults = {name: default for name, _, default in options_of(EngineArgs)}
    engine_kwargs = {
        k: v for k, v in values_of(args, EngineArgs).items() if k not in skip and v != defaults[k]
    }
    spec = None
    if args.speculative_config is not None:  # the drafter; its draft lengths are the grid's
        parsed = dataclasses.asdict(normalise(args.speculative_config))
        for key, flag in _TREE_KEYS.items():
            if parsed[key] != getattr(SpeculativeConfig, key):
                raise InvalidInputError(
                    f"speculative_config.{key}: bench takes the grid's trees from {flag}",
                    f"speculative_config.{key}",
                )
        own = {*_OWN_SPEC_KEYS, *_TREE_KEYS}
        spec = {k: v for k, v in parsed.items() if k not in own and v is not None}
    return BenchConfig(
        model=args.model,
        draft_model=args.draft_model,
        batch_sizes=list(args.batch_sizes),
        draft_lengths=list(args.draft_lengths),
        trees=list(args.trees),
        seed=args.seed,
        speculative_config=spec,
        engine_kwargs=engine_kwargs,
        **values_of(args, BenchConfig),
    )


def long_context_config(args: argparse.Namespace) -> Any:
    """The long-context test's settings from the offline bench's flags."""
    from specbatch.bench.long_context import LongContextConfig
    from specbatch.entrypoints.bench_long_context import check
    from specbatch.speculative_config import normalise

    ks = [k for k in args.draft_lengths if k != "auto"]
    given = list(args.draft_lengths) != list(DEFAULT_DRAFT_LENGTHS)
    spec = normalise(args.speculative_config) if args.speculative_config else None
    if spec is not None and spec.method != "self_sparse":
        raise InvalidInputError(
            "speculative_config.method: --context-lens drafts with self_sparse, got "
            f"{spec.method!r}",
            "speculative_config.method",
        )
    dtype = getattr(args, "dtype", None)
    cfg = LongContextConfig(
        model=args.model, context_lens=list(args.context_lens), batch_sizes=list(args.batch_sizes),
        output_len=args.output_len, draft_length=max(ks) if given and max(ks, default=0) else 3,
        window=spec.window if spec else None, sinks=spec.sinks if spec else None,
        temperature=args.temperature, repeats=args.repeats,
        dtype=dtype if dtype in ("bfloat16", "float32") else "bfloat16",
    )  # fmt: skip
    check(cfg)
    return cfg


def run(args: argparse.Namespace) -> int:
    from specbatch.bench.offline import run_bench
    from specbatch.bench.report import format_report, write_all

    if args.context_lens is not None:
        from specbatch.entrypoints.bench_long_context import report

        out = args.out if args.out != "bench_results/bench" else "bench_results/long_context"
        return report(long_context_config(args), out)
    cfg = config_from(args)
    cfg.check()  # a bad value fails before any model loads
    result = run_bench(cfg, progress=not args.no_progress)
    print(format_report(result), flush=True)
    for kind, path in write_all(result, args.out).items():
        print(f"wrote {kind}: {path}", flush=True)
    return 0
