"""EAGLE-2's dynamic draft tree, grown by a model drafter one batched pass per depth.

The root grows ``topk`` children; at each further depth the ``topk`` candidates of the last
depth with the highest cumulative draft probability (the beam) are run through the drafter and
grow ``topk`` children each; at the end the ``nodes`` best candidates are kept. Children are the
top ``topk`` tokens of q (greedy requests, or ``sampled`` off), or drawn from q without
replacement (the law recursive rejection sampling verifies). A sampled tree is pruned by a score
each candidate has before it is drawn (its parent's probability times the mass its earlier
siblings left), never by its own token, so that whether a candidate is kept cannot depend on
what was drawn: the verifier's exactness needs that.

The drafter's pass over the beam of depth d reads those nodes' tokens at position
``base + d - 1`` and writes their K/V at key index ``base + (d - 1) * topk + j`` (one slot per
expanded node: the scheduler reserves ``DraftShape.lookahead``); each attends to the request's
context and to its own ancestors only. Inputs for each pass are built with tensor ops from the
previous pass's outputs.
"""

from __future__ import annotations

import torch

from specbatch.model.layers.attention import AttentionMetadata
from specbatch.worker.draft_roots import DraftPass, Roots
from specbatch.worker.model_runner import ForwardInputs
from specbatch.worker.proposer import DraftRound
from specbatch.worker.sampler import SamplingTensors, logits_to_probs, sample


def beam_inputs(
    base: list[int],
    tables: torch.Tensor,
    d: int,
    k: int,
    block_size: int,
    tokens: torch.Tensor,
    bits: torch.Tensor | None = None,
) -> ForwardInputs:
    """A drafter pass over each request's ``k`` beam nodes of depth ``d``: read at position
    ``base + d - 1``, written at key index ``base + (d - 1) * k + j``; with ``bits`` (a tree),
    each sees the keys before ``base`` and, from there on, its ancestors."""
    device = tables.device
    n = len(base)
    base_t = torch.tensor(base, dtype=torch.int64, device=device)
    keys = base_t[:, None] + (d - 1) * k + torch.arange(k, device=device)[None, :]
    slots = tables.gather(1, keys // block_size) * block_size + keys % block_size
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, n * k + 1, k, device=device),
        seq_lens=base_t + d * k,
        block_tables=tables,
        slot_mapping=slots.reshape(-1),
        query_lens_cpu=[k] * n,
        seq_lens_cpu=[b + d * k for b in base],
    )
    if bits is not None:
        meta.tree_starts = base_t
        meta.tree_masks = bits.reshape(-1)
    return ForwardInputs(tokens, (base_t + d - 1).repeat_interleave(k), meta)


