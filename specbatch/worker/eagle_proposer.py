"""The EAGLE drafter: a head of one decoder layer that reads the target's features.

Head position t reads token x_{t+1} and the target's feature f_t; it keeps its own paged KV
cache (one layer, the target's block tables). Each step it first catches up on the positions
the target processed in the request's previous step (their features, kept here from that
pass: the accepted ones only), then drafts (draft_loop.py): the output at the last of them
gives q for the token after the newest, and each further draft reads its parent's token with
the head's own output there as its feature. Positions drafted from the head's own features are
recomputed from the target's once verified, so the scheduler counts the head as having seen
only the positions the target processed (``num_draft_computed``).
"""

from __future__ import annotations

import time
from functools import cached_property

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import TensorParallelGroup
from specbatch.model.eagle import TargetParts, load_eagle_head
from specbatch.model.layers.backend_choice import select_backend
from specbatch.model.llama import head_dim_of
from specbatch.scheduler.output import ScheduledRequest
from specbatch.worker.draft_loop import CatchUp, catch_up, drafting, grow, placed
from specbatch.worker.draft_roots import Roots, padded_tables
from specbatch.worker.model_runner import ForwardInputs, ModelRunner, copy_blocks
from specbatch.worker.proposal import Proposal
from specbatch.worker.proposer import Drafter, DraftRound, RoundOutcome


