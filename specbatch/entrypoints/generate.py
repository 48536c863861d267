"""``specbatch generate``: run every prompt of a file, writing results as they complete."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from specbatch.engine.data_parallel import DataParallelEngine, create_engine
from specbatch.engine.llm_engine import LLMEngine
from specbatch.engine.metrics import EngineMetrics
from specbatch.entrypoints.flags import (
    add_engine_flags,
    add_sampling_flags,
    engine_args_from,
    values_of,
)
from specbatch.entrypoints.generate_output import ResultsFile, load_finished, result_record
from specbatch.entrypoints.signals import exit_status, what_happened
from specbatch.errors import InvalidInputError
from specbatch.grammar.backend import parse
from specbatch.prompts_file import LINE_SAMPLING_FIELDS, PromptLine, PromptsFile, read_prompts
from specbatch.sampling_params import SamplingParams

SEED_STRIDE = 1_000_003  # request seed = seed * SEED_STRIDE + index, unless the line sets one
SEED_MODULUS = 1 << 63

_LINE_FIELDS = textwrap.fill(
    f"the flags: {', '.join(LINE_SAMPLING_FIELDS)}.",
    92,
    initial_indent=" " * 10,
    subsequent_indent=" " * 10,
)
DESCRIPTION = f"""\
Generate a completion for every prompt in FILE and write one JSON line per prompt to OUT, in
the order requests finish, flushing each line as soon as it is written.

FILE formats (chosen by extension):
  .txt    one prompt per non-blank line, taken literally: escapes such as \\n are NOT
          interpreted, and blank lines are skipped. Use .jsonl for multi-line prompts.
  .jsonl  one JSON object per line: {{"prompt": "..."}} or {{"prompt_token_ids": [1, 2, 3]}},
          optionally "id" (copied to the output) and per-line sampling fields that override
{_LINE_FIELDS}

Each output line holds "index" (the prompt's position among FILE's non-blank lines, from 0,
malformed lines included), "id", "prompt", "text", "token_ids", "finish_reason",
"num_prompt_tokens", "num_output_tokens", "ttft_s", "e2e_s" and, when speculating,
"acceptance_rate" and "mean_tokens_per_round". With logprobs: "token_logprobs",
"top_logprobs" and "cumulative_logprob"; with n > 1, "completions" holds all n (text,
token ids, finish reason, logprobs), the first also at the top level.

