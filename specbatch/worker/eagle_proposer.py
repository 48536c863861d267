"""The EAGLE drafter: a head of one decoder layer that reads the target's features.

Head position t reads token x_{t+1} and the target's feature f_t; it keeps its own paged KV
cache (one layer, the target's block tables). Each step it first catches up on the positions
the target processed in the request's previous step (their features, kept here from that
pass: the accepted ones only), then drafts: the output at the last of them gives q for the
token after the newest, and each further draft reads the draft before it with the head's own
output as its feature. Positions drafted from the head's own features are recomputed from the
target's once verified, so the scheduler counts the head as having seen only the positions the
target processed (``num_draft_computed``).
"""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.model.eagle import TargetParts, load_eagle_head
from specbatch.model.layers.backend_choice import select_backend
from specbatch.model.llama import head_dim_of
from specbatch.scheduler.output import NewRequestData, ScheduledRequest
from specbatch.worker.model_runner import ModelRunner
from specbatch.worker.proposer import DraftRound, Proposal, TargetPass


class EagleProposer:
    def __init__(self, config: EngineConfig, device: torch.device, target: ModelRunner) -> None:
        assert config.draft is not None
        self.config = config
        self.device = device
        head_config = config.draft.hf_config
        backend = select_backend(
            device,
            config.attention_backend,
            dtype=config.draft.dtype,
            block_size=config.block_size,
            head_dim=head_dim_of(head_config),
        )
        self.head = load_eagle_head(
            config.draft.path, TargetParts.of(target.model), backend, config.draft.dtype, device
        )
        if device.type == "cpu":
            from specbatch.kernels.cpu import cpu_kernels

            kernels = cpu_kernels()
            if kernels is not None:
                self.head.use_cpu_kernels(kernels)
        self.feature_layers: tuple[int, ...] | None = self.head.streams
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # per request: the first position of the features kept, and the features
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.head.kv_cache_bytes_per_token() * block_size

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.head.allocate_kv_caches(
            num_blocks, self.config.block_size, self.device
        )

    def add_request(self, new: NewRequestData) -> None:
        pass

    def finish_request(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def _features(self, r: ScheduledRequest) -> torch.Tensor:
        start, feats = self.pending[r.request_id]
        lo, n = r.draft_start - start, len(r.draft_token_ids)
        if lo < 0 or lo + n > feats.shape[0]:
            raise RuntimeError(
                f"EAGLE: request {r.request_id} needs target features of positions "
                f"{r.draft_start}..{r.draft_start + n - 1}, kept {start}..{start + len(feats) - 1}"
            )
        return feats[lo : lo + n]

    @torch.inference_mode()
    def propose(self, step: DraftRound) -> Proposal:
        out = step.proposal(self.config.target.vocab_size, self.device)
        catch = step.catch_up(self.config.block_size, self.device)
        if catch is None:
            return out
        inputs = catch.inputs
        features = self.head.from_target(torch.cat([self._features(r) for r in catch.requests]))
        feature, hidden = self.head(
            inputs.input_ids, features, inputs.positions, self.kv_caches[0], inputs.meta
        )
        sampling, gammas = step.sampling, step.gammas
        active = [i for i, g in enumerate(gammas) if g > 0]
        if not active:
            return out
        out.counts = list(gammas)
        rows = torch.tensor([catch.last_row[sampling[i].request_id] for i in active])
        feature, hidden = feature.index_select(0, rows), hidden.index_select(0, rows)
        first = [r.draft_start + len(r.draft_token_ids) for r in sampling]
        for j in range(max(gammas)):
            tokens = step.draw(self.head.compute_logits(hidden), active, j, out)
            nxt = step.next_pass(tokens, active, j, first, self.config.block_size)
            if nxt is None:
                break
            active, keep, inputs = nxt
            feature, hidden = self.head(
                inputs.input_ids,
                feature.index_select(0, keep),
                inputs.positions,
                self.kv_caches[0],
                inputs.meta,
            )
        return out

    def observe(
        self,
        step: DraftRound,
        emitted: list[list[int]],
        accepted: list[int],
        target: TargetPass | None,
    ) -> None:
        """Keep the features of the positions the target processed and kept: a prompt chunk's
        rows, or a decoding request's last token and its accepted drafts."""
        assert target is not None
        accepted_of = {r.request_id: a for r, a in zip(step.sampling, accepted, strict=True)}
        for r, row in zip(step.requests, target.row_starts, strict=True):
            n = len(r.target_token_ids) + accepted_of.get(r.request_id, 0)
            self.pending[r.request_id] = (r.target_start, target.features[row : row + n].clone())