class EagleProposer(Drafter):
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        tp: TensorParallelGroup,
        target: ModelRunner,
    ) -> None:
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
            config.draft, TargetParts.of(target.model), backend, config.draft.dtype, device
        )
        if device.type == "cpu":
            from specbatch.kernels.cpu import cpu_kernels

            kernels = cpu_kernels()
            if kernels is not None:
                self.head.use_cpu_kernels(kernels)
        self.feature_layers = self.head.streams
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pending: dict[str, KeptFeatures] = {}  # per request, until the head reads them

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.head.kv_cache_bytes_per_token() * block_size

    def init_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.head.allocate_kv_caches(
            num_blocks, self.config.block_size, self.device
        )

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        copy_blocks(self.kv_caches, src, dst, self.device)

    def attention(self) -> tuple[torch.nn.Module, object, None]:
        return self.head, self.head.attention_backend, None

    def finish_request(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def _features(self, r: ScheduledRequest) -> torch.Tensor:
        kept = self.pending[r.request_id]
        return kept.take(r.draft_start, len(r.draft_token_ids), r.request_id)

    @torch.inference_mode()
    def propose(self, step: DraftRound) -> Proposal:
        catch = catch_up(step, self.config.block_size, self.device)
        if catch is None:
            return step.empty_proposal(self.device)
        inputs = catch.inputs
        target_features = torch.cat([self._features(r) for r in catch.requests])
        active = drafting(step)
        if self._whole_round(step, active):
            return self._round(step, catch, target_features, active)
        features = self.head.from_target(target_features)
        feature, hidden = self.head(
            inputs.input_ids, features, inputs.positions, self.kv_caches[0], inputs.meta
        )
        if not active:
            step.note("catch-up", int(inputs.input_ids.shape[0]))
            return step.empty_proposal(self.device)
        reqs = [step.sampling[i] for i in active]
        rows = torch.tensor([catch.last_row[r.request_id] for r in reqs], device=self.device)
        roots = Roots(
            active,
            self.head.compute_logits(hidden.index_select(0, rows)),
            feature.index_select(0, rows),
            [r.draft_start + len(r.draft_token_ids) for r in reqs],
            [r.block_table for r in reqs],
        )
        step.note("catch-up", int(inputs.input_ids.shape[0]))
        sampled = self.config.speculative_config.tree_children == "sampled"
        return grow(step, roots, self._pass, self.config.block_size, sampled)

    def _whole_round(self, step: DraftRound, active: list[int]) -> bool:
        """Whether the catch-up pass and every drafting request's chain run as one kernel
        call (``Eagle3HeadPlan.round``): chains drawn in one call, a plan with fc."""
        if not active or self._embedding is None:
            return False
        plan = self.head.cpu_plan
        if plan is None or plan.fc is None:
            return False
        return all(step.shapes[i].topk == 1 for i in active) and _chain_in_one_call(step, active)

    def _round(
        self, step: DraftRound, catch: CatchUp, target_features: torch.Tensor, active: list[int]
    ) -> Proposal:
        plan, table = self.head.cpu_plan, self._embedding
        assert plan is not None and table is not None
        reqs = [step.sampling[i] for i in active]
        depths = [step.shapes[i].depth for i in active]
        temperature, u = _chain_uniforms(step, active)
        rows = torch.tensor([catch.last_row[r.request_id] for r in reqs], dtype=torch.int64)
        base = torch.tensor([r.draft_start + len(r.draft_token_ids) for r in reqs])
        tables = padded_tables([r.block_table for r in reqs], self.device)
        inputs = catch.inputs
        start = time.perf_counter()
        tokens, probs, seconds = plan.round(
            table, inputs.input_ids, target_features, inputs.positions, inputs.meta, rows,
            temperature, u, base, tables, self.kv_caches[0], depths, not step.greedy,
        )  # fmt: skip
        rows_by_depth = [sum(n > d for n in depths) for d in range(1, max(depths))]
        step.note_round(start, int(inputs.input_ids.shape[0]), seconds, rows_by_depth)
        return placed(step, active, tokens, depths, probs)

    def _pass(
        self, tokens: torch.Tensor, state: torch.Tensor | None, inputs: ForwardInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert state is not None
        return self.head.forward_logits(
            tokens, state, inputs.positions, self.kv_caches[0], inputs.meta
        )

    @cached_property
    def _embedding(self) -> torch.Tensor | None:
        """The table the head embeds tokens with, where its CPU plan can run the whole drafting call
        (the plan covers the LM head, the table is whole on this rank); else None."""
        plan = self.head.cpu_plan
        if plan is None or plan.lm_head is None:
            return None
        table = self.head.embed_tokens
        if table is None:
            table = self.head.target.embed
        if getattr(getattr(table, "tp", None), "size", 1) != 1:
            return None
        weight = getattr(table, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != plan.dtype:
            return None
        return weight

    def observe(self, step: DraftRound, outcome: RoundOutcome) -> None:
        """Keep the features of the positions the target processed and kept (a prompt chunk's
        rows, or a decoding request's last token and its accepted drafts), after those the
        head has not caught up on yet: it lags while the policy gives a request no drafts.
        Nothing of a request whose drafter is off."""
        on = []
        for r, kept_rows in zip(step.requests, outcome.kept_rows, strict=True):
            if r.drafter_off:
                self.pending.pop(r.request_id, None)
            else:
                on.append((r, kept_rows))
        if not on:
            return
        assert outcome.target is not None
        rows = [row for _, kept in on for row in kept]
        index = torch.tensor(rows, dtype=torch.int64, device=outcome.target.features.device)
        new = outcome.target.features.index_select(0, index)  # one copy for the whole step
        at = 0
        for r, kept_rows in on:
            kept = self.pending.get(r.request_id)
            if kept is None or kept.end != r.target_start:  # new, or recomputed from the start
                kept = self.pending[r.request_id] = KeptFeatures(r.target_start)
            kept.drop_before(r.draft_start + len(r.draft_token_ids))  # what the head now holds
            kept.add(new[at : at + len(kept_rows)])
            at += len(kept_rows)


def _chain_in_one_call(step: DraftRound, index: list[int]) -> bool:
    """Whether the chains of the requests ``index`` can be drawn in one kernel call: no
    grammar, penalty, top-k, top-p or min-p, each chain at its temperature alone."""
    if step.grammars is not None or step.penalties is not None:
        return False
    params = [step.params[i] for i in index]
    return not any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)


def _chain_uniforms(step: DraftRound, index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The temperatures [A] (float32) and drafting uniforms [A, W] of the requests ``index``
    (the uniforms are read only at a temperature above 0)."""
    temperature = torch.tensor([step.params[i].temperature for i in index], dtype=torch.float32)
    u = step.uniforms
    if not step.greedy and index != list(range(u.shape[0])):
        u = u.index_select(0, torch.tensor(index, dtype=torch.int64, device=u.device))
    return temperature.to(u.device), u


class KeptFeatures:
    """One request's target features of consecutive positions ``start .. end - 1``, kept in
    the chunks the steps produced until the head reads them."""

    def __init__(self, start: int) -> None:
        self.start = self.end = start
        self.chunks: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor) -> None:
        self.chunks.append(rows)
        self.end += rows.shape[0]

    def drop_before(self, position: int) -> None:
        while self.chunks and self.start + self.chunks[0].shape[0] <= position:
            self.start += self.chunks.pop(0).shape[0]

    def take(self, position: int, n: int, request_id: str) -> torch.Tensor:
        if position < self.start or position + n > self.end:
            raise RuntimeError(
                f"EAGLE: request {request_id} needs target features of positions "
                f"{position}..{position + n - 1}, kept {self.start}..{self.end - 1}"
            )
        whole = self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)
        self.chunks = [whole]
        return whole[position - self.start : position - self.start + n]
