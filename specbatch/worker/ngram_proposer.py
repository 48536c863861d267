"""The n-gram drafter (prompt lookup): a request's last n tokens, found earlier in its own prompt
and output, propose the tokens that followed them there. No model, no KV cache, no forward.

Its q is the point mass on each proposed token, so the rejection rule accepts a draft x with
probability p(x) and otherwise samples p with x removed: exact at every temperature, top-k and
top-p. The lookup is incremental: each request keeps, for every n in [min, max], a map from an
n-gram to where it last ended, updated as tokens arrive, so a step costs a few dict lookups a
request however long its context.
"""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.scheduler.output import NewRequestData
from specbatch.worker.proposer import Drafter, DraftRound, Proposal, RoundOutcome


class NgramIndex:
    """One request's tokens and, per n, the latest end of every n-gram followed by a token."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(n_min, n_max + 1)
        }

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            t = len(
                self.tokens
            )  # tok's position: the n-grams ending just before it now have a follower
            for n, table in self.last_end.items():
                if t >= n:
                    table[tuple(self.tokens[t - n : t])] = t
            self.tokens.append(tok)

    def sync(self, start: int, tokens: list[int], prompt: list[int] | None = None) -> None:
        """Tokens ``start ..`` of the request as the target sees them this step. Tokens never
        change once known, so only those past the end are new (a preempted request resends
        its prompt: nothing to do). A request that starts past its first tokens (it shares
        another's cache) takes those from its ``prompt``."""
        known = len(self.tokens)
        if start > known:
            self.extend((prompt or [])[known:start])
            known = start
        if start + len(tokens) > known:
            self.extend(tokens[max(0, known - start) :])

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        suffix (n from max down to min) that occurred before; [] when none did."""
        end = len(self.tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            pos = self.last_end[n].get(tuple(self.tokens[end - n :]))
            if pos is not None:
                return self.tokens[pos : pos + k]
        return []


class NgramProposer(Drafter):
    def __init__(
        self, config: EngineConfig, device: torch.device, tp: object, target: object
    ) -> None:
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self.device = device
        self.index: dict[str, NgramIndex] = {}
        self.prompts: dict[str, list[int]] = {}

    def add_request(self, new: NewRequestData) -> None:
        self.index[new.request_id] = NgramIndex(self.n_min, self.n_max)
        self.prompts[new.request_id] = new.prompt_token_ids

    def finish_request(self, request_id: str) -> None:
        self.index.pop(request_id, None)
        self.prompts.pop(request_id, None)

    def propose(self, step: DraftRound) -> Proposal:
        for r in step.requests:
            rid = r.request_id
            self.index[rid].sync(r.target_start, r.target_token_ids, self.prompts[rid])
        drafts = [
            self.index[r.request_id].propose(s.depth) if s.nodes > 0 else []
            for r, s in zip(step.sampling, step.shapes, strict=True)
        ]
        width = max((len(d) for d in drafts), default=0)
        out = Proposal.empty(len(drafts), self.device, width)
        out.counts = [len(d) for d in drafts]
        if any(out.counts):
            padded = [d + [0] * (width - len(d)) for d in drafts]
            out.tokens = torch.tensor(padded, dtype=torch.int64, device=self.device)
        return out

    def observe(self, step: DraftRound, outcome: RoundOutcome) -> None:
        for r, toks in zip(step.sampling, outcome.emitted, strict=True):
            index = self.index[r.request_id]
            # the step's target tokens end at the request's last known token; what it emitted
            # follows them
            index.sync(r.target_start + len(r.target_token_ids), toks)
