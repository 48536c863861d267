"""One rank of the engine: the target, the drafter, and the speculative round of THEORY.md.

``execute`` runs one engine step for the whole batch:
1. draw each sampling request's uniforms from its own generator (count fixed by its gamma);
2. the drafter (proposer.py: a draft model, or n-gram lookup) proposes up to ``gamma_i``
   tokens per request, with the distributions q they were drawn from (or point masses);
3. the target scores every request's unprocessed tokens plus its drafts in ONE ragged forward;
4. the rejection sampler accepts a prefix of each request's drafts and emits one more token.
Penalties (penalties.py) change the logits of both models at every position they sample or
verify; logprobs are the target's at each emitted token, never the draft's.
Rollback is not done here: the scheduler moves each model's progress counter back.
"""

from __future__ import annotations

import itertools
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
from specbatch.worker.draft_model_proposer import DraftModelProposer
from specbatch.worker.eagle_proposer import EagleProposer
from specbatch.worker.logprobs import emitted_logprobs, position_logprobs
from specbatch.worker.model_runner import ModelRunner, build_inputs
from specbatch.worker.ngram_proposer import NgramProposer
from specbatch.worker.penalties import History, Penalties
from specbatch.worker.proposer import DraftRound, Proposal, Proposer, TargetPass
from specbatch.worker.rejection_sampler import greedy_verify, rejection_sample
from specbatch.worker.sampler import SamplingTensors, logits_to_probs


@dataclass
class _RequestState:
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    history: History | None  # only for a penalised request


@dataclass
class _Verified:
    """What the target pass gives the rest of the round."""

    p: torch.Tensor  # [B, G+1, V] probabilities, or (all greedy) [B, G+1] argmax ids
    target_pass: TargetPass | None
    logprobs: torch.Tensor | None  # [L, V], the verified rows of requests asking for logprobs
    logprob_rows: dict[int, int]  # sampling index -> its first row in ``logprobs``
    prompt_logprobs: dict[str, tuple[int, list]]


