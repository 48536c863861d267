"""The draft-model drafter: a smaller model with its own paged KV cache (the target's block
tables), catching up on the tokens it has not seen, then proposing one batched pass per draft
position, each token sampled from the draft's q under the request's own sampling transforms."""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.scheduler.output import NewRequestData
from specbatch.worker.model_runner import ModelRunner, build_inputs
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
        sampling, gammas = step.sampling, step.gammas
        g_max = max(gammas, default=0)
        out = Proposal.empty(len(sampling), g_max, self.device)
        # Catch-up: every request's unseen tokens; logits at the last one of each proposer.
        catch = [r for r in step.requests if r.draft_token_ids]
        if not catch:
            return out
        if not step.greedy:
            vocab = self.config.target.vocab_size
            out.probs = torch.zeros(
                (len(sampling), g_max, vocab), dtype=torch.float32, device=self.device
            )
        proposers = [i for i, g in enumerate(gammas) if g > 0]
        out.counts = list(gammas)
        ends: dict[str, int] = {}
        ids: list[int] = []
        for r in catch:
            ids.extend(r.draft_token_ids)
            ends[r.request_id] = len(ids) - 1
        inputs = build_inputs(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            [len(r.draft_token_ids) for r in catch],
            [r.draft_start for r in catch],
            [r.block_table for r in catch],
            self.config.block_size,
            self.device,
        )
        rows = [ends[sampling[i].request_id] for i in proposers]
        logits = self.runner.forward(
            inputs, torch.tensor(rows, dtype=torch.int64, device=self.device)
        )
        active = proposers
        for j in range(g_max):
            tokens = step.draw(logits, active, j, out)
            still = [i for i in active if gammas[i] > j + 1]
            if not still:
                break
            keep = torch.tensor(
                [k for k, i in enumerate(active) if gammas[i] > j + 1],
                dtype=torch.int64,
                device=self.device,
            )
            active = still
            inputs = build_inputs(
                tokens.index_select(0, keep),
                [1] * len(active),
                [sampling[i].target_start + len(sampling[i].target_token_ids) + j for i in active],
                [sampling[i].block_table for i in active],
                self.config.block_size,
                self.device,
            )
            logits = self.runner.forward(inputs, torch.arange(len(active), device=self.device))
        return out
