"""One rank of the engine: the target, the draft, and the speculative round of THEORY.md.

``execute`` runs one engine step for the whole batch:
1. draw each sampling request's uniforms from its own generator (count fixed by its gamma);
2. the draft catches up on the tokens it has not seen, then proposes ``gamma_i`` tokens per
   request, one batched pass per draft position (requests drop out as their gamma runs out);
3. the target scores every request's unprocessed tokens plus its drafts in ONE ragged forward;
4. the rejection sampler accepts a prefix of each request's drafts and emits one more token.
Rollback is not done here: the scheduler moves each model's progress counter back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.output import (
    RequestStepResult,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
)
from specbatch.worker.model_runner import ModelRunner, build_inputs
from specbatch.worker.rejection_sampler import rejection_sample
from specbatch.worker.sampler import SamplingTensors, logits_to_probs, sample


@dataclass
class _RequestState:
    params: SamplingParams
    generator: torch.Generator


def _sampling_tensors(params: list[SamplingParams], device: torch.device) -> SamplingTensors:
    return SamplingTensors.from_lists(
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
        device=device,
    )


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device | None = None,
        tp: TensorParallelGroup = SINGLE,
        draft_tp: TensorParallelGroup = SINGLE,
    ) -> None:
        self.config = config
        self.device = device or torch.device(config.device)
        self.tp = tp
        self.target = ModelRunner(
            config.target, self.device, tp, config.attention_backend, config.block_size
        )
        self.draft: ModelRunner | None = None
        if config.speculative and config.draft is not None:
            self.draft = ModelRunner(
                config.draft, self.device, draft_tp, config.attention_backend, config.block_size
            )
        self._states: dict[str, _RequestState] = {}

    # ---- set-up ----------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one block costs on this rank, in the target's cache and the draft's together."""
        n = self.target.kv_bytes_per_block(self.config.block_size)
        if self.draft is not None:
            n += self.draft.kv_bytes_per_block(self.config.block_size)
        return n

    def kv_memory_budget(self) -> int:
        """Bytes this rank may give to KV caches (unused when num_kv_blocks is given)."""
        if self.config.num_kv_blocks is not None:
            return 0
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free * self.config.gpu_memory_utilization)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.target.allocate_kv_cache(num_blocks, self.config.block_size)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, self.config.block_size)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        for rid in plan.finished_request_ids:
            self._states.pop(rid, None)
        for new in plan.new_requests:
            self._states[new.request_id] = _RequestState(
                new.sampling_params, torch.Generator().manual_seed(new.seed)
            )
        reqs = plan.requests
        if not reqs:
            return StepResult()
        sampling = [r for r in reqs if r.sample]
        gammas = [r.num_draft for r in sampling] if self.draft is not None else [0] * len(sampling)
        g_max = max(gammas, default=0)
        params = [self._states[r.request_id].params for r in sampling]
        uniforms = self._draw_uniforms(sampling, gammas, g_max)
        t0 = time.perf_counter()
        drafts, q = self._propose(reqs, sampling, gammas, g_max, params, uniforms[:, :g_max])
        t1 = time.perf_counter()
        p = self._verify(reqs, sampling, drafts, gammas, g_max, params)
        t2 = time.perf_counter()
        if not sampling:
            return StepResult(timings={"draft": t1 - t0, "target": t2 - t1, "sample": 0.0})
        out = rejection_sample(
            drafts,
            torch.tensor(gammas, dtype=torch.int64, device=self.device),
            q,
            p,
            uniforms[:, g_max : 2 * g_max],
            uniforms[:, 2 * g_max],
        )
        host = torch.cat([out.num_accepted.unsqueeze(1), out.token_ids], dim=1).tolist()
        t3 = time.perf_counter()
        results = {
            r.request_id: RequestStepResult(token_ids=row[1 : row[0] + 2], num_accepted=row[0])
            for r, row in zip(sampling, host)
        }
        return StepResult(results, {"draft": t1 - t0, "target": t2 - t1, "sample": t3 - t2})

    def _draw_uniforms(
        self, sampling: list[ScheduledRequest], gammas: list[int], g_max: int
    ) -> torch.Tensor:
        """[B, 2G+1]: draft draws, acceptance draws, and the final draw of each request.

        A request draws exactly 2*gamma+1 numbers from its own generator, whatever the batch,
        so a seeded request is reproducible alone or in any company. Greedy requests draw none.
        """
        u = torch.zeros((len(sampling), 2 * g_max + 1), dtype=torch.float32)
        for i, (r, g) in enumerate(zip(sampling, gammas)):
            state = self._states[r.request_id]
            if state.params.greedy:
                continue
            draws = torch.rand(2 * g + 1, generator=state.generator)
            u[i, :g] = draws[:g]
            u[i, g_max : g_max + g] = draws[g : 2 * g]
            u[i, 2 * g_max] = draws[2 * g]
        return u.to(self.device)

    def _propose(
        self,
        reqs: list[ScheduledRequest],
        sampling: list[ScheduledRequest],
        gammas: list[int],
        g_max: int,
        params: list[SamplingParams],
        draft_u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [B, G] and the distributions q [B, G, V] they were sampled from."""
        vocab = self.config.target.vocab_size
        drafts = torch.zeros((len(sampling), g_max), dtype=torch.int64, device=self.device)
        q = torch.zeros((len(sampling), g_max, vocab), dtype=torch.float32, device=self.device)
        draft = self.draft
        if draft is None:
            return drafts, q
        # Catch-up: every request's unseen tokens; logits at the last one of each proposer.
        catch = [r for r in reqs if r.draft_token_ids]
        if not catch:
            return drafts, q
        proposers = [i for i, g in enumerate(gammas) if g > 0]
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
        logits = draft.forward(inputs, torch.tensor(rows, dtype=torch.int64, device=self.device))
        active = proposers
        for j in range(g_max):
            idx = torch.tensor(active, dtype=torch.int64, device=self.device)
            probs = logits_to_probs(
                logits, _sampling_tensors([params[i] for i in active], self.device)
            )
            tokens = sample(probs, draft_u[idx, j])
            drafts[idx, j] = tokens
            q[idx, j] = probs
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
            logits = draft.forward(inputs, torch.arange(len(active), device=self.device))
        return drafts, q

    def _verify(
        self,
        reqs: list[ScheduledRequest],
        sampling: list[ScheduledRequest],
        drafts: torch.Tensor,
        gammas: list[int],
        g_max: int,
        params: list[SamplingParams],
    ) -> torch.Tensor:
        """One ragged target pass; returns p [B_sampling, G+1, V] at the verified positions."""
        gamma_of = {r.request_id: g for r, g in zip(sampling, gammas)}
        ids: list[int] = []
        q_lens: list[int] = []
        draft_rows: list[int] = []
        draft_src: list[int] = []
        logit_rows: list[int] = []
        expand: list[int] = []  # row of the computed logits behind each [b, k] of p
        i = 0  # index among the sampling requests
        for r in reqs:
            start = len(ids)
            ids.extend(r.target_token_ids)
            g = gamma_of.get(r.request_id, 0)
            if g:
                draft_rows.extend(range(len(ids), len(ids) + g))
                draft_src.extend(range(i * g_max, i * g_max + g))
                ids.extend([0] * g)
            q_lens.append(len(ids) - start)
            if r.sample:
                # logits only at the request's g + 1 verified positions; p's padding positions
                # (k > g, never read by the rejection sampler) repeat the bonus row
                last = start + len(r.target_token_ids) - 1
                first = len(logit_rows)
                logit_rows.extend(range(last, last + g + 1))
                expand.extend(first + min(k, g) for k in range(g_max + 1))
                i += 1
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device)
        if draft_rows:
            dst = torch.tensor(draft_rows, dtype=torch.int64, device=self.device)
            src = torch.tensor(draft_src, dtype=torch.int64, device=self.device)
            input_ids[dst] = drafts.reshape(-1)[src]
        inputs = build_inputs(
            input_ids,
            q_lens,
            [r.target_start for r in reqs],
            [r.block_table for r in reqs],
            self.config.block_size,
            self.device,
        )
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
        logits = self.target.forward(inputs, rows if logit_rows else None)
        if not sampling:
            return logits.new_empty((0, g_max + 1, logits.shape[-1]))
        st = _sampling_tensors(params, self.device).repeat_interleave([g + 1 for g in gammas])
        probs = logits_to_probs(logits, st)
        rows = torch.tensor(expand, dtype=torch.int64, device=self.device)
        return probs.index_select(0, rows).view(len(sampling), g_max + 1, -1)
