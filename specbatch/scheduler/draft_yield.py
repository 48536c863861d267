"""What a draft is expected to yield: acceptance rates leaning on their priors, and the tokens a
round of a chain or of a tree brings at those rates (THEORY.md). Plain Python."""

from __future__ import annotations

from collections.abc import Sequence

from specbatch.draft_shape import DraftShape

PRIOR_WEIGHT = 32.0  # pseudo-tests a rate leans on its prior with


def lean(accepted: float, tested: float, prior: float, weight: float = PRIOR_WEIGHT) -> float:
    """A rate's posterior mean, with ``weight`` pseudo-tests at ``prior``."""
    return (accepted + weight * prior) / (tested + weight)


def chain_tokens(alpha: float | Sequence[float], k: int) -> float:
    """Expected tokens a round of a k-draft chain accepted at ``alpha`` at every depth
    (THEORY.md's formula) or at ``alpha[d - 1]`` at depth d (the last rate for deeper ones)."""
    rates = [alpha] * k if isinstance(alpha, float | int) else alpha
    tokens = reach = 1.0
    for d in range(k):
        reach *= rates[min(d, len(rates) - 1)]
        tokens += reach
    return tokens


def tree_bound(alpha: float | Sequence[float], shape: DraftShape) -> float:
    """Tokens a round of a tree, were its levels accepted independently with ``b`` children
    each (an upper bound: siblings are correlated)."""
    b = max(1.0, min(shape.topk, shape.nodes / max(shape.depth, 1)))
    rates = [alpha] if isinstance(alpha, float | int) else alpha
    return chain_tokens([1.0 - (1.0 - a) ** b for a in rates], shape.depth)
