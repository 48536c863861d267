"""What ``specbatch verify`` found: the report of one comparison, its verdict, and how it reads.

The verdict: FAIL when the Bonferroni p-value is below alpha (or, greedy, when a sequence is
seen on one side only); INCONCLUSIVE when the draft never ran, nothing could be compared, or
the smallest total-variation difference caught with probability ``POWER`` is above
``USEFUL_TV``; PASS otherwise.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from specbatch.sequence_stats import MAX_CELLS, SequenceComparison, samples_for

POWER = 0.9  # the probability at which the report states the detectable difference
TARGET_TV = 0.05  # what the default number of samples catches at every token
USEFUL_TV = 0.2  # a test that cannot catch this much says nothing: INCONCLUSIVE
MOSTLY_POOLED = 0.5  # a token whose pooled cell holds more than this gets a note


@dataclass
class RunStats:
    """One side of the comparison."""

    seqs: list[tuple[int, ...]]
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
    adaptive: bool
    prompt: str | None
    prompt_token_ids: list[int]
    num_samples: int
    num_tokens: int
    sampling: dict[str, float | int]
    alpha: float
    seed: int
    speculative: RunStats
    plain: RunStats
    comparison: SequenceComparison | None  # None: greedy, the sequences are compared as sets
    notes: list[str] = field(default_factory=list)

    @property
    def greedy_mismatches(self) -> int:
        """Samples whose sequence the other side never produced (greedy decoding)."""
        a, b = set(self.speculative.seqs), set(self.plain.seqs)
        return sum(s not in b for s in self.speculative.seqs) + sum(
            s not in a for s in self.plain.seqs
        )

    @property
    def p_value(self) -> float | None:
        return None if self.comparison is None else self.comparison.p_value

    @property
    def detectable_tv(self) -> float | None:
        return None if self.comparison is None else self.comparison.detectable_tv

    @property
    def verdict(self) -> str:
        if self.speculative.spec_rounds == 0:
            return "INCONCLUSIVE"
        if self.comparison is None:
            return "FAIL" if self.greedy_mismatches else "PASS"
        if self.comparison.p_value < self.alpha:
            return "FAIL"
        tv = self.detectable_tv
        return "INCONCLUSIVE" if tv is None or tv > USEFUL_TV else "PASS"

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"


def add_notes(r: VerifyReport) -> None:
    k = r.num_speculative_tokens
    if r.speculative.spec_rounds == 0:
        r.notes.append("the draft was never used, so this run says nothing about speculation")
    elif r.speculative.max_draft_len < k:
        r.notes.append(
            f"rounds proposed at most {r.speculative.max_draft_len} of the {k} draft tokens "
            "(the first token comes from the prompt pass and a round never proposes past "
            f"--tokens); use --tokens {k + 2} to exercise every position"
        )
    if r.comparison is None:
        return
    pooled = [p.position + 1 for p in r.comparison.positions if p.pooled_share > MOSTLY_POOLED]
    if pooled:
        r.notes.append(
            f"at token {', '.join(map(str, pooled))} most samples are rare continuations pooled "
            "into one cell, where a difference among them alone is invisible; a lower "
            "--temperature, a --top-k or a more specific --prompt let the cells cover more"
        )


def _verdict_line(r: VerifyReport) -> str:
    c = r.comparison
    if r.verdict == "INCONCLUSIVE" and r.speculative.spec_rounds == 0:
        return "INCONCLUSIVE: the draft never ran (see the note)."
    if c is None:
        if r.greedy_mismatches:
            return (
                f"FAIL: {r.greedy_mismatches} of {2 * r.num_samples} greedy samples are "
                "sequences the other side never produced"
            )
        return "PASS: with and without speculation, greedy decoding gave the same sequences"
    p_text = f"p-value {c.p_value:.3g}"
    tv = c.detectable_tv
    caught = (
        f"a total-variation difference of {tv:.3f} or more at any token would have been caught "
        f"with probability {POWER:g}"
    )
    if r.verdict == "FAIL":
        worst = c.worst_position
        where = "" if worst is None else f", at token {worst.position + 1}"
        return f"FAIL ({p_text} < alpha {r.alpha:g}{where})"
    if tv is None:
        return (
            "INCONCLUSIVE: every token fell into one cell, so nothing could be compared; use "
            "more --num-samples, a higher --temperature or another --prompt"
        )
    if r.verdict == "INCONCLUSIVE":
        needed = samples_for(TARGET_TV, len(c.positions), r.alpha, POWER)
        return (
            f"INCONCLUSIVE ({p_text}): only {caught}; use --num-samples {needed} (the default) "
            f"to catch {TARGET_TV:g}"
        )
    return f"PASS ({p_text} >= alpha {r.alpha:g}): {caught}"


def _position_table(c: SequenceComparison) -> list[str]:
    lines = ["  token  cells  pooled  chi-square  p-value  catches TV"]
    for p in c.positions:
        tv = "-" if p.detectable_tv is None else f"{p.detectable_tv:.3f}"
        lines.append(
            f"  {p.position + 1:5d}  {p.cells:5d}  {p.pooled_share:6.1%}  {p.statistic:10.2f}  "
            f"{p.p_value:7.3g}  {tv:>10}"
        )
    m = len(c.positions)
    lines.append(
        f"  (each token's law given its prefix bin, in at most {MAX_CELLS} cells; each token is "
        f"tested at alpha / {m},\n   and the p-value is the smallest of the {m} times {m})"
    )
    return lines


def format_report(r: VerifyReport) -> str:
    """The human-readable report that ``specbatch verify`` prints."""
    spec = r.speculative
    defaults = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    sampling = " ".join(
        f"{k}={v}" for k, v in r.sampling.items() if k not in defaults or v != defaults[k]
    )
    prompt = repr(r.prompt) if r.prompt is not None else f"token ids {r.prompt_token_ids}"
    ref = "" if r.reference_model == r.model else f" (plain run: {r.reference_model})"
    acc = "n/a" if spec.acceptance_rate is None else f"{spec.acceptance_rate:.3f}"
    tpr = "n/a" if spec.mean_tokens_per_round is None else f"{spec.mean_tokens_per_round:.3f}"
    k = f"auto, up to {r.num_speculative_tokens}" if r.adaptive else r.num_speculative_tokens
    lines = [
        "specbatch verify: do speculative and plain decoding sample the same distribution?",
        f"  target              {r.model}{ref}",
        f"  draft               {r.draft_model} (k = {k})",
        f"  prompt              {prompt} ({len(r.prompt_token_ids)} tokens)",
        f"  sampling            {sampling}, {r.num_tokens} tokens each, ignore_eos",
        f"  samples             {r.num_samples} speculative + {r.num_samples} plain "
        f"(seed {r.seed}, one seed per request)",
        f"  distinct sequences  {len(set(spec.seqs))} speculative, {len(set(r.plain.seqs))} plain",
        f"  speculation         acceptance rate {acc}, {tpr} tokens per round, "
        f"{spec.spec_rounds} rounds, draft length up to {spec.max_draft_len}",
        f"  time                speculative {spec.seconds:.1f} s, plain {r.plain.seconds:.1f} s",
    ]
    if r.comparison is not None:
        lines += ["", *_position_table(r.comparison)]
    for note in r.notes:
        lines += textwrap.wrap(f"note: {note}", 96, initial_indent="  ", subsequent_indent="    ")
    lines += ["", _verdict_line(r)]
    lines.append(
        "What this means: the test asks whether the two samples could come from one "
        "distribution.\n"
        f"An exact engine fails it by chance only, with probability at most alpha = {r.alpha:g} "
        f"(1 run in {1 / r.alpha:.0f}).\n"
        "A FAIL is strong evidence that speculation changed the output distribution for this "
        "pair and\nthese settings, i.e. a bug; rerun with another --seed to rule out bad luck. "
        "A PASS means no\ndifference was detected; it cannot prove exactness (more "
        "--num-samples detect smaller differences)."
    )
    return "\n".join(lines)
