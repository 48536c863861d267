"""The plans ``auto`` prices at a replan (``AdaptiveDraftLength.choose``), built all at once.

Both families start from ``gains`` ``[J, n]``: the chance that request i's j-th draft and every
draft before it are accepted, so the tokens a draft adds to a round's expected output.

* Uniform plans: every request ``min(G, cap_i)``, for G = 0 .. J.
* Per-request plans: every allowed draft (j, i), sorted by decreasing gain (ties: shallower
  first); for each deepest draft position G, every prefix of that order restricted to j < G.
  A request's drafts come in order of position, as gains fall along a round.

Each plan carries what the cost model prices (``StepCostModel.predict``): its expected tokens,
the draft's catch-up tokens in its first pass (``lag_i`` for each request that drafts), its
drafts in all, and the requests in each draft pass after the first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class CandidatePlans:
    """Plans ``[P]``: expected tokens (-inf: not a plan), catch-up tokens, drafts in all, and
    requests per draft pass 2.. (``sizes``, ``[P, J - 1]``)."""

    tokens: np.ndarray
    catchup: np.ndarray
    drafts: np.ndarray
    sizes: np.ndarray

    @staticmethod
    def concat(*plans: CandidatePlans) -> CandidatePlans:
        return CandidatePlans(
            *(np.concatenate([getattr(p, f.name) for p in plans]) for f in fields(CandidatePlans))
        )


def uniform_plans(
    gains: np.ndarray, cap: np.ndarray, lag: np.ndarray
) -> tuple[np.ndarray, CandidatePlans]:
    """The gammas ``[J + 1, n]`` of the uniform plans (row G: every request ``min(G, cap)``)
    and the plans."""
    g_max, n = gains.shape
    gammas = np.minimum(np.arange(g_max + 1)[:, None], cap[None, :])
    expected = np.vstack([np.ones(n), 1 + np.cumsum(gains, axis=0)])  # [g, i]: E(tokens)
    plans = CandidatePlans(
        tokens=np.take_along_axis(expected, gammas, axis=0).sum(axis=1),
        catchup=(lag[None, :] * (gammas > 0)).sum(axis=1),
        drafts=gammas.sum(axis=1),
        sizes=(gammas[:, :, None] >= np.arange(2, g_max + 1)[None, None, :]).sum(axis=1),
    )
    return gammas, plans


@dataclass(frozen=True)
class PerRequestPlans:
    """The per-request plans, ``[G, prefix]`` flattened in ``plans``; a prefix that ends at a
    draft beyond G repeats an earlier plan, and its tokens are -inf."""

    pos_j: np.ndarray  # the sorted drafts' positions (0: a request's first draft)
    pos_i: np.ndarray  # and requests
    plans: CandidatePlans

    def gammas(self, deepest: int, prefix: int, n: int) -> np.ndarray:
        """The gammas of the plan at deepest position ``deepest`` ending at draft ``prefix``."""
        taken = self.pos_i[: prefix + 1][self.pos_j[: prefix + 1] < deepest]
        return np.bincount(taken, minlength=n)


def per_request_plans(gains: np.ndarray, cap: np.ndarray, lag: np.ndarray) -> PerRequestPlans:
    g_max, n = gains.shape
    pos_j, pos_i = np.nonzero(np.arange(1, g_max + 1)[:, None] <= cap[None, :])
    gain = gains[pos_j, pos_i]
    order = np.argsort(-gain, kind="stable")
    pos_j, pos_i, gain = pos_j[order], pos_i[order], gain[order]
    within = pos_j[None, :] < np.arange(1, g_max + 1)[:, None]  # [G, K]
    first = np.where(pos_j == 0, lag[pos_i], 0.0)
    deeper = pos_j[:, None] == np.arange(1, g_max)[None, :]  # [K, J - 1]: passes 2..
    tokens = n + np.cumsum(within * gain, axis=1)
    plans = CandidatePlans(
        tokens=np.where(within, tokens, -np.inf).ravel(),
        catchup=np.cumsum(within * first, axis=1).ravel(),
        drafts=np.cumsum(within, axis=1).ravel(),
        sizes=np.cumsum(within[:, :, None] & deeper[None], axis=1).reshape(within.size, g_max - 1),
    )
    return PerRequestPlans(pos_j, pos_i, plans)
