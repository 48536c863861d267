"""Suffix decoding (``method: suffix``, as vLLM's through arctic-inference, here in Python): a
model-free drafter that remembers. Each live request has a suffix tree of its prompt and
output; one global tree holds the outputs of the last ``suffix_decoding_max_cached_requests``
requests (``suffix_tree.py``). Each step the longest suffixes of a request's last
``suffix_decoding_max_tree_depth`` tokens are looked up in both, and the most frequent
continuation is proposed (a chain, or the best-first tree of the ``topk`` most frequent
continuations a node when the step drafts trees): for a match of m tokens at most
``suffix_decoding_max_spec_factor * m`` tokens, at most the round's draft length, none whose
path's empirical probability is below ``suffix_decoding_min_token_prob``.

The drafts are chosen, not sampled (a point mass q, as the n-gram drafter's), so the
verifier's rule for chosen drafts keeps the target's law at every temperature, whatever the
trees hold. With ``batch_invariant`` the global tree is off: what other requests produced would
make a seeded request's drafts, and so its sampled tokens, depend on what else ran.
"""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.scheduler.output import NewRequestData
from specbatch.worker.proposal import Proposal
from specbatch.worker.proposer import Drafter, DraftRound, RoundOutcome
from specbatch.worker.suffix_tree import Draft, SuffixCache


class SuffixProposer(Drafter):
    def __init__(
        self, config: EngineConfig, device: torch.device, tp: object, target: object
    ) -> None:
        spec = config.speculative_config
        cached = 0 if config.batch_invariant else spec.suffix_decoding_max_cached_requests
        self.cache = SuffixCache(spec.suffix_decoding_max_tree_depth, cached)
        self.spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_prob = spec.suffix_decoding_min_token_prob
        self.device = device
        self.tokens: dict[str, list[int]] = {}  # each live request's prompt and output so far

    def add_request(self, new: NewRequestData) -> None:
        self.cache.start(new.request_id, new.prompt_token_ids)
        self.tokens[new.request_id] = list(new.prompt_token_ids)

    def finish_request(self, request_id: str) -> None:
        if self.tokens.pop(request_id, None) is not None:
            self.cache.stop(request_id)

    def _sync(self, request_id: str, start: int, tokens: list[int]) -> None:
        """Tokens ``start ..`` of the request: those past what is known are its output. Tokens
        never change once known (a preempted request resends them: nothing new)."""
        known = self.tokens[request_id]
        if start + len(tokens) > len(known):
            new = tokens[len(known) - start :]
            known.extend(new)
            self.cache.extend(request_id, new)

    def propose(self, step: DraftRound) -> Proposal:
        for r in step.requests:
            self._sync(r.request_id, r.target_start, r.target_token_ids)
        drafts = [
            self._draft(r.request_id, s.nodes, s.depth, s.topk) if s.nodes else Draft()
            for r, s in zip(step.sampling, step.shapes, strict=True)
        ]
        width = max((len(d.tokens) for d in drafts), default=0)
        out = Proposal.empty(len(drafts), self.device, width)
        out.counts = [len(d.tokens) for d in drafts]
        if any(out.counts):
            pad = [d.tokens + [0] * (width - len(d.tokens)) for d in drafts]
            out.tokens = torch.tensor(pad, dtype=torch.int64, device=self.device)
            if step.tree:
                pad = [d.parents + [0] * (width - len(d.parents)) for d in drafts]
                out.parents = torch.tensor(pad, dtype=torch.int64, device=self.device)
        return out

    def _draft(self, request_id: str, nodes: int, depth: int, topk: int) -> Draft:
        context = self.tokens[request_id][-self.cache.depth :]
        return self.cache.speculate(
            request_id, context, nodes, self.spec_factor, self.min_prob, depth, topk
        )

    def observe(self, step: DraftRound, outcome: RoundOutcome) -> None:
        for r, toks in zip(step.sampling, outcome.emitted, strict=True):
            # what the step emitted follows the target's tokens, which end at the last known
            self._sync(r.request_id, r.target_start + len(r.target_token_ids), toks)
