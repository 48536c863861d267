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
from dataclasses import dataclass, field
from typing import Any

from specbatch.config import EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.errors import InvalidInputError
from specbatch.sampling_params import SamplingParams
from specbatch.stats import chi_square_two_sample

DEFAULT_TEXT_PROMPT = "Once upon a time"
MIN_EXPECTED = 5.0  # sequences expected fewer times than this in a sample are pooled


@dataclass
class RunStats:
    """One side of the comparison."""

    counts: Counter[tuple[int, ...]]
    seconds: float
    acceptance_rate: float | None = None
    mean_tokens_per_round: float | None = None
    spec_rounds: int = 0
    max_draft_len: int = 0


@dataclass
class VerifyReport:
    model: str
    draft_model: str
    reference_model: str
    num_speculative_tokens: int
    prompt: str | None
    prompt_token_ids: list[int]
    num_samples: int
    num_tokens: int
    sampling: dict[str, float | int]
    alpha: float
    seed: int
    distinct_speculative: int
    distinct_plain: int
    distinct_total: int
    bins: int
    statistic: float
    dof: int
    p_value: float
    acceptance_rate: float | None
    mean_tokens_per_round: float | None
    spec_rounds: int
    max_draft_len: int
    speculative_seconds: float
    plain_seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def inconclusive(self) -> bool:
        """The test had no power: everything pooled into one bin, or the draft never ran."""
        return (self.dof == 0 and self.distinct_total > 1) or self.spec_rounds == 0

    @property
    def passed(self) -> bool:
        return not self.inconclusive and self.p_value >= self.alpha

    @property
    def verdict(self) -> str:
        if self.inconclusive:
            return "INCONCLUSIVE"
        return "PASS" if self.passed else "FAIL"


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
    draft_model: str,
    *,
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
    for reserved in ("model", "draft_model", "num_speculative_tokens", "seed"):
        extra.pop(reserved, None)

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
        EngineArgs(
            model=model,
            draft_model=draft_model,
            num_speculative_tokens=num_speculative_tokens,
            seed=seed,
            **extra,
        )
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
        draft_model=str(draft_model),
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
        acceptance_rate=spec.acceptance_rate,
        mean_tokens_per_round=spec.mean_tokens_per_round,
        spec_rounds=spec.spec_rounds,
        max_draft_len=spec.max_draft_len,
        speculative_seconds=spec.seconds,
        plain_seconds=plain.seconds,
    )
    _add_notes(report)
    return report


def _add_notes(r: VerifyReport) -> None:
    if r.spec_rounds == 0:
        r.notes.append("the draft was never used, so this run says nothing about speculation")
    elif r.max_draft_len < r.num_speculative_tokens:
        r.notes.append(
            f"rounds proposed at most {r.max_draft_len} of the {r.num_speculative_tokens} draft "
            f"tokens (the first token comes from the prompt pass and a round never proposes past "
            f"--tokens); use --tokens {r.num_speculative_tokens + 2} to exercise every position"
        )
    if r.dof == 0 and r.distinct_total > 1:
        r.notes.append(
            f"every sequence was expected fewer than {MIN_EXPECTED:g} times, so all were pooled "
            "into one bin and the test has no power: use fewer --tokens, a lower --temperature, "
            "a more specific prompt or more --num-samples"
        )
    elif r.distinct_total > 2 * r.bins:
        r.notes.append(
            f"{r.distinct_total} distinct sequences fell into {r.bins} bins: most are rare, which "
            "costs the test power; fewer --tokens or more --num-samples help"
        )


def format_report(r: VerifyReport) -> str:
    """The human-readable report that ``specbatch verify`` prints."""
    s = r.sampling
    prompt = repr(r.prompt) if r.prompt is not None else f"token ids {r.prompt_token_ids}"
    ref = "" if r.reference_model == r.model else f" (plain run: {r.reference_model})"
    acc = "n/a" if r.acceptance_rate is None else f"{r.acceptance_rate:.3f}"
    tpr = "n/a" if r.mean_tokens_per_round is None else f"{r.mean_tokens_per_round:.3f}"
    p_text = f"{r.p_value:.4g}"
    lines = [
        "specbatch verify: do speculative and plain decoding sample the same distribution?",
        f"  target              {r.model}{ref}",
        f"  draft               {r.draft_model} (k = {r.num_speculative_tokens})",
        f"  prompt              {prompt} ({len(r.prompt_token_ids)} tokens)",
        f"  sampling            temperature={s['temperature']} top_p={s['top_p']} "
        f"top_k={s['top_k']} min_p={s['min_p']}, {r.num_tokens} tokens each, ignore_eos",
        f"  samples             {r.num_samples} speculative + {r.num_samples} plain "
        f"(seed {r.seed}, one seed per request)",
        f"  distinct sequences  {r.distinct_speculative} speculative, {r.distinct_plain} plain, "
        f"{r.distinct_total} together",
        f"  bins after pooling  {r.bins} (sequences expected < {MIN_EXPECTED:g} times pooled)",
        f"  chi-square          statistic {r.statistic:.3f}, dof {r.dof}, p-value {p_text}",
        f"  speculation         acceptance rate {acc}, {tpr} tokens per round, "
        f"{r.spec_rounds} rounds, draft length up to {r.max_draft_len}",
        f"  time                speculative {r.speculative_seconds:.1f} s, "
        f"plain {r.plain_seconds:.1f} s",
    ]
    lines += [f"  note: {n}" for n in r.notes]
    lines.append("")
    if r.inconclusive:
        lines.append("INCONCLUSIVE: the test could not tell anything here (see the note).")
    elif r.passed:
        lines.append(f"PASS (p-value {p_text} >= alpha {r.alpha:g})")
    else:
        lines.append(f"FAIL (p-value {p_text} < alpha {r.alpha:g})")
    lines.append(
        "What this means: the test asks whether the two samples could come from one "
        "distribution.\n"
        f"An exact engine fails it by chance only, with probability alpha = {r.alpha:g} "
        f"(1 run in {1 / r.alpha:.0f}).\n"
        "A FAIL is strong evidence that speculation changed the output distribution for this "
        "pair and\nthese settings, i.e. a bug; rerun with another --seed to rule out bad luck. "
        "A PASS means no\ndifference was detected at this sample size; it cannot prove "
        "exactness (more --num-samples\ndetect smaller differences)."
    )
    return "\n".join(lines)
