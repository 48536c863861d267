"""One rank of the engine: the target, the drafter, and the speculative round of THEORY.md.

``execute`` runs one engine step for the whole batch:
1. draw each sampling request's uniforms from its own generator (count fixed by its drafts);
2. the drafter (``Drafter``: a draft model, an EAGLE head, n-gram lookup) proposes each
   request's drafts, a chain or a tree, with the distributions q they were drawn from;
3. the target scores every request's unprocessed tokens plus its drafts in ONE ragged forward
   (``RoundLayout``; a tree's nodes attend to their ancestors only);
4. verification accepts a path of each request's drafts and emits one more token
   (``rejection_sampler`` for chains, ``tree_verify`` for trees); a tree's accepted nodes are
   moved into consecutive cache slots, as if a chain of them had been verified.
Penalties (penalties.py) change the logits of both models at every position they sample or
verify, and so do grammars (grammar_masks.py: structured outputs); logprobs are the target's at
each emitted token, never the draft's.
Rollback is not done here: the scheduler moves each model's progress counter back.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from specbatch.config import EngineConfig
from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.draft_shape import DraftShape
from specbatch.drafters import DRAFTERS
from specbatch.grammar.backend import CompiledGrammarRef, worker_tokenizer_info, xgrammar
from specbatch.sampling_params import SamplingParams
from specbatch.scheduler.kv_prices import KvPrices
from specbatch.scheduler.output import (
    RequestStepResult,
    ScheduledRequest,
    SchedulerOutput,
    StepResult,
)
from specbatch.worker.drafters import make_drafter
from specbatch.worker.grammar_masks import RequestGrammar, StepGrammars
from specbatch.worker.kv_price import measure_kv_price
from specbatch.worker.logprobs import emitted_logprobs, position_logprobs
from specbatch.worker.model_runner import ModelRunner
from specbatch.worker.penalties import History, Penalties
from specbatch.worker.proposal import Proposal
from specbatch.worker.proposer import DraftRound, RoundOutcome, TargetPass
from specbatch.worker.rejection_sampler import greedy_walk, rejection_sample
from specbatch.worker.round_layout import RoundLayout
from specbatch.worker.sampler import SamplingTensors, logits_to_probs
from specbatch.worker.tree_verify import verify_tree

GRAMMARS_KEPT = 512  # compiled grammars a worker keeps
CPU_KV_CACHE_MEMORY = 1 << 30  # a CPU rank's KV budget when none is given


@dataclass
class _RequestState:
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    history: History | None  # only for a penalised request
    grammar: RequestGrammar | None  # only for a structured output


@dataclass
class _Verdict:
    """What verification decided, per sampling request."""

    emitted: list[list[int]]
    accepted: list[int]
    path: list[list[int]]  # the accepted nodes, in order (a chain: 1..accepted)
    rejected: list[bool] | None  # None: chains (rejected iff accepted < proposed)


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
        self.drafter = make_drafter(config, self.device, draft_tp, self.target)
        self.draft: ModelRunner | None = getattr(self.drafter, "runner", None)
        spec = config.speculative_config
        kind = DRAFTERS.get(spec.method)
        samples = kind is not None and kind.samples  # a lookup's children are chosen
        self.sampled_children = samples and spec.tree_children == "sampled"
        self._states: dict[str, _RequestState] = {}
        self._grammar_info: object = None  # xgrammar's tokenizer info, read on first use
        self._compiled: dict[str, object] = {}  # grammar key -> compiled grammar, on a Ray rank

    # ---- set-up ----------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one block costs on this rank, in the target's cache and the draft's together."""
        n = self.target.kv_bytes_per_block(self.config.block_size)
        if self.drafter is not None:
            n += self.drafter.kv_bytes_per_block(self.config.block_size)
        return n

    def kv_memory_budget(self) -> int:
        """Bytes this rank may give to KV caches (unused when num_kv_blocks is given)."""
        if self.config.num_kv_blocks is not None:
            return 0
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type == "cpu":
            return CPU_KV_CACHE_MEMORY
        free, _total = torch.cuda.mem_get_info(self.device)
        return int(free * self.config.gpu_memory_utilization)

    def init_kv_cache(self, num_blocks: int) -> KvPrices | None:
        """Allocate the caches; with ``auto``, first measure what attention costs per cached
        token (the draft policy prices long contexts from it)."""
        prices = self._kv_prices() if self.config.speculative_config.auto else None
        self.target.allocate_kv_cache(num_blocks, self.config.block_size)
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)
        # what exists now lives as long as the worker: no later collection need walk it
        gc.collect()
        gc.freeze()
        return prices

    def _kv_prices(self) -> KvPrices:
        bs = self.config.block_size
        target = measure_kv_price(self.target.model, self.target.backend, bs)
        own = self.drafter.attention() if self.drafter is not None else None
        if own is None:
            return KvPrices(target, None, None)
        model, backend, view = own
        same = model is self.target.model  # the target's own layers draft: priced once
        return KvPrices(target, target if same else measure_kv_price(model, backend, bs), view)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        self._track(plan)
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        reqs = plan.requests
        if not reqs:
            return StepResult()
        sampling = [r for r in reqs if r.sample]
        shapes = [r.shape if self.drafter else DraftShape() for r in sampling]
        params = [self._states[r.request_id].params for r in sampling]
        # an all-greedy step needs no distributions: argmaxes and the one-hot limit of the rule
        greedy = all(sp.greedy for sp in params)
        draft_u, verify_u = self._draw_uniforms(sampling, shapes)
        histories = [self._states[r.request_id].history for r in sampling]
        vocab = self.config.target.vocab_size
        penalties = Penalties.of(histories, vocab, self.device)
        grammars = StepGrammars.of([self._states[r.request_id].grammar for r in sampling], vocab)
        t0 = time.perf_counter()
        step = DraftRound(reqs, sampling, shapes, params, draft_u, greedy, penalties, grammars)
        proposal = step.empty_proposal(self.device)
        # a step whose every request has its drafter off (asleep) asks the drafter for
        # nothing: it has nothing to catch up on or draft, and only forgets what it kept
        drafter = self.drafter
        if drafter is not None and all(r.drafter_off for r in reqs):
            drafter.observe(step, RoundOutcome([], [], [[] for _ in reqs], None))
            drafter = None
        if drafter is not None:
            proposal = drafter.propose(step)
        if grammars is not None:
            proposal = grammars.cut(proposal)
        t1 = time.perf_counter()
        layout = RoundLayout.build(reqs, sampling, proposal, self.config.block_size, self.device)
        if grammars is not None:
            grammars.prepare_verified(proposal, layout.first_verified)
        t_pass = time.perf_counter()
        logits, target_pass, prompt_logprobs = self._target_pass(reqs, layout)
        t2 = time.perf_counter()
        passes = [*step.passes, ("target", int(layout.inputs.input_ids.shape[0]), t2 - t_pass)]
        if not sampling:
            if drafter is not None:
                rows = [list(range(s, s + len(r.target_token_ids)))
                        for r, s in zip(reqs, layout.row_starts, strict=True)]  # fmt: skip
                drafter.observe(step, RoundOutcome([], [], rows, target_pass))
            timings = {"draft": t1 - t0, "target": t2 - t1, "sample": 0.0}
            return StepResult(timings=timings, prompt_logprobs=prompt_logprobs, passes=passes)
        if grammars is not None:
            logits = grammars.apply_verified(logits)
        raw = logits
        if penalties is not None:
            logits = penalties.apply(logits, layout.row_request, *layout.paths)
        st = None  # each verified row's sampling parameters, unless argmaxes are all it needs
        asking = [b for b, sp in enumerate(params) if sp.logprobs is not None]
        if asking or not greedy:
            st = SamplingTensors.from_params(params, self.device, [n + 1 for n in proposal.counts])
        p = logits.argmax(dim=-1) if greedy else logits_to_probs(logits, st)
        verdict = self._verify(step, proposal, layout, p, verify_u)
        if proposal.is_tree:
            self._compact(sampling, layout, verdict)
        done = grammars.commit(verdict.emitted) if grammars is not None else [False] * len(params)
        for history, toks in zip(histories, verdict.emitted, strict=True):
            if history is not None:
                history.append(toks)
        if drafter is not None:
            drafter.observe(step, self._outcome(reqs, sampling, layout, verdict, target_pass))
        logprobs = {}
        if asking:
            assert st is not None
            logprobs = self._emitted_logprobs(raw, logits, st, layout, verdict, asking, params)
        t3 = time.perf_counter()
        results = {
            r.request_id: RequestStepResult(
                toks,
                verdict.accepted[b],
                proposal.counts[b],
                logprobs.get(b),
                None if verdict.rejected is None else verdict.rejected[b],
                done[b],
            )
            for b, (r, toks) in enumerate(zip(sampling, verdict.emitted, strict=True))
        }
        timings = {"draft": t1 - t0, "target": t2 - t1, "sample": t3 - t2}
        return StepResult(results, timings=timings, prompt_logprobs=prompt_logprobs, passes=passes)

    def _track(self, plan: SchedulerOutput) -> None:
        """Forget finished requests; set up new ones (generator, penalty history, drafter)."""
        for rid in plan.finished_request_ids:
            self._states.pop(rid, None)
            if self.drafter is not None:
                self.drafter.finish_request(rid)
        vocab = self.config.target.vocab_size
        for new in plan.new_requests:
            sp = new.sampling_params
            history = None
            if sp.penalised:
                ids, banned = new.prompt_token_ids, new.min_tokens_banned
                history = History(sp, ids, banned, vocab, self.device)
            grammar = None
            if new.grammar is not None:
                grammar = RequestGrammar(self._matcher(new.grammar))
            self._states[new.request_id] = _RequestState(
                sp, torch.Generator().manual_seed(new.seed), new.prompt_token_ids, history, grammar
            )
            if self.drafter is not None:
                self.drafter.add_request(new)

    def _matcher(self, ref: CompiledGrammarRef) -> object:
        """A new matcher of a compiled grammar (rebuilt once per grammar on a Ray rank)."""
        compiled = self._compiled.get(ref.key)
        if compiled is None:
            if ref.compiled is None and self._grammar_info is None:
                self._grammar_info = worker_tokenizer_info(self.config)
            compiled = ref.resolve(self._grammar_info)
            if len(self._compiled) >= GRAMMARS_KEPT:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[ref.key] = compiled
        return xgrammar().GrammarMatcher(compiled)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy on write: every model's K/V of each source block into its copy (all sources
        are read before any copy is written)."""
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]
        self.target.copy_blocks(src, dst)
        if self.drafter is not None:
            self.drafter.copy_blocks(src, dst)

    def _draw_uniforms(
        self, sampling: list[ScheduledRequest], shapes: list[DraftShape]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, Wd] for drafting, [B, Wv] for verifying): each sampled request draws exactly
        ``DraftShape.draws`` numbers from its own generator, whatever the batch, so a seeded
        request is reproducible alone or in any company. Greedy requests draw none."""
        counts = [s.draws(self.sampled_children) for s in shapes]
        wd = max((c[0] for c in counts), default=0)
        wv = max((c[1] for c in counts), default=1)
        draft_u = torch.zeros((len(sampling), wd), dtype=torch.float32)
        verify_u = torch.zeros((len(sampling), wv), dtype=torch.float32)
        for b, (r, (nd, nv)) in enumerate(zip(sampling, counts, strict=True)):
            state = self._states[r.request_id]
            if state.params.greedy:
                continue
            draws = torch.rand(nd + nv, generator=state.generator)
            draft_u[b, :nd] = draws[:nd]
            verify_u[b, :nv] = draws[nd:]
        return draft_u.to(self.device), verify_u.to(self.device)

    def _target_pass(
        self, reqs: list[ScheduledRequest], layout: RoundLayout
    ) -> tuple[torch.Tensor, TargetPass | None, dict[str, tuple[int, list]]]:
        """The round's one target pass: logits of the verified rows, the features the drafter
        reads, and the prompt logprobs asked for."""
        scored: list[tuple[str, int, int, int]] = []  # id, first position scored, row, count
        for r, start in zip(reqs, layout.row_starts, strict=True):
            state = self._states[r.request_id]
            if state.params.prompt_logprobs is not None:
                # the rows whose next token is a prompt token score that token
                end = min(r.target_start + len(r.target_token_ids), len(state.prompt_token_ids) - 1)
                if end > r.target_start:
                    scored.append((r.request_id, r.target_start + 1, start, end - r.target_start))
        rows = layout.verified_rows
        if scored:
            extra = [row + k for _, _, row, n in scored for k in range(n)]
            rows = torch.cat([rows, torch.tensor(extra, dtype=torch.int64, device=self.device)])
        streams = None  # the features a drafter reads, when one keeps any request's
        if self.drafter is not None and not all(r.drafter_off for r in reqs):
            streams = self.drafter.feature_layers
        logits, features = self.target.forward_features(
            layout.inputs, rows if rows.numel() else None, streams
        )
        target_pass = None
        if features is not None:
            target_pass = TargetPass(features, layout.row_starts)
        n = layout.num_verified
        return logits[:n], target_pass, self._prompt_logprobs(logits[n:], scored)

    def _verify(
        self,
        step: DraftRound,
        proposal: Proposal,
        layout: RoundLayout,
        p: torch.Tensor,
        u: torch.Tensor,
    ) -> _Verdict:
        """Accept a path of each request's drafts and one more token."""
        if p.dim() == 1 and not proposal.is_tree:  # greedy chains: a walk over host lists
            drafts = proposal.tokens.tolist()
            emitted, accepted = greedy_walk(
                drafts, proposal.counts, p.tolist(), layout.first_verified
            )
            return _Verdict(emitted, accepted, [list(range(1, a + 1)) for a in accepted], None)
        counts = torch.tensor(proposal.counts, dtype=torch.int64, device=self.device)
        first = torch.tensor(layout.first_verified, dtype=torch.int64, device=self.device)
        if proposal.is_tree:
            rrs = None  # sampled children: those of drafting sampled requests
            if proposal.probs is not None:
                rrs = torch.tensor(
                    [
                        not sp.greedy and n > 0
                        for sp, n in zip(step.params, proposal.counts, strict=True)
                    ],
                    device=self.device,
                )
            topk = max((s.topk for s in step.shapes), default=1)
            v = verify_tree(
                proposal.tokens, layout.topology, p, first, u, proposal.probs, rrs, topk
            )
            host = torch.cat([v.num_accepted[:, None], v.rejected[:, None].long(), v.path,
                              v.token_ids], dim=1).tolist()  # fmt: skip
            d = v.path.shape[1]
            return _Verdict(
                [row[2 + d : 2 + d + row[0] + 1] for row in host],
                [row[0] for row in host],
                [row[2 : 2 + row[0]] for row in host],
                [bool(row[1]) for row in host],
            )
        width = proposal.tokens.shape[1]
        # p per request [B, G+1(, V)]: its root and drafts; padding positions repeat its last
        if all(n == width for n in proposal.counts):  # no padding: the rows as they lie
            p_rows = p.view(len(proposal.counts), width + 1, *p.shape[1:])
        else:
            k = torch.arange(width + 1, device=self.device)[None, :]
            p_rows = p[first[:, None] + torch.minimum(k, counts[:, None])]
        # the final draw follows the granted drafts' (a lookup may propose fewer)
        granted = [s.depth if s.nodes else 0 for s in step.shapes]
        if all(g == granted[0] for g in granted):
            final = u[:, granted[0]]
        else:
            at = torch.tensor(granted, dtype=torch.int64, device=self.device)
            final = u.gather(1, at[:, None])[:, 0]
        out = rejection_sample(proposal.tokens, counts, proposal.probs, p_rows, u[:, :width], final)
        host = torch.cat([out.num_accepted.unsqueeze(1), out.token_ids], dim=1).tolist()
        return _Verdict(
            [row[1 : row[0] + 2] for row in host],
            [row[0] for row in host],
            [list(range(1, row[0] + 1)) for row in host],
            None,
        )

    def _compact(
        self, sampling: list[ScheduledRequest], layout: RoundLayout, verdict: _Verdict
    ) -> None:
        """Move each request's accepted tree nodes into the slots right after its root."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.config.block_size
        for r, path in zip(sampling, verdict.path, strict=True):
            root = r.target_start + len(r.target_token_ids) - 1
            for depth, node in enumerate(path, start=1):
                if node != depth:
                    for key, out in ((root + node, src), (root + depth, dst)):
                        out.append(r.block_table[key // bs] * bs + key % bs)
        if src:
            self.target.move_kv(src, dst)

    def _outcome(
        self,
        reqs: list[ScheduledRequest],
        sampling: list[ScheduledRequest],
        layout: RoundLayout,
        verdict: _Verdict,
        target_pass: TargetPass | None,
    ) -> RoundOutcome:
        """For the drafter: per step request, the pass rows of the positions it keeps (a
        prompt chunk's rows; a sampling request's root and accepted nodes)."""
        path_of = {r.request_id: path for r, path in zip(sampling, verdict.path, strict=True)}
        kept: list[list[int]] = []
        for r, start in zip(reqs, layout.row_starts, strict=True):
            rows = list(range(start, start + len(r.target_token_ids)))
            path = path_of.get(r.request_id)
            if path:
                root = rows[-1]
                rows.extend(root + node for node in path)
            kept.append(rows)
        return RoundOutcome(verdict.emitted, verdict.accepted, kept, target_pass)

    def _emitted_logprobs(
        self,
        raw: torch.Tensor,
        processed: torch.Tensor,
        st: SamplingTensors,
        layout: RoundLayout,
        verdict: _Verdict,
        asking: list[int],
        params: list[SamplingParams],
    ) -> dict[int, list]:
        """Each asking request's logprobs at the tokens it emitted: the target's rows of its
        root and of its accepted nodes."""
        rows = {b: layout.node_rows(b, [0, *verdict.path[b]]) for b in asking}
        pick = [row for b in asking for row in rows[b]]
        lp = self._logprobs_at(raw, processed, st, pick)
        firsts, at = {}, 0
        for b in asking:
            firsts[b], at = at, at + len(rows[b])
        ks = [params[b].logprobs or 0 for b in asking]
        return emitted_logprobs(lp, firsts, ks, verdict.emitted)

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
