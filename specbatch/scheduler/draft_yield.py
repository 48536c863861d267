"""What a draft is expected to yield: acceptance rates leaning on their priors, and the tokens a
round of a chain or of a tree brings at those rates (THEORY.md). Plain Python."""

from __future__ import annotations

from specbatch.draft_shape import DraftShape

PRIOR_WEIGHT = 32.0  # pseudo-tests a rate leans on its prior with


def lean(accepted: float, tested: float, prior: float, weight: float = PRIOR_WEIGHT) -> float:
    """A rate's posterior mean, with ``weight`` pseudo-tests at ``prior``."""
    return (accepted + weight * prior) / (tested + weight)


def chain_tokens(alpha: float, k: int) -> float:
    """Expected tokens a round of a k-draft chain accepted at ``alpha`` (THEORY.md)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tree_bound(alpha: float, shape: DraftShape) -> float:
    """Tokens a round of a tree, were its levels accepted independently with ``b`` children
    each (an upper bound: siblings are correlated)."""
    b = max(1.0, min(shape.topk, shape.nodes / max(shape.depth, 1)))
    return chain_tokens(1.0 - (1.0 - alpha) ** b, shape.depth)
