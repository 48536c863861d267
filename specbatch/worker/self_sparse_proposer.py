"""Self-speculation over a sparse view of the target's own KV cache (MagicDec): the target's
own layers draft, each pass attending only to the request's first ``sinks`` and last ``window``
keys (``sparse_view.py``). No draft weights, no KV cache of its own, no training.

Each drafting request's root (its last known token, position P) runs first, then one pass per
depth grows a chain or a tree (draft_loop.py, draft_tree.py). The passes write their K/V into the
target's cache at the lookahead slots P .. (which the scheduler reserves for the round): the
target's verification pass, which follows in the same step, overwrites P .. P + nodes, and any
slot past those lies beyond the tokens the round can accept. Slots before P are only read.

The scheduler gives drafts only to requests with one token to process (their root), so the
target has computed every position the view reads.
"""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.worker.draft_loop import drafting, grow
from specbatch.worker.draft_roots import Roots
from specbatch.worker.model_runner import ForwardInputs, ModelRunner, build_inputs
from specbatch.worker.proposal import Proposal
from specbatch.worker.proposer import Drafter, DraftRound
from specbatch.worker.sparse_view import sparse_view


class SelfSparseProposer(Drafter):
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        tp: TensorParallelGroup,
        target: ModelRunner,
    ) -> None:
        self.config = config
        self.device = device
        self.target = target  # not ``runner``: the worker reads that name as a draft model's
        spec = config.speculative_config
        self.sinks, self.window = spec.sinks, spec.window

    def attention(self) -> tuple[torch.nn.Module, object, int]:
        return self.target.model, self.target.backend, self.sinks + self.window

    def propose(self, step: DraftRound) -> Proposal:
        active = drafting(step)
        if not active:
            return step.empty_proposal(self.device)
        reqs = [step.sampling[i] for i in active]
        bs = self.config.block_size
        inputs = build_inputs(
            torch.tensor([r.target_token_ids[0] for r in reqs], dtype=torch.int64,
                         device=self.device),
            [1] * len(reqs),
            [r.target_start for r in reqs],
            [r.block_table for r in reqs],
            bs,
            self.device,
        )  # fmt: skip
        _, logits = self._pass(inputs.input_ids, None, inputs)
        step.note("catch-up", len(reqs))
        roots = Roots(
            active,
            logits,
            None,
            [r.target_start + 1 for r in reqs],
            [r.block_table for r in reqs],
        )
        sampled = self.config.speculative_config.tree_children == "sampled"
        return grow(step, roots, self._pass, bs, sampled)

    def _pass(
        self, tokens: torch.Tensor, state: torch.Tensor | None, inputs: ForwardInputs
    ) -> tuple[None, torch.Tensor]:
        view = sparse_view(inputs.meta, self.sinks, self.window, self.config.block_size)
        rows = torch.arange(tokens.shape[0], device=self.device)
        return None, self.target.forward(ForwardInputs(inputs.input_ids, inputs.positions, view),
                                         rows)  # fmt: skip