def make_proposer(
    config: EngineConfig, device: torch.device, draft_tp: TensorParallelGroup, target: ModelRunner
) -> Proposer | None:
    """The drafter ``config`` asks for, or None when the engine does not speculate."""
    if not config.speculative:
        return None
    if config.spec_method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, device)
    if config.spec_method == "eagle":
        return EagleProposer(config, device, target)
    return DraftModelProposer(config, device, draft_tp)


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
        self.proposer = make_proposer(config, self.device, draft_tp, self.target)
        self.draft: ModelRunner | None = None  # the draft model's runner, if it is the drafter
        if isinstance(self.proposer, DraftModelProposer):
            self.draft = self.proposer.runner
        self._states: dict[str, _RequestState] = {}

    # ---- set-up ----------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one block costs on this rank, in the target's cache and the draft's together."""
        n = self.target.kv_bytes_per_block(self.config.block_size)
        if self.proposer is not None:
            n += self.proposer.kv_bytes_per_block(self.config.block_size)
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
        if self.proposer is not None:
            self.proposer.init_kv_cache(num_blocks)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        for rid in plan.finished_request_ids:
            self._states.pop(rid, None)
            if self.proposer is not None:
                self.proposer.finish_request(rid)
        vocab = self.config.target.vocab_size
        for new in plan.new_requests:
            sp = new.sampling_params
            history = None
            if sp.penalised:
                ids, banned = new.prompt_token_ids, new.min_tokens_banned
                history = History(sp, ids, banned, vocab, self.device)
            self._states[new.request_id] = _RequestState(
                sp, torch.Generator().manual_seed(new.seed), new.prompt_token_ids, history
            )
            if self.proposer is not None:
                self.proposer.add_request(new)
        reqs = plan.requests
        if not reqs:
            return StepResult()
        sampling = [r for r in reqs if r.sample]
        gammas = [r.num_draft if self.proposer else 0 for r in sampling]
        g_max = max(gammas, default=0)
        params = [self._states[r.request_id].params for r in sampling]
        # an all-greedy step needs no distributions: argmaxes and the one-hot limit of the rule
        greedy = all(sp.greedy for sp in params)
        uniforms = self._draw_uniforms(sampling, gammas, g_max)
        histories = [self._states[r.request_id].history for r in sampling]
        penalties = Penalties.of(histories, vocab, self.device)
        t0 = time.perf_counter()
        step = DraftRound(reqs, sampling, gammas, params, uniforms[:, :g_max], greedy, penalties)
        if self.proposer is None:
            proposal = Proposal.empty(len(sampling), g_max, self.device)
        else:
            proposal = self.proposer.propose(step)
        t1 = time.perf_counter()
        verified = self._verify(step, proposal, g_max)
        t2 = time.perf_counter()
        if not sampling:
            if self.proposer is not None:
                self.proposer.observe(step, [], [], verified.target_pass)
            timings = {"draft": t1 - t0, "target": t2 - t1, "sample": 0.0}
            return StepResult(timings=timings, prompt_logprobs=verified.prompt_logprobs)
        counts = torch.tensor(proposal.counts, dtype=torch.int64, device=self.device)
        if greedy:
            out = greedy_verify(proposal.tokens, counts, verified.p)
        else:
            out = rejection_sample(
                proposal.tokens,
                counts,
                proposal.probs,
                verified.p,
                uniforms[:, g_max : 2 * g_max],
                uniforms[:, 2 * g_max],
            )
        host = torch.cat([out.num_accepted.unsqueeze(1), out.token_ids], dim=1).tolist()
        emitted = [row[1 : row[0] + 2] for row in host]
        for history, toks in zip(histories, emitted):
            if history is not None:
                history.append(toks)
        if self.proposer is not None:
            self.proposer.observe(step, emitted, [row[0] for row in host], verified.target_pass)
        logprobs = {}
        if verified.logprobs is not None:
            ks = [params[i].logprobs or 0 for i in verified.logprob_rows]
            logprobs = emitted_logprobs(verified.logprobs, verified.logprob_rows, ks, emitted)
        t3 = time.perf_counter()
        results = {
            r.request_id: RequestStepResult(toks, row[0], n, logprobs.get(i))
            for i, (r, row, toks, n) in enumerate(zip(sampling, host, emitted, proposal.counts))
        }
        timings = {"draft": t1 - t0, "target": t2 - t1, "sample": t3 - t2}
        return StepResult(results, timings=timings, prompt_logprobs=verified.prompt_logprobs)

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

    def _verify(self, step: DraftRound, proposal: Proposal, g_max: int) -> _Verified:
        """One ragged target pass: p at the verified positions (or, all greedy, the target's
        argmax there), the features the drafter reads, and the logprobs asked for."""
        reqs, sampling, params, greedy = step.requests, step.sampling, step.params, step.greedy
        gammas = proposal.counts
        gamma_of = {r.request_id: g for r, g in zip(sampling, gammas)}
        ids: list[int] = []
        q_lens: list[int] = []
        draft_rows: list[int] = []
        draft_src: list[int] = []
        logit_rows: list[int] = []
        expand: list[int] = []  # row of the computed logits behind each [b, k] of p
        row_request: list[int] = []  # the sampling index of each verified row
        row_before: list[int] = []  # how many of its drafts come before each verified row
        first_row: list[int] = []  # each sampling request's first verified row
        scored: list[tuple[str, int, int, int]] = []  # prompt logprobs: id, position, row, count
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
            state = self._states[r.request_id]
            if state.params.prompt_logprobs is not None:
                # the rows whose next token is a prompt token score that token
                end = min(r.target_start + len(r.target_token_ids), len(state.prompt_token_ids) - 1)
                if end > r.target_start:
                    scored.append((r.request_id, r.target_start + 1, start, end - r.target_start))
            if r.sample:
                # logits only at the request's g + 1 verified positions; p's padding positions
                # (k > g, never read by the rejection sampler) repeat the bonus row
                last = start + len(r.target_token_ids) - 1
                first_row.append(len(logit_rows))
                logit_rows.extend(range(last, last + g + 1))
                expand.extend(first_row[-1] + min(k, g) for k in range(g_max + 1))
                row_request.extend([i] * (g + 1))
                row_before.extend(range(g + 1))
                i += 1
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device)
        if draft_rows:
            dst = torch.tensor(draft_rows, dtype=torch.int64, device=self.device)
            src = torch.tensor(draft_src, dtype=torch.int64, device=self.device)
            input_ids[dst] = proposal.tokens.reshape(-1)[src]
        inputs = build_inputs(
            input_ids,
            q_lens,
            [r.target_start for r in reqs],
            [r.block_table for r in reqs],
            self.config.block_size,
            self.device,
        )
        all_rows = logit_rows + [row + k for _, _, row, n in scored for k in range(n)]
        rows = torch.tensor(all_rows, dtype=torch.int64, device=self.device)
        streams = self.proposer.feature_layers if self.proposer is not None else None
        logits, features = self.target.forward_features(inputs, rows if all_rows else None, streams)
        target_pass = None
        if features is not None:
            target_pass = TargetPass(features, list(itertools.accumulate(q_lens, initial=0))[:-1])
        prompt_logprobs = self._prompt_logprobs(logits[len(logit_rows) :], scored)
        logits = logits[: len(logit_rows)]
        if not sampling:
            empty = logits.new_empty((0, g_max + 1, logits.shape[-1]))
            return _Verified(empty, target_pass, None, {}, prompt_logprobs)
        raw = logits
        if step.penalties is not None:
            who = torch.tensor(row_request, dtype=torch.int64, device=self.device)
            before = torch.tensor(row_before, dtype=torch.int64, device=self.device)
            logits = step.penalties.apply(logits, who, proposal.tokens.index_select(0, who), before)
        asking = [k for k, sp in enumerate(params) if sp.logprobs is not None]
        st = None  # each verified row's sampling parameters, unless argmaxes are all it needs
        if asking or not greedy:
            st = SamplingTensors.from_params(params, self.device)
            st = st.repeat_interleave([g + 1 for g in gammas])
        logprobs, logprob_rows = None, {}
        if asking:
            assert st is not None
            pick: list[int] = []
            for k in asking:
                logprob_rows[k] = len(pick)
                pick.extend(range(first_row[k], first_row[k] + gammas[k] + 1))
            logprobs = self._logprobs_at(raw, logits, st, pick)
        expand_rows = torch.tensor(expand, dtype=torch.int64, device=self.device)
        if greedy:
            tokens = logits.argmax(dim=-1).index_select(0, expand_rows)
            p = tokens.view(len(sampling), g_max + 1)
        else:
            assert st is not None
            probs = logits_to_probs(logits, st)
            p = probs.index_select(0, expand_rows).view(len(sampling), g_max + 1, -1)
        return _Verified(p, target_pass, logprobs, logprob_rows, prompt_logprobs)

    def _logprobs_at(
        self, raw: torch.Tensor, processed: torch.Tensor, st: SamplingTensors, rows: list[int]
    ) -> torch.Tensor:
        """logprobs_mode's logprobs [len(rows), V] at these verified rows: the model's
        log-softmax, or the log of the distribution sampled from (penalties, temperature and
        the top-k/top-p/min-p cut; greedy rows at temperature 1)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        if self.config.logprobs_mode == "raw_logprobs":
            return torch.log_softmax(raw.index_select(0, index).float(), dim=-1)
        sub = SamplingTensors.from_lists(
            [t if t > 0 else 1.0 for t in st.temperature[index].tolist()],
            st.top_k[index].tolist(),
            st.top_p[index].tolist(),
            st.min_p[index].tolist(),
            self.device,
        )
        return torch.log(logits_to_probs(processed.index_select(0, index), sub))

    def _prompt_logprobs(
        self, logits: torch.Tensor, scored: list[tuple[str, int, int, int]]
    ) -> dict[str, tuple[int, list]]:
        """Request id -> (first prompt position scored, the model's logprobs of each token)."""
        out: dict[str, tuple[int, list]] = {}
        if not scored:
            return out
        lp = torch.log_softmax(logits.float(), dim=-1)
        at = 0
        for rid, first, _, n in scored:
            state = self._states[rid]
            k = state.params.prompt_logprobs or 0
            tokens = state.prompt_token_ids[first : first + n]
            out[rid] = (first, position_logprobs(lp[at : at + n], tokens, [k] * n))
            at += n
        return out