Malformed lines are reported as FILE:LINE: message and skipped; the others still run, and the
exit status is then 1. Random sampling is reproducible: a prompt without its own "seed" uses
seed = (--seed * 1000003 + index) mod 2**63, so a rerun or a --resume gives the same results. Ctrl-C
(or SIGTERM) aborts the requests in flight, keeps what was written and exits with status 130
(143); rerun with --resume to finish. Exit status: 0 all done, 1 some lines rejected, 2 usage or
setup error."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate completions for a file of prompts",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompts", required=True, metavar="FILE", help="prompts file (.txt or .jsonl)")
    p.add_argument(
        "--output",
        required=True,
        metavar="OUT",
        help="results file (JSON lines); overwritten unless --resume",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the results already in OUT "
        "(a truncated last line is dropped) and run only the missing prompts",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sampling_flags(p)
    add_engine_flags(
        p,
        helps={"seed": "base seed: a prompt without its own seed uses seed * 1000003 + its index"},
    )
    p.set_defaults(func=run)
    return p


# ---- the run -------------------------------------------------------------------------------


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def line_params(base: dict[str, Any], line: PromptLine, seed: int) -> SamplingParams:
    derived = (seed * SEED_STRIDE + line.index) % SEED_MODULUS  # a generator takes < 2**64
    return SamplingParams(**{**base, "seed": derived, **line.overrides})


def run(args: argparse.Namespace) -> int:
    base_params = values_of(args, SamplingParams)
    params = SamplingParams(**base_params)  # a bad flag fails before any model loads
    if params.structured_outputs is not None:  # and so does a grammar that does not parse
        parse(params.structured_outputs, None)
    try:
        prompts = read_prompts(args.prompts)
    except OSError as e:
        raise InvalidInputError(
            f"prompts: cannot read '{args.prompts}': {e.strerror or e}", "prompts"
        ) from None
    for w in prompts.warnings:
        _say(f"{prompts.where(w.line_no)}: warning: {w.message}")
    if not prompts.prompts and not prompts.errors:
        raise InvalidInputError(
            f"prompts: '{args.prompts}' holds no prompts (no non-blank line)", "prompts"
        )
    out_path = Path(args.output)
    done = load_finished(out_path, prompts) if args.resume else set()
    with ResultsFile(out_path) as sink:  # fails early if OUT is not writable
        engine = create_engine(engine_args_from(args))
        try:
            if not args.resume:
                sink.clear()
            return _generate(engine, args, prompts, base_params, done, sink)
        finally:
            engine.shutdown()


def _generate(
    engine: LLMEngine | DataParallelEngine,
    args: argparse.Namespace,
    prompts: PromptsFile,
    base_params: dict[str, Any],
    done: set[int],
    sink: ResultsFile,
) -> int:
    if prompts.format == "txt" and engine.tokenizer is None and prompts.prompts:
        raise InvalidInputError(
            f"prompts: '{prompts.path}' holds text prompts but the model has no tokenizer; "
            'give token ids in a .jsonl file ({"prompt_token_ids": [...]})',
            "prompts",
        )
    errors = [(e.line_no, e.message) for e in prompts.errors if e.index not in done]
    pending: dict[str, PromptLine] = {}
    try:
        for line in prompts.prompts:
            if line.index in done:
                continue
            try:
                params = line_params(base_params, line, engine.config.seed)
                rid = engine.add_request(line.prompt, params, request_id=str(line.index))
            except InvalidInputError as e:
                errors.append((line.line_no, str(e)))
                continue
            pending[rid] = line
        for line_no, message in sorted(errors):
            _say(f"{prompts.where(line_no)}: {message}")
        return _drive(engine, args, pending, done, len(errors), sink)
    except KeyboardInterrupt as e:
        engine.abort_request(list(pending))
        _say(
            f"\n{what_happened(e)}: aborted {len(pending)} unfinished request(s); finished "
            f"results are in {args.output}; rerun with --resume to complete the rest"
        )
        return exit_status(e)


def _drive(
    engine: LLMEngine | DataParallelEngine,
    args: argparse.Namespace,
    pending: dict[str, PromptLine],
    done: set[int],
    num_rejected: int,
    sink: ResultsFile,
) -> int:
    from tqdm import tqdm

    speculative = engine.config.speculative_config.speculative
    has_tok = engine.tokenizer is not None
    start, tokens, finished = time.perf_counter(), 0, 0
    with tqdm(
        total=len(pending),
        desc="generate",
        unit="req",
        file=sys.stderr,
        disable=args.no_progress,
        dynamic_ncols=True,
    ) as bar:
        while pending:
            for out in engine.step():
                line = pending.get(out.request_id)
                if not out.finished or line is None:
                    continue
                record = result_record(line, out, has_tok, speculative)
                sink.write(record)
                del pending[out.request_id]
                finished += 1
                tokens += record["num_output_tokens"]
                bar.update(1)
            if not engine.has_unfinished_requests() and pending:
                raise RuntimeError(f"requests {sorted(pending)[:5]} vanished from the engine")
    elapsed = time.perf_counter() - start
    parts = [f"generate: {finished} request(s) done"]
    if done:
        parts.append(f"{len(done)} already in {args.output}")
    if num_rejected:
        parts.append(f"{num_rejected} line(s) rejected")
    summary = ", ".join(parts) + (
        f"; {tokens} output tokens in {elapsed:.2f} s ({tokens / max(elapsed, 1e-9):.1f} tokens/s)"
    )
    if speculative:
        summary += speculation_summary(engine.metrics)
    _say(summary)
    return 1 if num_rejected else 0


def speculation_summary(metrics: EngineMetrics) -> str:
    """What speculation did, for generate's closing line: the acceptance and tokens a round,
    the share of decoding steps that drafted, and (with ``auto``) drafting's tokens/s against
    plain decoding's where the engine measured both."""
    spec = metrics.summary()
    out = ""
    if spec.get("acceptance_rate") is not None:
        out += (
            f"; acceptance rate {spec['acceptance_rate']:.3f} (alpha {spec['alpha']:.3f}), "
            f"{spec['mean_tokens_per_round']:.2f} tokens per round"
        )
    if spec.get("drafting_share") is not None:
        share = 100 * spec["drafting_share"]
        shown = f"{share:.0f}%" if share >= 1 or share == 0 else f"{share:.2f}%"
        out += (
            f"; drafts in {shown} of decoding steps "
            f"({metrics.drafting_steps:,} of {metrics.decoding_steps:,})"
        )
    return out
