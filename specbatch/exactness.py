"""A statistical check that speculative decoding is exact on a model pair (``specbatch verify``).

Speculative decoding must leave the target's output distribution unchanged, whatever the draft
(THEORY.md). ``verify_exactness`` builds the engine as configured (by default the built-in target
with its EAGLE head), at a fixed draft length k unless ``auto`` is asked for (the engine's own
default, auto, chooses lengths per step and may leave draft positions unexercised), samples
``num_samples`` continuations of one prompt with it and as many from the same target with
speculation off, each request with its own seed, and compares the two samples token by token
(``specbatch.sequence_stats``).

The first token of every request comes from the prompt pass, and a round never proposes past
``max_tokens``: continuations of k + 2 tokens (the default) let the first round propose all k
drafts and its bonus token, so every draft position is exercised. By default the number of
samples is what catches a total-variation difference of ``TARGET_TV`` with probability
``POWER`` at every token. With temperature 0 the comparison is exact: a sequence seen on one
side and not on the other fails.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specbatch.config import EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import InvalidInputError
from specbatch.exactness_report import (
    TARGET_TV,
    RunStats,
    VerifyReport,
    add_notes,
    format_report,
)
from specbatch.options import check_options, option, options_of
from specbatch.sampling_params import SamplingParams
from specbatch.sequence_stats import compare_positions, samples_for
from specbatch.speculative_config import DEFAULT_NUM_SPECULATIVE_TOKENS

DEFAULT_TEXT_PROMPT = "import os\nimport sys\n"
NO_DRAFTER = (
    "model: speculation is off for this target: give its drafter too (draft_model or "
    "speculative_config), or no model to check the built-in pair"
)
RESERVED = ("model", "draft_model", "num_speculative_tokens", "seed", "speculative_config")
# The sampling fields the check sets itself (the length, when to stop, what is reported); the
# others change the law it compares, and may be given.
SET_BY_THE_CHECK = ("max_tokens", "min_tokens", "n", "logprobs", "stop", "stop_token_ids",
                    "ignore_eos", "seed")  # fmt: skip
# A grammar ends outputs at lengths of its own; the check compares outputs of one length.
NOT_CHECKED = ("structured_outputs",)
SAMPLING = {
    n: d
    for n, o, d in options_of(SamplingParams)
    if o.flag and n not in SET_BY_THE_CHECK and n not in NOT_CHECKED
}


@dataclass
class CheckOptions:
    """The check's own options (``verify_exactness``' keywords, ``specbatch verify``'s flags)."""

    # fmt: off
    num_samples: int | None = option(None, "samples per side (default: enough to catch a "
        f"difference of {TARGET_TV:g} at every token)", type=int, ge=1, shown="an integer >= 1",
        metavar="N")
    tokens: int | None = option(None, "tokens per sample, the first from the prompt pass "
        "(never from the draft) (default: the draft length k + 2)", type=int, ge=2,
        shown="an integer >= 2", metavar="L")
    alpha: float = option(1e-3, "significance level: the false-alarm rate", gt=0, lt=1,
        metavar="A")
    seed: int = option(0, "seed of the runs", ge=0)
    # fmt: on


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _default_prompt(engine: LLMEngine) -> str | list[int]:
    if engine.tokenizer is not None:
        return DEFAULT_TEXT_PROMPT
    bos = getattr(engine.config.target.hf_config, "bos_token_id", None)
    return [bos] if _is_int(bos) and 0 <= bos < engine.config.target.vocab_size else [0]


def _sample(
    engine: LLMEngine,
    prompt_ids: list[int],
    params: Sequence[SamplingParams],
    desc: str | None,
) -> RunStats:
    """Add every request, step until all finish, keep the output sequences in request order."""
    ids = [engine.add_request(list(prompt_ids), p) for p in params]
    order = {rid: i for i, rid in enumerate(ids)}
    seqs: list[tuple[int, ...] | None] = [None] * len(ids)
    pending = set(ids)
    max_draft = 0
    bar = None
    if desc is not None:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    try:
        while pending:
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    seqs[order[out.request_id]] = tuple(out.outputs[0].token_ids)
                    max_draft = max([max_draft, *out.metrics.draft_lengths])
                    if bar is not None:
                        bar.update(1)
    except BaseException:
        engine.abort_request(list(pending))
        raise
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    s = engine.metrics.summary()
    return RunStats(
        seqs=[s for s in seqs if s is not None],
        seconds=seconds,
        acceptance_rate=s["acceptance_rate"],  # type: ignore[arg-type]
        mean_tokens_per_round=s["mean_tokens_per_round"],  # type: ignore[arg-type]
        spec_rounds=int(s["spec_rounds"] or 0),  # type: ignore[arg-type]
        max_draft_len=max_draft,
    )


def _drafter(engine: LLMEngine, asked: int | str | None) -> tuple[str, int, bool]:
    """What the engine speculates with: a description, its draft length k and whether k is
    ``auto``'s maximum; refuses an engine that does not speculate (``asked``: the draft length
    the caller gave)."""
    cfg, spec = engine.config, engine.config.speculative_config
    if not spec.speculative:
        if asked == 0:
            raise InvalidInputError(
                "num_speculative_tokens: verify needs speculation on (an integer >= 1 or auto)",
                "num_speculative_tokens",
            )
        raise InvalidInputError(NO_DRAFTER, "model")
    lookups = {"ngram": "prompt lookup", "suffix": "suffix trees",
               "self_sparse": "the target over a sparse view of its cache"}  # fmt: skip
    where = cfg.draft.path if cfg.draft is not None else lookups.get(spec.method, spec.method)
    return f"{spec.method}: {where}", spec.depth, spec.auto


