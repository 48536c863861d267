"""What a drafter proposes: each request's draft nodes, their parents (a tree) and, when they
were sampled, the law q each node's children were drawn from; the verifier needs only these
and p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """Request b's draft nodes ``1 .. counts[b]`` are ``tokens[b, :counts[b]]`` (node j at column
    j - 1; node 0 is the request's last known token, the root). ``parents[b, j - 1]`` is node j's
    parent, always a lower index, siblings in the order they were drawn; None: chains (node j's
    parent is j - 1). ``probs[b, j]`` is q at node j, the law its children were drawn from
    without replacement; None: the children were not sampled (argmaxes, top-k, or a lookup)."""

    tokens: torch.Tensor  # int64 [B, N]; padding 0
    counts: list[int]
    probs: torch.Tensor | None = None  # [B, N, V]
    parents: torch.Tensor | None = None  # int64 [B, N]

    @staticmethod
    def empty(batch: int, device: torch.device, width: int = 0) -> Proposal:
        tokens = torch.zeros((batch, width), dtype=torch.int64, device=device)
        return Proposal(tokens, [0] * batch)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None
