"""Where a model drafter's drafts grow from: each drafting request's root (its logits at the
last known token once the drafter has caught up, with the key index and block table its drafts
are written at), and the drafter's pass that grows chains (draft_loop.py) and trees
(draft_tree.py) from the roots a depth at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from specbatch.worker.model_runner import ForwardInputs

# One drafter pass: (tokens [R], the state of each row's parent or None, the inputs) ->
# (the state of each row, float32 logits [R, V])
DraftPass = Callable[
    [torch.Tensor, torch.Tensor | None, ForwardInputs], tuple[torch.Tensor | None, torch.Tensor]
]


@dataclass
class Roots:
    """The drafting requests after the drafter's catch-up: their logits at the last known token."""

    index: list[int]  # their indices among the step's sampling requests
    logits: torch.Tensor  # float32 [A, V]
    state: torch.Tensor | None  # [A, F]: what the next pass reads beside a token (EAGLE)
    base: list[int]  # the key index of each one's first draft pass
    blocks: list[list[int]]  # their block tables

    @cached_property
    def tables(self) -> torch.Tensor:
        """int64 [A, W]: the block tables, padded to one width."""
        return padded_tables(self.blocks, self.logits.device)


def padded_tables(blocks: list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 [A, W]: block tables padded with 0 to the longest one's width."""
    w = max(map(len, blocks), default=1) or 1
    padded = [t + [0] * (w - len(t)) for t in blocks]
    return torch.tensor(padded, dtype=torch.int64).to(device)
