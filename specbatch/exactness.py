"""A statistical check that speculative decoding is exact on a model pair (``specbatch verify``).

Speculative decoding must leave the target's output distribution unchanged, whatever the draft
(THEORY.md). ``verify_exactness`` samples ``num_samples`` continuations of ``num_tokens`` tokens
of one prompt with speculation (target + draft) and as many without it (the target alone), each
request with its own seed, counts whole sequences, and runs a chi-square homogeneity test on
the two tables of counts. Under exactness the p-value is uniform, so the test fails by chance
with probability ``alpha``.

The first token of every request comes from the prompt pass, without the draft, and a round
never proposes past ``max_tokens``: with ``num_tokens`` L the draft proposes at most L - 2
tokens a round, so ``L >= k + 2`` is needed to exercise every draft position.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from specbatch.config import EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import InvalidInputError
from specbatch.exactness_report import (
    MIN_EXPECTED,
    POWER,
    RunStats,
    VerifyReport,
    add_notes,
    format_report,
)
from specbatch.sampling_params import SamplingParams
from specbatch.stats import chi_square_two_sample, detectable_tv

DEFAULT_TEXT_PROMPT = "Once upon a time"


def _check(name: str, ok: bool, limit: str, value: Any) -> None:
    if not ok:
        raise InvalidInputError(f"{name} must be {limit}, got {value!r}")


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
    """Add every request, step until all finish, count the output sequences."""
    ids = [engine.add_request(list(prompt_ids), p) for p in params]
    pending = set(ids)
    counts: Counter[tuple[int, ...]] = Counter()
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
                    counts[tuple(out.outputs[0].token_ids)] += 1
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
        counts=counts,
        seconds=seconds,
        acceptance_rate=s["acceptance_rate"],  # type: ignore[arg-type]
        mean_tokens_per_round=s["mean_tokens_per_round"],  # type: ignore[arg-type]
        spec_rounds=int(s["spec_rounds"] or 0),  # type: ignore[arg-type]
        max_draft_len=max_draft,
    )


def verify_exactness(
    model: str,
    draft_model: str | None = None,
    *,
    speculative_config: Mapping[str, Any] | None = None,
    num_speculative_tokens: int = 4,
    num_samples: int = 2000,
    num_tokens: int = 3,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    alpha: float = 1e-3,
    seed: int = 0,
    engine_kwargs: Mapping[str, Any] | None = None,
    reference_model: str | None = None,
    progress: bool = False,
) -> VerifyReport:
    """Compare ``num_samples`` speculative samples with as many plain samples of the target.

    The drafter is ``draft_model``, or ``speculative_config`` (any method; its
    ``num_speculative_tokens`` wins over the argument).
    ``engine_kwargs`` are further ``EngineArgs`` fields for both engines (dtype, device,
    num_kv_blocks, max_model_len, ...). ``reference_model`` (default: ``model``) is the model of
    the plain run; pointing it at another model is how the test itself is tested. Speculative
    request ``i`` uses seed ``seed * 2 * num_samples + i`` and plain request ``i`` seed
    ``... + num_samples + i``, so no two requests share a random stream.
    Raises ``InvalidInputError`` for bad arguments (and whatever the engines raise).
    """
    _check("num_samples", _is_int(num_samples) and num_samples >= 1, "an integer >= 1", num_samples)
    _check(
        "tokens",
        _is_int(num_tokens) and num_tokens >= 2,
        "an integer >= 2 (the first token comes from the prompt pass, never from the draft)",
        num_tokens,
    )
    _check("alpha", isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0, "in (0, 1)", alpha)
    _check("seed", _is_int(seed) and seed >= 0, "an integer >= 0", seed)
    _check(
        "num_speculative_tokens",
        _is_int(num_speculative_tokens) and num_speculative_tokens >= 1,
        "an integer >= 1",
        num_speculative_tokens,
    )
    if prompt is not None and prompt_token_ids is not None:
        raise InvalidInputError("prompt: give a prompt text or prompt_token_ids, not both")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    SamplingParams(**sampling)  # check the values before loading anything
    extra = dict(engine_kwargs or {})
    for reserved in (
        "model",
        "draft_model",
        "num_speculative_tokens",
        "seed",
        "speculative_config",
    ):
        extra.pop(reserved, None)
    if (draft_model is None) == (speculative_config is None):
        raise InvalidInputError("verify: give a draft_model or a speculative_config (one)")
    drafter = dict(speculative_config or {"method": "draft_model", "model": draft_model})
    drafter.setdefault("num_speculative_tokens", num_speculative_tokens)
    num_speculative_tokens = drafter["num_speculative_tokens"]

    def params(first_seed: int) -> list[SamplingParams]:
        return [
            SamplingParams(
                **sampling,
                max_tokens=num_tokens,
                ignore_eos=True,
                seed=(first_seed + i) % (1 << 63),
            )
            for i in range(num_samples)
        ]

    base = seed * 2 * num_samples
    spec_engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, speculative_config=drafter, seed=seed, **extra)
    )
    try:
        if prompt is None and prompt_token_ids is None:
            given: str | list[int] = _default_prompt(spec_engine)
        else:
            given = prompt if prompt is not None else list(prompt_token_ids or [])
        field_name = "prompt_token_ids" if isinstance(given, list) else "prompt"
        text, ids = spec_engine.prepare_prompt(given, field=field_name)
        spec = _sample(spec_engine, ids, params(base), "speculative" if progress else None)
    finally:
        spec_engine.shutdown()
    plain_engine = LLMEngine.from_engine_args(
        EngineArgs(model=reference_model or model, seed=seed, **extra)
    )
    try:
        plain_engine.prepare_prompt(ids, field="prompt_token_ids")
        plain = _sample(
            plain_engine, ids, params(base + num_samples), "plain" if progress else None
        )
    finally:
        plain_engine.shutdown()

    result = chi_square_two_sample(spec.counts, plain.counts, min_expected=MIN_EXPECTED)
    report = VerifyReport(
        model=str(model),
        draft_model=f"{drafter['method']}: {drafter.get('model') or 'built-in'}",
        reference_model=str(reference_model or model),
        num_speculative_tokens=num_speculative_tokens,
        prompt=text,
        prompt_token_ids=list(ids),
        num_samples=num_samples,
        num_tokens=num_tokens,
        sampling=sampling,
        alpha=float(alpha),
        seed=seed,
        distinct_speculative=len(spec.counts),
        distinct_plain=len(plain.counts),
        distinct_total=len(set(spec.counts) | set(plain.counts)),
        bins=result.bins,
        statistic=result.statistic,
        dof=result.dof,
        p_value=result.p_value,
        pooled_mass=result.pooled_mass,
        detectable_tv=(
            detectable_tv(num_samples / 2, result.dof, alpha, POWER) + result.pooled_mass
            if result.dof > 0
            else None
        ),
        acceptance_rate=spec.acceptance_rate,
        mean_tokens_per_round=spec.mean_tokens_per_round,
        spec_rounds=spec.spec_rounds,
        max_draft_len=spec.max_draft_len,
        speculative_seconds=spec.seconds,
        plain_seconds=plain.seconds,
    )
    add_notes(report)
    return report


__all__ = ["DEFAULT_TEXT_PROMPT", "RunStats", "VerifyReport", "format_report", "verify_exactness"]
