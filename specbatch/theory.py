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


def expected_woken_experts(rows: float, num_experts: int, top_k: int) -> float:
    """E * (1 - (1 - k/E)^rows): the experts of one layer that ``rows`` rows wake when each
    picks ``top_k`` of ``num_experts`` uniformly and independently of the others."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def moe_verify_cost(
    batch: int, gamma: float, num_experts: int, top_k: int, fixed_bytes: float, expert_bytes: float
) -> float:
    """A verify pass over a plain step, both reading weights only (memory-bound): the weights
    every step reads (``fixed_bytes``: attention, norms, head, dense MLPs) plus one expert's
    bytes over all sparse layers (``expert_bytes``) per expert woken, by ``batch`` rows in the
    plain step and ``batch * (gamma + 1)`` in the verify pass. A dense model's is 1."""

    def step(rows: float) -> float:
        return fixed_bytes + expected_woken_experts(rows, num_experts, top_k) * expert_bytes

    return step(batch * (gamma + 1.0)) / step(batch)
