"""The n-gram drafter (prompt lookup): a request's last n tokens, found earlier in its own prompt
and output, propose the tokens that followed them there. No model, no KV cache, no forward.

Its q is the point mass on each proposed token, so the rejection rule accepts a draft x with
probability p(x) and otherwise samples p with x removed: exact at every temperature, top-k and
top-p. The lookup is incremental: each request keeps, for every n in [min, max], a map from an
n-gram to where it ended lately (its ``MATCHES`` latest ends), updated as tokens arrive, so a
step costs a few dict lookups a request however long its context. A tree of drafts is the trie
of what followed several earlier occurrences, the longest suffixes and latest first; its
children are chosen, not sampled, so it is verified by the walk.
"""

from __future__ import annotations

import torch

from specbatch.config import EngineConfig
from specbatch.scheduler.output import NewRequestData
from specbatch.worker.proposal import Proposal
from specbatch.worker.proposer import Drafter, DraftRound, RoundOutcome

MATCHES = 8  # the latest earlier ends kept per n-gram


class NgramIndex:
    """One request's tokens and, per n, the latest ends of every n-gram followed by a token."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(n_min, n_max + 1)
        }

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            t = len(self.tokens)  # tok's position: the n-grams ending before it have a follower
            for n, table in self.ends.items():
                if t >= n:
                    ends = table.setdefault(tuple(self.tokens[t - n : t]), [])
                    ends.append(t)
                    if len(ends) > MATCHES:
                        del ends[0]
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

    def continuations(self, k: int) -> list[list[int]]:
        """Up to ``k`` tokens that followed each earlier occurrence of the request's suffixes,
        the longest suffix (n from max down to min) first and, for one n, the latest first."""
        end = len(self.tokens)
        out = []
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            for pos in reversed(self.ends[n].get(tuple(self.tokens[end - n :]), ())):
                out.append(self.tokens[pos : pos + k])
        return out

    def propose(self, k: int) -> list[int]:
        """A chain: what followed the latest occurrence of the longest suffix; [] if none."""
        found = self.continuations(k)
        return found[0] if found else []

    def propose_tree(self, depth: int, topk: int, nodes: int) -> tuple[list[int], list[int]]:
        """The trie of the continuations (``continuations`` order): tokens and parents of up
        to ``nodes`` nodes, at most ``topk`` children a node and ``depth`` deep."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[int, dict[int, int]] = {0: {}}  # node -> token -> child
        for cont in self.continuations(depth):
            node = 0
            for tok in cont:
                child = children[node].get(tok)
                if child is None:
                    if len(tokens) >= nodes or len(children[node]) >= topk:
                        break
                    tokens.append(tok)
                    parents.append(node)
                    child = len(tokens)
                    children[node][tok] = child
                    children[child] = {}
                node = child
        return tokens, parents


class NgramProposer(Drafter):
    def __init__(
        self, config: EngineConfig, device: torch.device, tp: object, target: object
    ) -> None:
        spec = config.speculative_config
        self.n_min, self.n_max = spec.prompt_lookup_min, spec.prompt_lookup_max
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
        if step.tree:
            return self._trees(step)
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

    def _trees(self, step: DraftRound) -> Proposal:
        trees = [
            self.index[r.request_id].propose_tree(s.depth, s.topk, s.nodes) if s.nodes else ([], [])
            for r, s in zip(step.sampling, step.shapes, strict=True)
        ]
        width = max((len(t) for t, _ in trees), default=0)
        out = Proposal.empty(len(trees), self.device, width)
        out.counts = [len(t) for t, _ in trees]
        if any(out.counts):
            pad = [(t + [0] * (width - len(t)), p + [0] * (width - len(p))) for t, p in trees]
            out.tokens = torch.tensor([t for t, _ in pad], dtype=torch.int64, device=self.device)
            out.parents = torch.tensor([p for _, p in pad], dtype=torch.int64, device=self.device)
        return out

    def observe(self, step: DraftRound, outcome: RoundOutcome) -> None:
        for r, toks in zip(step.sampling, outcome.emitted, strict=True):
            index = self.index[r.request_id]
            # the step's target tokens end at the request's last known token; what it emitted
            # follows them
            index.sync(r.target_start + len(r.target_token_ids), toks)