class TreeGrower:
    """The candidates of every request, depth by depth ([A, M] each, M growing)."""

    def __init__(
        self,
        step: DraftRound,
        roots: Roots,
        forward: DraftPass,
        block_size: int,
        topk: int,
        sampled: bool,
    ) -> None:
        self.step, self.roots, self.forward = step, roots, forward
        self.block_size, self.topk = block_size, topk
        self.device = roots.logits.device
        a = len(roots.index)
        self.rows = torch.arange(a, device=self.device)
        self.index = torch.tensor(roots.index, dtype=torch.int64, device=self.device)
        params = [step.params[i] for i in roots.index]
        self.greedy_rows = torch.tensor([p.greedy for p in params], device=self.device)
        # per request: children sampled from q (RRS), or its top-k (greedy requests: argmaxes)
        self.sampled = sampled
        self.draw_rows = ~self.greedy_rows if sampled else torch.zeros_like(self.greedy_rows)
        self.st = None if step.greedy else SamplingTensors.from_params(params, self.device)
        self.keep_q = sampled and not step.greedy
        z = torch.zeros(a, 0, dtype=torch.int64, device=self.device)
        self.token, self.parent, self.depth = z, z.clone(), z.clone()
        self.score = torch.zeros(a, 0, device=self.device)  # cumulative q: the beam's order
        self.prune = torch.zeros(a, 0, device=self.device)  # the final choice's order
        self.q_rows: list[torch.Tensor] = []  # q of each expanded node, [A, V] per beam slot
        self.q_slot = torch.full((a, 1), -1, dtype=torch.int64, device=self.device)
        self.draws_used = 0

    def run(self, max_depth: int, depths: list[int]) -> None:
        a = len(self.roots.index)
        depth_of = torch.tensor(depths, dtype=torch.int64, device=self.device)
        beam = torch.zeros(a, 1, dtype=torch.int64, device=self.device)  # candidate ids (0: root)
        beam_bits = torch.zeros(a, 1, dtype=torch.int64, device=self.device)
        paths = torch.zeros(a, 1, 0, dtype=torch.int64, device=self.device)
        beam_score = torch.ones(a, 1, device=self.device)
        logits, state = self.roots.logits.unsqueeze(1), self.roots.state
        for d in range(1, max_depth + 1):
            kb = beam.shape[1]
            live = depth_of >= d  # [A]
            q = self._q(logits.reshape(a * kb, -1), paths.reshape(a * kb, -1), kb, live)
            first = self.token.shape[1] + 1  # id of the first candidate of this depth
            kids, kid_q = self._children(q, kb)  # [A*kb, K] each
            k = kids.shape[1]
            self._record(beam, kids.view(a, kb * k), kid_q.view(a, kb, k), beam_score, d, live)
            if self.keep_q:
                self.q_slot = torch.cat([self.q_slot, self.q_slot.new_full((a, kb * k), -1)], 1)
                ids = beam  # the expanded nodes' q
                slot = len(self.q_rows)
                for j in range(kb):
                    self.q_rows.append(q.view(a, kb, -1)[:, j])
                self.q_slot.scatter_(1, ids, torch.arange(slot, slot + kb, device=self.device)
                                     .expand(a, kb).contiguous())  # fmt: skip
            if d == max_depth or not bool((depth_of > d).any()):
                break
            # the next beam: the best candidates of this depth, run through the drafter
            cand = torch.arange(first, first + kb * k, device=self.device).expand(a, -1)
            score = self.score[:, first - 1 :]
            order = torch.sort(-score, dim=1, stable=True).indices[:, : self.topk]
            beam = cand.gather(1, order)
            parent_slot = order // k  # the beam slot of each new beam node's parent
            paths = torch.cat(
                [paths.gather(1, parent_slot[:, :, None].expand(-1, -1, paths.shape[2])),
                 self.token.gather(1, beam - 1)[:, :, None]], dim=2)  # fmt: skip
            beam_score = score.gather(1, order)
            own = torch.arange(self.topk, device=self.device) + (d - 1) * self.topk
            beam_bits = beam_bits.gather(1, parent_slot) | (1 << own)[None, :]
            parent_state = None
            if state is not None:
                rows = (self.rows[:, None] * kb + parent_slot).reshape(-1)
                parent_state = state.index_select(0, rows)
            state, flat_logits = self._pass(beam, beam_bits, parent_state, d, depth_of > d)
            logits = flat_logits.view(a, self.topk, -1)

    def _q(
        self, logits: torch.Tensor, paths: torch.Tensor, kb: int, live: torch.Tensor
    ) -> torch.Tensor | None:
        """q at each beam node [A*kb, V] (masked by its grammar after its path and penalised
        with it), or None (all greedy); keeps the processed logits in ``self._logits``."""
        step = self.step
        if step.grammars is not None:  # the rows of requests drafting this deep
            alive = live.tolist()
            owners = [b if ok else None for b, ok in zip(self.roots.index, alive, strict=True)]
            rows = [b for b in owners for _ in range(kb)]
            logits = step.grammars.mask(logits, rows, paths.tolist())
        if step.penalties is not None:
            who = self.index.repeat_interleave(kb)
            before = torch.full_like(who, paths.shape[1])
            logits = step.penalties.apply(logits, who, paths if paths.shape[1] else None, before)
        self._logits = logits
        if self.st is None:
            return None
        st = self.st if kb == 1 else self.st.repeat_interleave([kb] * len(self.roots.index))
        return logits_to_probs(logits, st)

    def _children(self, q: torch.Tensor | None, kb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each beam node's children (int64 [A*kb, K]) and their probability under the law
        that ranks them (float [A*kb, K]): q, or for greedy requests the drafter's softmax."""
        k = self.topk
        greedy = self.greedy_rows.repeat_interleave(kb)[:, None]
        if q is None:
            dist = torch.softmax(self._logits.float(), dim=-1)
        elif bool(greedy.any()):
            dist = torch.where(greedy, torch.softmax(self._logits.float(), dim=-1), q)
        else:
            dist = q
        kids = torch.topk(dist, k, dim=1).indices if k > 1 else dist.argmax(dim=1, keepdim=True)
        if q is not None and bool(self.draw_rows.any()):
            # sampled rows: without replacement, in drawing order, one uniform per child
            u = self._uniforms(kb * k).reshape(-1, k)
            left = q.clone()
            drawn = torch.zeros_like(kids)
            for j in range(k):
                x = sample(left, u[:, j])
                drawn[:, j] = x
                left.scatter_(1, x[:, None], 0.0)
            kids = torch.where(self.draw_rows.repeat_interleave(kb)[:, None], drawn, kids)
        return kids, dist.gather(1, kids)

    def _uniforms(self, n: int) -> torch.Tensor:
        """The next ``n`` drafting uniforms of each request [A, n]."""
        u = self.step.uniforms.index_select(0, self.index)[:, self.draws_used : self.draws_used + n]
        self.draws_used += n
        return u

    def _record(
        self,
        beam: torch.Tensor,
        kids: torch.Tensor,
        kid_q: torch.Tensor,
        beam_score: torch.Tensor,
        d: int,
        live: torch.Tensor,
    ) -> None:
        """Append this depth's candidates (ids continue after the last ones)."""
        a, kb, k = kid_q.shape
        score = (beam_score[:, :, None] * kid_q).reshape(a, kb * k)
        if self.sampled:  # before its draw: the parent's probability times what is left
            before = torch.cumsum(kid_q, dim=2) - kid_q
            prune = (beam_score[:, :, None] * (1.0 - before)).reshape(a, kb * k)
        else:
            prune = score
        # never above its parent's (ties keep the parent first: it has the lower id), so the
        # ``nodes`` best candidates always hold each kept node's parent; rounding alone can lift
        # a last sibling's child above it, and a child of a dead node is dead
        parent_prune = torch.cat([self.prune.new_ones(a, 1), self.prune], dim=1).gather(1, beam)
        prune = torch.minimum(prune, parent_prune.repeat_interleave(k, dim=1))
        # a child of probability 0 was never drawn (its siblings had taken all of q's mass)
        dead = ~live[:, None] | (kid_q.reshape(a, kb * k) <= 0) | (prune < 0)
        self.token = torch.cat([self.token, kids], dim=1)
        self.parent = torch.cat([self.parent, beam.repeat_interleave(k, dim=1)], dim=1)
        self.depth = torch.cat([self.depth, torch.full_like(kids, d)], dim=1)
        self.score = torch.cat([self.score, score.masked_fill(dead, -1.0)], dim=1)
        self.prune = torch.cat([self.prune, prune.masked_fill(dead, -1.0)], dim=1)

    def _pass(
        self,
        beam: torch.Tensor,
        bits: torch.Tensor,
        parent_state: torch.Tensor | None,
        d: int,
        live: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The drafter over the beam of depth ``d`` of the requests that draft deeper (read at
        depth d's position); the others' rows come back zero and are never read."""
        a, k = beam.shape
        idx = live.nonzero()[:, 0]
        n = idx.shape[0]
        base = [b for b, alive in zip(self.roots.base, live.tolist(), strict=True) if alive]
        tokens = self.token.index_select(0, idx).gather(1, beam.index_select(0, idx) - 1)
        tokens = tokens.reshape(-1)
        tables = self.roots.tables.index_select(0, idx)
        inputs = beam_inputs(base, tables, d, k, self.block_size, tokens, bits.index_select(0, idx))
        rows = (idx[:, None] * k + torch.arange(k, device=self.device)[None, :]).reshape(-1)
        if parent_state is not None:
            parent_state = parent_state.index_select(0, rows)
        state, logits = self.step.timed(n * k, lambda: self.forward(tokens, parent_state, inputs))
        if n == a:
            return state, logits
        full = logits.new_zeros(a * k, logits.shape[1]).index_copy_(0, rows, logits)
        if state is not None:
            state = state.new_zeros(a * k, state.shape[1]).index_copy_(0, rows, state)
        return state, full

    def select(
        self, nodes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keep each request's ``nodes`` best candidates: (tokens [A, N], parents [A, N] in the
        kept numbering, counts [A], q [A, N, V] at the kept nodes or None)."""
        a, m = self.token.shape
        order = torch.sort(-self.prune, dim=1, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            1, order, torch.arange(m, device=self.device).expand(a, m).contiguous()
        )
        keep = (rank < nodes[:, None]) & (self.prune >= 0)
        counts = keep.sum(dim=1)
        width = int(counts.max()) if a else 0
        new_id = torch.cumsum(keep.to(torch.int64), dim=1) * keep  # 1-based, 0 where dropped
        at = torch.where(keep, new_id - 1, width)  # dropped candidates go to a trash column
        tokens = torch.zeros(a, width + 1, dtype=torch.int64, device=self.device)
        tokens.scatter_(1, at, self.token)
        full_id = torch.cat([torch.zeros_like(new_id[:, :1]), new_id], dim=1)  # id 0: root
        parents = torch.zeros(a, width + 1, dtype=torch.int64, device=self.device)
        parents.scatter_(1, at, full_id.gather(1, self.parent))
        probs = None
        if self.keep_q and self.q_rows:
            stack = torch.stack(self.q_rows, dim=1)  # [A, slots, V]
            slot = self.q_slot  # [A, M+1] by candidate id (0: root)
            kept_ids = torch.cat([torch.ones_like(keep[:, :1]), keep], dim=1)
            order = torch.where(kept_ids, full_id, width + 1)  # new id of each candidate
            probs = torch.zeros(a, width + 2, stack.shape[2], device=self.device)
            has = (slot >= 0) & kept_ids
            src = stack.gather(1, slot.clamp(min=0)[:, :, None].expand(-1, -1, stack.shape[2]))
            dst = torch.where(has, order, width + 1)
            probs.scatter_(1, dst[:, :, None].expand_as(src), src)
            probs = probs[:, :width]
        return tokens[:, :width], parents[:, :width], counts, probs
