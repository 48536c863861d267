"""What ``specbatch verify`` found: the report of one comparison, and how it reads.

Power: the two samples of N sequences each act like one of N / 2 in a goodness-of-fit test, so
by ``specbatch.stats.power`` the test catches any difference of total variation
``detectable_tv`` between the two distributions (over its bins; a difference hidden inside the
pooled bin is added to it) with probability 0.9.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MIN_EXPECTED = 5.0  # sequences expected fewer times than this in a sample are pooled
POWER = 0.9  # the probability at which the report states the detectable difference


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
    pooled_mass: float  # share of the samples in the pooled bin
    detectable_tv: float | None  # caught with probability POWER; None: no test was possible
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


def add_notes(r: VerifyReport) -> None:
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
    power_text = (
        "none (one bin)"
        if r.detectable_tv is None
        else f"a total-variation difference >= {r.detectable_tv:.3f} between the two "
        f"distributions is caught with probability {POWER:g}"
    )
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
        f"  bins after pooling  {r.bins} (sequences expected < {MIN_EXPECTED:g} times pooled: "
        f"{r.pooled_mass:.1%} of the samples)",
        f"  chi-square          statistic {r.statistic:.3f}, dof {r.dof}, p-value {p_text}",
        f"  power               {power_text}",
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
