"""Grammar masks inside the speculative round (structured outputs).

A request with a grammar keeps a matcher at the state after its emitted tokens. A position's
mask is the set of tokens the grammar allows after the path of drafts leading to it: the
drafter's logits at every draft position and the target's at every verified row are masked
(-inf outside it) before they become q and p, so the rejection rule keeps the law of sampling
the masked target token by token, and greedy is the masked target's argmax. A drafted node the
grammar does not allow after its parent (an n-gram lookup proposes without the grammar), and
every node after the grammar's end, is cut before the target sees it. After verification the
matcher walks to the emitted tokens: back past the rejected drafts, then on along the rest.
Masks are filled before the target pass (the drafter's are reused for the rows they share) and
applied to its logits after it; a step without a grammar request never comes here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specbatch.worker.proposal import Proposal

_MISSING = object()


class RequestGrammar:
    """One request's matcher and the tokens it has walked past the request's emitted ones."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.path: list[int] = []

    def goto(self, path: Sequence[int]) -> bool:
        """Walk to the state after ``path`` (from the emitted tokens' state): back to the
        common prefix with the path walked last, then forward. False if a token is not
        allowed or comes after the grammar's end (the walk stops before it)."""
        common = 0
        limit = min(len(self.path), len(path))
        while common < limit and self.path[common] == path[common]:
            common += 1
        if len(self.path) > common:
            self._rollback(len(self.path) - common)
            del self.path[common:]
        for t in path[common:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                return False
            self.path.append(t)
        return True

    def _rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    @property
    def ended(self) -> bool:
        return bool(self.matcher.is_terminated())

    def commit(self, tokens: list[int]) -> int | None:
        """Make the emitted ``tokens`` the new start. Returns how many of them the grammar
        takes when it ended with them (None: it goes on)."""
        if not self.goto(tokens) and not self.ended:
            bad = tokens[len(self.path)]
            raise RuntimeError(f"grammar: emitted token {bad} is outside the request's grammar")
        taken = len(self.path)
        self.path = []
        return taken if self.ended else None


def allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether ``token``'s bit is set in a bitmask row."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class StepGrammars:
    """The grammars of one step's sampling requests (None: no grammar) and the masks filled
    this step, by request and path."""

    def __init__(self, grammars: list[RequestGrammar | None], vocab_size: int) -> None:
        self.grammars = grammars
        self.vocab = vocab_size
        self.width = (vocab_size + 31) // 32
        self._masks: dict[tuple[int, tuple[int, ...]], torch.Tensor | None] = {}
        self._verified: tuple[torch.Tensor, list[int]] | None = None

    @staticmethod
    def of(grammars: list[RequestGrammar | None], vocab_size: int) -> StepGrammars | None:
        if all(g is None for g in grammars):
            return None
        return StepGrammars(grammars, vocab_size)

    def ends(self, b: int, path: Sequence[int]) -> bool:
        """Whether nothing may follow ``path`` for request b: its grammar ended, or the path
        left it (never for a request without a grammar)."""
        g = self.grammars[b]
        return g is not None and (not g.goto(path) or g.ended)

    # ---- masks -------------------------------------------------------------------------------
    def _fill(self, buf: torch.Tensor, i: int, b: int, path: Sequence[int]) -> bool:
        """Row i of ``buf``: request b's mask after ``path``; False (row untouched) when the path
        leaves the grammar or passes its end."""
        key = (b, tuple(path))
        cached = self._masks.get(key, _MISSING)
        if cached is _MISSING:
            g = self.grammars[b]
            assert g is not None
            if g.goto(path) and not g.ended:
                g.matcher.fill_next_token_bitmask(buf, i)
                cached = buf[i]
            else:
                cached = None
            self._masks[key] = cached
        elif cached is not None:
            buf[i] = cached
        return cached is not None

    def mask_row(self, b: int, path: Sequence[int]) -> torch.Tensor | None:
        """Request b's mask after ``path`` [W] (int32 bits), or None."""
        buf = self._buffer(1)
        return buf[0] if self._fill(buf, 0, b, path) else None

    def _buffer(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.width), -1, dtype=torch.int32)

    def mask(
        self,
        logits: torch.Tensor,
        owners: Sequence[int | None],
        paths: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """``logits`` [R, V] with row r masked as request ``owners[r]`` after ``paths[r]``
        (rows of requests without a grammar, or whose owner is None, as they were), in
        float32; masked in place when they are float32 already."""
        rows = [r for r, b in enumerate(owners) if b is not None and self.grammars[b] is not None]
        if not rows:
            return logits
        buf = self._buffer(len(owners))
        for r in rows:
            b = owners[r]
            assert b is not None
            self._fill(buf, r, b, paths[r])
        return apply_bitmask(logits, buf, rows, self.vocab)

    # ---- the round ---------------------------------------------------------------------------
    def cut(self, proposal: Proposal) -> Proposal:
        """Drop every node the grammar does not allow after its parent, with its subtree
        (a chain: the rest of it), and every node after the grammar's end."""
        tokens = proposal.tokens.tolist()
        parents = proposal.parents.tolist() if proposal.parents is not None else None
        for b, n in enumerate(proposal.counts):
            if n == 0 or self.grammars[b] is None:
                continue
            paths: dict[int, list[int]] = {0: []}
            for j in range(1, n + 1):
                parent = parents[b][j - 1] if parents is not None else j - 1
                if parent not in paths:
                    continue
                mask = self.mask_row(b, paths[parent])
                if mask is not None and allowed(mask, tokens[b][j - 1]):
                    paths[j] = [*paths[parent], tokens[b][j - 1]]
                elif parents is None:
                    break
            kept = sorted(k for k in paths if k)
            if len(kept) < n:
                _keep_nodes(proposal, b, kept)
        return proposal

    def prepare_verified(self, proposal: Proposal, first_row: Sequence[int]) -> None:
        """The masks of the target's verified rows (request b's node j at row
        ``first_row[b] + j``), filled now, before the target pass, to apply after it."""
        tokens = proposal.tokens.tolist()
        parents = proposal.parents.tolist() if proposal.parents is not None else None
        which: list[int] = []
        owners: list[int] = []
        paths: list[list[int]] = []
        for b, n in enumerate(proposal.counts):
            if self.grammars[b] is None:
                continue
            node_paths: list[list[int]] = [[]]
            for j in range(1, n + 1):
                parent = parents[b][j - 1] if parents is not None else j - 1
                node_paths.append([*node_paths[parent], tokens[b][j - 1]])
            for j, path in enumerate(node_paths):
                which.append(first_row[b] + j)
                owners.append(b)
                paths.append(path)
        buf = self._buffer(max(which, default=-1) + 1)
        for row, b, path in zip(which, owners, paths, strict=True):
            self._fill(buf, row, b, path)
        self._verified = (buf, which)

    def apply_verified(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's verified rows masked (``mask``'s terms)."""
        assert self._verified is not None, "prepare_verified first"
        buf, which = self._verified
        return apply_bitmask(logits, buf, which, self.vocab)

    def commit(self, emitted: list[list[int]]) -> list[bool]:
        """Walk each request's matcher to what it emitted; cut the tokens after the grammar's
        end (in place). Returns, per request, whether its grammar ended."""
        done = [False] * len(emitted)
        for b, g in enumerate(self.grammars):
            if g is None:
                continue
            taken = g.commit(emitted[b])
            if taken is not None:
                del emitted[b][taken:]
                done[b] = True
        return done


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int
) -> torch.Tensor:
    """``logits`` in float32 (in place when they are float32 and contiguous) with row r of
    ``rows`` set to -inf where ``bitmask[r]`` has a 0 bit."""
    from specbatch.grammar.backend import xgrammar

    out = logits.float().contiguous()
    bits = bitmask.to(out.device, non_blocking=True)
    xgrammar().apply_token_bitmask_inplace(out, bits, vocab_size=vocab, indices=rows)
    return out


def _keep_nodes(proposal: Proposal, b: int, kept: list[int]) -> None:
    """Request b keeps only the nodes ``kept`` (ascending, each with its parent kept), renumbered
    in order; a chain keeps a prefix."""
    proposal.counts[b] = len(kept)
    if proposal.parents is None:
        return  # a chain's cut is a shorter count
    width = proposal.tokens.shape[1]
    new_id = {0: 0, **{old: new for new, old in enumerate(kept, start=1)}}
    cols = torch.tensor([k - 1 for k in kept], dtype=torch.int64, device=proposal.tokens.device)
    n = len(kept)
    proposal.tokens[b, :n] = proposal.tokens[b].index_select(0, cols)
    proposal.tokens[b, n:] = 0
    old_parents = proposal.parents[b].tolist()
    parents = [new_id[old_parents[k - 1]] for k in kept] + [0] * (width - n)
    proposal.parents[b] = torch.tensor(parents, dtype=torch.int64, device=proposal.tokens.device)
    if proposal.probs is not None:  # column j: q at node j (the root's at 0)
        old = proposal.probs[b].clone()
        for new, k in enumerate(kept, start=1):
            if new < old.shape[0]:
                proposal.probs[b, new] = old[k] if k < old.shape[0] else 0.0
