"""The shape of one request's drafts in one round: a chain of ``k`` tokens, or a tree.

A tree of depth ``depth`` grows ``topk`` children per expanded node, expands the ``topk`` best
nodes of each depth (one drafter pass per depth), and keeps its ``nodes`` best nodes for the
target to verify. A chain is the tree with ``topk == 1`` and ``nodes == depth``. Plain data,
no torch: the scheduler reserves slots and budget from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftShape:
    depth: int = 0  # the longest path: at most depth + 1 tokens a round
    topk: int = 1  # children per expanded node
    nodes: int = 0  # draft tokens the target verifies

    @staticmethod
    def chain(k: int) -> DraftShape:
        return DraftShape(k, 1, k)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def lookahead(self) -> int:
        """Slots past the last known token: the target's nodes, and the drafter's passes over
        the nodes it expands (``topk`` per depth after the first)."""
        return max(self.nodes, self.topk * (self.depth - 1))

    def fit(self, room: int) -> DraftShape:
        """This shape within ``room`` slots (and tokens) past the last known token: itself, or
        as deep and as large as fits with the same children per node (none when nothing
        does)."""
        if self.lookahead <= room and self.depth <= room:
            return self
        depth = min(self.depth, room)
        if not self.is_chain:
            depth = min(depth, room // self.topk + 1)
        nodes = min(self.nodes, room, depth if self.is_chain else self.nodes)
        if depth < 1 or nodes < 1:
            return DraftShape()
        return DraftShape(depth, self.topk, nodes)

    def draws(self, sampled: bool) -> tuple[int, int]:
        """Uniforms one sampled request draws in a round with this shape: (for drafting, for
        verifying). A chain: one per draft, then one per draft and the final token. A tree:
        its children drawn without replacement (``sampled``) or chosen as the top ``topk``,
        then verified by recursive rejection sampling (one per candidate and one more per
        level) or by the walk (one per level)."""
        if self.nodes == 0:
            return 0, 1
        if self.is_chain:
            return self.depth, self.depth + 1
        if sampled:
            k = self.topk
            return k + (self.depth - 1) * k * k, (self.depth + 1) * (k + 1)
        return 0, self.depth + 1

    def __str__(self) -> str:
        if self.is_chain:
            return str(self.depth)
        return f"{self.depth}x{self.topk}/{self.nodes}"