def verify_exactness(
    model: str | None = None,
    draft_model: str | None = None,
    *,
    speculative_config: Mapping[str, Any] | str | None = None,
    num_speculative_tokens: int | str | None = None,
    num_samples: int | None = None,
    num_tokens: int | None = None,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    alpha: float = CheckOptions.alpha,
    seed: int = CheckOptions.seed,
    engine_kwargs: Mapping[str, Any] | None = None,
    reference_model: str | None = None,
    progress: bool = False,
    **sampling: Any,
) -> VerifyReport:
    """Compare speculative samples with as many plain samples of the target.

    ``model``, ``draft_model``, ``speculative_config`` and ``num_speculative_tokens`` mean what
    they mean to ``EngineArgs`` (none given: the built-in pair), except that no draft length
    given means ``DEFAULT_NUM_SPECULATIVE_TOKENS``, not auto; ``engine_kwargs`` are further
    ``EngineArgs`` fields for both engines (dtype, device, num_kv_blocks, max_model_len, ...).
    ``num_tokens`` defaults to k + 2 and ``num_samples`` to what catches a total-variation
    difference of ``TARGET_TV`` at every token. ``sampling``: ``SamplingParams`` fields of both
    runs (those of ``SAMPLING``: temperature, top_p, penalties...). ``reference_model``
    (default: the target) is the model of the plain run; pointing it at another model is how the
    test itself is tested.
    Speculative request ``i`` uses seed ``seed * 2 * num_samples + i`` and plain request ``i``
    seed ``... + num_samples + i``, so no two requests share a random stream.
    Raises ``InvalidInputError`` for bad arguments (and whatever the engines raise).
    """
    own = {"num_samples": num_samples, "tokens": num_tokens, "alpha": alpha, "seed": seed}
    check_options(CheckOptions, own)
    if prompt is not None and prompt_token_ids is not None:
        raise InvalidInputError(
            "prompt: give a prompt text or prompt_token_ids, not both", "prompt"
        )
    if model is not None and draft_model is None and speculative_config is None:
        raise InvalidInputError(NO_DRAFTER, "model")  # only the built-in target has its drafters
    unknown = sorted(set(sampling) - set(SAMPLING))
    if unknown:
        raise TypeError(f"verify_exactness() got unexpected keyword argument(s) {unknown}")
    sampling = {**SAMPLING, **sampling}
    SamplingParams(**sampling)  # check the values before loading anything
    extra = {k: v for k, v in (engine_kwargs or {}).items() if k not in RESERVED}
    args = EngineArgs(
        model=model,
        draft_model=draft_model,
        speculative_config=(
            dict(speculative_config)
            if isinstance(speculative_config, Mapping)
            else speculative_config
        ),
        num_speculative_tokens=num_speculative_tokens,
        seed=seed,
        **extra,
    )
    if args.speculative.num_speculative_tokens is None:  # a fixed k: every position exercised
        k = {"num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS}
        if args.speculative_config is not None:
            k = {"speculative_config": {**dataclasses.asdict(args.speculative), **k}}
        args = dataclasses.replace(args, **k)
    spec_engine = LLMEngine.from_engine_args(args)
    try:
        drafter, k, adaptive = _drafter(spec_engine, num_speculative_tokens)
        length = num_tokens if num_tokens is not None else k + 2
        n = num_samples if num_samples is not None else samples_for(TARGET_TV, length, alpha)

        def params(first_seed: int) -> list[SamplingParams]:
            return [
                SamplingParams(
                    **sampling,
                    max_tokens=length,
                    ignore_eos=True,
                    seed=(first_seed + i) % (1 << 63),
                )
                for i in range(n)
            ]

        base = seed * 2 * n
        if prompt is None and prompt_token_ids is None:
            given: str | list[int] = _default_prompt(spec_engine)
        else:
            given = prompt if prompt is not None else list(prompt_token_ids or [])
        field_name = "prompt_token_ids" if isinstance(given, list) else "prompt"
        text, ids = spec_engine.prepare_prompt(given, field=field_name)
        spec = _sample(spec_engine, ids, params(base), "speculative" if progress else None)
        target = spec_engine.config.target.path
    finally:
        spec_engine.shutdown()
    reference = reference_model or model
    plain_engine = LLMEngine.from_engine_args(
        EngineArgs(model=reference, num_speculative_tokens=0, seed=seed, **extra)
    )
    try:
        plain_engine.prepare_prompt(ids, field="prompt_token_ids")
        plain = _sample(plain_engine, ids, params(base + n), "plain" if progress else None)
    finally:
        plain_engine.shutdown()

    report = VerifyReport(
        model=target,
        draft_model=drafter,
        reference_model=target if reference_model is None else str(reference_model),
        num_speculative_tokens=k,
        adaptive=adaptive,
        prompt=text,
        prompt_token_ids=list(ids),
        num_samples=n,
        num_tokens=length,
        sampling=sampling,
        alpha=float(alpha),
        seed=seed,
        speculative=spec,
        plain=plain,
        comparison=None
        if sampling["temperature"] == 0
        else compare_positions(spec.seqs, plain.seqs, alpha),
    )
    add_notes(report)
    return report


__all__ = ["DEFAULT_TEXT_PROMPT", "RunStats", "VerifyReport", "format_report", "verify_exactness"]
