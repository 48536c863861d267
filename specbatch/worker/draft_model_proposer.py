"""The draft-model drafter: a smaller model with its own paged KV cache (the target's block
tables), catching up on the tokens it has not seen, then growing each request's drafts one
batched pass per depth (draft_loop.py), each token drawn from the draft's q under the request's
own sampling transforms."""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.worker.draft_loop import catch_up, drafting, grow
from specbatch.worker.draft_roots import Roots
from specbatch.worker.model_runner import ForwardInputs, ModelRunner
from specbatch.worker.proposal import Proposal
from specbatch.worker.proposer import Drafter, DraftRound


class DraftModelProposer(Drafter):
    def __init__(
        self, config: EngineConfig, device: torch.device, tp: TensorParallelGroup, target: object
    ) -> None:
        assert config.draft is not None
        self.config = config
        self.device = device
        self.runner = ModelRunner(
            config.draft, device, tp, config.attention_backend, config.block_size
        )

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, self.config.block_size)

    def attention(self) -> tuple[torch.nn.Module, object, None]:
        return self.runner.model, self.runner.backend, None

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.runner.copy_blocks(src, dst)

    def propose(self, step: DraftRound) -> Proposal:
        catch = catch_up(step, self.config.block_size, self.device)
        if catch is None:
            return step.empty_proposal(self.device)
        active = drafting(step)
        reqs = [step.sampling[i] for i in active]
        rows = [catch.last_row[r.request_id] for r in reqs]
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        logits = self.runner.forward(catch.inputs, index)
        step.note("catch-up", int(catch.inputs.input_ids.shape[0]))
        roots = Roots(
            active,
            logits,
            None,
            [r.target_start + len(r.target_token_ids) for r in reqs],
            [r.block_table for r in reqs],
        )
        sampled = self.config.speculative_config.tree_children == "sampled"
        return grow(step, roots, self._pass, self.config.block_size, sampled)

    def _pass(
        self, tokens: torch.Tensor, state: torch.Tensor | None, inputs: ForwardInputs
    ) -> tuple[None, torch.Tensor]:
        rows = torch.arange(tokens.shape[0], device=self.device)
        return None, self.runner.forward(inputs, rows)
