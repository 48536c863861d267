"""THEORY.md's first-order model of speculative decoding, in one place."""

from __future__ import annotations


def expected_tokens_per_round(alpha: float, gamma: float) -> float:
    """E[tokens per round] = (1 - a^(g+1)) / (1 - a): accepted drafts plus the one emitted token,
    when each of ``gamma`` drafts is accepted independently with probability ``alpha``."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: float, c: float, verify_cost: float = 1.0) -> float:
    """S = E[tokens] / (gamma * c + verify_cost) over plain decoding, with ``c`` a draft pass over a
    target pass. THEORY.md takes ``verify_cost`` = 1 (scoring gamma + 1 tokens costs one step);
    pass the measured ratio to see how much of a gap that assumption explains."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + verify_cost)
