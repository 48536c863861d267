"""The draft-model drafter: a smaller model with its own paged KV cache (the target's block
tables), catching up on the tokens it has not seen, then proposing one batched pass per draft
position, each token sampled from the draft's q under the request's own sampling transforms."""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.scheduler.output import NewRequestData
from specbatch.worker.model_runner import ModelRunner
from specbatch.worker.proposer import DraftRound, Proposal, TargetPass


class DraftModelProposer:
    feature_layers = None

    def __init__(self, config: EngineConfig, device: torch.device, tp: TensorParallelGroup) -> None:
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

    def add_request(self, new: NewRequestData) -> None:
        pass

    def finish_request(self, request_id: str) -> None:
        pass

    def observe(
        self,
        step: DraftRound,
        emitted: list[list[int]],
        accepted: list[int],
        target: TargetPass | None,
    ) -> None:
        pass

    def propose(self, step: DraftRound) -> Proposal:
        out = step.proposal(self.config.target.vocab_size, self.device)
        catch = step.catch_up(self.config.block_size, self.device)
        if catch is None:
            return out
        sampling, gammas = step.sampling, step.gammas
        active = [i for i, g in enumerate(gammas) if g > 0]
        out.counts = list(gammas)
        rows = [catch.last_row[sampling[i].request_id] for i in active]
        logits = self.runner.forward(
            catch.inputs, torch.tensor(rows, dtype=torch.int64, device=self.device)
        )
        first = [r.target_start + len(r.target_token_ids) for r in sampling]
        for j in range(max(gammas, default=0)):
            tokens = step.draw(logits, active, j, out)
            nxt = step.next_pass(tokens, active, j, first, self.config.block_size)
            if nxt is None:
                break
            active, _, inputs = nxt
            logits = self.runner.forward(inputs, torch.arange(len(active), device=self.device))
        return out
